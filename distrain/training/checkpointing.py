"""What a checkpoint holds and how a run is rebuilt from one.

The Trainer's parts each give their state (``state_dict``/``load_state_dict``): the bare module
(the same parameter names under every strategy), the optimizers and LR schedulers, the precision
plugin (its grad scaler), the loop's progress, every rank's RNG streams and each callback. The
strategy decides how that is written (one file, DCP shards, DeepSpeed's engine files); the
``ModelCheckpoint`` callback decides when.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.runtime import rng_state, set_rng_state

CHECKPOINT_FORMAT = "distrain/1"


@dataclass
class TrainProgress:
    """Where the loop is: what a checkpoint must carry to resume exactly."""

    global_step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    """Global position in this epoch's sample order (samples consumed by all ranks together)."""
    epoch_done: bool = False
    """Saved at the end of ``epoch``: a resume starts the next one."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "samples_in_epoch": self.samples_in_epoch,
            "epoch_done": self.epoch_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = state["global_step"]
        self.epoch = state["epoch"]
        self.samples_in_epoch = state["samples_in_epoch"]
        self.epoch_done = state.get("epoch_done", False)


class CheckpointManager:
    def __init__(self, trainer):
        self.trainer = trainer

    # ---- where ------------------------------------------------------------------------------------
    def last_path(self) -> Path:
        cb = self.trainer.checkpoint_callback
        dirpath = Path(cb.dirpath) if cb and cb.dirpath else Path(self.trainer.default_root_dir) / "checkpoints"
        return dirpath / "last"

    def resolve(self, ckpt_path: str | os.PathLike) -> Path:
        if ckpt_path == "last":
            last = self.last_path()
            if not last.exists():
                raise FileNotFoundError(f"ckpt_path='last': no checkpoint found at {last} (nothing to resume)")
            return last.resolve()
        return Path(ckpt_path)

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
        return {**t.progress.state_dict(), "callback_metrics": dict(t.metrics.callback_metrics)}

    def load_progress_state(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.progress.load_state_dict(state)
        t.metrics.callback_metrics = dict(state.get("callback_metrics", {}))

    def state(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "format": CHECKPOINT_FORMAT,
            **self._live_objects(),
            "progress": self.progress_state(),
            "rng": t.runtime.all_gather_object(rng_state()),  # every rank's streams
            "callbacks": {cb.state_key: cb.state_dict() for cb in t.callbacks},
            "loggers": self.logger_states(),
            "hyper_parameters": dict(t.module.hparams) if t.module is not None else {},
            "config": t.run_config or {},
            "world_size": t.world_size,
            "strategy": type(t.strategy).__name__,
        }

    # A tracker's run (W&B id, MLflow run id) rides along, so a resumed job continues that run.
    # Rank 0's loggers hold it (only rank 0 logs), and rank 0 writes what is not sharded.
    def logger_states(self) -> dict[str, dict]:
        return {lg.state_key: s for lg in self.trainer.loggers if (s := lg.state_dict())}

    def load_logger_states(self, states: dict[str, dict]) -> None:
        for lg in self.trainer.loggers:
            if lg.state_key in states:
                lg.load_state_dict(states[lg.state_key])

    # ---- save and restore -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint directory (all ranks call this together)."""
        if self.trainer.module is None:
            raise RuntimeError("save_checkpoint() needs a module attached by fit/validate/test first")
        self.trainer.runtime.save(path, self.state())

    def restore(self, path: Path, weights_only: bool = False) -> None:
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
        self.load_progress_state(state["progress"])
        for cb in t.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        self.load_logger_states(extra.get("loggers", {}))  # absent in older checkpoints
        rngs = extra.get("rng", [])
        if t.global_rank < len(rngs):
            set_rng_state(rngs[t.global_rank])
        else:  # more ranks than the checkpoint had: a fresh, rank-distinct stream
            t.runtime.seed_everything(t.seed + 1_000_003 * (t.global_rank + 1) + t.progress.global_step)

    # ---- spawn/fork: the trained weights and the progress come back to the parent -----------------
    def state_for_parent(self) -> dict[str, Any]:
        weights = {k: v.detach().cpu() for k, v in self.trainer.module.state_dict().items()}
        return {"model": weights, "progress": self.progress_state()}

    def restore_in_parent(self, module, state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        self.load_progress_state(state["progress"])
