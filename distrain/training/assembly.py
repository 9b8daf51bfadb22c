"""What a ``Trainer`` is made of, built from its checked arguments (``training/arguments.py``): the runtime (where and
how the ranks run), the run's folder, the loop's options, and the parts it holds (callbacks, metrics, evaluator,
checkpoints, stop agreement, anomaly guard), with the loop's own state at its start."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.checkpoint.remote import RemoteDir, is_url
from distrain.cluster import replica_run_dir
from distrain.profilers import profile, profiler_from
from distrain.run_dir import DEFAULT as DEFAULT_ROOT_DIR
from distrain.runtime import Runtime
from distrain.training.anomalies import AnomalyGuard
from distrain.training.arguments import NOT_RUN, ProcessSettings, TrainerState, check_keywords
from distrain.training.checkpointing import CheckpointManager, TrainProgress
from distrain.training.defaults import default_callbacks, default_loggers
from distrain.training.evaluation import Evaluator
from distrain.training.hooks import call_callbacks
from distrain.training.loop_state import LoopState
from distrain.training.metrics import MetricsLogger
from distrain.training.nonfinite import DeviceCheck
from distrain.training.preemption import StopAgreement


@dataclass
class RunDirChoice:
    """How the run's folder is chosen: once, when the first stage starts (``choose_run_dir``)."""

    chosen: bool = False
    """Chosen already (``distrain train`` checks and keeps its own: ``run_dir.claim``)."""
    default_loggers: bool = False
    """``logger=True``: the default loggers write in the folder chosen."""


def assemble(trainer, a: dict[str, Any]) -> None:
    """Build ``trainer``'s parts from its checked arguments ``a`` (``checked_arguments``)."""
    trainer.process_settings = ProcessSettings(a["deterministic"], a["benchmark"], a["detect_anomaly"])
    # Lightning's arguments distrain runs without, at their "not used" values; the rest are the strategy's options
    strategy_kwargs = a["strategy_kwargs"]
    check_keywords(a["strategy"], strategy_kwargs, set(a) - {"strategy_kwargs", "loop"})  # the Trainer's own names
    strategy_kwargs = {k: v for k, v in strategy_kwargs.items() if k not in NOT_RUN}
    # where and how the ranks run
    rt = trainer.runtime = Runtime(
        a["accelerator"], a["strategy"], a["devices"], a["num_nodes"], a["precision"], **strategy_kwargs
    )
    # each replica group of a fault-tolerant run keeps its own run directory (replica_<id>/)
    root = a["default_root_dir"]
    #: ``default_root_dir`` in object storage: the checkpoints go there (``<url>/checkpoints``, ``choose_run_dir``);
    #: the run's logs, metrics and plots are files on this machine, in that URL's local stage
    trainer.remote_root = replica_run_dir(str(root).rstrip("/")) if is_url(root) else None
    if trainer.remote_root is not None:
        root = str(RemoteDir(trainer.remote_root).stage)
    trainer.default_root_dir = replica_run_dir(str(root or os.path.join(os.getcwd(), DEFAULT_ROOT_DIR)))
    #: the run's folder (Lightning's name): metrics, TensorBoard, checkpoints, plots, logs. Final once the first
    #: stage starts (``choose_run_dir``); ``distrain train`` checked its own (``run_dir.claim``) and keeps it
    trainer.log_dir = trainer.default_root_dir
    trainer.run_dir_choice = RunDirChoice(default_loggers=a["logger"] is True)
    point_runtime_at_run_dir(trainer)
    strategy_name = type(rt.strategy).__name__
    if a["compile"]:  # torch.compile when the strategy sets the model up (strategies/layers.py: apply_compile)
        if not rt.strategy.traits.compiles:
            raise ValueError(f"compile=True is not supported with {strategy_name}")
        rt.strategy.compile = a["compile"]
    if a["sync_batchnorm"]:
        if rt.world_size > 1 and rt.accelerator.name == "cpu":
            raise ValueError(
                "sync_batchnorm=True on cpu: torch's SyncBatchNorm synchronizes on GPUs only (it raises on a CPU "
                "tensor once ranks share a process group); train on GPUs, or without it"
            )
        rt.strategy.sync_batchnorm = True
    if a["async_save"] and not rt.strategy.traits.saves_in_background:
        raise ValueError(f"async_save=True (checkpointing.async_save) is not supported with {strategy_name}")
    trainer.seed = a["seed"]
    # what the loop does
    trainer.loop = a["loop"]
    trainer.progress = TrainProgress()
    if a["on_anomaly"] is not None and not rt.strategy.traits.reruns_steps:
        raise ValueError(
            f"on_anomaly is not supported with {strategy_name}: it re-runs an anomalous "
            "step before deciding, on every rank alike (single, ddp, fsdp and tensor parallelism do)"
        )
    #: a non-finite gradient norm, checked on the device where the optimizer can skip a step there
    trainer.nonfinite = DeviceCheck(trainer)
    #: loss spikes and non-finite losses: re-run, recorded, then stopped at, skipped or rolled back from
    trainer.anomalies = (
        AnomalyGuard(trainer, a["on_anomaly"], a["anomaly_window"], a["anomaly_zscore"]) if a["on_anomaly"] else None
    )
    # what runs beside it
    trainer.callbacks = default_callbacks(
        a["callbacks"],
        a["enable_checkpointing"],
        a["enable_progress_bar"],
        a["enable_plots"],
        a["histogram_every_n_steps"],
        type(trainer).default_checkpoint,
    )
    trainer.metrics = MetricsLogger(
        rt,
        default_loggers(a["logger"], trainer.log_dir),
        a["log_every_n_steps"],
        print_steps=not a["enable_progress_bar"],
        straggler_threshold=a["straggler_threshold"],
    )
    trainer.metrics.autolog_hparams = bool(a["enable_autolog_hparams"])  # Lightning's: hyperparameters to loggers
    trainer.profiler = profiler_from(a["profiler"])  # Lightning's: where each stage's time goes, by action
    trainer.evaluator = Evaluator(
        rt, trainer.metrics, functools.partial(call_callbacks, trainer), functools.partial(profile, trainer)
    )
    trainer.checkpoints = CheckpointManager(trainer)
    trainer.checkpoints.async_save = a["async_save"]  # checkpoints written while training goes on
    trainer.stop = StopAgreement(rt, trainer.stop_signals)
    trainer.run_config = None  # the resolved config, stored in checkpoints (the CLI sets it)
    _start_state(trainer)


