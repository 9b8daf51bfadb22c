"""``distrain.Module``: the user's model plus the steps that train, evaluate and predict it."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distrain.checkpoint.state import read_checkpoint_meta, read_model_weights

#: Lightning hooks and overrides distrain never calls, and what to do instead. A module that defines one is refused
#: when fit/validate/test/predict starts (``unsupported_hooks``), rather than silently running without it.
UNSUPPORTED_HOOKS = {
    "on_before_batch_transfer": "change the batch in the DataLoader's collate_fn",
    "transfer_batch_to_device": "distrain moves tensors (and dicts/lists/tuples of them) itself; use collate_fn",
    "on_after_batch_transfer": "change the batch at the top of training_step",
    "configure_callbacks": "pass the callbacks to Trainer(callbacks=[...])",
    "configure_sharded_model": "rename it configure_model",
    "on_validation_model_eval": "distrain calls module.eval() itself; use on_validation_start",
    "on_validation_model_train": "distrain calls module.train() itself; use on_validation_end",
    "on_test_model_eval": "distrain calls module.eval() itself; use on_test_start",
    "on_test_model_train": "distrain calls module.train() itself; use on_test_end",
    "on_predict_model_eval": "distrain calls module.eval() itself; use on_predict_start",
}


def unsupported_hooks(module: nn.Module) -> list[str]:
    """One line per Lightning hook ``module``'s class defines that distrain does not call."""
    return [
        f"{type(module).__name__}.{name}: distrain does not call this Lightning hook; {instead}"
        for name, instead in UNSUPPORTED_HOOKS.items()
        if callable(getattr(type(module), name, None)) and getattr(Module, name, None) is None
    ]


def check_hooks(module: nn.Module) -> None:
    """Before any rank starts: a Lightning hook distrain does not call is refused in one line, naming it and what to
    do instead (``UNSUPPORTED_HOOKS``), rather than training without it."""
    problems = unsupported_hooks(module)
    if problems:
        raise NotImplementedError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


