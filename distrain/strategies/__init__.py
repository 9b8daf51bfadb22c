"""Parallel strategies, one file each. Each file registers its names (``registry.register``) when it is imported,
and ``registry.entries()`` imports every file here the first time a strategy is looked up: a new strategy is one new
file. Importing the package itself imports none of them, so a file without torch (a strategy's config section,
``fsdp_config.py``) is read without torch."""

import importlib
import pkgutil

#: the package's public classes, each imported from its file the first time it is asked for
_EXPORTS = {
    "Strategy": "base",
    "LoopFacts": "base",
    "DDPStrategy": "ddp",
    "DeepSpeedStrategy": "deepspeed",
    "FSDPStrategy": "fsdp",
    "ModelParallelStrategy": "model_parallel",
    "PipelineStrategy": "pipeline",
    "SingleDeviceStrategy": "single",
    "make_strategy": "registry",
}
__all__ = list(_EXPORTS)


def import_all() -> None:
    """Import every file of the package: each registers the strategies it defines."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
