"""The Trainer: epochs → batches → micro-steps (accumulation) → optimizer step → callbacks.

The loop never asks which strategy runs it; it only talks to the Runtime.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader

from distrain.callbacks import Callback, ModelCheckpoint, ProgressBar
from distrain.data import ResumableDistributedSampler, batch_size_of, move_to_device, tokens_in_batch
from distrain.loggers import JSONLLogger, Logger, TensorBoardLogger
from distrain.metrics import MetricCollector, Throughput
from distrain.module import Module
from distrain.runtime import Runtime, rng_state, set_rng_state
from distrain.strategies.base import Strategy, TrainingPlan

CHECKPOINT_FORMAT = "distrain/1"


class Trainer:
    def __init__(
        self,
        accelerator: str = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str = "32-true",
        max_epochs: int | None = None,
        max_steps: int = -1,
        accumulate_grad_batches: int | dict[int, int] = 1,
        gradient_clip_val: float | None = None,
        val_check_interval: int | float | None = None,
        log_every_n_steps: int = 50,
        default_root_dir: str | os.PathLike | None = None,
        callbacks: Iterable[Callback] | Callback | None = None,
        logger: bool | Logger | Iterable[Logger] = True,
        seed: int = 0,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        use_distributed_sampler: bool = True,
        limit_val_batches: int | None = None,
        **strategy_kwargs: Any,
    ):
        if gradient_clip_val is not None and gradient_clip_val < 0:
            raise ValueError(f"gradient_clip_val must be >= 0 (None or 0 disables clipping), got {gradient_clip_val}")
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be a positive integer, got {log_every_n_steps!r}")
        self.runtime = Runtime(accelerator, strategy, devices, num_nodes, precision, **strategy_kwargs)
        self.max_epochs = max_epochs if max_epochs is not None else (1000 if max_steps == -1 else None)
        self.max_steps = max_steps
        self.accumulation_schedule = _accumulation_schedule(accumulate_grad_batches)
        self.gradient_clip_val = gradient_clip_val
        self.val_check_interval = val_check_interval
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = str(default_root_dir or os.path.join(os.getcwd(), "distrain_runs"))
        self.runtime.flight_recorder_dir = os.path.join(self.default_root_dir, "flight_recorder")  # NCCL only
        self.seed = seed
        self.use_distributed_sampler = use_distributed_sampler
        self.limit_val_batches = limit_val_batches
        self.callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        if enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
            self.callbacks.append(ModelCheckpoint())
        if enable_progress_bar and not any(isinstance(c, ProgressBar) for c in self.callbacks):
            self.callbacks.append(ProgressBar())
        self.enable_progress_bar = enable_progress_bar
        if logger is True:
            self.loggers: list[Logger] = [JSONLLogger(self.default_root_dir), TensorBoardLogger(self.default_root_dir)]
        elif not logger:
            self.loggers = []
        else:
            self.loggers = [logger] if isinstance(logger, Logger) else list(logger)
        self.run_config: dict | None = None  # the resolved config, stored in checkpoints (CLI sets it)

        # progress: what a checkpoint must carry to resume exactly
        self.global_step = 0
        self.current_epoch = 0
        self._samples_in_epoch = 0  # global position in this epoch's sample order
        self.should_stop = False
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.module: Module | None = None
        self.model: nn.Module | None = None  # the strategy-wrapped module
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[dict] = []
        self._metrics = MetricCollector(self.runtime)
        self._grad_norm: torch.Tensor | None = None
        self._num_batches: int | None = None
        self._last_val_step = -1
        self._epoch_done = False
        self._signal_received: int | None = None
        self._pending_stop = None
        self.preempted: int | None = None  # the signal that stopped the run, if one did

    # ---- where am I ---------------------------------------------------------------------------
    is_global_zero = property(lambda self: self.runtime.is_global_zero)
    global_rank = property(lambda self: self.runtime.global_rank)
    local_rank = property(lambda self: self.runtime.local_rank)
    world_size = property(lambda self: self.runtime.world_size)
    strategy = property(lambda self: self.runtime.strategy)

    def init_module(self, empty_init: bool | None = None):
        """``with trainer.init_module(): model = Model()`` builds directly on the device (and
        in bf16 for bf16-true; on meta for sharded strategies). ``empty_init=True`` skips weight
        initialization, for weights you are about to load."""
        return self.runtime.init_module(empty_init)

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    # ---- public entry points: each launches the ranks, then runs the stage in every rank -------
    def fit(self, module: nn.Module, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        module = _as_module(module)
        if datamodule is not None:
            train_dataloaders = train_dataloaders or datamodule.train_dataloader()
            if val_dataloaders is None and hasattr(datamodule, "val_dataloader"):
                val_dataloaders = datamodule.val_dataloader()
        if train_dataloaders is None:
            raise ValueError("fit() needs train_dataloaders or a datamodule with train_dataloader()")
        if ckpt_path is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
            # torchrun restarted the group after a failure: continue from the newest checkpoint
            ckpt_path = "last" if self._last_checkpoint().exists() else None
        return self._launch(self._fit, module, train_dataloaders, val_dataloaders, ckpt_path)

    def validate(self, module: nn.Module, dataloaders=None, ckpt_path=None, datamodule=None) -> list[dict]:
        loader = dataloaders if dataloaders is not None else datamodule.val_dataloader()
        return self._launch(self._evaluate_stage, _as_module(module), "validate", loader, ckpt_path)

    def test(self, module: nn.Module, dataloaders=None, ckpt_path=None, datamodule=None) -> list[dict]:
        loader = dataloaders if dataloaders is not None else datamodule.test_dataloader()
        return self._launch(self._evaluate_stage, _as_module(module), "test", loader, ckpt_path)

    def predict(self, module: nn.Module, dataloaders=None, ckpt_path=None, datamodule=None) -> list:
        """Returns this rank's predictions, in its sampler order (rank 0's for spawn/fork)."""
        loader = dataloaders if dataloaders is not None else datamodule.predict_dataloader()
        return self._launch(self._predict_stage, _as_module(module), loader, ckpt_path)

    def _launch(self, fn, module: Module, *args):
        # spawn/fork: the trained weights and the progress come back to this (parent) process
        def restore(state):
            self._configure(module)  # the parent never built configure_model's layers
            module.load_state_dict(state["model"])
            self._load_progress(state["progress"])

        return self.runtime._launch(fn, module, *args, collect=self._state_for_parent, restore=restore)

    def _state_for_parent(self) -> dict:
        weights = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        return {"model": weights, "progress": self._progress()}

    # ---- fit ----------------------------------------------------------------------------------
    def _fit(self, module: Module, train_loader, val_loader, ckpt_path):
        rt = self.runtime
        train_loader = self._setup_loader(train_loader, shuffle_seed=self.seed)
        val_loader = self._setup_loader(val_loader, even=False) if val_loader is not None else None
        self._num_batches = _safe_len(train_loader)
        self._attach(module, "fit", train_loader)
        if ckpt_path is not None:
            self._restore(self._resolve_ckpt_path(ckpt_path))
        self._throughput = Throughput(
            rt.world_size, _flops_per_token(module), rt.accelerator.peak_flops(rt.device, rt.precision.compute_dtype)
        )
        if self.is_global_zero:
            for lg in self.loggers:
                if self.run_config:
                    lg.log_hyperparams(self.run_config)
        self._call("on_fit_start")
        module.on_fit_start()
        previous_handlers = self._catch_preemption_signals()
        try:
            self._train_loop(module, train_loader, val_loader)
            rt.progress(None, "end of training")
            if val_loader is not None and self._last_val_step != self.global_step and not self.preempted:
                self._validate_during_fit(module, val_loader)  # the run always ends with a val score
            self._call("on_train_end")
        except BaseException as error:
            hang = rt.explain_failure(error)  # a collective timed out or lost a peer: who is elsewhere, and where
            self._call("on_exception", hang or error)
            if hang is None:
                raise
            self._pending_stop = None  # the stop-signal all-reduce in flight cannot finish either
            raise hang from error
        finally:
            self._stop_requested(final=True)  # no collective may be left in flight
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize()
            self._call("teardown", "fit")
        if self.preempted and self.is_global_zero:
            print(f"distrain: stopped by signal {self.preempted} at step {self.global_step}; "
                  "the checkpoint in `last` resumes it", flush=True)
        return self.callback_metrics

    def _catch_preemption_signals(self) -> dict:
        """SIGTERM (torchrun/k8s stopping us) and SIGUSR1 (SLURM before time-out/preemption) end
        the run at the next optimizer step with a checkpoint, instead of killing it mid-step."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            self._signal_received = signum

        previous = {}
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            previous[signum] = signal.signal(signum, handler)
        return previous

    def _stop_requested(self, final: bool = False) -> bool:
        """True on every rank, at the same step, once any rank got a stop signal.

        Each step starts an asynchronous max-reduction of "signal received?" and reads the one
        started a step earlier, which has long finished: agreement without a blocking
        collective per step. ``final`` only collects the reduction in flight.
        """
        previous, self._pending_stop = self._pending_stop, None
        flag = float(previous()) if previous is not None else 0.0
        if not final:
            self._pending_stop = self.runtime.all_reduce_async(torch.tensor(float(self._signal_received or 0)), "max")
        if flag:
            self.preempted = int(flag)
        return bool(flag)

    def _train_loop(self, module: Module, loader, val_loader) -> None:
        rt, optimizer = self.runtime, self.optimizers[0]
        val_every = self._val_every_steps()
        while not self._done() and (self.max_epochs is None or self.current_epoch < self.max_epochs):
            sampler = getattr(loader, "sampler", None)
            if isinstance(sampler, ResumableDistributedSampler):
                sampler.set_epoch(self.current_epoch)
                sampler.set_start(self._samples_in_epoch)
            elif self._samples_in_epoch:
                raise RuntimeError(
                    "this checkpoint was saved mid-epoch, and this train loader has no distrain sampler to skip the "
                    "samples already seen (use_distributed_sampler=False, an IterableDataset or a custom batch "
                    "sampler); resume from an epoch-end checkpoint, or let distrain shard the data"
                )
            accumulate = self._accumulate_for(self.current_epoch)
            per_step = (getattr(loader, "batch_size", None) or 1) * rt.world_size
            first_batch = self._samples_in_epoch // per_step
            self._call("on_train_epoch_start")
            module.on_train_epoch_start()
            micro, step_samples, step_tokens, step_loss = 0, 0, 0, torch.zeros((), device=rt.device)
            for batch_idx, batch in _steps_read_ahead(enumerate(loader, start=first_batch), accumulate, module):
                rt.progress(self.global_step + 1, "forward/backward")  # where this rank is, if a collective hangs
                batch = move_to_device(batch, rt.device)
                samples, tokens = batch_size_of(batch), tokens_in_batch(batch)
                is_last_batch = self._num_batches is not None and batch_idx + 1 >= self._num_batches
                micro += 1
                steps_now = micro % accumulate == 0 or is_last_batch

                # Non-final micro-steps only accumulate locally: no gradient all-reduce.
                with rt.no_backward_sync(self.model, enabled=not steps_now):
                    self._metrics.current_batch_size = samples
                    with rt.autocast():
                        output = self.model("training_step", batch, batch_idx)
                    loss = _loss_of(output)
                    rt.backward(loss / accumulate, self.model)
                step_loss += loss.detach().float() / accumulate
                self._samples_in_epoch += samples * rt.world_size
                step_tokens += tokens or 0
                step_samples += samples
                if not steps_now:
                    continue

                rt.progress(None, "optimizer step")
                if self.gradient_clip_val:
                    self._grad_norm = rt.clip_gradients(self.model, optimizer, self.gradient_clip_val)
                self._call("on_before_optimizer_step", optimizer)
                rt.optimizer_step(optimizer, self.model)
                optimizer.zero_grad(set_to_none=True)
                self._step_schedulers("step")
                self.global_step += 1
                self._throughput.step(step_samples, step_tokens or None)
                self._log_train_step(step_loss, optimizer)
                micro, step_samples, step_tokens, step_loss = 0, 0, 0, torch.zeros((), device=rt.device)
                rt.progress(None, "stop-signal check")
                if self._stop_requested():
                    self.should_stop = True  # on_train_end below writes the checkpoint
                if val_loader is not None and val_every and self.global_step % val_every == 0:
                    self._validate_during_fit(module, val_loader)  # first, so checkpoints can monitor it
                rt.progress(None, "callbacks after the step (checkpointing)")
                self._call("on_train_batch_end", output, batch, batch_idx)
                if self._done():
                    break
            else:  # the epoch ran to its end
                self._end_epoch(module, val_loader, val_every)
                continue
            break

    def _end_epoch(self, module: Module, val_loader, val_every) -> None:
        self.runtime.progress(None, "end of epoch")
        if self._epoch_done:  # resumed from a checkpoint written at this epoch's end: already done
            self._epoch_done = False
            self.current_epoch += 1
            self._samples_in_epoch = 0
            return
        self._step_schedulers("epoch")
        epoch_metrics = self._metrics.pop_epoch_metrics()
        self._publish(epoch_metrics, to_loggers=bool(epoch_metrics))
        if val_loader is not None and not val_every:
            self._validate_during_fit(module, val_loader)
        module.on_train_epoch_end()
        self._epoch_done = True  # a checkpoint saved in the hooks below resumes at the next epoch
        self._call("on_train_epoch_end")
        self._epoch_done = False
        self.current_epoch += 1
        self._samples_in_epoch = 0

    def _done(self) -> bool:
        return self.should_stop or (self.max_steps != -1 and self.global_step >= self.max_steps)

    def _log_train_step(self, step_loss: torch.Tensor, optimizer) -> None:
        self.runtime.progress(None, "logging")
        logged = self._metrics.pop_step_metrics(reduce=True)
        if self.global_step % self.log_every_n_steps and not self._done():
            self.callback_metrics.update(logged)
            return
        # The loss is averaged over ranks only on logging steps: one small all-reduce.
        self.runtime.accelerator.synchronize(self.runtime.device)  # CUDA is async: time what really ran
        metrics = {
            "epoch": self.current_epoch,
            "loss": self.runtime.all_reduce(step_loss).item(),
            "lr": optimizer.param_groups[0]["lr"],
            **logged,
            **self._throughput.compute(),
            **self._memory_stats(),
        }
        if self._grad_norm is not None:
            metrics["grad_norm"] = float(self._grad_norm)
        self.progress_bar_metrics = {
            "loss": metrics["loss"],
            **({"tok/s": round(metrics["tokens_per_sec"])} if "tokens_per_sec" in metrics else {}),
            **{k: v for k, v in logged.items() if k in self._metrics.prog_bar},
        }
        self._publish(metrics)
        if self.is_global_zero and not self.enable_progress_bar:
            shown = " | ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float) and not k.startswith("mem"))
            print(f"step {self.global_step}" + (f"/{self.max_steps}" if self.max_steps > 0 else "") + f" | {shown}", flush=True)

    def _memory_stats(self) -> dict[str, Any]:
        rt = self.runtime
        local = rt.accelerator.memory_stats(rt.device)
        if rt.world_size == 1:
            return local
        per_rank = rt.all_gather(torch.tensor(list(local.values()), dtype=torch.float64)).tolist()
        out = {name: max(r[i] for r in per_rank) for i, name in enumerate(local)}  # the fullest rank
        out["mem_per_rank_mb"] = [r[-1] for r in per_rank]
        return out

    def _publish(self, metrics: dict[str, Any], to_loggers: bool = True) -> None:
        self.callback_metrics.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        self.logged_metrics = metrics
        if to_loggers and self.is_global_zero:
            for lg in self.loggers:
                lg.log_metrics(metrics, self.global_step)

    def _step_schedulers(self, interval: str) -> None:
        count = self.global_step + 1 if interval == "step" else self.current_epoch + 1
        for config in self.lr_schedulers:
            if config["interval"] == interval and count % config["frequency"] == 0:
                config["scheduler"].step()

    # ---- evaluation ----------------------------------------------------------------------------
    def _validate_during_fit(self, module: Module, loader) -> None:
        self.runtime.progress(None, "validation")
        self._last_val_step = self.global_step
        metrics = self._run_eval(module, "validation_step", loader, self.limit_val_batches)
        self._publish(metrics)
        module.on_validation_epoch_end()
        self._call("on_validation_end")

    def _run_eval(self, module: Module, step_name: str, loader, limit: int | None) -> dict[str, float]:
        rt = self.runtime
        was_training = module.training
        module.eval()
        self._metrics.stage = "validate"
        default_name = "val_loss" if step_name == "validation_step" else "test_loss"
        num_batches = len(loader) if limit is None else min(limit, len(loader))
        collective = rt.strategy.collective_forward and self.model is not None
        if collective:
            # Sharded forwards all-gather: every rank must run as many steps as the busiest one.
            # A rank that runs out repeats its last batch with logging muted, so each sample
            # still counts exactly once.
            num_steps = int(rt.all_reduce(torch.tensor(num_batches), op="max"))
        else:
            num_steps = num_batches
        batches = iter(loader)
        batch = None
        with torch.no_grad():
            for batch_idx in range(num_steps):
                self._metrics.muted = batch_idx >= num_batches
                if not self._metrics.muted:
                    batch = move_to_device(next(batches), rt.device)
                if batch is None:  # this rank got no evaluation data at all
                    break
                self._metrics.current_batch_size = batch_size_of(batch)
                with rt.autocast():
                    if collective:
                        output = self.model(step_name, batch, batch_idx)
                    else:
                        output = getattr(module, step_name)(batch, batch_idx)
                if isinstance(output, torch.Tensor) and output.dim() == 0 and default_name not in self._metrics.epoch_sums:
                    self._metrics.log(default_name, output, None, None, True, False, None)
        self._metrics.muted = False
        metrics = self._metrics.pop_epoch_metrics()
        self._metrics.stage = "train"
        module.train(was_training)
        return metrics

    def _evaluate_stage(self, module: Module, stage: str, loader, ckpt_path) -> list[dict]:
        self._attach(module, stage)
        loader = self._setup_loader(loader, even=False)
        if ckpt_path is not None:
            self._restore(self._resolve_ckpt_path(ckpt_path), weights_only=True)
        metrics = self._run_eval(module, "validation_step" if stage == "validate" else "test_step", loader, None)
        self._publish(metrics)
        for lg in self.loggers if self.is_global_zero else []:
            lg.finalize()
        return [metrics]

    def _predict_stage(self, module: Module, loader, ckpt_path) -> list:
        self._attach(module, "predict")
        loader = self._setup_loader(loader, even=False)
        if ckpt_path is not None:
            self._restore(self._resolve_ckpt_path(ckpt_path), weights_only=True)
        module.eval()
        step = (lambda b, i: self.model("predict_step", b, i)) if self.model is not None else module.predict_step
        with torch.no_grad(), self.runtime.autocast():
            return [step(move_to_device(batch, self.runtime.device), i) for i, batch in enumerate(loader)]

    # ---- set-up -----------------------------------------------------------------------------------
    def _attach(self, module: Module, stage: str, train_loader=None) -> None:
        rt = self.runtime
        rt.seed_everything(self.seed)  # same seed everywhere: every rank builds identical weights
        object.__setattr__(module, "_trainer", self)
        self.module = module
        self._configure(module)
        for cb in self.callbacks:
            cb.setup(self, module, stage)
        if stage != "fit":
            if not rt.strategy.collective_forward:
                self.model = None
                module.to(rt.device)
            elif self.model is None or rt.strategy.unwrap(self.model).module is not module:  # not the one fit() set up
                model = rt.strategy.setup_module(_StepRouter(module))
                self.model, _, _ = rt.strategy.setup_training(model, [], [], TrainingPlan())  # no optimizer
            return
        # The model is set up first: sharding strategies replace parameters, and the optimizer
        # must hold the ones that will be trained.
        model = rt.strategy.setup_module(_StepRouter(module))
        optimizers, schedulers = _parse_optimizers(module.configure_optimizers())
        plan = TrainingPlan(
            micro_batch_size=getattr(train_loader, "batch_size", None),
            accumulate=self._accumulate_for(0),
            gradient_clip_val=self.gradient_clip_val,
            total_steps=self.estimated_stepping_batches,
            run_dir=self.default_root_dir,
        )
        self.model, self.optimizers, self.lr_schedulers = rt.strategy.setup_training(model, optimizers, schedulers, plan)

    def _configure(self, module: Module) -> None:
        if not getattr(module, "_distrain_configured", False):
            with self.runtime.init_module():
                module.configure_model()
            object.__setattr__(module, "_distrain_configured", True)

    def _setup_loader(self, loader, shuffle_seed: int = 0, even: bool = True):
        if not self.use_distributed_sampler or not isinstance(loader, DataLoader):
            return loader
        from distrain.data import with_distributed_sampler

        return with_distributed_sampler(loader, self.world_size, self.global_rank, shuffle_seed, even=even)

    def _accumulate_for(self, epoch: int) -> int:
        return self.accumulation_schedule[max(e for e in self.accumulation_schedule if e <= epoch)]

    @property
    def estimated_stepping_batches(self) -> int | None:
        if self.max_steps != -1:
            return self.max_steps
        n = getattr(self, "_num_batches", None)
        if n is None or self.max_epochs is None:
            return None
        return sum(math.ceil(n / self._accumulate_for(e)) for e in range(self.max_epochs))

    def _val_every_steps(self) -> int | None:
        v = self.val_check_interval
        if v is None:
            return None
        if isinstance(v, float) and v <= 1.0:
            n = self._num_batches
            if n is None:
                raise ValueError("a fractional val_check_interval needs a train loader with a length")
            return max(1, int(n * v / self._accumulate_for(0)))
        return int(v)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, self.module, *args)

    # ---- checkpoints ------------------------------------------------------------------------------
    def _progress(self) -> dict:
        return {
            "global_step": self.global_step,
            "epoch": self.current_epoch,
            "samples_in_epoch": self._samples_in_epoch,
            "epoch_done": self._epoch_done,
            "callback_metrics": dict(self.callback_metrics),
        }

    def _load_progress(self, progress: dict) -> None:
        self.global_step = progress["global_step"]
        self.current_epoch = progress["epoch"]
        self._samples_in_epoch = progress["samples_in_epoch"]
        self._epoch_done = progress.get("epoch_done", False)
        self.callback_metrics = dict(progress.get("callback_metrics", {}))

    def _resumable_objects(self) -> dict[str, Any]:
        """The live objects a checkpoint restores in place (saving and loading use this one list)."""
        return {
            "model": self.module,  # the bare module: same names under every strategy
            "optimizers": self.optimizers,
            "lr_schedulers": [c["scheduler"] for c in self.lr_schedulers],
            "precision": self.runtime.precision,
        }

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            **self._resumable_objects(),
            "progress": self._progress(),
            "rng": self.runtime.all_gather_object(rng_state()),  # every rank's streams
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "hyper_parameters": dict(self.module.hparams) if self.module is not None else {},
            "config": self.run_config or {},
            "world_size": self.world_size,
            "strategy": type(self.strategy).__name__,
        }

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write a checkpoint directory (all ranks must call this together)."""
        if self.module is None:
            raise RuntimeError("save_checkpoint() needs a module attached by fit/validate/test first")
        self.runtime.save(path, self._checkpoint_state())

    def _last_checkpoint(self) -> Path:
        cb = self.checkpoint_callback
        dirpath = Path(cb.dirpath) if cb and cb.dirpath else Path(self.default_root_dir) / "checkpoints"
        return dirpath / "last"

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike) -> Path:
        if ckpt_path == "last":
            last = self._last_checkpoint()
            if not last.exists():
                raise FileNotFoundError(f"ckpt_path='last': no checkpoint found at {last} (nothing to resume)")
            return last.resolve()
        return Path(ckpt_path)

    def _restore(self, path: Path, weights_only: bool = False) -> None:
        if weights_only:
            self.runtime.load(path, {"model": self.module})
            return
        state = {**self._resumable_objects(), "progress": None, "callbacks": None}
        extra = self.runtime.load(path, state)
        if extra.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
            raise RuntimeError(f"{path} has checkpoint format {extra['format']!r}; this distrain reads {CHECKPOINT_FORMAT!r}")
        self._load_progress(state["progress"])
        for cb in self.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        rngs = extra.get("rng", [])
        if self.global_rank < len(rngs):
            set_rng_state(rngs[self.global_rank])
        else:  # more ranks than the checkpoint had: a fresh, rank-distinct stream
            self.runtime.seed_everything(self.seed + 1_000_003 * (self.global_rank + 1) + self.global_step)


class _StepRouter(nn.Module):
    """Makes ``model("training_step", batch, i)`` run through the strategy's wrapper (DDP's
    forward hooks must see the call) while the user's code stays a plain ``training_step``."""

    def __init__(self, module: Module):
        super().__init__()
        self.module = module

    def forward(self, step_name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, step_name)(*args, **kwargs)


