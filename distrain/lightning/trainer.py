"""``lightning.pytorch.trainer``: distrain's Trainer with Lightning's ``PL_TRAINER_*`` environment defaults."""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distrain.checkpoint.remote import is_url
from distrain.lightning.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from distrain.lightning.plugins.environments import READ_BY_DISTRAIN, ClusterEnvironment, SLURMEnvironment
from distrain.lightning.plugins.precision import Precision, precision_of
from distrain.run_dir import versions
from distrain.runtime import rng_state, set_rng_state
from distrain.trainer import Trainer as _Trainer
from distrain.training.defaults import callback_list

__all__ = ["Trainer", "env_defaults", "seed_everything"]


def env_defaults(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Lightning's ``PL_TRAINER_<ARGUMENT>`` variables (``PL_TRAINER_DEVICES=2``) as Trainer keywords: a Python
    literal where the value reads as one, else the string. An argument the Trainer does not take is refused there,
    named as the keyword."""
    defaults = {}
    for key, raw in environ.items():
        if key.startswith("PL_TRAINER_") and len(key) > len("PL_TRAINER_"):
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
            defaults[key[len("PL_TRAINER_") :].lower()] = value
    return defaults


class Trainer(_Trainer):
    """distrain's ``Trainer`` as Lightning's behaves, for scripts that move by their imports alone:
    - its arguments are keywords (Lightning's are keyword-only), with Lightning's ``PL_TRAINER_*`` environment
      variables as defaults: a keyword given in the script wins, as in Lightning;
    - the training data sharded over several ranks is shuffled, whatever its loader says, in the order Lightning's
      sampler gives it (seeded by ``PL_GLOBAL_SEED``, which ``seed_everything`` sets, else 0); ``distrain.Trainer``
      keeps the loader's own order;
    - on a CPU, ``devices="auto"`` (and -1) is one process, as Lightning's CPU accelerator counts one device
      (``distrain.Trainer`` starts a rank per core, up to 2);
    - Lightning's schedule of validations: ``val_check_interval`` counts the batches of each epoch
      (``distrain.Trainer``: optimizer steps over the run), a validation inside an epoch runs after
      ``on_train_batch_end``, and fit adds none after its last step (``distrain.Trainer`` ends with one);
    - Lightning's random numbers: fit goes on with the script's random streams (``seed_streams``), the loaders draw
      from torch's generator as torch's own do, and a sanity check of 2 batches runs first, drawing nothing."""

    default_checkpoint = ModelCheckpoint  # Lightning's paths: epoch=0-step=8.ckpt, last.ckpt
    continues_script_streams = True  # Lightning's numbers: no stage reseeds, the loaders draw as torch's

    def __init__(self, **kwargs: Any):
        kwargs = {"num_sanity_val_steps": 2, **env_defaults(), **kwargs}  # Lightning's default sanity check
        environment, plugin_precision = _plugins(kwargs.pop("plugins", None))
        if plugin_precision is not None:
            if kwargs.get("precision") not in (None, plugin_precision):
                raise ValueError(
                    f"Trainer(precision={kwargs['precision']!r}, plugins=[...]) and a precision plugin of "
                    f"{plugin_precision!r}: choose one (as Lightning asks)"
                )
            kwargs["precision"] = plugin_precision
        #: Lightning's SLURM behaviour (a plugin's, else the default under srun): stop on its signal, requeue, resume
        self.slurm = environment if isinstance(environment, SLURMEnvironment) else None
        if environment is None and SLURMEnvironment.detect():
            self.slurm = SLURMEnvironment()
        elif environment is not None and not isinstance(environment, READ_BY_DISTRAIN):
            _place_this_rank(environment, kwargs.get("devices", "auto"), kwargs.get("num_nodes", 1))
        if self.slurm is not None and self.slurm.requeue_signal not in self.stop_signals:
            self.stop_signals = (*self.stop_signals, self.slurm.requeue_signal)
        precision, accelerator = kwargs.get("precision", "32-true"), kwargs.get("accelerator", "auto")
        kwargs["precision"] = _lightning_precision(precision, accelerator)
        kwargs["default_root_dir"] = kwargs.get("default_root_dir") or os.getcwd()  # Lightning's: where it runs
        schedules = [c for c in callback_list(kwargs.get("callbacks")) if isinstance(c, GradientAccumulationScheduler)]
        if schedules:  # Lightning's callback: distrain's own schedule of accumulate_grad_batches
            if kwargs.get("accumulate_grad_batches", 1) != 1 or len(schedules) > 1:
                raise ValueError(
                    "You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` "
                    "callback (or two of them). Either remove `accumulate_grad_batches` from the Trainer or remove "
                    "the callback."
                )
            kwargs["accumulate_grad_batches"] = schedules[0].scheduling
        if kwargs.get("logger", True) is True and not is_url(str(kwargs["default_root_dir"])):
            kwargs["logger"] = _default_loggers(str(kwargs["default_root_dir"]))
        if kwargs.get("devices", "auto") in ("auto", -1, "-1") and _on_cpu(accelerator):
            kwargs["devices"] = 1  # Lightning's CPU accelerator counts one device (distrain's: a rank per core)
        super().__init__(**kwargs)
        self.loop.validates_as_lightning = True
        self.metrics.collector.forks = True  # on_step and on_epoch: name_step, name_epoch

    def fit(self, model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        """distrain's ``fit``, with Lightning's SLURM auto-requeue: a job SLURM requeued (``SLURM_RESTART_COUNT``)
        goes on from its last checkpoint where the script names none, and a run that its ``requeue_signal`` stopped
        is requeued by rank 0 (``scontrol requeue``) once its checkpoint is written."""
        requeues = self.slurm is not None and self.slurm.auto_requeue
        if ckpt_path is None and requeues and SLURMEnvironment.requeued():
            ckpt_path = "last"  # this run is a new version: `last` is the newest earlier version's
        metrics = super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        if requeues and self.preempted == self.slurm.requeue_signal and self.is_global_zero:
            _requeue(SLURMEnvironment.job_id(), self.preempted, self.global_step)
        return metrics

    def seed_streams(self, stage_start: bool) -> None:
        """Lightning's: a stage goes on with the script's streams (a spawned rank with those its parent had), except
        that a distributed strategy (DDP, FSDP, DeepSpeed: any but one device's own, on one device too) seeds them
        again from ``seed_everything``'s seed when it sets up, as Lightning's do (``reset_seed``); ranks of a script
        that never seeded take rank 0's, so that every rank builds the same weights."""
        if not stage_start:
            return
        if self._script_streams is not None:
            set_rng_state(self._script_streams)
        if self._distributed and "PL_GLOBAL_SEED" in os.environ:
            self.runtime.seed_everything(int(os.environ["PL_GLOBAL_SEED"]))
        elif self.world_size > 1:
            set_rng_state(self.runtime.broadcast(rng_state()))

    def checkpoint_at(self, ckpt_path):
        """``ckpt_path="last"`` where this run (a new version, as in Lightning) has none yet: the newest earlier
        version's ``last``, said on the console (Lightning would warn and go on without one); with none, Lightning's
        warning, and the stage goes on from the weights as they are."""
        import warnings

        if ckpt_path != "last" or self.remote_root is not None:
            return super().checkpoint_at(ckpt_path)
        try:
            return super().checkpoint_at(ckpt_path)
        except FileNotFoundError:
            pass
        here = Path(self.log_dir)
        earlier = [p for _, p in versions(here.parent) if p != here and (p / "checkpoints" / "last").exists()]
        if earlier:
            found = earlier[-1] / "checkpoints" / "last"
            if self.is_global_zero:
                print(f"distrain: ckpt_path='last': resuming {found}, the newest earlier run's", flush=True)
            return super().checkpoint_at(str(found))
        if self.is_global_zero:
            warnings.warn(
                'ckpt_path="last": there is no last checkpoint yet, so none is loaded (as in Lightning); save one '
                "with ModelCheckpoint(save_last=True)",
                stacklevel=4,
            )
        return None

    def run_folder(self, ckpt_path) -> str:
        """Lightning's: the first logger's folder (the ``log_dir`` of TensorBoard's and the CSV logger, another's
        ``save_dir``; the default logger's is ``lightning_logs/version_N``), or ``default_root_dir`` with none. The
        checkpoints go in its ``checkpoints`` folder, as Lightning's, and a run resumed from a checkpoint is a new
        version, as in Lightning."""
        from distrain.loggers import CSVLogger, TensorBoardLogger

        loggers = self.metrics.loggers
        if self.remote_root is not None:
            return super().run_folder(ckpt_path)
        if not loggers:
            return self.default_root_dir
        first = loggers[0]
        folder = first.log_dir if isinstance(first, (TensorBoardLogger, CSVLogger)) else first.save_dir
        return str(folder or self.default_root_dir)

    def train_order(self) -> tuple[bool | None, int]:
        """Lightning's: under a distributed strategy (on one device too) the training data is shuffled by its
        ``DistributedSampler``, seeded by ``PL_GLOBAL_SEED``, whatever the loader says; on one device's own, as the
        loader says; with ``overfit_batches``, never shuffled."""
        shuffle = False if self.loop.overfit else (True if self._distributed else None)
        return shuffle, int(os.environ.get("PL_GLOBAL_SEED", 0))

    @property
    def _distributed(self) -> bool:
        """A strategy of several ranks' kind (DDP, FSDP, DeepSpeed...), whatever the ranks: Lightning's reseed its
        streams and shard (and shuffle) the training data on one device too; its single-device strategy does not."""
        from distrain.strategies.single import SingleDeviceStrategy

        return not isinstance(self.runtime.strategy, SingleDeviceStrategy)


def _plugins(plugins: Any) -> tuple[ClusterEnvironment | None, str | None]:
    """``Trainer(plugins=...)`` (one plugin or a list): the cluster environment and the precision it names. Anything
    else, or two of a kind, is refused in one line naming it."""
    environment, precision = None, None
    for plugin in [] if plugins is None else plugins if isinstance(plugins, (list, tuple)) else [plugins]:
        name = type(plugin).__name__
        if isinstance(plugin, ClusterEnvironment) and environment is None:
            environment = plugin
        elif isinstance(plugin, Precision) and precision is None:
            precision = precision_of(plugin)
        elif isinstance(plugin, (ClusterEnvironment, Precision)):
            kind = "precisions" if isinstance(plugin, Precision) else "cluster environments"
            raise ValueError(f"Trainer(plugins=[...]): two {kind} given ({name} is the second); give one")
        else:
            raise ValueError(
                f"Trainer(plugins=[{name}]): distrain takes a precision plugin (Precision, MixedPrecision, "
                "DoublePrecision, HalfPrecision) or a cluster environment (ClusterEnvironment, SLURMEnvironment) "
                "there; checkpoint I/O is distrain's own (torch.distributed.checkpoint)"
            )
    return environment, precision


def _place_this_rank(environment: ClusterEnvironment, devices: Any, num_nodes: Any) -> None:
    """A cluster environment that starts the ranks itself (``creates_processes_externally``): its answers become the
    variables this rank's process group reads, as Lightning's strategies ask it when the Trainer is made. One that
    leaves starting them to the Trainer gives the main address and port."""
    if isinstance(devices, int) and isinstance(num_nodes, int):
        environment.validate_settings(devices, num_nodes)
    answers = {"MASTER_ADDR": lambda: environment.main_address, "MASTER_PORT": lambda: environment.main_port}
    if environment.creates_processes_externally:
        answers.update(
            RANK=environment.global_rank,
            WORLD_SIZE=environment.world_size,
            LOCAL_RANK=environment.local_rank,
            NODE_RANK=environment.node_rank,
        )
    values = {}
    for key, answer in answers.items():
        try:
            values[key] = str(answer())
        except Exception as e:  # noqa: BLE001 — the user's class: its failure, named
            raise ValueError(
                f"Trainer(plugins=[{type(environment).__name__}()]): asked for {key}, it raised {type(e).__name__}: {e}"
            ) from None
    os.environ.update(values)
    if environment.creates_processes_externally and isinstance(num_nodes, int) and num_nodes > 0:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(max(1, int(values["WORLD_SIZE"]) // num_nodes)))


def _requeue(job_id: str | None, signal_number: int, step: int) -> None:
    """Lightning's auto-requeue, from rank 0 once the stopped run's checkpoint is written: ``scontrol requeue``."""
    import re
    import subprocess
    import sys

    if job_id is None or not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        print(f"distrain: stopped by signal {signal_number}, but SLURM_JOB_ID is {job_id!r}: not requeued", flush=True)
        return
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        said = (done.stderr or done.stdout).strip().splitlines()
        failed = f"exit code {done.returncode}: {said[-1] if said else ''}" if done.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        failed = f"{type(e).__name__}: {e}"
    if failed:
        print(
            f"distrain: requeuing SLURM job {job_id} failed ({failed}); resume it with ckpt_path='last'",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"distrain: stopped by signal {signal_number} at step {step}: requeued SLURM job {job_id}, which goes on "
            "from this checkpoint (SLURMEnvironment(auto_requeue=True))",
            flush=True,
        )


def _default_loggers(root: str) -> list:
    """``logger=True``: Lightning's default, TensorBoard in ``root/lightning_logs/version_N``, with distrain's
    ``metrics.jsonl`` beside its event files."""
    from distrain.lightning.loggers import TensorBoardLogger
    from distrain.loggers import JSONLLogger

    tensorboard = TensorBoardLogger(root)
    return [tensorboard, JSONLLogger(tensorboard.log_dir)]


def _on_cpu(accelerator: Any) -> bool:
    from distrain.accelerators import resolve_accelerator

    return isinstance(accelerator, str) and resolve_accelerator(accelerator).name == "cpu"


def _lightning_precision(precision: Any, accelerator: Any) -> Any:
    """Lightning's choice where fp16 cannot run: ``16-mixed`` (or ``16``) on a CPU trains in ``bf16-mixed``, with
    Lightning's warning (``distrain.Trainer`` refuses it instead, naming bf16-mixed)."""
    import warnings

    from distrain.config import canonical_precision

    precision = canonical_precision(precision)
    if precision == "16-mixed" and _on_cpu(accelerator):
        warnings.warn(
            f"Trainer(accelerator={accelerator!r}, precision='16-mixed') on a CPU: AMP with fp16 needs a GPU, "
            "so it trains in precision='bf16-mixed' (as Lightning does)",
            stacklevel=3,
        )
        return "bf16-mixed"
    return precision


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Lightning's: seeds Python, NumPy and torch, and keeps the seed in ``PL_GLOBAL_SEED`` (the training sampler's
    seed, and the ranks a launcher starts read it). None: ``PL_GLOBAL_SEED``'s, else 0."""
    from distrain.runtime import seed_everything as seed_process

    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    return seed_process(seed, workers)
