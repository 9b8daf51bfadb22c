"""``lightning.pytorch.profilers``: Lightning's ``SimpleProfiler`` and ``AdvancedProfiler`` (``distrain.profilers``);
its ``PyTorchProfiler`` and ``XLAProfiler`` are refused where imported, in one line: torch's own profiler runs around
``fit``."""

from distrain.lightning._refuse import refusing
from distrain.profilers import AdvancedProfiler, PassThroughProfiler, Profiler, SimpleProfiler

__all__ = ["AdvancedProfiler", "PassThroughProfiler", "Profiler", "SimpleProfiler"]

__getattr__ = refusing(__name__, "run torch.profiler.profile around fit (step times are logged)")