def _as_module(module: nn.Module) -> Module:
    if isinstance(module, Module):
        return module
    raise TypeError(
        f"{type(module).__name__} is a plain nn.Module; wrap it: distrain.LossModule(model, learning_rate=...) "
        "(its forward must return a loss), or subclass distrain.Module"
    )


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    raise TypeError(f"training_step must return a loss tensor or a dict with 'loss', got {type(output).__name__}")


def _parse_optimizers(conf: Any) -> tuple[list[torch.optim.Optimizer], list[dict]]:
    schedulers: list = []
    if isinstance(conf, torch.optim.Optimizer):
        optimizers = [conf]
    elif isinstance(conf, dict):
        optimizers = [conf["optimizer"]]
        if conf.get("lr_scheduler") is not None:
            schedulers = [conf["lr_scheduler"]]
    elif isinstance(conf, (list, tuple)) and len(conf) == 2 and isinstance(conf[0], (list, tuple)):
        optimizers, schedulers = list(conf[0]), list(conf[1])
    elif isinstance(conf, (list, tuple)):
        optimizers = list(conf)
    else:
        raise TypeError(f"configure_optimizers returned {type(conf).__name__}; expected an optimizer or a dict")
    if len(optimizers) != 1:
        raise ValueError(f"the Trainer's loop steps exactly one optimizer; configure_optimizers gave {len(optimizers)}")
    configs = []
    for s in schedulers:
        c = dict(s) if isinstance(s, dict) else {"scheduler": s}
        c.setdefault("interval", "epoch")
        c.setdefault("frequency", 1)
        if c["interval"] not in ("step", "epoch"):
            raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch', got {c['interval']!r}")
        configs.append(c)
    return optimizers, configs


