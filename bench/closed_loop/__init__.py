"""Closed-loop bench: what Sluice admits on a real vLLM, against the same vLLM alone.

``python -m bench.closed_loop``; see :mod:`bench.closed_loop.core` and :mod:`bench.closed_loop.report`.
"""
