"""Scheduling and memory accounting in plain Python over ints.

Nothing in this package imports torch: the engine and the trace-replay simulator drive
the very same classes.
"""
