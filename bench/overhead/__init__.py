"""Proxy overhead bench (issue 7): Sluice with everything on against peers; see ``bench.overhead.core``."""
