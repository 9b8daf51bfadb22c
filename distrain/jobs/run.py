"""``distrain train`` as a whole: the job, the memory plan's decisions, the Trainer, fit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.jobs.common import Workload, build_trainer

if TYPE_CHECKING:
    from distrain.config import RunConfig


def job_for(config: RunConfig) -> Workload:
    from distrain.models.gpt import GPT_SIZES, check_experts_key

    t = config.training
    check_experts_key(t)
    if t.module is not None:
        from distrain.jobs.user import UserModuleJob

        return UserModuleJob(config)
    if t.model_name not in GPT_SIZES:  # a Hugging Face hub name or local directory
        from distrain.jobs.hf import HFJob

        return HFJob(config)
    from distrain.jobs.gpt import GPTJob

    return GPTJob(config)


def run(config: RunConfig, resume: str | None = None, overwrite: bool = False) -> int:
    from distrain import run_dir

    if run_dir.starts_the_run():  # before the plan and before any file is written
        run_dir.claim(config.output_dir, resume, overwrite, config.checkpointing.checkpoint_dir)
    started = _start(config, resume)
    if isinstance(started, int):
        return started
    job, trainer = started
    job.fit(trainer, resume)  # the Trainer's closing summary ends the run's output
    marker = Path(config.output_dir) / "PREEMPTED"  # tells a job script that `--resume auto` has more to do
    if trainer.is_global_zero:
        marker.write_text(f"{trainer.preempted}\n") if trainer.preempted else marker.unlink(missing_ok=True)
    return 0


def verify(config: RunConfig, steps: int, as_json: bool) -> int:
    """``distrain verify``: the run ``distrain train`` would start, for ``steps`` steps, against one process."""
    import json

    from distrain.verify import verify as verify_run

    config.distributed.max_restarts = 0  # ddp_torchft: a failed check is the finding, not a reason to restart
    job = job_for(config)
    _check_fits_for_verify(job, config, steps)  # before the plan: nothing to wait for when it cannot run here
    started = _start(config, None, job)
    if isinstance(started, int):
        return started
    job, trainer = started
    trainer.loop.max_steps = steps  # what the header announces (verify_run stops there too)
    module, train_loader, _ = job.prepare(trainer)
    report = verify_run(trainer, module, train_loader, steps, label=f"{job.strategy}{trainer.strategy.layout_note}")
    if report is None:  # a rank other than the one that reports
        return 0
    print(json.dumps(report.to_json(), indent=2) if as_json else report.table(), flush=True)
    return 0 if report.ok else 1


def _start(config: RunConfig, resume: str | None, job: Workload | None = None):
    """The job and its Trainer, as ``distrain train`` makes them (or an exit code when the plan says stop)."""
    from distrain import launch
    from distrain.checkpoint.remote import RemoteDir, is_url
    from distrain.cluster import replica_group, replica_run_dir
    from distrain.planner import decide
    from distrain.planner.from_config import activation_checkpointing_every
    from distrain.strategies import registry

    t, d, c = config.training, config.distributed, config.checkpointing
    if d.pipeline_microbatches:  # a pipeline's micro-batches are the accumulation micro-batches (validated to agree)
        t.gradient_accumulation_steps = d.pipeline_microbatches
    job = job or job_for(config)
    # each replica group of a fault-tolerant run writes its own run directory (replica_<id>/)
    config.output_dir = replica_run_dir(config.output_dir)
    if c.checkpoint_dir:
        c.checkpoint_dir = replica_run_dir(c.checkpoint_dir)
    out = Path(config.output_dir)
    if is_url(c.checkpoint_dir):  # object storage: writable, and what --resume last takes, said before any rank
        remote = RemoteDir(c.checkpoint_dir)
        remote.check_writable()
        if resume == "last" and remote.last_name() is None:
            raise FileNotFoundError(f"--resume last: no checkpoint in {remote} to resume from")
        ckpt_dir = c.checkpoint_dir
    else:
        ckpt_dir = Path(c.checkpoint_dir) if c.checkpoint_dir else out / "checkpoints"
        # --resume auto (requeued/restarted jobs): the newest intact checkpoint if there is one, else a fresh start
        lasts = [ckpt_dir / "last"]
        if registry.starts_replica_groups(d.strategy) and replica_group() is None:  # the groups' supervisor: theirs
            lasts = [ckpt_dir / f"replica_{g}" / "last" for g in range(d.replica_groups)]
            if not c.checkpoint_dir:
                lasts = [out / f"replica_{g}" / "checkpoints" / "last" for g in range(d.replica_groups)]
        missing = [str(last.parent) for last in lasts if not last.exists()]
        if resume == "last" and missing:
            raise FileNotFoundError(f"--resume last: no checkpoint in {', '.join(missing)} to resume from")
        if resume and len(lasts) == 1:
            _check_resume_fits(config, job, lasts[0] if resume in ("last", "auto") else Path(resume))
    # the memory plan: strategy auto, activation_checkpointing auto, a warning when it will not fit
    decision = decide.for_config(config, job) if job.plannable else decide.Decision(d.strategy)
    decide.print_messages(decision)
    if decision.stop:
        return 2
    if decision.accumulate:  # auto chose a layout whose ranks share samples: the same global batch
        t.gradient_accumulation_steps = decision.accumulate
    every_n = activation_checkpointing_every(config)
    selective = t.activation_checkpointing_mode == "selective"
    policy = {"classes": job.block_classes, "every_n": every_n, "selective": selective} if every_n else None
    options = {
        "activation_checkpointing_policy": policy,
        **registry.options_from_config(decision.strategy, config, job.block_classes),
        **decision.strategy_options(job.block_classes, selective),
    }
    trainer = build_trainer(config, decision.strategy, ckpt_dir, options)
    job.strategy = decision.strategy
    if trainer.is_global_zero and not os.environ.get("DISTRAIN_LAUNCHED_CHILD"):
        launch.tee_output(trainer.runtime.log_dir, 0)  # the run's header belongs in rank 0's log too
    return job, trainer


def _check_resume_fits(config: RunConfig, job, checkpoint: Path) -> None:
    """A resume into a model of other shapes (another ``n_experts``, ``seq_len``, model size): one line before the
    plan and any rank, naming the parameters that differ, instead of every rank failing in its set-up (and the
    run's config.yaml rewritten with the keys that do not fit). The built-in GPT and Hugging Face models, whose
    module the planner builds on the meta device; the checkpoint read without its tensors' bytes."""
    from distrain.checkpoint.io import CheckpointError
    from distrain.checkpoint.state import compare_model_keys, saved_model_shapes
    from distrain.config import ConfigError
    from distrain.planner.from_config import spec_from_config

    if not job.plannable or config.training.module or not checkpoint.exists():
        return
    found = saved_model_shapes(checkpoint)
    if not found:
        return
    module = spec_from_config(config, job).build()
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    try:
        compare_model_keys(expected, found, "model", type(module).__name__)
    except CheckpointError as e:
        raise ConfigError(f"--resume {checkpoint}: {e}; resume with the config that wrote it") from None


#: what shrinking a model for ``distrain verify --shrink`` sets in its config: 2 blocks, width 64
SHRUNK = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def shrink(config: RunConfig) -> None:
    """``--shrink``: the same layout and precision on the model's own family, 2 blocks deep and 64 wide (fresh
    weights: a checkpoint's shapes no longer fit). The built-in GPT becomes gpt-tiny."""
    from distrain.config import ConfigError
    from distrain.models.gpt import GPT_SIZES

    t = config.training
    if t.module is not None:
        raise ConfigError(
            "--shrink: a Module of your own (training.module) has no config to shrink; pass smaller module_args"
        )
    if t.model_name in GPT_SIZES:
        t.model_name = "gpt-tiny"
        return
    t.model_config = {**SHRUNK, **t.model_config}
    t.pretrained = False


def _check_fits_for_verify(job, config: RunConfig, steps: int) -> None:
    """Verifying keeps whole copies of the weights and gradients of every step, twice, on this host."""
    import psutil

    from distrain.config import ConfigError

    params = getattr(job, "parameter_count", None)
    if not params:
        return
    needed = params * 4 * (4 * steps + 8)
    available = psutil.virtual_memory().available
    if needed > available // 2:
        raise ConfigError(
            f"distrain verify: {config.training.model_name} has {params / 1e6:.0f}M parameters; verifying {steps} "
            f"steps keeps about {needed / 2**30:.1f} GiB of copies on this host ({available / 2**30:.1f} GiB free): "
            "--shrink "
            "verifies the same layout on the model's family with 2 blocks, 64 wide"
        )
