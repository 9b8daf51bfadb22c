"""``lightning.pytorch.plugins``: the precision plugins and cluster environments ``Trainer(plugins=[...])`` takes
(``precision.py``, ``environments.py``); Lightning's other plugins (checkpoint I/O, layer sync) are refused where
they are imported, saying what does their work here."""

from distrain.lightning._refuse import refusing
from distrain.lightning.plugins.environments import ClusterEnvironment
from distrain.lightning.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = ["ClusterEnvironment", "DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision"]

_PRECISION = refusing(
    __name__,
    "a precision is Trainer(precision=...): 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true, fp8, or a "
    "Precision, MixedPrecision, DoublePrecision or HalfPrecision plugin",
)
_OTHER = refusing(
    __name__,
    "checkpoints are written by distrain's own checkpoint code (torch.distributed.checkpoint), and a layer sync is "
    "Trainer(sync_batchnorm=True)",
)


def __getattr__(name: str) -> object:
    return (_PRECISION if name.endswith("Precision") else _OTHER)(name)
