"""The names every layer shares: the signals the collectors produce and the policies, the static
rules and the dashboard read (`signals`), and the duration type settings are written in (`units`).

The bottom layer: it imports nothing of the project, and everything may import it.
"""
