"""Getting numbers in: parse expositions, scrape targets, map metric families to signals.

Collectors never decide and never store; they hand `Signal` values to the control loop.
"""
