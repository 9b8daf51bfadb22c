"""The Trainer: epochs → optimizer steps → the micro-batches of each step.

    for epoch:                                     run_epochs
        for micro_batches in optimizer steps:      (the last window of an epoch may be shorter)
            train_step(micro_batches)              forward/backward each, then clip and step once
            validate, checkpoint, stop?            callbacks after the step

The loop never asks which strategy runs it: it talks to the Runtime. Checkpoints, evaluation,
metrics and stop-signal agreement are components it holds (``distrain/training/``).
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distrain import run_dir
from distrain.batch import BatchLayout, resumed_micro_batch
from distrain.callbacks import Callback, ModelCheckpoint
from distrain.callbacks.lr_finder import TunerExit
from distrain.data import (
    batch_size_of,
    micro_batch_size,
    tokens_in_batch,
)
from distrain.datamodule import is_datamodule, one_loader, optional_loader, set_up_stage, stage_loader
from distrain.loggers import Logger
from distrain.module import Module, as_module, check_hooks, loss_of, overrides
from distrain.profilers import Profiler, profile
from distrain.runtime import Runtime, isolated_rng, rng_state
from distrain.strategies.base import Strategy
from distrain.training import startup
from distrain.training.anomalies import AnomalyError
from distrain.training.arguments import (
    LoopOptions,
    ProcessSettings,
    TrainerState,
    check_manual_optimization,
    checked_arguments,
)
from distrain.training.assembly import RunDirChoice, assemble, choose_run_dir
from distrain.training.checkpointing import CHECKPOINT_FORMAT, CheckpointManager, TrainProgress
from distrain.training.epoch_data import epoch_batches, optimizer_steps
from distrain.training.evaluation import Evaluator, length, limited
from distrain.training.hooks import call_callbacks, call_hook
from distrain.training.loop_state import LoopState
from distrain.training.manual import manual_step
from distrain.training.metrics import MetricsLogger, StepResult, print_fit_summary
from distrain.training.nonfinite import NonFiniteError
from distrain.training.optimizer_step import apply_step, gradient_norm
from distrain.training.optimizers import step_schedulers
from distrain.training.outcomes import StepOutcome
from distrain.training.preemption import SIGNALS, StopAgreement
from distrain.training.stage_setup import attach, build, configure
from distrain.training.stages import report, sanity_check, setup_loader, stage_call, teardown, validate_during_fit
from distrain.training.views import TrainerViews

__all__ = ["Trainer", "CHECKPOINT_FORMAT", "NonFiniteError", "AnomalyError"]


class Trainer(TrainerViews):
    """Trains a ``distrain.Module`` (or a Lightning-style module) on one process, N processes or N nodes: the
    parallel strategy is one argument. ``fit``, ``validate``, ``test``, ``predict`` and ``verify`` as in
    Lightning; the ranks are started here (or found, under torchrun, srun, mpirun, a PyTorchJob).

    Where and how the ranks run: ``accelerator`` (``auto``, ``cpu``, ``gpu``), ``devices`` (per node, ``auto``:
    every GPU, or the CPU cores), ``num_nodes``, ``strategy`` (``auto``: the memory planner picks the fastest that
    fits; ``ddp``, ``ddp_spawn``, ``fsdp``, ``deepspeed_stage_1``..``_3_offload``, ``model_parallel``,
    ``pipeline``, ``ddp_torchft``, or a ``Strategy``), ``precision`` (``32-true``, ``16-mixed``, ``bf16-mixed``,
    ``bf16-true``, ``64-true``, ``fp8``); any other keyword goes to the strategy (``sharding_strategy=``,
    ``cpu_offload=``, ``replica_groups=`` ...), and one no strategy takes is refused in one line. ``deterministic``,
    ``benchmark``, ``detect_anomaly``: torch's flags, set in every rank.

    How long and how each step is made: ``max_epochs``, ``max_steps`` (-1: no limit), ``min_epochs``/``min_steps``
    (a stop a callback asks for waits for them), ``max_time`` (``"DD:HH:MM:SS"``, a timedelta or a dict),
    ``accumulate_grad_batches`` (an int, or ``{epoch: n}``), ``gradient_clip_val`` (by norm, or by value with
    ``gradient_clip_algorithm="value"``), ``val_check_interval``
    (steps, or a fraction of an epoch), ``check_val_every_n_epoch``, ``num_sanity_val_steps`` (0 here: no sanity
    check unless asked), ``limit_train/val/test/predict_batches`` (a count or a fraction), ``fast_dev_run`` (n
    batches of each stage, nothing written), ``use_distributed_sampler`` (shard the loaders over the data-parallel
    ranks; resumable mid-epoch), ``seed`` (every rank builds the same weights), ``compile``. ``inference_mode`` and
    ``enable_model_summary`` are accepted: evaluation runs under ``torch.no_grad`` either way, and no model summary
    is printed (Lightning's ``ModelSummary`` callback prints one); ``suggest_integrations`` too (no tips here).
    ``overfit_batches``, ``sync_batchnorm`` (on GPUs), ``enable_autolog_hparams`` and ``profiler`` (``"simple"``,
    ``"advanced"`` or a ``distrain.profilers`` one: a report per stage) do as in Lightning.

    When something goes wrong: ``on_nonfinite`` (a NaN/inf loss or gradient norm: ``stop``, ``skip``,
    ``ignore``), ``on_anomaly`` (a loss spike or non-finite loss re-run to tell data from hardware, then ``stop``,
    ``skip`` or ``rollback``; ``anomaly_zscore``, ``anomaly_window``), ``straggler_threshold`` (name a rank slower
    than the others by this fraction of a step; 0: off).

    What it writes: ``default_root_dir`` (a new ``version_N`` folder per run unless a path is given: metrics.jsonl,
    TensorBoard, checkpoints, plots, logs), ``callbacks``, ``logger`` (True: JSONL and TensorBoard),
    ``log_every_n_steps``, ``enable_progress_bar``, ``enable_checkpointing`` (a ``ModelCheckpoint`` with ``last``),
    ``enable_plots``, ``histogram_every_n_steps``, ``async_save`` (checkpoints written while training goes on).
    """

    runtime: Runtime  # accelerator + precision + strategy: every rank-aware call goes through it
    loop: LoopOptions
    progress: TrainProgress  # step, epoch and data position: what a resume restores
    callbacks: list[Callback]
    metrics: MetricsLogger  # Module.log, throughput, memory → loggers (rank 0)
    evaluator: Evaluator  # validate / test / predict, in lockstep where forwards communicate
    profiler: Profiler | None  # where each stage's time goes, by action (Trainer(profiler=...))
    checkpoints: CheckpointManager  # what a checkpoint holds; save and restore
    stop: StopAgreement  # SIGTERM/SIGUSR1 → every rank stops at the same step
    loop_state: LoopState  # the loop's own bookkeeping between steps
    loop_optimizers: list  # the optimizers as the module's hooks and self.optimizers() hand them out
    process_settings: ProcessSettings  # torch's deterministic/benchmark/anomaly flags, set in each rank per stage
    run_dir_choice: RunDirChoice  # how log_dir is chosen, once (training/assembly.py)
    module: Module | None  # the user's module
    model: nn.Module | None  # the same, wrapped by the strategy (what the loop calls)
    optimizers: list[torch.optim.Optimizer]
    lr_schedulers: list[dict]
    #: False: each stage seeds every rank from ``seed`` (``seed_streams``: the same weights and order whatever ran
    #: before it), and the loaders draw from generators of their own. True (``distrain.lightning``): a stage goes on
    #: with the random streams the script left, and the loaders draw from torch's generator as torch's own do
    continues_script_streams = False
    #: the signals that stop the run at a step with a checkpoint (SIGTERM, SIGUSR1; Lightning's SLURMEnvironment adds
    #: its requeue_signal)
    stop_signals: tuple[int, ...] = SIGNALS
    #: the checkpoint callback a Trainer adds where none is given (Lightning's names its checkpoints ``*.ckpt``)
    default_checkpoint: type[ModelCheckpoint] = ModelCheckpoint
    _script_streams: dict | None = None  # spawned ranks: the streams the script had when it called fit

    def __init__(
        self,
        accelerator: str = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str | int = "32-true",
        max_epochs: int | None = None,
        max_steps: int = -1,
        accumulate_grad_batches: int | dict[int, int] = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int = 0,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: str | timedelta | dict | None = None,
        log_every_n_steps: int = 50,
        default_root_dir: str | os.PathLike | None = None,
        callbacks: Iterable[Callback] | Callback | None = None,
        logger: bool | Logger | Iterable[Logger] = True,
        seed: int = 0,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        use_distributed_sampler: bool = True,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        fast_dev_run: bool | int = False,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        detect_anomaly: bool = False,
        inference_mode: bool = True,
        enable_model_summary: bool | None = None,
        on_nonfinite: str = "stop",
        on_anomaly: str | None = None,
        anomaly_zscore: float = 6.0,
        anomaly_window: int = 50,
        straggler_threshold: float = 0.2,
        enable_plots: bool = True,
        histogram_every_n_steps: int | None = None,
        compile: bool | dict = False,
        async_save: bool = False,
        sync_batchnorm: bool = False,
        overfit_batches: int | float = 0,
        enable_autolog_hparams: bool = True,
        suggest_integrations: bool = True,
        profiler: str | Profiler | None = None,
        **strategy_kwargs: Any,
    ):
        # each argument checked (one line for one at fault) and made what the loop reads (training/arguments.py),
        # then the parts it runs with (training/assembly.py)
        assemble(self, checked_arguments(locals()))

    def init_module(self, empty_init: bool | None = None):
        """``with trainer.init_module(): model = Model()`` builds directly on the device (and in bf16
        for bf16-true; on meta for sharded strategies). ``empty_init=True`` skips weight
        initialization, for weights you are about to load."""
        return self.runtime.init_module(empty_init)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write a checkpoint (one file for a ``.ckpt``/``.pt`` name where the state is whole, else a directory):
        called by every rank together, or by one alone where each holds the whole state (DDP: under
        ``if trainer.is_global_zero:``); elsewhere that is refused in one line
        (``CheckpointManager.save_as_called``)."""
        if not self.checkpoints.save_as_called(path) and self.is_global_zero:
            warnings.warn(f"distrain: the checkpoint {path} holds non-finite weights", stacklevel=2)

    # ---- public entry points: each launches the ranks, then runs the stage in every rank -------
    def fit(self, model: nn.Module, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        """Train ``model`` on the loaders given, else ``datamodule``'s (also passed in ``train_dataloaders``'
        place, as Lightning allows), else the module's own ``train_dataloader()``/``val_dataloader()``. A datamodule
        or module's loaders are made in every rank, after ``prepare_data`` and ``setup("fit")``."""
        module = as_module(model)
        if datamodule is None and is_datamodule(train_dataloaders):
            train_dataloaders, datamodule = None, train_dataloaders
        if datamodule is module:  # a module that is its own datamodule (the CLI's training.module): its hooks once
            datamodule = None
        source = datamodule if datamodule is not None else module
        if train_dataloaders is None and not callable(getattr(source, "train_dataloader", None)):
            raise ValueError(
                "fit() needs train_dataloaders, a datamodule with train_dataloader(), or a module that defines "
                "train_dataloader()"
            )
        check_hooks(module)
        if ckpt_path is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
            # torchrun restarted the group after a failure: continue from the newest intact checkpoint
            ckpt_path = "auto"
        choose_run_dir(self, ckpt_path)
        if self.runtime.auto_options is not None and not self.runtime.environment_ready:  # the planner chooses
            from distrain.planner.decide import decide_auto_strategy

            decide_auto_strategy(self, module, train_dataloaders, datamodule)
        check_manual_optimization(self, module)
        data = (train_dataloaders, val_dataloaders, datamodule)
        return self._launch(self._fit, module, data, ckpt_path)

    def verify(self, module: nn.Module, train_dataloaders=None, datamodule=None, steps: int = 3):
        """A few steps of this configuration against one process on the same global batch, and the checks
        that need no reference (``distrain/verify``). Prints the report and returns it (None on ranks other
        than the one that started the run). Uses this trainer up: make a new one to train."""
        from distrain.verify import verify

        loader = train_dataloaders if train_dataloaders is not None else datamodule.train_dataloader()
        report = verify(self, as_module(module), loader, steps)
        if report is not None:
            print(report.table(), flush=True)
        return report

    # validate / test / predict take Lightning's arguments, in Lightning's order. ``model=None``: the module fit
    # trained, from its best checkpoint unless ``ckpt_path`` says otherwise (Lightning's rule); ``ckpt_path``: None
    # (the weights as they are), "best", "last" or a checkpoint's path
    def validate(
        self, model: nn.Module | None = None, dataloaders=None, ckpt_path=None, verbose: bool = True, datamodule=None
    ) -> list[dict]:
        """The validation metrics (``verbose``: also printed, on rank 0)."""
        call = stage_call(self, "validate", model, dataloaders, ckpt_path, datamodule)
        return report(self, "validate", self._launch(*call), verbose)

    def test(
        self, model: nn.Module | None = None, dataloaders=None, ckpt_path=None, verbose: bool = True, datamodule=None
    ) -> list[dict]:
        """The test metrics (``verbose``: also printed, on rank 0)."""
        call = stage_call(self, "test", model, dataloaders, ckpt_path, datamodule)
        return report(self, "test", self._launch(*call), verbose)

    def predict(
        self,
        model: nn.Module | None = None,
        dataloaders=None,
        datamodule=None,
        return_predictions: bool | None = None,
        ckpt_path=None,
    ) -> list | None:
        """Returns this rank's predictions, in its sampler order (rank 0's for spawn/fork), on the CPU; None with
        ``return_predictions=False``, which keeps none (a ``BasePredictionWriter`` writes them)."""
        run, *call = stage_call(self, "predict", model, dataloaders, ckpt_path, datamodule)
        predictions = self._launch(functools.partial(run, keep=return_predictions is not False), *call)
        return None if return_predictions is False else predictions

    @property
    def predict_loop(self):
        """Lightning's ``trainer.predict_loop``: the samples of the batches ``predict`` runs, and what it kept."""
        return self.evaluator.predict_loop

    def _launch(self, fn, module: Module, *args):
        strategy = self.runtime.strategy  # as planned: strategy="auto" has chosen by now
        if self.continues_script_streams and not self.runtime.ranks_run_this_script:
            self._script_streams = rng_state()  # spawned ranks start from the script's streams, as Lightning's do
        if overrides(module, "backward") and not strategy.traits.runs_module_backward:
            raise NotImplementedError(
                f"{type(module).__name__}.backward: {type(strategy).__name__} runs the backward in its own engine or "
                "schedule, which never calls a LightningModule's backward; do that work in training_step or "
                "on_before_backward, or use ddp or fsdp"
            )
        strategy.check_module(module)

        def restore(state):  # spawn/fork: the trained weights and the progress come back to this process
            configure(self, module)  # the parent never built configure_model's layers
            self.checkpoints.restore_in_parent(module, state)

        return self.runtime.run_in_ranks(fn, module, *args, collect=self.checkpoints.state_for_parent, restore=restore)

    # ---- fit ------------------------------------------------------------------------------------
    def _fit(self, module: Module, data: tuple, ckpt_path):
        started = time.perf_counter()
        rt = self.runtime
        train_loader, val_loader, datamodule = data
        self.state = TrainerState("fit", "train")
        self.seed_streams(stage_start=True)  # setup(stage) may build layers: alike on every rank
        checkpoint = self.checkpoint_at(ckpt_path) if ckpt_path is not None else None
        saved = self.checkpoints.read_before_loaders(checkpoint)  # the datamodule's state, the global batch
        set_up_stage("fit", self, module, datamodule, saved.get("datamodule"))
        build(self, module)
        if val_loader is None:  # first, leaving the random streams alone, as Lightning makes it for its sanity check
            with isolated_rng():
                val_loader = optional_loader(datamodule if datamodule is not None else module, "val_dataloader")
        val_loader = one_loader(val_loader, "val_dataloaders")
        train_loader = stage_loader("fit", module, train_loader, datamodule)
        micro_batch = resumed_micro_batch(self, checkpoint, saved.get("batch_layout"), train_loader)
        shuffle, shuffle_seed = self.train_order()
        train_loader = setup_loader(self, train_loader, shuffle_seed, batch_size=micro_batch, shuffle=shuffle)
        val_loader = setup_loader(self, val_loader, even=False) if val_loader is not None else None
        batches = limited(length(train_loader), self.loop.limit_train_batches, "limit_train_batches")
        # how often fit validates, once, before any step (an interval that could never validate is refused here)
        every = self.loop.validation_interval(batches) if val_loader is not None else None
        self.loop_state.num_batches, self.loop_state.val_every = batches, every
        self.train_dataloader, self.val_dataloaders = train_loader, val_loader
        self.batch_layout = BatchLayout(
            micro_batch_size(train_loader) or 1, self.loop.accumulate_for(0), self.data_parallel_size
        )
        attach(self, module, "fit", train_loader, before_backward=self._before_backward)
        startup.mark("model and data set-up")
        if checkpoint is not None:
            self.checkpoints.restore(checkpoint)
            step = self.batch_layout.micro_batch * self.data_parallel_size
            self.progress.samples_in_epoch -= self.progress.samples_in_epoch % step  # a whole step of this layout
            startup.mark("checkpoint read")
        # a rank that resumes or was restarted says how long it took to train again (training/startup.py)
        self.loop_state.announce_start = checkpoint is not None or startup.restarted()
        first_step = self.global_step
        self.metrics.start_fit(_flops_per_token(module), self.run_config, module)
        self.metrics.timer.watch_gradients(module.parameters())  # each rank's own part of the backward (stragglers)
        self.stop.install()
        try:
            with self.runtime.diagnosing_hangs(on_error=self._on_fit_error):
                try:
                    call_hook(self, "on_fit_start")
                except TunerExit:  # Tuner.lr_find's search ran when fit started: the fit ends there, as in Lightning
                    return self.callback_metrics
                if val_loader is not None and self.loop.num_sanity_val_steps:
                    sanity_check(self, val_loader)
                call_hook(self, "on_train_start")
                self.run_epochs(train_loader, val_loader)
                self.nonfinite.settle()  # the last step's device check
                rt.mark_phase(None, "end of training")
                closing = val_loader is not None and not self.loop.validates_as_lightning and not self.preempted
                if closing and self.loop_state.last_val_step != self.global_step:
                    validate_during_fit(self, val_loader)  # the run always ends with a val score
                call_hook(self, "on_train_end")
                self.checkpoints.complete_pending()  # one written in the background: on disk before fit returns
                call_hook(self, "on_fit_end")
        finally:
            self.metrics.timer.unwatch()
            self.stop.finish()  # no collective may be left in flight
            self.stop.uninstall()
            self.metrics.finalize()
            teardown(self, "fit", module, datamodule)
        if self.is_global_zero and self.metrics.summarize:
            print_fit_summary(self, first_step, time.perf_counter() - started)
        return self.callback_metrics

    def _on_fit_error(self, error: BaseException, hang: Exception | None) -> None:
        call_callbacks(self, "on_exception", hang or error)
        if hang is not None:
            self.stop.abandon()  # the stop-signal all-reduce in flight cannot finish either

    def run_epochs(self, loader, val_loader) -> None:
        """fit's epochs from where the progress stands, until ``max_steps``, ``max_epochs`` or an agreed stop; also
        run by a callback that trains a while with the fit's set-up (the learning-rate finder's search)."""
        while not self._done() and (self.loop.max_epochs is None or self.current_epoch < self.loop.max_epochs):
            accumulate = self.loop.accumulate_for(self.current_epoch)
            batches = epoch_batches(
                loader,
                self.progress,
                self.current_epoch,
                self.data_parallel_size,
                self.loop_state.num_batches,
                streams_continue=self.continues_script_streams,
                iterator_drew=self.loop_state.iterator_drew,
                epoch_start=lambda: call_hook(self, "on_train_epoch_start"),
            )
            self.loop_state.iterator_drew = False
            for micro_batches in optimizer_steps(batches, accumulate, self.runtime, loader, self.metrics.timer):
                if self.runtime.strategy.start_step(self.global_step):
                    break  # this rank took over a peer's state (a replica group rejoining): read on from its position
                with profile(self, "run_training_batch"):
                    output = self.train_step(micro_batches)
                if self.loop_state.announce_start:
                    self.loop_state.announce_start = False
                    startup.mark("first step")
                    if self.is_global_zero:
                        print(startup.line(self.global_step), flush=True)
                if output is StepOutcome.ROLLED_BACK:
                    break  # the newest checkpoint was loaded: read on from its position
                if output is StepOutcome.DROPPED or output is StepOutcome.SKIPPED:
                    if self._done():
                        return
                    continue
                if output is StepOutcome.SKIP_REST_OF_EPOCH:
                    self._end_epoch(val_loader)
                    break
                self._after_step(output, micro_batches, val_loader)
                if self._done():
                    if self.loop.validates_as_lightning and not self.preempted:  # Lightning ends an epoch cut short,
                        last = micro_batches[-1][0] + 1 == self.loop_state.num_batches  # validated at its last batch
                        self._end_epoch(val_loader if last else None)
                    return
            else:
                self._end_epoch(val_loader)

    def train_step(self, micro_batches: list[tuple[int, Any]]) -> Any:
        """One optimizer step over this rank's micro-batches: forward/backward each (gradients synchronized on the
        last one only), settle it (the strategy commits it or drops it; a loss spike is re-run, then applied, skipped
        or rolled back from), apply it (clip, check, step) and log it. The gradient is the mean over the step's
        micro-batches (each loss divided by their number, also in a shorter last window) and over the ranks. Returns
        the last ``training_step`` output, or the ``StepOutcome`` of a step that gave none to go on with."""
        if not self.module.automatic_optimization:
            return manual_step(self, micro_batches, self._skips_rest_of_epoch, self._done)
        rt, optimizer = self.runtime, self.optimizers[0]
        rt.mark_phase(self.global_step + 1, "forward/backward")  # where this rank is, if a collective hangs
        micro_batches = self._start_step(micro_batches)
        if isinstance(micro_batches, StepOutcome):
            return micro_batches
        position = self.progress.samples_in_epoch  # the step's first sample in the epoch's global order
        rng = rng_state() if self.anomalies is not None else None  # a re-run starts from the same RNG state
        with profile(self, f"[Strategy]{type(rt.strategy).__name__}.training_step"):
            step_loss, output = rt.strategy.run_step(
                self.model, micro_batches, before_each=self._before_each(micro_batches)
            )
        call_hook(self, "on_after_backward")
        samples = sum(batch_size_of(batch) for _, batch in micro_batches)
        tokens = sum(tokens_in_batch(batch) or 0 for _, batch in micro_batches)
        self.progress.samples_in_epoch += samples * self.data_parallel_size
        action = self._settle(step_loss, micro_batches, position, rng)
        if isinstance(action, StepOutcome):
            return action

        rt.mark_phase(None, "optimizer step")
        grad_norm = gradient_norm(self, optimizer) if action == "apply" else None
        last_idx = micro_batches[-1][0]
        if action != "apply" or not apply_step(self, optimizer, grad_norm, step_loss, last_idx):
            self.progress.skipped_steps += 1
        self.module.optimizer_zero_grad(self.current_epoch, last_idx, self.loop_optimizers[0])
        step_schedulers(self, "step")
        self.progress.global_step += 1
        self._log_step(step_loss, grad_norm, samples, tokens)
        return output

    def _start_step(self, micro_batches: list[tuple[int, Any]]) -> list[tuple[int, Any]] | StepOutcome:
        """The step's micro-batches on the device, its start hooks run; or why it does not run: its first batch's
        ``on_train_batch_start`` skipped the rest of the epoch, or the anomaly policy skips its data."""
        batches = [batch for _, batch in micro_batches]
        self.module.on_train_step_start(batches, len(batches))
        call_callbacks(self, "on_train_step_start", batches)
        micro_batches = [(batch_idx, self.runtime.to_device(batch)) for batch_idx, batch in micro_batches]
        self.loop_state.first_micro_batch = True
        self.metrics.collector.current_batch_size = batch_size_of(micro_batches[0][1])
        if self._skips_rest_of_epoch(*micro_batches[0]):
            return StepOutcome.SKIP_REST_OF_EPOCH
        if self.anomalies is not None and self.anomalies.skips(self.current_epoch, self.progress.samples_in_epoch):
            self.anomalies.skip_bad_data(micro_batches)
            return StepOutcome.SKIPPED
        return micro_batches

    def _before_each(self, micro_batches: list[tuple[int, Any]]):
        """What runs before each ``training_step`` of the step: its timer, batch size and ``on_train_batch_start``
        (the first batch's ran in ``_start_step``)."""
        indices, first_idx = iter([batch_idx for batch_idx, _ in micro_batches]), micro_batches[0][0]

        def before_each(batch):
            self.metrics.timer.forward_started()
            self.metrics.collector.current_batch_size = batch_size_of(batch)
            batch_idx = next(indices, None)  # None: a pipeline's schedule calls it per piece of a micro-batch
            if batch_idx is None or batch_idx == first_idx:
                return
            if call_hook(self, "on_train_batch_start", batch, batch_idx) == -1:
                raise ValueError(
                    f"on_train_batch_start returned -1 (skip the rest of the epoch) at batch {batch_idx}, inside an "
                    "accumulation window; return it at the first batch of an optimizer step (batch_idx % "
                    "accumulate_grad_batches == 0)"
                )

        return before_each

    def _settle(self, step_loss: torch.Tensor, micro_batches, position: int, rng) -> str | StepOutcome:
        """What becomes of the step once its gradients are in: the strategy drops it (it said why: nothing of it
        applies, the step not counted), or "apply"/"skip" (the anomaly policy may re-run a loss spike first), or
        the anomaly policy rolls back."""
        if not self.runtime.strategy.commit_step():
            self.optimizers[0].zero_grad(set_to_none=True)
            self.progress.dropped_steps += 1
            return StepOutcome.DROPPED
        self.nonfinite.settle()  # the previous step's device check: the device has long passed it
        if self.anomalies is None:
            return "apply"
        action = self.anomalies.check(step_loss, micro_batches, position, rng)
        return StepOutcome.ROLLED_BACK if action == "rollback" else action

    def _log_step(self, step_loss: torch.Tensor, grad_norm: Any, samples: int, tokens: int) -> None:
        final = self._done()
        if self.metrics.logs_at(self.global_step, final):
            self.nonfinite.settle()  # a logged step counts only applied steps
        self.runtime.mark_phase(None, "logging")
        lr = self.optimizers[0].param_groups[0]["lr"]
        result = StepResult(
            self.global_step, self.current_epoch, step_loss, lr, grad_norm, samples, tokens, self.progress.skipped_steps
        )
        self.metrics.step_done(result, final=final, max_steps=self.loop.max_steps)

    def _after_step(self, output: Any, micro_batches: list[tuple[int, Any]], val_loader) -> None:
        rt, as_lightning = self.runtime, self.loop.validates_as_lightning
        step = (self.current_epoch, self.global_step, [b for b, _ in micro_batches], self.loop_state.val_every)
        due = val_loader is not None and self.loop.validates_after(*step)
        if due and not as_lightning:
            validate_during_fit(self, val_loader)  # before the callbacks, so checkpoints can monitor it
        rt.mark_phase(None, "callbacks after the step (checkpointing)")
        self.checkpoints.commit_written()  # one written in the background since: committed before a new one starts
        batch_idx, batch = micro_batches[-1]
        call_hook(self, "on_train_batch_end", output, batch, batch_idx)
        if due and as_lightning:
            validate_during_fit(self, val_loader)
        rt.mark_phase(None, "stop-signal check")
        # A signal, or a callback's should_stop, on any rank: every rank stops at the same step (on
        # several ranks the step after the request; on_train_end writes the checkpoint)
        self.loop_state.stopping = self._stop_agreed(self.stop.requested(local=self.should_stop), self.current_epoch)

    def _end_epoch(self, val_loader) -> None:
        self.runtime.mark_phase(None, "end of epoch")
        if self.progress.epoch_done:  # resumed from a checkpoint written at this epoch's end: already done
            self.progress.next_epoch()
            return
        if val_loader is not None and self.loop.validates_at_end(self.current_epoch, self.loop_state.val_every):
            validate_during_fit(self, val_loader)
        collector = self.metrics.collector
        collector.stage = "epoch end"  # what on_train_epoch_end logs is an epoch value (as in Lightning)
        try:
            self.module.on_train_epoch_end()
        finally:
            collector.stage = "train"
        epoch_metrics = collector.pop_epoch_metrics()
        self.metrics.publish(epoch_metrics, self.global_step, to_loggers=bool(epoch_metrics), epoch=self.current_epoch)
        step_schedulers(self, "epoch")  # after validation: a scheduler may monitor its metric (ReduceLROnPlateau)
        self.progress.epoch_done = True  # a checkpoint saved in the hooks below resumes at the next epoch
        call_callbacks(self, "on_train_epoch_end")
        # a stop asked in this epoch's validation or end hooks (early stopping) ends the run here, on every rank
        self.loop_state.stopping = self._stop_agreed(
            self.stop.requested_now(local=self.should_stop), self.current_epoch + 1
        )
        self.progress.next_epoch()

    def _stop_agreed(self, agreed: bool, epochs_done: int) -> bool:
        """Whether the run stops, every rank having ``agreed`` on a stop: a signal always stops it; a stop the code
        asked for (``should_stop``: early stopping, ``max_time``) waits for ``min_epochs`` and ``min_steps``, as in
        Lightning, and is asked again after them if it still holds."""
        if not agreed or self.stop.preempted is not None:
            return agreed
        if self.global_step >= (self.loop.min_steps or 0) and epochs_done >= (self.loop.min_epochs or 0):
            return True
        if self.should_stop and self.is_global_zero and not self.loop_state.told_minimum:
            self.loop_state.told_minimum = True
            print(
                f"distrain: a stop was asked at step {self.global_step}, before min_epochs={self.loop.min_epochs} / "
                f"min_steps={self.loop.min_steps}: training goes on until both are reached",
                flush=True,
            )
        self.should_stop = False
        return False

    def _done(self) -> bool:
        return self.loop_state.stopping or (self.loop.max_steps != -1 and self.global_step >= self.loop.max_steps)

    # ---- Lightning's per-micro-batch hooks and manual optimization -------------------------------------
    def _before_backward(self, output: Any) -> None:
        """Between ``training_step`` and its backward (``StepRouter`` calls it): Lightning's
        ``on_before_zero_grad`` (once per optimizer step) then ``on_before_backward(loss)``."""
        if self.metrics.timer is not None:
            self.metrics.timer.forward_ended()
        if self.loop_state.first_micro_batch:
            self.loop_state.first_micro_batch = False
            call_hook(self, "on_before_zero_grad", self.optimizers[0])
        call_hook(self, "on_before_backward", loss_of(output))

    def _skips_rest_of_epoch(self, batch_idx: int, batch: Any) -> bool:
        """Runs ``on_train_batch_start`` of a step's first batch. -1 there skips the rest of the epoch, as in
        Lightning, on every rank: where the module overrides the hook, the ranks agree (one small all-reduce a
        step), so a rank that returns -1 never leaves the others waiting in the step's collectives."""
        skip = call_hook(self, "on_train_batch_start", batch, batch_idx) == -1
        if overrides(self.module, "on_train_batch_start") and self.world_size > 1:
            skip = bool(self.runtime.all_reduce(torch.tensor(int(skip)), op="max"))
        return skip

    # ---- conventions: where Lightning's Trainer differs, ``distrain.lightning``'s overrides these -----------------
    def seed_streams(self, stage_start: bool) -> None:
        """Every rank's random streams seeded from ``seed`` before a stage sets up anything, and again before the
        model is built (``stage_start=False``): every rank builds the same weights."""
        self.runtime.seed_everything(self.seed)

    def checkpoint_at(self, ckpt_path) -> Path | None:
        """The checkpoint a stage starts from, fit to resume and the others to evaluate (``checkpoints.resolve``)."""
        return self.checkpoints.resolve(ckpt_path)

    def run_folder(self, ckpt_path) -> str:
        """The folder the run writes in (``trainer.log_dir``): ``default_root_dir``, or the next ``version_N`` in it
        where it holds an earlier run; a resume goes on in the run it resumes (``run_dir.choose``)."""
        return run_dir.choose(self.default_root_dir, ckpt_path)

    def train_order(self) -> tuple[bool | None, int]:
        """Whether the training data is shuffled (None: as its loader says; never with ``overfit_batches``) and the
        seed of its order."""
        return (False if self.loop.overfit else None), self.seed


def _flops_per_token(module: Module) -> float | None:
    fn = getattr(module, "flops_per_token", None)
    try:
        return float(fn() if callable(fn) else fn) if fn is not None else None
    except Exception as e:  # MFU is a nicety: say why it is missing, and train on
        warnings.warn(
            f"distrain: {type(module).__name__}.flops_per_token failed ({type(e).__name__}: {e}); "
            "MFU will not be logged",
            stacklevel=2,
        )
        return None
