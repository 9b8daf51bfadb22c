"""Lightning's hooks of a run, in Lightning's order: the callbacks' (in the order given), then the module's. Free
functions over the Trainer's public parts (``trainer.callbacks``, ``trainer.module``), as Lightning's
``trainer/call.py``: the loop, the stages and the checkpoints call them alike."""

from __future__ import annotations

from typing import Any

from distrain.profilers import profile


def call_callbacks(trainer: Any, hook: str, *args: Any) -> None:
    """The callbacks' ``hook``, in their order (one that is not a ``Callback`` may lack it)."""
    for cb in trainer.callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            with profile(trainer, f"[Callback]{getattr(cb, 'state_key', type(cb).__name__)}.{hook}"):
                fn(trainer, trainer.module, *args)


def call_hook(trainer: Any, hook: str, *args: Any) -> Any:
    """Lightning's ``hook``: the callbacks', then the module's, whose result it returns."""
    call_callbacks(trainer, hook, *args)
    with profile(trainer, f"[LightningModule]{type(trainer.module).__name__}.{hook}"):
        return getattr(trainer.module, hook)(*args)
