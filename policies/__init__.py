"""Deciding: pure functions of signal windows and fleet state to findings and proposals.

Nothing here performs I/O or reads a clock; `now` is always an argument.
"""
