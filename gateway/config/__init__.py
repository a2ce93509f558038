"""Sluice's configuration: the pydantic models, loading and validating the YAML, the running
snapshot and hot reload.

``settings`` (one model per YAML section) on ``section``'s building blocks; ``source`` reads a
file with the strict YAML loader; ``load`` validates it, reporting every problem at once;
``store`` holds the running snapshot, swapped whole; ``reload`` swaps it on SIGHUP or a changed
file. This ``__init__`` imports nothing, so the pure admission core can use ``section`` and
``settings`` without loading the rest.
"""
