"""The virtual-time replay: trace arrivals against emulated engines, on a virtual clock.

The second adapter over the admission and prediction code the gateway ships (the live gateway is
the first): ``gateway`` never imports this package, and ``simulator`` (the ground truth) never
imports it either. ``replay.forecasts`` scores forecasts against the emulator's outcomes;
``replay.admission`` scores admission policies (``replay.policies``) by goodput.
"""