def choose_run_dir(trainer, ckpt_path) -> None:
    """Where a Trainer's run writes, chosen once, when its first stage starts and before any rank writes:
    ``default_root_dir``, or the next ``version_N`` in it when it holds an earlier run; a resume goes on in the
    run it resumes (``run_dir.choose``)."""
    if trainer.run_dir_choice.chosen:
        return
    trainer.run_dir_choice.chosen = True
    path = trainer.run_folder(ckpt_path)
    if path != trainer.log_dir:
        trainer.log_dir = path
        point_runtime_at_run_dir(trainer)
        if trainer.run_dir_choice.default_loggers:
            trainer.metrics.loggers = default_loggers(True, path)
    if trainer.remote_root is not None:
        checkpoints_to_object_storage(trainer)


def checkpoints_to_object_storage(trainer) -> None:
    """``default_root_dir`` in object storage: each ``ModelCheckpoint`` given no ``dirpath`` writes to
    ``<url>/checkpoints`` (``<url>/version_N/checkpoints`` for a later run of the same folder), as Lightning's
    would; the run's own files stay here, and the console says where."""
    from distrain.callbacks.checkpoint import ModelCheckpoint

    relative = os.path.relpath(trainer.log_dir, trainer.default_root_dir)
    url = trainer.remote_root + ("" if relative == "." else "/" + Path(relative).as_posix()) + "/checkpoints"
    chosen = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath is None]
    for cb in chosen:
        cb.write_to(url)
    if int(os.environ.get("RANK", "0")) == 0:
        where = f"checkpoints go to {url}; " if chosen else ""
        print(f"distrain: {where}the run's logs and metrics stay on this machine, in {trainer.log_dir}", flush=True)


def point_runtime_at_run_dir(trainer) -> None:
    """The runtime writes the ranks' logs and NCCL's flight records in the run's folder."""
    trainer.runtime.flight_recorder_dir = os.path.join(trainer.log_dir, "flight_recorder")  # NCCL only
    trainer.runtime.log_dir = os.path.join(trainer.log_dir, "logs")  # rank_N.log: every rank's output


def _start_state(trainer) -> None:
    """What the loop keeps as it runs, as it is before any stage."""
    # what it trains (set by fit/validate/test/predict)
    trainer.module = None
    trainer.model = None
    trainer.optimizers = []
    trainer.lr_schedulers = []
    trainer.loop_optimizers = []  # what the module's hooks and self.optimizers() hand out (LoopOptimizer)
    trainer.should_stop = False  # a callback may set it: the run ends (on every rank) at a step or epoch boundary
    trainer.state = TrainerState()
    trainer.loop_state = LoopState()  # the loop's own bookkeeping (training/loop_state.py)
    trainer.batch_layout = None  # micro-batch × accumulation × data-parallel ranks, set by fit
    # what a Lightning module reads from its trainer (self.trainer.datamodule, ...), set in the ranks
    trainer.datamodule = None
    trainer.train_dataloader = None  # this rank's train loader, as fit set it up
    trainer.val_dataloaders = None
    trainer.sanity_checking = False  # True while the sanity check runs (num_sanity_val_steps)
