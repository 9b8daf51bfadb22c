"""One process, one device: no process group, no wrapping."""

from distrain.strategies.base import Strategy, Traits
from distrain.strategies.registry import register


class SingleDeviceStrategy(Strategy):
    """One process on one device (``strategy="single"``): no process group, no wrapping."""

    start_method = None
    planned_as = ("single", {})
    traits = Traits(replicated_state=True)  # the one process holds the whole state


register("single", SingleDeviceStrategy, "one process on one device", cost_model="distrain.planner.models.replicated")
