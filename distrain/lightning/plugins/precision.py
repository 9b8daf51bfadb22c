"""``lightning.pytorch.plugins.precision``: Lightning's precision plugins, for ``Trainer(plugins=[...])``.

A precision is ``Trainer(precision=...)`` here (32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true, fp8), and
distrain runs it itself: autocast, the fp16 GradScaler, the dtype of the weights and of each batch. A plugin given
to the Trainer stands for its ``precision``: ``Precision`` (a subclass sets the class attribute, as Lightning's
own do), ``MixedPrecision("bf16-mixed", "cpu")``, ``DoublePrecision()``, ``HalfPrecision("bf16-true")``. A
subclass that overrides one of Lightning's hooks (``forward_context``, ``backward``, ``optimizer_step``...) is
refused in one line naming it: distrain would never call it.
"""

from __future__ import annotations

from typing import Any

from distrain.lightning._refuse import refusing

__all__ = ["DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision", "precision_of"]

#: Lightning's ``Precision`` hooks: where a plugin of the user's overrides one, distrain would train without it
HOOKS = (
    "connect",
    "convert_module",
    "tensor_init_context",
    "module_init_context",
    "forward_context",
    "convert_input",
    "convert_output",
    "pre_backward",
    "backward",
    "post_backward",
    "optimizer_step",
    "clip_gradients",
    "clip_grad_by_value",
    "clip_grad_by_norm",
    "train_step_context",
    "val_step_context",
    "test_step_context",
    "predict_step_context",
    "main_params",
    "state_dict",
    "load_state_dict",
    "teardown",
)


class Precision:
    """Lightning's base precision plugin: its ``precision`` is the Trainer's (32-true unless a subclass says)."""

    precision: str = "32-true"


for _hook in HOOKS:  # Lightning's hooks, defined here so that a subclass's own shows as its override
    setattr(Precision, _hook, lambda self, *args, **kwargs: None)


class MixedPrecision(Precision):
    """Lightning's autocast plugin: ``precision`` "16-mixed" or "bf16-mixed"; distrain makes the fp16 GradScaler
    itself, so ``scaler`` must be None."""

    def __init__(self, precision: str, device: str, scaler: Any = None) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(f"MixedPrecision(precision={precision!r}): must be '16-mixed' or 'bf16-mixed'")
        if scaler is not None:
            raise ValueError(
                "MixedPrecision(scaler=...): distrain makes and checkpoints the fp16 GradScaler itself; leave it None"
            )
        self.precision, self.device = precision, device


class DoublePrecision(Precision):
    """Lightning's float64 plugin: ``precision="64-true"``."""

    precision = "64-true"


class HalfPrecision(Precision):
    """Lightning's half-precision weights plugin: ``precision`` "16-true" or "bf16-true"."""

    def __init__(self, precision: str = "16-true") -> None:
        if precision not in ("16-true", "bf16-true"):
            raise ValueError(f"HalfPrecision(precision={precision!r}): must be '16-true' or 'bf16-true'")
        self.precision = precision


def precision_of(plugin: Precision) -> str:
    """The precision a plugin stands for; a ValueError naming the hooks it overrides, which distrain never calls."""
    name = type(plugin).__name__
    overridden = [
        hook for hook in HOOKS if next(c for c in type(plugin).__mro__ if hook in vars(c)).__module__ != __name__
    ]
    if overridden:
        raise ValueError(
            f"Trainer(plugins=[{name}()]): distrain runs precision={plugin.precision!r} itself and would never call "
            f"{name}'s {', '.join(overridden)}; give precision={plugin.precision!r} (docs/migrating.md)"
        )
    return plugin.precision


__getattr__ = refusing(
    __name__, "a precision is Trainer(precision=...): 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true, fp8"
)
