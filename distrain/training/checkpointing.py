"""What a checkpoint holds and how a run is rebuilt from one.

The Trainer's parts each give their state (``state_dict``/``load_state_dict``): the bare module
(the same parameter names under every strategy), the optimizers and LR schedulers, the precision
plugin (its grad scaler), the loop's progress, every rank's RNG streams and each callback. The
strategy decides how that is written (one file, DCP shards, DeepSpeed's engine files); the
``ModelCheckpoint`` callback decides when.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from distrain.checkpoint import io as ckpt_io
from distrain.checkpoint import lightning_layout
from distrain.checkpoint import state as ckpt_state
from distrain.checkpoint.remote import at as remote_at
from distrain.checkpoint.remote import is_url
from distrain.checkpoint.state import read_checkpoint_meta
from distrain.distributed import watch
from distrain.runtime import rng_state, set_rng_state
from distrain.training.hooks import call_callbacks

CHECKPOINT_FORMAT = ckpt_io.CHECKPOINT_FORMAT


@dataclass
class TrainProgress:
    """Where the loop is: what a checkpoint must carry to resume exactly."""

    global_step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    """Global position in this epoch's sample order (samples consumed by all ranks together)."""
    epoch_done: bool = False
    """Saved at the end of ``epoch``: a resume starts the next one."""
    skipped_steps: int = 0
    """Optimizer steps dropped because their gradients were not finite (``on_nonfinite="skip"``)."""
    dropped_steps: int = 0
    """Steps whose gradients were not applied because a replica group was lost during them (``ddp_torchft``); unlike
    skipped steps they do not count in ``global_step``."""
    order_seed: int | None = None
    """The seed this epoch's sample order was drawn with, where torch's generator drew it (``distrain.lightning`` on
    one rank, as ``RandomSampler``); None where the order comes from the Trainer's seed."""

    def next_epoch(self) -> None:
        self.epoch_done = False
        self.epoch += 1
        self.samples_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's (or a peer's) progress: counts only — they become this run's step, epoch and data position."""
        counts = {"global_step": None, "epoch": None, "samples_in_epoch": None, "skipped_steps": 0, "dropped_steps": 0}
        for name, default in counts.items():
            value = state.get(name, default) if default is not None else state.get(name)
            if type(value) is not int or value < 0:
                raise ValueError(f"its progress {name} is {value!r}, not a count")
            setattr(self, name, value)
        self.order_seed = state.get("order_seed")
        if self.order_seed is not None and (type(self.order_seed) is not int or not 0 <= self.order_seed < 2**63):
            raise ValueError(f"its progress order_seed is {self.order_seed!r}, not a seed")
        self.epoch_done = state.get("epoch_done", False)
        if type(self.epoch_done) is not bool:
            raise ValueError(f"its progress epoch_done is {self.epoch_done!r}, not true or false")


