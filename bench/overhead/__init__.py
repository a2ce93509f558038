"""Proxy overhead bench: Sluice with everything on against peers; see ``bench.overhead.core``."""
