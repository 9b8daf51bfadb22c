"""One process, one device: no process group, no wrapping."""

from distrain.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    start_method = None
