"""End-to-end bench: Sluice in front of two real vLLM-on-CPU replicas, driven by AIPerf.

``python -m bench.e2e``; see :mod:`bench.e2e.core`.
"""
