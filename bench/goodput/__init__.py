"""Goodput of admission policies under real traces, in virtual time (``python -m bench.goodput``)."""