class AttributeDict(dict):
    """``hparams``: a dict whose keys read as attributes too (``self.hparams.lr`` and ``self.hparams["lr"]``),
    as Lightning's is; saved in checkpoints as a plain dict."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            held = ", ".join(map(str, self)) or "nothing"
            raise AttributeError(f"hparams has no {key!r} (it holds: {held})") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]


def hyperparameters_of(frame, args: tuple, ignore: str | list[str] | None) -> dict[str, Any]:
    """What ``save_hyperparameters(*args, ignore=...)`` stores: the arguments of the ``__init__`` running in
    ``frame`` (those named in ``args``, if any), or the dict/Namespace given as the one argument."""
    if len(args) == 1 and not isinstance(args[0], str):  # save_hyperparameters(dict or Namespace)
        values = dict(args[0]) if isinstance(args[0], dict) else dict(vars(args[0]))
        names: tuple = ()
    else:
        init_args = inspect.getargvalues(frame)
        values = {k: init_args.locals[k] for k in init_args.args if k != "self"}
        if init_args.keywords:
            values.update(init_args.locals[init_args.keywords])
        names = args
    ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
    return {k: v for k, v in values.items() if (not names or k in names) and k not in ignored}


class Module(nn.Module):
    """Subclass and implement ``training_step`` and ``configure_optimizers``.

    Build layers in ``__init__`` or — for large models — in ``configure_model``, which runs
    under the strategy's init context (on the device, or sharded for sharded strategies).

    Written to Lightning's ``LightningModule`` API: its hooks (called in Lightning's order; docs/migrating.md, "Coming
    from Lightning"), its properties (``device``, ``current_epoch``, ``global_step``, ``global_rank``, ...) and manual
    optimization (``automatic_optimization = False``, ``self.optimizers()``, ``self.manual_backward``).
    """

    #: False: ``training_step`` steps the optimizers itself (``self.optimizers()``, ``self.manual_backward``)
    automatic_optimization: bool = True
    #: False: ``prepare_data`` runs on global rank 0 only (files on a disk every node shares)
    prepare_data_per_node: bool = True

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_trainer", None)  # not a submodule, not in state_dict
        self.hparams = AttributeDict()

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyperparameters (``save_hyperparameters``), read as attributes or as keys; checkpoints store
        them, so ``load_from_checkpoint`` can rebuild the module. Assigning a dict or a Namespace replaces them."""
        return self._hparams

    @hparams.setter
    def hparams(self, value: Any) -> None:  # ``self.hparams = {...}`` keeps attribute access
        object.__setattr__(self, "_hparams", AttributeDict(value if isinstance(value, dict) else vars(value)))

    # ---- what users implement -------------------------------------------------------------
    def configure_model(self) -> None:
        """Create layers here to have them built under the strategy's init context."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict:
        """One micro-batch (on the device) → its loss, or a dict with ``"loss"``: the Trainer runs the backward, the
        gradient the mean over the step's micro-batches and the ranks. Under manual optimization it steps the
        optimizers itself. Required; ``batch_idx`` may be left out of the signature."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """One validation batch, in eval mode under ``torch.no_grad``: ``self.log`` what it measures (per epoch, a
        sample-weighted mean over every rank). A scalar tensor returned is logged as ``val_loss`` unless that is
        logged already. Does nothing unless overridden."""
        return None

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """One batch of ``Trainer.test``, as ``validation_step`` (a scalar tensor returned: ``test_loss``)."""
        return None

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """One batch of ``Trainer.predict``, in eval mode under ``torch.no_grad``: its prediction (by default
        ``self(batch)``); ``predict`` returns this rank's, in order."""
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

    # Lightning's hooks, called in Lightning's order (docs/migrating.md, "Coming from Lightning"). Two differ on
    # purpose: with accumulate_grad_batches > 1, on_after_backward and on_train_batch_end run once per optimizer
    # step (after its last micro-batch), and distrain zeroes gradients right after each step, so they are already
    # None in on_before_zero_grad.
    def prepare_data(self) -> None:
        """Download or write data: runs on local rank 0 of each node, before the other ranks go on."""

    def setup(self, stage: str) -> None:
        """In every rank, before ``configure_model``; ``stage`` is "fit", "validate", "test" or "predict"."""

    def teardown(self, stage: str) -> None:
        """Last in each stage (``stage``: "fit", "validate", "test" or "predict"), before the datamodule's
        ``teardown``; in ``fit`` also when training failed."""

    def on_fit_start(self) -> None:
        """Once the model, the optimizers and a resumed checkpoint are set up, after the callbacks' ``on_fit_start``;
        ``on_train_start`` follows, then the first step."""

    def on_fit_end(self) -> None:
        """When ``fit`` has finished: after ``on_train_end``, and once a checkpoint written in the background is on
        disk."""

    def on_train_start(self) -> None:
        """Right after ``on_fit_start``, before the first step."""

    def on_train_end(self) -> None:
        """When training ends (its steps or epochs done, or stopped), after the last validation and the callbacks'
        ``on_train_end``."""

    def on_train_epoch_start(self) -> None:
        """At the start of each training epoch, before its first batch is read."""

    def on_train_epoch_end(self) -> None:
        """At the end of each training epoch, after its validation when validation runs once per epoch: what it logs
        is an epoch value."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Before each ``training_step``, the batch on the device. Return -1 at the first batch of an optimizer step to
        skip the rest of the epoch, on every rank (inside an accumulation window it is an error)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each optimizer step (not each micro-batch), and after the callbacks' ``on_train_batch_end``:
        ``outputs`` is the step's last ``training_step`` output, ``batch`` and ``batch_idx`` its last micro-batch's."""

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per optimizer step, after its first ``training_step`` and before that backward (manual optimization:
        in ``optimizer.zero_grad()``). The gradients are already None: distrain zeroes them after each step."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """After each ``training_step``, before its backward, with the loss it returned (manual optimization: in
        ``manual_backward``)."""

    def on_after_backward(self) -> None:
        """Once per optimizer step, after its last micro-batch's backward: gradients accumulated and reduced across
        ranks, not yet unscaled nor clipped (manual optimization: after each ``manual_backward``)."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before each optimizer step, the gradients final (reduced, clipped); not before a step the loop drops for
        non-finite gradients."""

    def on_validation_start(self) -> None:
        """When a validation run starts (``fit`` and ``Trainer.validate``), the module in eval mode."""

    def on_validation_end(self) -> None:
        """When a validation run ends, after ``on_validation_epoch_end``."""

    def on_validation_epoch_start(self) -> None:
        """After ``on_validation_start``, before the first batch."""

    def on_validation_epoch_end(self) -> None:
        """After the last batch: what it logs is part of this run's metrics."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each ``validation_step``, the batch on the device."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each ``validation_step``, ``outputs`` what it returned."""

    def on_test_start(self) -> None:
        """When a test run starts (``Trainer.test``), the module in eval mode."""

    def on_test_end(self) -> None:
        """When a test run ends, after ``on_test_epoch_end``."""

    def on_test_epoch_start(self) -> None:
        """After ``on_test_start``, before the first batch."""

    def on_test_epoch_end(self) -> None:
        """After the last batch: what it logs is part of this run's metrics."""

    def on_test_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each ``test_step``, the batch on the device."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each ``test_step``, ``outputs`` what it returned."""

    def on_predict_start(self) -> None:
        """When a predict run starts (``Trainer.predict``), the module in eval mode."""

    def on_predict_end(self) -> None:
        """When a predict run ends, after ``on_predict_epoch_end``."""

    def on_predict_epoch_start(self) -> None:
        """After ``on_predict_start``, before the first batch."""

    def on_predict_epoch_end(self) -> None:
        """After the last batch."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each ``predict_step``, the batch on the device."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each ``predict_step``, ``outputs`` what it returned."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add keys of your own to ``checkpoint`` (plain values: numbers, strings, tensors, lists, dicts)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """On resume (and in ``load_from_checkpoint``): ``checkpoint`` holds the keys ``on_save_checkpoint`` added."""

    # ---- services ------------------------------------------------------------------------
    @property
    def device_mesh(self):
        """Under ``ModelParallelStrategy`` / ``PipelineStrategy``: the ``DeviceMesh`` of the ranks, with dims
        ``"pipeline_parallel"``, ``"data_parallel"`` and ``"tensor_parallel"`` (Lightning's names), for a
        tensor-parallel plan of your own in ``configure_model``
        (``parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)``). None otherwise."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = self._trainer.strategy.device_mesh if self._trainer is not None else None
        return mesh if isinstance(mesh, DeviceMesh) else None

    @property
    def trainer(self):
        """The Trainer this module is attached to (a RuntimeError before one is)."""
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (the Trainer's device once attached)."""
        if self._trainer is not None:
            return self._trainer.runtime.device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    # where the loop is, as Lightning names it (0 before a Trainer is attached)
    current_epoch = property(
        lambda self: self._trainer.current_epoch if self._trainer is not None else 0,
        doc="The epoch the Trainer is in, counted from 0.",
    )
    global_step = property(
        lambda self: self._trainer.global_step if self._trainer is not None else 0,
        doc="The optimizer steps taken so far (a resumed run's included).",
    )
    global_rank = property(
        lambda self: self._trainer.global_rank if self._trainer is not None else 0,
        doc="This process's rank among all ranks.",
    )
    local_rank = property(
        lambda self: self._trainer.local_rank if self._trainer is not None else 0,
        doc="This process's rank on its node.",
    )
    loggers = property(
        lambda self: list(self._trainer.loggers) if self._trainer is not None else [],
        doc="The Trainer's loggers (an empty list without a Trainer).",
    )
    logger = property(lambda self: next(iter(self.loggers), None), doc="The first of ``loggers``, or None.")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's tensor (or dict/list/tuple of tensors) stacked along a new first dimension of size
        world_size; with ``group`` (a process group), its ranks' only: ``self.trainer.strategy.data_parallel_group``
        gathers each sample once under model parallelism, whose tensor-parallel, context-parallel and pipeline
        ranks hold copies of the same samples. ``sync_grads`` is not supported."""
        if sync_grads:
            raise ValueError("all_gather: sync_grads=True is not supported (the gathered tensors carry no gradient)")
        if isinstance(data, dict):
            return {k: self.all_gather(v, group) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.all_gather(v, group) for v in data)
        tensor = torch.as_tensor(data, device=self.device)
        return self.trainer.runtime.all_gather(tensor, group)

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer ``configure_optimizers`` returned (a list when it returned several), wrapped as Lightning
        wraps it: still an instance of its class, with a ``step()`` that goes through the strategy and the precision
        plugin. Under manual optimization ``step()`` averages the gradients over the ranks first (distrain syncs
        gradients at the step, so accumulating by hand communicates once). ``use_pl_optimizer=False``: unwrapped."""
        opts = self.trainer.loop_optimizers if use_pl_optimizer else self.trainer.optimizers
        opts = opts or self.trainer.optimizers
        return opts[0] if len(opts) == 1 else list(opts)

    def lr_schedulers(self) -> Any:
        """The scheduler(s) ``configure_optimizers`` returned: one, a list, or None."""
        schedulers = [c["scheduler"] for c in self.trainer.lr_schedulers]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` under manual optimization, through the precision plugin (loss scaling)."""
        if self.automatic_optimization:
            raise RuntimeError("manual_backward is for manual optimization: set automatic_optimization = False")
        self.on_before_backward(loss)
        self.trainer.runtime.strategy.backward(loss, self.trainer.model)
        self.on_after_backward()

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> Any:
        """Clip ``optimizer``'s gradients (over all ranks) to ``gradient_clip_val``: by global norm ("norm", the
        default) or by value ("value"). Under manual optimization call it between manual_backward and step."""
        if gradient_clip_val is None:
            return None
        optimizer = getattr(optimizer, "optimizer", optimizer)
        trainer = self.trainer
        if not self.automatic_optimization:
            from distrain.training.optimizers import sync_gradients

            sync_gradients(trainer, optimizer)
        if gradient_clip_algorithm in (None, "norm"):
            return trainer.runtime.clip_gradients(trainer.model, optimizer, gradient_clip_val)
        if gradient_clip_algorithm == "value":  # unscaled first, as the norm's
            return trainer.runtime.strategy.clip_gradient_values(trainer.model, optimizer, gradient_clip_val)
        raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}")

    # ---- the optimizer step's hooks, as Lightning's: override one to change how the loop steps ----------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Runs the backward of ``loss`` (already scaled where a grad scaler is on). Override it to change how, as in
        Lightning; strategies whose engine or schedule runs the backward (DeepSpeed, pipelines) refuse a module that
        does, before any rank starts."""
        loss.backward(*args, **kwargs)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clips the gradients before each optimizer step; the Trainer's ``gradient_clip_val`` comes in."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Steps the optimizer; the step's forward and backward have run. Override it to change the step (a
        warm-up of the learning rate, say) and call ``optimizer.step(closure=optimizer_closure)`` in it: a step it
        leaves out is not applied."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Clears the gradients after each optimizer step."""
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Steps a scheduler when it is due (``interval``, ``frequency``), with its monitored metric if it has one."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters take gradients until ``untoggle_optimizer``: the other optimizers'
        parameters get ``requires_grad=False`` (a GAN's generator step leaves the discriminator's alone)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        saved: dict[nn.Parameter, bool] = {}
        for other in self.trainer.optimizers:
            if other is optimizer:
                continue
            for group in other.param_groups:
                for param in group["params"]:
                    if param not in saved:
                        saved[param] = param.requires_grad
                        param.requires_grad = False
        for group in optimizer.param_groups:  # a parameter both optimizers hold keeps its own setting
            for param in group["params"]:
                if param in saved:
                    param.requires_grad = saved[param]
        object.__setattr__(self, "_param_requires_grad_state", saved)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Gives back the ``requires_grad`` that ``toggle_optimizer`` changed."""
        for param, requires_grad in getattr(self, "_param_requires_grad_state", {}).items():
            param.requires_grad = requires_grad
        object.__setattr__(self, "_param_requires_grad_state", {})

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any):
        """``toggle_optimizer`` for the ``with`` block, then ``untoggle_optimizer``."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a metric. Training defaults to per-step, evaluation to per-epoch (a
        sample-weighted mean that is always reduced across ranks). ``reduce_fx="sum"``: the epoch
        value is the total over all calls (and, reduced, all ranks), e.g. a count of samples.
        Lightning's positional order; ``logger`` and ``rank_zero_only`` are accepted and change nothing (every
        value goes to the loggers, from rank 0)."""
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
        """``self.log(name, value, **kwargs)`` for each item of ``metrics``."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    def save_hyperparameters(self, *args: Any, ignore: str | list[str] | None = None, logger: bool = True) -> None:
        """Store the calling ``__init__``'s arguments (all, those named in ``args``, or a dict/Namespace given
        instead) in ``self.hparams`` so ``load_from_checkpoint`` can rebuild us; ``ignore`` leaves names out."""
        self.hparams = hyperparameters_of(inspect.currentframe().f_back, args, ignore)

    def freeze(self) -> None:
        """No gradients for any parameter, and eval mode (for inference after ``load_from_checkpoint``)."""
        for param in self.parameters():
            param.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Undo ``freeze``: gradients for every parameter again, and train mode."""
        for param in self.parameters():
            param.requires_grad = True
        self.train()

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, strict: bool = True, **kwargs: Any) -> Module:
        """Rebuild the module from its saved hyperparameters (``kwargs`` override) and weights."""
        meta = read_checkpoint_meta(checkpoint_path)
        module = cls(**{**meta.get("hyper_parameters", {}), **kwargs})
        module.configure_model()
        object.__setattr__(module, "_distrain_configured", True)  # a later trainer must not rebuild it
        module.load_state_dict(read_model_weights(checkpoint_path), strict=strict)
        module.on_load_checkpoint(meta)
        return module.eval()

    def __getstate__(self):  # the trainer never travels with the module (spawn pickles it)
        return {**super().__getstate__(), "_trainer": None}


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
        """The wrapped model on ``batch``: a dict as keyword arguments, a list or tuple as positional ones, anything
        else as the one argument."""
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
        """The loss the wrapped model returns for ``batch`` (a tensor, or its ``loss`` key or attribute)."""
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Logs the wrapped model's loss for ``batch`` as ``val_loss``."""
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        """AdamW with ``learning_rate`` and ``weight_decay`` (none on 1-D parameters), and a per-step schedule:
        linear warm-up over ``warmup_steps``, then ``lr_schedule`` over ``total_steps``."""
        from distrain.optim import adamw, warmup_decay

        s = self.settings
        optimizer = adamw(self.model, s["learning_rate"], s["weight_decay"])
        scheduler = warmup_decay(optimizer, s["warmup_steps"], s["total_steps"], s["lr_schedule"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepRouter(nn.Module):
    """Makes ``model("training_step", batch, i)`` run through the strategy's wrapper (DDP's
    forward hooks must see the call) while the user's code stays a plain ``training_step``.

    ``StepRouter.of(module)``: the module's one router, whichever stage and Trainer set it up: a strategy that
    shards in place (FSDP2's ``fully_shard``) finds it sharded already and keeps it so."""

    @classmethod
    def of(cls, module: Module, before_backward: Callable[[Any], None] | None = None) -> StepRouter:
        router = module.__dict__.get("_distrain_router")  # not a submodule: outside the module's tree and state
        if router is None:
            router = module.__dict__["_distrain_router"] = cls(module)
        router.before_backward = before_backward
        return router

    def __init__(self, module: Module, before_backward: Callable[[Any], None] | None = None):
        super().__init__()
        self.module = module
        #: the loop's, between a ``training_step`` and its backward (Lightning's on_before_zero_grad,
        #: on_before_backward: here, in order)
        self.before_backward = before_backward

    def __getstate__(self) -> dict:
        # the module carries its router (``of``): a copy or pickle of the module leaves the loop's hook behind
        return {**super().__getstate__(), "before_backward": None}

    def forward(self, step_name: str, batch: Any, batch_idx: int) -> Any:
        output = run_step(self.module, step_name, batch, batch_idx)
        if step_name == "training_step" and self.before_backward is not None and self.module.automatic_optimization:
            self.before_backward(output)
        return output


_TAKES_BATCH_IDX: dict[Any, bool] = {}


def run_step(module: Module, step_name: str, batch: Any, batch_idx: int) -> Any:
    """``module.<step_name>(batch, batch_idx)``, or ``(batch)`` where the step has no ``batch_idx``
    parameter: Lightning lets ``training_step(self, batch)`` (and the evaluation steps) leave it out."""
    step = getattr(module, step_name)
    function = getattr(step, "__func__", step)
    takes = _TAKES_BATCH_IDX.get(function)
    if takes is None:
        try:
            parameters = list(inspect.signature(step).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable: assume torch's usual (batch, batch_idx)
            parameters = None
        takes = _TAKES_BATCH_IDX[function] = parameters is None or (
            any(p.kind is p.VAR_POSITIONAL or p.name == "batch_idx" for p in parameters)
            or sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters) >= 2
        )
    return step(batch, batch_idx) if takes else step(batch)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned: a tensor, or a dict with ``"loss"``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    raise TypeError(f"training_step must return a loss tensor or a dict with 'loss', got {type(output).__name__}")


def as_module(module: nn.Module) -> Module:
    """``module`` as the Trainer takes it: a ``Module``; a plain ``nn.Module`` is refused, saying how to wrap it."""
    if isinstance(module, Module):
        return module
    raise TypeError(
        f"{type(module).__name__} is a plain nn.Module; wrap it: distrain.LossModule(model, learning_rate=...) "
        "(its forward must return a loss), or subclass distrain.Module"
    )


def overrides(module: nn.Module, *names: str) -> bool:
    """``module``'s class defines one of ``names`` itself (not ``Module``'s default)."""
    return any(getattr(type(module), name) is not getattr(Module, name) for name in names)