def _accumulation_schedule(value: int | dict[int, int]) -> dict[int, int]:
    schedule = dict(value) if isinstance(value, dict) else {0: value}
    schedule.setdefault(0, 1)
    for epoch, n in schedule.items():
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"accumulate_grad_batches[{epoch}] must be a positive integer, got {n!r}")
    return schedule


def _steps_read_ahead(batches: Iterable, accumulate: int, module: Module) -> Iterable:
    """The loader's ``(batch_idx, batch)`` pairs, unchanged. When the module overrides
    ``on_train_step_start``, each optimizer step's ``accumulate`` micro-batches are read first and
    shown to it before the first one runs (e.g. to normalize a loss by the step's token count).
    The groups are the loop's own steps: ``accumulate`` batches from where the epoch (re)starts,
    the last one shorter."""
    if type(module).on_train_step_start is Module.on_train_step_start:
        yield from batches
        return
    batches = iter(batches)
    while group := list(itertools.islice(batches, accumulate)):
        module.on_train_step_start([batch for _, batch in group], accumulate)
        yield from group


def _safe_len(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _flops_per_token(module: Module) -> float | None:
    fn = getattr(module, "flops_per_token", None)
    try:
        return float(fn() if callable(fn) else fn) if fn is not None else None
    except Exception:
        return None
