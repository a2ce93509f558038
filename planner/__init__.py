"""Capacity planning (``sluice plan``) from the same step model, emulator and admission engine that
serve the traffic.

``planner.closed_forms``: the arithmetic (Little's law, recompute versus swap, cost, speculative
tokens per step), plain functions of numbers. ``planner.workload``: the workload (a trace the
replay reads, or a synthetic stream). ``planner.replicas``: a replay at N replicas scored per
class, and the search for the smallest N. ``planner.checks``: the closed forms applied to a
profile. ``planner.plan`` puts them together; ``planner.report`` renders the result;
``planner.cli`` is the command line. Runs from a checkout (like ``replay``, which it drives);
``gateway`` never imports it (``sluice plan`` runs ``python -m planner``).
"""
