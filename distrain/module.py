"""``distrain.Module``: the user's model plus the steps that train, evaluate and predict it."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from distrain.checkpoint.state import read_checkpoint_meta, read_model_weights


class Module(nn.Module):
    """Subclass and implement ``training_step`` and ``configure_optimizers``.

    Build layers in ``__init__`` or — for large models — in ``configure_model``, which runs
    under the strategy's init context (on the device, or sharded for sharded strategies).
    """

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_trainer", None)  # not a submodule, not in state_dict
        self.hparams: dict[str, Any] = {}

    # ---- what users implement -------------------------------------------------------------
    def configure_model(self) -> None:
        """Create layers here to have them built under the strategy's init context."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return None

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return None

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch)

    def configure_optimizers(self) -> Any:
        """An optimizer; or ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": s,
        "interval": "step"|"epoch", "frequency": 1}}``; or ``([opt], [sched])``."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    # optional hooks
    def on_train_step_start(self, batches: list, window: int) -> None:
        """This rank's micro-batches of the coming optimizer step (as the loader yields them, not yet
        on the device), before the first one runs; ``window`` is their number (``accumulate``, or fewer
        in an epoch's last step). The step's gradient is the mean, over its micro-steps (the Trainer
        divides each loss by ``window``) and over the ranks, of the losses ``training_step`` returns.
        Override it to normalize a loss by a whole step's count, e.g. of tokens."""

    def num_blocks(self) -> int | None:
        """How many repeated blocks ``configure_model`` will build, when known before it runs (the built-in
        GPT and Hugging Face jobs know it from their configs): a pipeline with more stages than blocks is
        refused before any rank starts."""
        return None

    def on_fit_start(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...

    # ---- services ------------------------------------------------------------------------
    @property
    def device_mesh(self):
        """Under ``ModelParallelStrategy`` / ``PipelineStrategy``: the ``DeviceMesh`` of the ranks, with dims
        ``"pipeline_parallel"``, ``"data_parallel"`` and ``"tensor_parallel"`` (Lightning's names), for a
        tensor-parallel plan of your own in ``configure_model``
        (``parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)``). None otherwise."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = getattr(self._trainer.strategy, "device_mesh", None) if self._trainer is not None else None
        return mesh if isinstance(mesh, DeviceMesh) else None

    @property
    def trainer(self):
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    def log(
        self,
        name: str,
        value: Any,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
        prog_bar: bool = False,
        batch_size: int | None = None,
        reduce_fx: str = "mean",
    ) -> None:
        """Record a metric. Training defaults to per-step, evaluation to per-epoch (a
        sample-weighted mean that is always reduced across ranks). ``reduce_fx="sum"``: the epoch
        value is the total over all calls (and, reduced, all ranks), e.g. a count of samples."""
        if reduce_fx not in ("mean", "sum"):
            raise ValueError(f"log({name!r}): reduce_fx must be 'mean' or 'sum', got {reduce_fx!r}")
        if self._trainer is not None:
            self._trainer.metrics.collector.log(
                name,
                value,
                on_step=on_step,
                on_epoch=on_epoch,
                sync_dist=sync_dist,
                prog_bar=prog_bar,
                batch_size=batch_size,
                reduce_fx=reduce_fx,
            )

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    def save_hyperparameters(self, *names: str) -> None:
        """Store the calling ``__init__``'s arguments so ``load_from_checkpoint`` can rebuild us."""
        frame = inspect.currentframe().f_back
        init_args = inspect.getargvalues(frame)
        values = {k: init_args.locals[k] for k in init_args.args if k != "self"}
        if init_args.keywords:
            values.update(init_args.locals[init_args.keywords])
        self.hparams = {k: v for k, v in values.items() if not names or k in names}

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, strict: bool = True, **kwargs: Any) -> Module:
        """Rebuild the module from its saved hyperparameters (``kwargs`` override) and weights."""
        meta = read_checkpoint_meta(checkpoint_path)
        module = cls(**{**meta.get("hyper_parameters", {}), **kwargs})
        module.configure_model()
        object.__setattr__(module, "_distrain_configured", True)  # a later trainer must not rebuild it
        module.load_state_dict(read_model_weights(checkpoint_path), strict=strict)
        return module.eval()

    def __getstate__(self):  # the trainer never travels with the module (spawn pickles it)
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_trainer"] = None
        return state


class LossModule(Module):
    """Adapts a plain ``nn.Module`` whose forward returns a loss (or an object with ``.loss``)."""

    def __init__(
        self,
        model: nn.Module,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        total_steps: int = 0,
        lr_schedule: str = "constant",
    ):
        super().__init__()
        self.model = model
        self.settings = dict(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            lr_schedule=lr_schedule,
        )

    def forward(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            return self.model(**batch)
        if isinstance(batch, (list, tuple)):
            return self.model(*batch)
        return self.model(batch)

    def _loss(self, batch: Any) -> torch.Tensor:
        out = self(batch)
        if isinstance(out, torch.Tensor):
            return out
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            raise TypeError(f"{type(self.model).__name__}.forward must return a loss tensor or an object with .loss")
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        from distrain.optim import adamw, warmup_decay

        s = self.settings
        optimizer = adamw(self.model, s["learning_rate"], s["weight_decay"])
        scheduler = warmup_decay(optimizer, s["warmup_steps"], s["total_steps"], s["lr_schedule"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepRouter(nn.Module):
    """Makes ``model("training_step", batch, i)`` run through the strategy's wrapper (DDP's
    forward hooks must see the call) while the user's code stays a plain ``training_step``."""

    def __init__(self, module: Module):
        super().__init__()
        self.module = module

    def forward(self, step_name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, step_name)(*args, **kwargs)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned: a tensor, or a dict with ``"loss"``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    raise TypeError(f"training_step must return a loss tensor or a dict with 'loss', got {type(output).__name__}")
