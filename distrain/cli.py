"""``distrain train``: the built-in job (or your config) on any strategy, from the command line."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

from distrain.config import ConfigError, RunConfig, build_config, save_config

# CLI flag → the config key it sets (one name per knob; aliases live in argparse below)
FLAG_KEYS = {
    "strategy": "distributed.strategy",
    "devices": "distributed.devices",
    "accelerator": "distributed.accelerator",
    "num_nodes": "distributed.num_nodes",
    "precision": "training.precision",
    "max_steps": "training.max_steps",
    "seed": "training.seed",
    "output_dir": "output_dir",
    "model_name": "training.model_name",
    "batch_size": "training.batch_size_per_gpu",
    "seq_len": "data.seq_len",
    "gpu_memory": "distributed.gpu_memory",
    "cpu_memory": "distributed.cpu_memory",
}


def _devices(value: str):
    return value if value == "auto" else int(value)


def train_parser(
    prog: str = "distrain train", description: str = "train the built-in GPT job (or your config's)"
) -> argparse.ArgumentParser:
    train = argparse.ArgumentParser(prog=prog, description=description)
    train.add_argument("--config", help="YAML or JSON config file")
    train.add_argument(
        "--strategy", "--mode", dest="strategy", help="auto, single, ddp, ddp_spawn, ddp_fork, fsdp, ..."
    )
    train.add_argument("--devices", type=_devices, help="processes per node (an integer, or auto)")
    train.add_argument("--accelerator", help="auto, cpu or gpu")
    train.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int)
    train.add_argument("--precision", help="32-true, 16-mixed, bf16-mixed, bf16-true or fp8")
    train.add_argument("--max-steps", "--max_steps", dest="max_steps", type=int)
    train.add_argument("--output-dir", "--output_dir", dest="output_dir")
    train.add_argument("--seed", type=int)
    train.add_argument(
        "--model-name",
        "--model_name",
        dest="model_name",
        help="a built-in GPT size, or a Hugging Face hub name or local model directory",
    )
    train.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, help="micro-batch per rank")
    train.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, help="tokens (bytes) per sample")
    train.add_argument(
        "--gpu-memory", "--gpu_memory", dest="gpu_memory", metavar="SIZE", help="memory per GPU to plan for (80GB)"
    )
    train.add_argument(
        "--cpu-memory", "--cpu_memory", dest="cpu_memory", metavar="SIZE", help="host memory per node to plan for (1TB)"
    )
    train.add_argument(
        "--resume",
        metavar="last|auto|PATH",
        help="continue from the newest checkpoint (auto: only if one exists), or from PATH",
    )
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. training.learning_rate=3e-4")
    return train


def plan_parser() -> argparse.ArgumentParser:
    plan = train_parser(
        "distrain plan",
        "per-rank memory of every strategy (DDP, FSDP, ZeRO; with and without activation checkpointing and "
        "offload) for this run, the largest micro-batch that fits, and the recommendation; nothing is allocated",
    )
    plan.set_defaults(strategy="all")
    plan.add_argument("--json", action="store_true", help="the rows as JSON")
    return plan


def convert_parser() -> argparse.ArgumentParser:
    convert = argparse.ArgumentParser(
        prog="distrain convert", description="consolidate a (sharded) checkpoint into one weights file"
    )
    convert.add_argument("checkpoint", help="a checkpoint directory (or its `last` link)")
    convert.add_argument("output", help="the file to write (a directory for --to hf)")
    convert.add_argument(
        "--to",
        choices=("torch", "safetensors", "hf"),
        default="safetensors",
        help="hf: a from_pretrained directory (config, safetensors, tokenizer) of a Hugging Face model",
    )
    return convert


def launch_parser() -> argparse.ArgumentParser:
    launch = argparse.ArgumentParser(
        prog="distrain launch",
        description="job files for torchrun, SLURM and Kubernetes; arguments after -- go to `distrain train`",
    )
    sub = launch.add_subparsers(dest="engine", required=True)
    tr = sub.add_parser("torchrun", help="print (or --run) the per-node torchrun command, c10d rendezvous")
    tr.add_argument("--nnodes", type=int, required=True)
    tr.add_argument("--nproc-per-node", type=int, required=True)
    tr.add_argument("--rdzv-endpoint", required=True, metavar="HOST:PORT")
    tr.add_argument("--max-restarts", type=int, default=0)
    tr.add_argument("--run", action="store_true", help="execute it here instead of printing it")
    sl = sub.add_parser("slurm", help="write an sbatch script (srun, one task per GPU, requeue)")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, required=True)
    sl.add_argument("--time", required=True, metavar="HH:MM:SS")
    sl.add_argument("--partition")
    sl.add_argument("--output", default="distrain.sbatch")
    k8 = sub.add_parser("k8s", help="write a Kubeflow PyTorchJob manifest")
    k8.add_argument("--nodes", type=int, required=True)
    k8.add_argument("--gpus-per-node", type=int, required=True)
    k8.add_argument("--image", required=True)
    k8.add_argument("--output", default="pytorchjob.yaml")
    sky = sub.add_parser("sky", help="write a SkyPilot task (AWS, GCP, Azure, Kubernetes, ...); --run launches it")
    sky.add_argument("--nodes", type=int, required=True)
    sky.add_argument("--gpus", required=True, metavar="NAME:COUNT", help="per node, e.g. A100:8 or H100:8")
    sky.add_argument("--cloud", choices=jobscripts_clouds(), help="default: wherever SkyPilot finds the GPUs")
    sky.add_argument("--spot", action="store_true", help="spot instances; a preempted job resumes (--resume auto)")
    sky.add_argument("--bucket", help="a storage bucket mounted at /checkpoints (where a recovered job finds them)")
    sky.add_argument("--name", default="distrain", help="the task and cluster name")
    sky.add_argument("--output", help="the file to write (default: NAME.sky.yaml)")
    sky.add_argument(
        "--run", action="store_true", help="then launch it with `sky launch` (`sky jobs launch` for --spot)"
    )
    return launch


def jobscripts_clouds() -> tuple[str, ...]:
    from distrain.jobscripts import SKY_CLOUDS

    return SKY_CLOUDS


def launch(argv: list[str]) -> int:
    from distrain import jobscripts

    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = launch_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.engine == "torchrun":
        cmd = jobscripts.torchrun_command(
            args.nnodes, args.nproc_per_node, args.rdzv_endpoint, train_args, max_restarts=args.max_restarts
        )
        if args.run:
            import subprocess

            return subprocess.call([sys.executable, "-m", "torch.distributed.run", *cmd[1:]])
        print(shlex.join(cmd))
        return 0
    if args.engine == "sky":
        return launch_sky(args, train_args)
    if args.engine == "slurm":
        text = jobscripts.sbatch_script(args.nodes, args.gpus_per_node, args.time, train_args, args.partition)
    else:
        text = jobscripts.pytorchjob_manifest(args.nodes, args.gpus_per_node, args.image, train_args)
    Path(args.output).write_text(text)
    print(f"distrain: wrote {args.output}")
    return 0


def launch_sky(args, train_args: list[str]) -> int:
    from distrain import jobscripts

    try:
        text = jobscripts.skypilot_task(
            args.nodes, args.gpus, train_args, cloud=args.cloud, spot=args.spot, bucket=args.bucket, name=args.name
        )
    except ValueError as e:
        print(f"distrain: error: {e}", file=sys.stderr)
        return 2
    output = args.output or f"{args.name}.sky.yaml"
    Path(output).write_text(text)
    command = jobscripts.sky_launch_command(output, args.spot, args.name)
    if args.spot and not args.bucket:
        print(
            "distrain: warning: --spot without --bucket: a job recovered on new machines starts without the "
            "checkpoints of the preempted one",
            file=sys.stderr,
        )
    if not args.run:
        print(f"distrain: wrote {output}; launch it with: {shlex.join(command)}")
        return 0
    import shutil
    import subprocess

    if shutil.which("sky") is None:
        print("distrain: error: the `sky` command is not installed: pip install 'distrain[sky]'", file=sys.stderr)
        return 2
    print(f"distrain: wrote {output}; running: {shlex.join(command)}", flush=True)
    return subprocess.call(command)


def doctor_parser() -> argparse.ArgumentParser:
    doctor = argparse.ArgumentParser(
        prog="distrain doctor",
        description="versions, devices, launcher variables; "
        "with --devices N (or under a launcher) an all-reduce check and bandwidth test",
    )
    doctor.add_argument("--devices", type=int, help="start N local ranks for the check")
    doctor.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=1)
    doctor.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every rank")
    return doctor


def plot_parser() -> argparse.ArgumentParser:
    plot = argparse.ArgumentParser(
        prog="distrain plot",
        description="loss, learning rate, throughput, MFU and memory against the step, from each run's "
        "metrics.jsonl; several runs overlay",
    )
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    plot.add_argument("-o", "--output", default="distrain-plot.png", help="the PNG to write")
    plot.add_argument("--labels", nargs="+", help="one name per run for the legend (default: the directory names)")
    plot.add_argument("--title")
    return plot


COMMANDS = {
    "train": train_parser,
    "plan": plan_parser,
    "convert": convert_parser,
    "launch": launch_parser,
    "doctor": doctor_parser,
    "plot": plot_parser,
    "bench": lambda: __import__("distrain.bench", fromlist=["bench_parser"]).bench_parser(),
}
USAGE = (
    "usage: distrain {train,plan,convert,launch,doctor,plot,bench} [options]   "
    "(`distrain COMMAND -h` for help; no command means train)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    if command == "launch":  # its own grammar: `-- <train args>` passes through untouched
        return launch(argv)
    # intermixed: `key=value` overrides may stand between and after the options
    args = COMMANDS[command]().parse_intermixed_args(argv)
    if command == "doctor":
        from distrain import doctor

        return doctor.run(args.devices, args.num_nodes, args.timeout)
    if command == "plot":
        return plot(args.runs, args.output, args.labels, args.title)
    if command == "bench":
        from distrain import bench

        return bench.main(args)
    if command == "convert":
        try:
            return convert(args.checkpoint, args.output, args.to)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"distrain: error: {e}", file=sys.stderr)
            return 2
    try:
        flags = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
        if command == "plan":  # `all` (every option) is the plan's own value, not a strategy to configure
            flags.pop("distributed.strategy", None)
        config = build_config(args.config, flags, args.overrides)
    except ConfigError as e:
        print(f"distrain: error: {e}", file=sys.stderr)
        return 2
    if command == "plan":
        from distrain.planner.cli import plan_command

        try:
            return plan_command(config, args.strategy, args.json)
        except (ConfigError, FileNotFoundError, ValueError) as e:
            print(f"distrain: error: {e}", file=sys.stderr)
            return 2
    if args.print_config:
        import yaml

        for note in config.mapped_keys:  # keys written the spec's way, and where they went
            print(f"# {note}")
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    try:
        return train(config, resume=args.resume)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        if not getattr(e, "distrain_reported", False):  # the launcher already named the rank and the log
            print(f"distrain: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # inside a rank: one line here, the traceback in that rank's log
        if not getattr(e, "distrain_reported", False):
            rank = os.environ.get("RANK", "0")
            log = Path(config.output_dir) / "logs" / f"rank_{rank}.log"
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"distrain: error on rank {rank}: {type(e).__name__}: {first} (traceback: {log})", file=sys.stderr)
        return 1


def train(config: RunConfig, resume: str | None = None) -> int:
    from torch.utils.data import DataLoader

    from distrain import launch
    from distrain.callbacks import ModelCheckpoint
    from distrain.data import byte_datasets
    from distrain.loggers import JSONLLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from distrain.models.gpt import GPT_SIZES
    from distrain.models.lm import GPTLanguageModel
    from distrain.strategies import registry
    from distrain.trainer import Trainer

    t, d, c, lg, data = config.training, config.distributed, config.checkpointing, config.logging, config.data
    if d.pipeline_microbatches:  # a pipeline's micro-batches are the accumulation micro-batches (validated to agree)
        t.gradient_accumulation_steps = d.pipeline_microbatches
    hf_job = user_module = None
    if t.module is not None:  # a Module of the user's own: imported (and built) before any rank starts
        from distrain.runtime import seed_everything

        seed_everything(t.seed)  # its layers built in __init__ draw from training.seed, as a script's would
        user_module = load_user_module(t.module, t.module_args)
    elif t.model_name not in GPT_SIZES:  # a Hugging Face hub name or local directory
        from distrain.hf.job import HFJob

        hf_job = HFJob(config)  # reads the model's config only: a bad name fails before any rank starts
    out = Path(config.output_dir)
    ckpt_dir = Path(c.checkpoint_dir) if c.checkpoint_dir else out / "checkpoints"
    # --resume auto (requeued/restarted jobs): the newest intact checkpoint if there is one, else a fresh start
    if resume == "last" and not (ckpt_dir / "last").exists():
        raise FileNotFoundError(f"--resume last: no checkpoint in {ckpt_dir} to resume from")

    loggers = [JSONLLogger(str(out))]
    if lg.use_tensorboard:
        loggers.append(TensorBoardLogger(str(out)))
    if lg.use_wandb:
        loggers.append(WandbLogger(project=lg.wandb_project, name=out.name, save_dir=str(out), mode=lg.wandb_mode))
    if lg.use_mlflow:
        # no URI anywhere: a SQLite store in the run directory (MLflow 3 refuses its old ./mlruns default)
        uri = lg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out.resolve()}/mlflow.db"
        loggers.append(MLFlowLogger(experiment_name=lg.mlflow_experiment, tracking_uri=uri, run_name=out.name))
    from distrain.models.gpt import Block

    # the repeated layer: FSDP unit, checkpointed
    if user_module is not None:
        from distrain.strategies.fsdp import _default_block_classes

        blocks = _default_block_classes(user_module) or set()
    else:
        blocks = hf_job.block_classes if hf_job else {Block}

    # the memory plan: strategy auto, activation_checkpointing auto, a warning when it will not fit
    from distrain.planner.cli import Decision, decide_for_training, print_messages

    # a Module of the user's own is planned by Trainer.fit (strategy auto), from the module itself
    decision = decide_for_training(config, hf_job) if user_module is None else Decision(strategy=d.strategy)
    print_messages(decision)
    if decision.stop:
        return 2
    strategy = decision.strategy
    every_n = config.fsdp.activation_checkpointing.every_n_layers
    # the spec's fsdp/top-level section is an alias; a DeepSpeed JSON that configures how activations are
    # checkpointed (partitioned, on the CPU) asks for it too
    use_ac = (
        t.activation_checkpointing is True
        or config.fsdp.activation_checkpointing.enabled
        or _deepspeed_asks_for_ac(config)
    )
    strategy_options = {
        "activation_checkpointing_policy": {"classes": blocks, "every_n": every_n} if use_ac else None,
        **registry.options_from_config(strategy, config, blocks),
        **decision.strategy_options(blocks),
    }
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
        val_check_interval=t.val_check_interval,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=lg.log_every_n_steps,
        default_root_dir=str(out),
        callbacks=[
            ModelCheckpoint(
                dirpath=str(ckpt_dir),
                every_n_train_steps=c.save_every_n_steps,
                save_top_k=c.keep_last_n,
                save_last=True,
            )
        ],
        logger=loggers,
        seed=t.seed,
        enable_progress_bar=lg.progress_bar,
        enable_plots=lg.plot_summary,
        histogram_every_n_steps=lg.histogram_every_n_steps,
        compile=t.compile,
        process_group_backend=d.backend,
        timeout=d.timeout_seconds,
        collective_timeout=d.collective_timeout_seconds,
        on_nonfinite=t.on_nonfinite,
        **strategy_options,
    )
    trainer.run_config = config.to_dict()
    if trainer.is_global_zero and not os.environ.get("DISTRAIN_LAUNCHED_CHILD"):
        launch.tee_output(trainer.runtime.log_dir, 0)  # the run's header belongs in rank 0's log too
    _check_pipeline_blocks(trainer, config, hf_job, user_module)

    if hf_job is not None:
        hf_job.fit(trainer, resume)
        return _finish(trainer, out)
    if user_module is not None:
        if trainer.is_global_zero:
            out.mkdir(parents=True, exist_ok=True)
            save_config(config, out / "config.yaml")
            print(
                f"distrain: {t.module} on {trainer.world_size} process(es), strategy {d.strategy} → {out}", flush=True
            )
        trainer.fit(user_module, datamodule=user_module, ckpt_path=resume)
        return _finish(trainer, out)
    train_set, val_set = byte_datasets(data.dataset, data.seq_len, data.max_bytes, data.val_fraction)
    global_batch = t.batch_size_per_gpu * trainer.data_parallel_size * t.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_set) / global_batch)
    total_steps = t.max_steps if t.max_steps > 0 else steps_per_epoch * t.num_epochs
    module = GPTLanguageModel(
        model_name=t.model_name,
        block_size=data.seq_len,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        warmup_steps=int(t.warmup_ratio * total_steps),
        total_steps=total_steps,
        lr_schedule=t.lr_schedule,
    )
    loader = lambda ds, shuffle: DataLoader(  # noqa: E731
        ds, batch_size=t.batch_size_per_gpu, shuffle=shuffle, num_workers=data.num_workers, drop_last=shuffle
    )
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        save_config(config, out / "config.yaml")
        print(
            f"distrain: {t.model_name} on {trainer.world_size} process(es), "
            f"strategy {strategy}{trainer.strategy.layout_note}, "
            f"global batch {global_batch} × {data.seq_len} bytes, {total_steps} steps → {out}",
            flush=True,
        )
    trainer.fit(module, loader(train_set, True), loader(val_set, False), ckpt_path=resume)
    return _finish(trainer, out)


def _check_pipeline_blocks(trainer, config: RunConfig, hf_job, user_module) -> None:
    """More pipeline stages than the model has blocks: refused before any rank starts (a Module of
    your own is checked in the ranks, once it is built)."""
    from distrain.models.gpt import GPT_SIZES

    layout = getattr(trainer.strategy, "layout", None)
    if layout is None or layout.num_stages < 2 or user_module is not None:
        return
    if hf_job is not None:
        blocks = getattr(hf_job.hf_config, "num_hidden_layers", None)
    else:
        blocks = GPT_SIZES[config.training.model_name]["n_layer"]
    if blocks is not None and layout.num_stages > blocks:
        raise ConfigError(
            f"{layout.num_stages} pipeline stages (distributed.pipeline_stages"
            f"{' × pipeline_stages_per_rank' if layout.stages_per_rank > 1 else ''}) but "
            f"{config.training.model_name} has {blocks} blocks: each stage needs at least one"
        )


def _deepspeed_asks_for_ac(config: RunConfig) -> bool:
    if config.deepspeed.config is None:
        return False
    from distrain.strategies.deepspeed_config import read_user_config

    section = (read_user_config(config.deepspeed.config)[0] or {}).get("activation_checkpointing") or {}
    return any(section.get(k) for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"))


def load_user_module(spec: str, args: dict):
    """``package.module:Class`` or ``path/to/file.py:Class`` → an instance built with ``args``."""
    import importlib
    import importlib.util

    from distrain.module import Module

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"training.module {spec!r}: write it as package.module:Class or path/to/file.py:Class")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise ConfigError(f"training.module {spec!r}: no such file {where}")
            loader_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            source = importlib.util.module_from_spec(loader_spec)
            sys.modules[loader_spec.name] = source  # spawned ranks unpickle the module's class by this name
            loader_spec.loader.exec_module(source)
            folder = str(Path(where).resolve().parent)
            if folder not in sys.path:  # spawned ranks (ddp_spawn) start with our sys.path and import it by name
                sys.path.append(folder)
        else:
            source = importlib.import_module(where)
    except ImportError as e:
        raise ConfigError(f"training.module {spec!r}: cannot import {where} ({e})") from None
    cls = getattr(source, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Module)):
        raise ConfigError(f"training.module {spec!r}: {where} has no distrain.Module subclass named {name!r}")
    if not callable(getattr(cls, "train_dataloader", None)):
        raise ConfigError(
            f"training.module {spec!r}: {name} must define train_dataloader() (the CLI has no data "
            "for a module of your own)"
        )
    try:
        return cls(**args)
    except TypeError as e:
        raise ConfigError(f"training.module_args {args!r} do not fit {name}: {e}") from None


def _finish(trainer, out: Path) -> int:
    marker = out / "PREEMPTED"  # tells a job script that `--resume auto` has more to do
    if trainer.is_global_zero:
        marker.write_text(f"{trainer.preempted}\n") if trainer.preempted else marker.unlink(missing_ok=True)
    if trainer.is_global_zero:
        cb = trainer.checkpoint_callback
        print(f"distrain: done at step {trainer.global_step}; last checkpoint: {cb.last_model_path}", flush=True)
    return 0


def plot(runs: list[str], output: str, labels: list[str] | None, title: str | None) -> int:
    from distrain.plotting import plot_runs

    if labels and len(labels) != len(runs):
        print(f"distrain: error: {len(labels)} --labels for {len(runs)} runs", file=sys.stderr)
        return 2
    try:
        path = plot_runs(runs, output, labels, title)
    except (FileNotFoundError, ValueError) as e:
        print(f"distrain: error: {e}", file=sys.stderr)
        return 2
    print(f"distrain: wrote {path}")
    return 0


def convert(checkpoint: str, output: str, to: str) -> int:
    """Full model weights from any distrain checkpoint (DDP's or FSDP's shards), no process group."""
    from distrain.checkpoint.state import read_model_weights

    if to == "hf":  # a directory: config + safetensors + tokenizer, from the checkpoint's own hyperparameters
        from distrain.hf.export import export_checkpoint

        print(f"distrain: wrote the Hugging Face model directory {export_checkpoint(checkpoint, output)}")
        return 0
    # clone: tied weights share storage, which safetensors refuses; contiguous for both formats
    weights = {k: v.detach().contiguous().clone() for k, v in read_model_weights(checkpoint).items()}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    if to == "torch":
        import torch

        torch.save(weights, output)
    else:
        from safetensors.torch import save_file

        save_file(weights, output)
    print(f"distrain: wrote {len(weights)} tensors ({sum(v.numel() for v in weights.values()):,} values) to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
