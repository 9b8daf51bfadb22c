"""What every workload shares: the protocol, the Trainer a config describes, the run's header."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from distrain.config import save_config

if TYPE_CHECKING:
    from distrain.config import RunConfig


class Workload(Protocol):
    """One of the things ``distrain train`` runs (``gpt.py``, ``hf.py``, ``user.py``). Named apart from the
    planner's ``Job``, which is the arithmetic of a run: model, micro-batch, ranks."""

    block_classes: set[type]
    plannable: bool
    strategy: str  # the strategy's name, once decided (``auto`` as the plan chose it)

    def prepare(self, trainer) -> tuple:
        """The module and its train and validation loaders (the loaders built, the data read, on this rank)."""
        ...

    def fit(self, trainer, resume: str | None) -> None: ...


def build_trainer(config: RunConfig, strategy: str, ckpt_dir: Path, strategy_options: dict):
    """The Trainer the config describes: loop, checkpoints, loggers, strategy."""
    from distrain.callbacks import ModelCheckpoint
    from distrain.loggers import JSONLLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from distrain.trainer import Trainer

    t, d, c, lg = config.training, config.distributed, config.checkpointing, config.logging
    out = Path(config.output_dir)
    loggers = [JSONLLogger(str(out))]
    if lg.use_tensorboard:
        loggers.append(TensorBoardLogger(str(out)))
    if lg.use_wandb:
        loggers.append(WandbLogger(project=lg.wandb_project, name=out.name, save_dir=str(out), mode=lg.wandb_mode))
    if lg.use_mlflow:
        # no URI anywhere: a SQLite store in the run directory (MLflow 3 refuses its old ./mlruns default)
        uri = lg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out.resolve()}/mlflow.db"
        loggers.append(MLFlowLogger(experiment_name=lg.mlflow_experiment, tracking_uri=uri, run_name=out.name))
    trainer = Trainer(
        accelerator=d.accelerator,
        devices=d.devices,
        num_nodes=d.num_nodes,
        strategy=strategy,
        precision=t.precision,
        max_epochs=t.num_epochs,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.gradient_accumulation_steps,
        gradient_clip_val=t.max_grad_norm,
        val_check_interval=t.val_check_interval or None,  # 0: at the end of each epoch only, as None means here
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=lg.log_every_n_steps,
        default_root_dir=str(out),
        callbacks=[
            ModelCheckpoint(
                dirpath=str(ckpt_dir),
                every_n_train_steps=c.save_every_n_steps,
                save_top_k=c.keep_last_n,
                save_last=True,
                save_on_train_epoch_end=True,  # save_every_n_steps=0: at each epoch's end, validated inside or not
            )
        ],
        logger=loggers,
        seed=t.seed,
        enable_progress_bar=lg.progress_bar,
        enable_plots=lg.plot_summary,
        histogram_every_n_steps=lg.histogram_every_n_steps,
        straggler_threshold=lg.straggler_threshold,
        compile=t.compile,
        process_group_backend=d.backend,
        timeout=d.timeout_seconds,
        collective_timeout=d.collective_timeout_seconds,
        on_nonfinite=t.on_nonfinite,
        on_anomaly=t.on_anomaly,
        anomaly_zscore=t.anomaly_zscore,
        anomaly_window=t.anomaly_window,
        async_save=c.async_save,
        **strategy_options,
    )
    trainer.run_config = config.to_dict()
    trainer.run_dir_choice.chosen = (
        True  # the run is written in output_dir, which `distrain train` checked (run_dir.claim)
    )
    return trainer


def announce(
    trainer, config: RunConfig, strategy: str, what: str, details: str = "", total_steps: int | None = None
) -> None:
    """Rank 0 writes the run's config and says what runs where: the header of every job. The steps it names are
    the Trainer's (``distrain verify --steps 2`` runs 2 of a run whose schedule spans ``total_steps``)."""
    out = Path(config.output_dir)
    steps = trainer.max_steps if trainer.max_steps > 0 else total_steps
    if steps:
        details += f", {steps} step{'s' * (steps != 1)}"
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        save_config(config, out / "config.yaml")
        print(
            f"distrain: {what} on {trainer.world_size} process(es), strategy {strategy}{trainer.strategy.layout_note}"
            f"{details} → {out}",
            flush=True,
        )