class CheckpointManager:
    def __init__(self, trainer):
        self.trainer = trainer
        #: in the parent of spawned/forked ranks after fit: the checkpoint rank 0 sent back
        self.parent_checkpoint: dict[str, Any] | None = None
        #: write checkpoints in the background (``Trainer(async_save=True)``): training goes on meanwhile
        self.async_save = False
        self._pending: tuple | None = None
        self._grace_checked = False  # a save's time against SLURM's GraceTime, said once (``_compare_with_grace``)
        #: trainer.save_checkpoint's calls, named alike on every rank: (stage, step, how many in it)
        self._calls = (-1, -1, 0)
        self._stages_begun = 0  # fit, validate, ...: every rank begins the same ones in the same order

    # ---- where ------------------------------------------------------------------------------------
    def last_path(self) -> Path:
        cb = self.trainer.checkpoint_callback
        dirpath = Path(cb.dirpath) if cb and cb.dirpath else Path(self.trainer.log_dir) / "checkpoints"
        return dirpath / "last"

    def resolve(self, ckpt_path: str | os.PathLike) -> Path | None:
        """The checkpoint to load. ``"last"``: the newest one, and a one-line error naming the newest
        intact one if it is damaged; ``"auto"``: the newest intact one (with a warning when that is
        not ``last``), or None when there is none yet; else the path itself, checked. Rank 0 decides
        and every rank follows, so all load the same checkpoint."""
        t = self.trainer
        kind, value = t.runtime.decided_on_rank_zero(lambda: self._decide(ckpt_path))
        if kind == "missing":
            raise FileNotFoundError(value)
        if kind == "damaged":
            raise ckpt_io.CheckpointError(value)
        return Path(value) if value is not None else None

    def best_or_current(self, stage: str) -> str | None:
        """What ``validate``/``test``/``predict`` with no model evaluate: the best checkpoint of the fit before, as
        Lightning does (said once, on rank 0), or the weights as fit left them where it kept none."""
        cb = self.trainer.checkpoint_callback
        if cb is None or not cb.best_model_path:
            return None
        if self.trainer.is_global_zero:
            warnings.warn(
                f"distrain: {stage}() with no model evaluates the best checkpoint of the previous fit "
                f"({cb.best_model_path}); pass ckpt_path='last', a path, or the model itself to choose",
                stacklevel=3,
            )
        return "best"

    def _decide(self, ckpt_path: str | os.PathLike) -> tuple[str, str | None]:
        remote = getattr(self.trainer.checkpoint_callback, "remote", None)
        if is_url(ckpt_path) or (remote is not None and ckpt_path in ("last", "auto")):
            return self._decide_remote(ckpt_path, remote)
        if ckpt_path == "best":  # Lightning's: the first ModelCheckpoint's best
            cb = self.trainer.checkpoint_callback
            if cb is None:
                return "missing", "ckpt_path='best' needs a ModelCheckpoint (enable_checkpointing, or one in callbacks)"
            if not cb.best_model_path:
                return "missing", "ckpt_path='best': no checkpoint was saved yet (fit first, or give a path)"
            ckpt_path = cb.best_model_path
        if ckpt_path in ("last", "auto"):
            last = self.last_path()
            ckpt_io.recover(last.parent)  # a commit a crash interrupted: its checkpoint back under its name
            if last.exists():
                target = last.resolve()
            elif ckpt_path == "auto":  # e.g. a crash between a commit and `last`: the newest intact one
                intact = ckpt_io.newest_intact(last.parent)
                return "ok", str(intact) if intact else None
            else:
                return "missing", f"ckpt_path='last': no checkpoint found at {last} (nothing to resume)"
        else:
            target = ckpt_io.as_named_by_lightning(Path(ckpt_path))
            ckpt_io.recover(target.parent)
            if not target.exists():
                return "missing", f"checkpoint not found: {target}"
            target = target.resolve()
        problem = ckpt_io.find_damage(target)
        if problem is None:
            return "ok", str(target)
        intact = ckpt_io.newest_intact(target.parent, exclude=target)
        if ckpt_path == "auto" and intact is not None:
            ckpt_io.warn_fallback(target, problem, intact)
            return "ok", str(intact)
        where = (
            f"the newest intact checkpoint is {intact} (--resume auto / ckpt_path='auto' falls back to it)"
            if intact
            else "no intact checkpoint is left beside it"
        )
        return "damaged", f"checkpoint {target} is damaged or incomplete ({problem}); {where}"

    def _decide_remote(self, ckpt_path: str, remote) -> tuple[str, str | None]:
        """A checkpoint in object storage (``<url>/<name>``, ``<url>/last``, or the callback's ``last``/``auto``):
        downloaded into the local cache (committed ones only: their manifest is there), then checked as a local
        one. On one node: its ranks read that copy."""
        remote, name = remote_at(ckpt_path) if is_url(ckpt_path) else (remote, ckpt_path)
        if name in (ckpt_io.LAST, "auto"):
            name = remote.last_name()
            if name is None:
                if ckpt_path == "auto":
                    return "ok", None
                return "missing", f"no checkpoint at {remote}/{ckpt_io.LAST} (nothing to resume)"
        local = remote.fetch(name)
        problem = ckpt_io.find_damage(local)
        if problem is not None:
            return "damaged", f"checkpoint {remote}/{name} is damaged or incomplete ({problem})"
        return "ok", str(local)

    # ---- what -------------------------------------------------------------------------------------
    def _live_objects(self) -> dict[str, Any]:
        """The objects a checkpoint restores in place (saving and loading use this one list)."""
        t = self.trainer
        return {
            "model": t.module,  # the bare module: same names under every strategy
            "optimizers": t.optimizers,
            "lr_schedulers": [c["scheduler"] for c in t.lr_schedulers],
            "precision": t.runtime.precision,
        }

    def progress_state(self) -> dict[str, Any]:
        t = self.trainer
        # numbers only (a value logged on a step that was not a logging step is still a tensor)
        metrics = {k: float(v) for k, v in t.metrics.callback_metrics.items()}
        return {**t.progress.state_dict(), "callback_metrics": metrics}

    def load_progress_state(self, state: dict[str, Any], source: str | os.PathLike = "the restored state") -> None:
        t = self.trainer
        try:
            t.progress.load_state_dict(state)
        except (ValueError, AttributeError) as e:
            raise ckpt_io.CheckpointError(f"{source}: {e}") from None
        metrics = state.get("callback_metrics", {})
        # numbers by name, as progress_state saved them; anything else is not a metric of this run
        t.metrics.callback_metrics = {
            k: float(v)
            for k, v in (metrics.items() if isinstance(metrics, dict) else ())
            if type(k) is str and type(v) in (int, float)
        }

    def live_state(self) -> dict[str, Any]:
        """What a peer takes over to go on from where this run stands (``ddp_torchft``: a replica group that rejoins):
        the weights, optimizer and scheduler states, the precision's scaler and the loop's progress, data position
        included. Tensors and plain containers only, as in a checkpoint: the peer reads them weights-only.

        The model goes apart from the optimizers: beside a model, DCP's optimizer helpers first initialize an optimizer
        that has not stepped yet by stepping it (AdamW would count one step more than DDP from then on). A replica
        holds its optimizer whole, so the optimizer's own ``state_dict`` is the whole state. Every rank of a group
        sends its own (a checkpoint's full state lives on rank 0 only)."""
        objects, unwrap, every_rank = self._live_objects(), self.trainer.strategy.unwrap, ckpt_state.FULL_EVERY_RANK
        model = ckpt_state.state_of({"model": objects.pop("model")}, unwrap, every_rank)
        return {**model, **ckpt_state.state_of({**objects, "progress": self.progress_state()}, unwrap, every_rank)}

    def load_live_state(self, loaded: dict[str, Any]) -> None:
        objects, unwrap = self._live_objects(), self.trainer.strategy.unwrap
        ckpt_state.load_into({"model": objects.pop("model")}, loaded, unwrap, ckpt_state.FULL)
        state = {**objects, "progress": None}
        ckpt_state.load_into(state, loaded, unwrap, ckpt_state.FULL)
        self.load_progress_state(state["progress"])

    def state(self, weights_only: bool = False, rngs: list | None = None) -> dict[str, Any]:
        """``rngs``: the RNG streams to record (default: every rank's, gathered)."""
        t = self.trainer
        live = self._live_objects()
        if weights_only:
            live = {k: v for k, v in live.items() if k not in ("optimizers", "lr_schedulers")} | {"weights_only": True}
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            **live,
            "progress": self.progress_state(),
            "rng": t.runtime.all_gather_object(rng_state()) if rngs is None else rngs,  # every rank's streams
            "callbacks": {cb.state_key: cb.state_dict() for cb in t.callbacks},
            "loggers": self.logger_states(),
            "hyper_parameters": dict(t.module.hparams) if t.module is not None else {},
            "config": t.run_config or {},
            "world_size": t.world_size,
            "batch_layout": vars(t.batch_layout) if getattr(t, "batch_layout", None) else None,
            "strategy": type(t.strategy).__name__,
        }
        datamodule_state_dict = getattr(t.datamodule, "state_dict", None)  # Lightning's hook: back before its loader
        if datamodule_state_dict is not None and (datamodule_state := datamodule_state_dict()):
            checkpoint["datamodule"] = datamodule_state
        strategy_state = t.strategy.state_dict()  # its own training state (semi-synchronous replica groups)
        if strategy_state:
            checkpoint["strategy_state"] = strategy_state
        # Lightning's hooks: the callbacks', then the module's, add keys of their own (on_load_checkpoint gets them)
        call_callbacks(t, "on_save_checkpoint", checkpoint)
        if t.module is not None:
            t.module.on_save_checkpoint(checkpoint)
        return checkpoint

    # A tracker's run (W&B id, MLflow run id) rides along, so a resumed job continues that run.
    # Rank 0's loggers hold it (only rank 0 logs), and rank 0 writes what is not sharded.
    def logger_states(self) -> dict[str, dict]:
        return {lg.state_key: s for lg in self.trainer.loggers if (s := lg.state_dict())}

    def load_logger_states(self, states: dict[str, dict]) -> None:
        for lg in self.trainer.loggers:
            if lg.state_key in states:
                lg.load_state_dict(states[lg.state_key])

    # ---- save and restore -------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike,
        then: Callable[[bool], None] | None = None,
        background: bool | None = None,
        weights_only: bool = False,
    ):
        """Write a checkpoint directory (all ranks call this together). ``then(finite)`` runs once it is committed:
        now, or — written in the background (``async_save``) — at the first step after every rank's writes finished
        (``commit_written``), or the next save or the end of fit, whichever comes first;
        ``finite``: every weight is finite (agreed across ranks): a checkpoint that is not must never become
        ``last``. Returns that. ``weights_only``: without the optimizers' and schedulers' states (DeepSpeed's engine
        writes its own either way), marked so that no fit resumes from it."""
        self.trainer.nonfinite.settle()  # a step the device skipped is counted before any checkpoint holds it
        self.complete_pending()
        if background is None:  # strategy="auto" may have chosen DeepSpeed, whose engine writes synchronously
            background = self.async_save and self.trainer.strategy.traits.saves_in_background
        if self.trainer.module is None:
            raise RuntimeError("save_checkpoint() needs a module attached by fit/validate/test first")
        if self.parent_checkpoint is not None:  # the parent of spawned/forked ranks: what rank 0 sent back
            finite = _write_alone(path, self.parent_checkpoint)
            if then is not None:
                then(finite)
            return finite
        finite = self.weights_finite()  # of the weights being saved: now, before the run changes them
        started = time.monotonic()
        self._pending = (self.trainer.runtime.save(path, self.state(weights_only), background), then, finite)
        if not background:
            self.complete_pending()
            self._compare_with_grace(time.monotonic() - started)
        return finite

    def _compare_with_grace(self, seconds: float) -> None:
        """Rank 0, after its first synchronous save under a SLURM partition that preempts: one line when the save
        took longer than the partition's ``GraceTime``. A preempted job gets SIGTERM, then SIGKILL that much later,
        so its checkpoint would never be written, and the requeued job would go back to the one before."""
        if self._grace_checked or not self.trainer.is_global_zero:
            return
        self._grace_checked = True
        from distrain.cluster import slurm_grace_s

        grace = slurm_grace_s()
        if grace is not None and seconds > grace:
            partition = os.environ.get("SLURM_JOB_PARTITION")
            print(
                f"distrain: warning: a checkpoint took {seconds:.1f} s to write, and partition {partition} gives a "
                f"preempted job {grace:g} s (GraceTime) from SIGTERM to SIGKILL: a preemption would end this job "
                "before its checkpoint is written, and the requeued job would resume from the one before. Ask for a "
                "longer GraceTime, or write faster (checkpointing.async_save)",
                flush=True,
            )

    def begin_stage(self) -> None:
        self._stages_begun += 1

    def save_as_called(self, path: str | os.PathLike) -> bool:
        """``trainer.save_checkpoint(path)``: written by every rank together, as the loop's own checkpoints are; or,
        called by one rank alone (under ``if trainer.is_global_zero:``, as Lightning's documentation shows), written
        by that rank where every rank holds the whole state (``traits.replicated_state``: DDP), else refused in one
        line naming the call. Never a collective one rank entered alone (gloo aborted the job; Lightning hangs).
        Returns whether the weights were finite."""
        t = self.trainer
        if self.parent_checkpoint is not None or t.world_size == 1 or not torch.distributed.is_initialized():
            return self.save(path, background=False)
        from distrain.distributed import arrival

        here = (self._stages_begun, t.global_step)
        self._calls = (*here, self._calls[2] + 1 if self._calls[:2] == here else 1)
        # the run's folder: another trainer's calls, on a process group kept across trainers, are others
        call = "save_checkpoint/{}/{}/{}/{}".format(os.path.abspath(str(t.log_dir)), *self._calls)
        together, alone = arrival.called_by_every_rank(call, t.global_rank, t.world_size)
        if together:
            return self.save(path, background=False)
        if alone != t.global_rank:  # it came late: the rank that waited for it wrote the checkpoint
            return True
        if not t.strategy.traits.replicated_state:
            raise RuntimeError(
                f"trainer.save_checkpoint({str(path)!r}) was called on rank {t.global_rank} alone (no other rank "
                f"called it within {arrival.WAIT_S:g} s): under {type(t.strategy).__name__} each rank holds part of "
                "the state, so every rank must call it (not under `if trainer.is_global_zero:`)"
            )
        print(
            f"distrain: trainer.save_checkpoint({str(path)!r}) on rank {t.global_rank} alone (no other rank called it "
            f"within {arrival.WAIT_S:g} s): written from this rank's state, which every rank holds the same",
            flush=True,
        )
        return self._save_alone(path)

    def _save_alone(self, path: str | os.PathLike) -> bool:
        """The whole state, written by this rank without a collective (every rank holds it the same); the RNG
        streams of this rank only, as rank 0's (a resume gives the others fresh ones)."""
        t = self.trainer
        state = self.state(rngs=[rng_state()] if t.global_rank == 0 else [])
        # FULL_EVERY_RANK: torch's FULL keeps the state on rank 0 only, which may not be this rank
        return _write_alone(path, ckpt_state.state_of(state, t.strategy.unwrap, ckpt_state.FULL_EVERY_RANK))

    @property
    def writing(self) -> ckpt_io.Pending | None:
        """The checkpoint being written in the background, not committed yet (``async_save``); None when there is
        none. Its ``written()`` says whether this rank's writes have finished."""
        return self._pending[0] if self._pending is not None else None

    def commit_written(self) -> None:
        """Every rank, once per step: a checkpoint written in the background is committed (and ``last`` moved to it)
        at the first step at which every rank's writes have finished, so that a job killed before the next save
        keeps it. Asked with one number's all-reduce per step, only while a checkpoint is being written."""
        pending = self.writing
        if pending is None:
            return
        every_rank = self.trainer.runtime.all_reduce(torch.tensor(float(pending.written())), op="min")
        if bool(every_rank):
            self.complete_pending()

    def complete_pending(self) -> None:
        """Wait for a checkpoint written in the background and commit it (every rank together)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        write, then, finite = pending
        if write is not None:
            with watch.patient("checkpoint commit"):
                write.complete()
        if then is not None:
            then(finite)

    def weights_finite(self) -> bool:
        t = self.trainer
        local = [t.strategy.local_shard(p) for p in t.module.parameters()]  # a shard, a partition: this rank's
        # each tensor's smallest and largest value: NaN and ±inf show there, in one pass that allocates nothing (a
        # stall of every save: isfinite(p).all() took 0.31 s on 168M parameters, this 0.014 s); one host sync
        extremes = [torch.stack(torch.aminmax(p.detach())).float() for p in local if p.numel()]
        finite = bool(torch.isfinite(torch.cat(extremes)).all()) if extremes else True
        return bool(t.runtime.all_reduce(torch.tensor(float(finite)), op="min"))

    def read_before_loaders(self, checkpoint: Path | None) -> dict[str, Any]:
        """What a fit resumed from ``checkpoint`` reads before it makes its loaders (rank 0's, for all): the
        datamodule's state and the batch layout. A weights-only checkpoint is refused here, in one line."""
        if checkpoint is None:
            return {}

        def entries() -> dict[str, Any]:  # a few small entries travel to the other ranks, not the whole file
            meta = read_checkpoint_meta(checkpoint)
            return {key: meta.get(key) for key in ("datamodule", "batch_layout", "weights_only")}

        saved = self.trainer.runtime.decided_on_rank_zero(entries)
        if saved.pop("weights_only"):
            raise ckpt_io.CheckpointError(
                f"{checkpoint} holds the weights only (ModelCheckpoint(save_weights_only=True)), so fit cannot resume "
                "from it: evaluate it (validate/test/predict with ckpt_path), or start from its weights "
                "(Module.load_from_checkpoint) without ckpt_path"
            )
        return saved

    def restore(self, path: Path | None, weights_only: bool = False) -> None:
        if path is None:  # ckpt_path="auto" with no checkpoint yet: a fresh start
            return
        t = self.trainer
        if weights_only:
            t.runtime.load(path, {"model": t.module})
            return
        state = {**self._live_objects(), "progress": None, "callbacks": None}
        extra = t.runtime.load(path, state)
        if extra.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
            raise RuntimeError(
                f"{path} has checkpoint format {extra['format']!r}; this distrain reads {CHECKPOINT_FORMAT!r}"
            )
        self.load_progress_state(state["progress"], source=path)
        try:  # a checkpoint Lightning wrote: its epoch goes on after the batches it had trained on (all at its end)
            batches = lightning_layout.batches_into_epoch(extra)
        except ValueError as e:
            raise ckpt_io.CheckpointError(f"{path} (written by Lightning): {e}") from None
        if batches is not None:
            epoch = t.loop_state.num_batches
            if t.progress.epoch_done:  # at its end, on any number of ranks
                batches = epoch
            elif epoch is not None and batches > epoch:
                raise ckpt_io.CheckpointError(
                    f"{path} (written by Lightning): its loops' {batches} processed batches exceed this run's epoch of "
                    f"{epoch} batches"
                )
            t.progress.samples_in_epoch = batches * t.batch_layout.micro_batch * t.data_parallel_size
        t.strategy.load_state_dict(extra.pop("strategy_state", {}), str(path))  # {}: the checkpoint has none
        t.module.on_load_checkpoint(extra)  # the checkpoint's other keys: those on_save_checkpoint added
        call_callbacks(t, "on_load_checkpoint", extra)
        saved = state["callbacks"]
        for cb in t.callbacks:
            key = cb.state_key
            alone = sum(type(other) is type(cb) for other in t.callbacks) == 1
            if key not in saved and alone:  # a checkpoint from before ModelCheckpoint's key told instances apart
                key = type(cb).__name__
            if key in saved:
                cb.load_state_dict(saved[key])
        if self.last_path().parent.resolve() == Path(path).resolve().parent:  # this run's own checkpoint
            self.load_logger_states(extra.get("loggers", {}))  # absent in older checkpoints
        elif extra.get("loggers") and t.is_global_zero:  # another run's: its tracker runs stay its own
            print(f"distrain: {path} is another run's checkpoint: its tracker runs are not continued here", flush=True)
        rngs = extra.get("rng", [])
        if t.global_rank < len(rngs):
            set_rng_state(rngs[t.global_rank])
        else:  # more ranks than the checkpoint had: a fresh, rank-distinct stream
            t.runtime.seed_everything(t.seed + 1_000_003 * (t.global_rank + 1) + t.progress.global_step)

    # ---- spawn/fork: the trained weights and the progress come back to the parent -----------------
    def state_for_parent(self) -> dict[str, Any]:
        """Called on every rank after the stage; rank 0's result travels to the parent: the weights,
        the progress and, after fit, the whole checkpoint (optimizer state included), so the parent
        can save, evaluate and export what was trained."""
        t = self.trainer
        weights = {k: v.detach().cpu() for k, v in t.module.state_dict().items()}
        payload = {"model": weights, "progress": self.progress_state()}
        cb = t.checkpoint_callback
        if cb is not None:  # what ckpt_path="best" and "last" of a later stage in the parent mean
            payload["checkpoint_paths"] = (cb.best_model_path, cb.last_model_path)
        if t.optimizers:
            payload["checkpoint"] = ckpt_state.state_of(self.state(), t.strategy.unwrap, ckpt_state.FULL)
        return payload

    def restore_in_parent(self, module, state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        self.load_progress_state(state["progress"])
        self.trainer.module = module
        self.parent_checkpoint = state.get("checkpoint")
        cb = self.trainer.checkpoint_callback
        if cb is not None and "checkpoint_paths" in state:
            cb.best_model_path, cb.last_model_path = state["checkpoint_paths"]


def _write_alone(path: str | os.PathLike, plain: dict[str, Any]) -> bool:
    """A whole checkpoint state (plain values), written and committed by this process with no other rank taking
    part; returns whether its model weights are finite."""

    ckpt_io.write_checkpoint(path, lambda tmp: ckpt_io.save_state_file(plain, tmp), True, lambda outcome: [outcome])
    return all(bool(torch.isfinite(v).all()) for v in plain["model"].values())
