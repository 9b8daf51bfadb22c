"""``distrain train``: the built-in job (or your config) on any strategy, from the command line.

The front door: ``distrain --help``, every command's ``--help`` and ``distrain config`` import no torch (the
commands import what they need inside their functions); every option is spelled out in full (no prefix matching),
and an option that is refused says, in one line, which one was meant or which ``key=value`` it names.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from distrain import jobscripts
from distrain.config import ConfigError, build_config, config_keys, redacted

if TYPE_CHECKING:
    from distrain.config import RunConfig

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


class _Formatter(argparse.HelpFormatter):
    """argparse's, wrapping lines at spaces only: an option (``--model-name``) is never cut at its hyphen."""

    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """Every distrain parser: options spelled out in full (``--max-step 3`` is an error, not ``--max-steps``), and
    an argument it refuses is one line (exit code 2) that names the option probably meant, or the config key the
    option's words name (``--learning-rate 0.1`` → ``training.learning_rate=0.1``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self.also_flags: tuple[str, ...] = ()  # options of the command line around this parser's, for did-you-mean

    def parse_args(self, args=None, namespace=None):
        return self._refuse_unknown(args, namespace, self.parse_known_args)

    def parse_intermixed_args(self, args=None, namespace=None):
        return self._refuse_unknown(args, namespace, self.parse_known_intermixed_args)

    def _refuse_unknown(self, args, namespace, parse):
        argv = list(sys.argv[1:] if args is None else args)
        namespace, extras = parse(argv, namespace)
        if extras:
            parser = _chosen_subparser(self, namespace)
            parser.error(_refusal(parser, extras, argv))
        return namespace

    def error(self, message: str):
        """One line, exit code 2 (argparse's usage is the command's ``--help``)."""
        if "`distrain" not in message:
            message += f" (`{self.prog} --help` lists the options)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def _chosen_subparser(parser: argparse.ArgumentParser, namespace) -> argparse.ArgumentParser:
    """The subcommand's parser that took the arguments (``distrain launch slurm``'s), else ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(namespace, action.dest, None) in action.choices:
            return _chosen_subparser(action.choices[getattr(namespace, action.dest)], namespace)
    return parser


def _refusal(parser: argparse.ArgumentParser, extras: list[str], argv: list[str]) -> str:
    """What to say about arguments ``parser`` does not take: for each option, the one probably meant or the config
    key its words name."""
    flags = [e for e in extras if e.startswith("-") and len(e) > 1 and not re.match(r"-\d", e)]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    return "; ".join(_flag_hint(parser, flag, argv) for flag in flags)


def _flag_hint(parser: argparse.ArgumentParser, flag: str, argv: list[str]) -> str:
    name, eq, value = flag.partition("=")
    if not eq:  # the value the user gave it, if one follows
        after = argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None
        value = after if after is not None and not after.startswith("-") else "VALUE"
    known = [*parser._option_string_actions, *getattr(parser, "also_flags", ())]
    flag_of_key = {key: option for dest, key in FLAG_KEYS.items() if (option := _option_of(parser, dest))}
    takes_keys = any(action.dest == "overrides" for action in parser._actions)
    keys = [k.key for k in config_keys()] if takes_keys else []
    words = name.lstrip("-").replace("-", "_").lower()
    named = [k for k in keys if words in (k, k.replace(".", "_"), k.rpartition(".")[2])]
    if named:  # --learning-rate: a config key, not an option
        forms = " or ".join(
            f"{k}={value}" + (f" (or {flag_of_key[k]} {value})" if k in flag_of_key else "") for k in named
        )
        return f"unrecognized option {name}: it is a config key, written {forms} (`distrain config` lists every key)"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    if close:
        action = parser._option_string_actions.get(close[0])
        sets = f", which sets {FLAG_KEYS[action.dest]}" if takes_keys and action and action.dest in FLAG_KEYS else ""
        return f"unrecognized option {name}; did you mean {close[0]}{sets}?"
    leaves = {k.rpartition(".")[2]: k for k in keys}
    near = difflib.get_close_matches(words, leaves, n=1, cutoff=0.75)
    if near:
        return f"unrecognized option {name}; did you mean the config key {leaves[near[0]]}={value}?"
    where = "; `distrain config` lists the key=value config keys" if takes_keys else ""
    return f"unrecognized option {name} (`{parser.prog} --help` lists the options{where})"


def _option_of(parser: argparse.ArgumentParser, dest: str) -> str | None:
    """The option (its first spelling) that sets ``dest``, if ``parser`` has one."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return None


class _HelpConfig(argparse.Action):
    """``--help-config``: ``distrain config``'s listing, then exit (as ``--help``)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(config_listing(), end="")
        parser.exit()


def _flag_values(args: argparse.Namespace) -> dict:
    """The config keys the command line's flags set (``FLAG_KEYS``), for those given."""
    return {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}


def _devices(value: str):
    return value if value == "auto" else int(value)


def _counts(one):
    """One value, or a comma-separated list of them (``distrain plan``'s what-if shapes)."""

    def parse(value: str):
        items = [one(v) for v in value.split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a number or a list like 1,2,4: {value!r}")
        return items[0] if len(items) == 1 else items

    return parse


def train_parser(
    prog: str = "distrain train",
    description: str = "train the built-in GPT job (or your config's)",
    writes_run: bool = True,
) -> argparse.ArgumentParser:
    """``distrain train``'s options (``plan`` and ``verify`` take them too: the same run; they write none)."""
    keys = ", ".join(f"--{flag.replace('_', '-')} ({key})" for flag, key in FLAG_KEYS.items())
    train = Parser(
        prog=prog,
        description=description,
        epilog=f"key=value: any config key, e.g. training.learning_rate=3e-4 (`distrain config` or --help-config "
        f"lists every key, with its type, default and range). The options set these keys: {keys}.",
    )
    train.add_argument("--config", help="YAML or JSON config file")
    train.add_argument(
        "--strategy", "--mode", dest="strategy", help="auto, single, ddp, ddp_spawn, ddp_fork, fsdp, ..."
    )
    train.add_argument("--devices", type=_devices, help="processes per node (an integer, or auto)")
    train.add_argument("--accelerator", help="auto, cpu or gpu")
    train.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int)
    train.add_argument("--precision", help="32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true or fp8")
    train.add_argument("--max-steps", "--max_steps", dest="max_steps", type=int)
    train.add_argument(
        "--output-dir",
        "--output_dir",
        dest="output_dir",
        help="where the run writes (default runs/distrain); a folder that holds an earlier run is refused unless "
        "--resume or --overwrite",
    )
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
    if writes_run:
        train.add_argument(
            "--overwrite",
            action="store_true",
            help="remove the earlier run's files in --output-dir first (named on the console; nothing else there)",
        )
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument(
        "--help-config", action=_HelpConfig, help="list every key=value config key (as `distrain config`) and exit"
    )
    train.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. training.learning_rate=3e-4")
    return train


def plan_parser() -> argparse.ArgumentParser:
    plan = train_parser(
        "distrain plan",
        "per-rank memory of every strategy (DDP, FSDP, ZeRO; with and without activation checkpointing and "
        "offload) for this run, the largest micro-batch that fits, and the recommendation; nothing is allocated",
        writes_run=False,
    )
    plan.set_defaults(strategy="all")
    plan.add_argument("--json", action="store_true", help="the rows as JSON")
    for action in plan._actions:  # what-if: a list of node counts or of devices per node, one plan per shape
        if action.dest == "num_nodes":
            action.type, action.help = _counts(int), "nodes; a list (1,2,4,8) plans each shape (what-if)"
        elif action.dest == "devices":
            action.type, action.help = _counts(_devices), "devices per node; a list (2,4,8) plans each (what-if)"
    plan.add_argument("--tokens", type=float, help="what-if: the token budget to time and price (1e9)")
    plan.add_argument("--gpu-hour-price", type=float, help="what-if: price of one GPU-hour (cost column)")
    plan.add_argument("--gpu-type", help="the GPU to time for (H100, A100, ...); default: this machine's, else H100")
    plan.add_argument("--bandwidth", type=float, metavar="GB/s", help="all-reduce bus bandwidth within a node")
    plan.add_argument("--inter-node-bandwidth", type=float, metavar="GB/s", help="bus bandwidth between nodes")
    plan.add_argument("--no-time", action="store_true", help="memory only: no step time (measures nothing)")
    plan.add_argument(
        "--measure",
        action="store_true",
        help="measure this machine's rates again (a plan takes the ones measured once and kept in "
        "~/.cache/distrain/rates/)",
    )
    return plan


def verify_parser() -> argparse.ArgumentParser:
    verify = train_parser(
        "distrain verify",
        "a few steps of this exact run (strategy, layout, precision, accumulation, checkpointing, compile) against "
        "one process on the same global batch: losses, gradients and weights per module, data, replicas, the "
        "optimizer's coverage, a checkpoint round trip, the dtypes used; exit code 1 when anything diverges",
        writes_run=False,
    )
    verify.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    verify.add_argument("--json", action="store_true", help="the report as JSON")
    verify.add_argument(
        "--shrink",
        action="store_true",
        help="the model's family, 2 blocks and 64 wide: verify a layout too big for here",
    )
    return verify


def convert_parser() -> argparse.ArgumentParser:
    convert = Parser(prog="distrain convert", description="consolidate a (sharded) checkpoint into one weights file")
    convert.add_argument("checkpoint", help="a checkpoint directory (or its `last` link)")
    convert.add_argument("output", help="the file to write (a directory for --to hf)")
    convert.add_argument(
        "--to",
        choices=("torch", "safetensors", "hf"),
        default="safetensors",
        help="hf: a from_pretrained directory (config, safetensors, tokenizer) of a Hugging Face model",
    )
    convert.add_argument(
        "--tokenizer",
        help="--to hf: the tokenizer to include (a Hub id or a directory); default: the checkpoint's, if a Hub id",
    )
    return convert


def launch_parser() -> argparse.ArgumentParser:
    launch = Parser(
        prog="distrain launch",
        description="job files for torchrun, SLURM and Kubernetes; arguments after -- go to `distrain train`",
    )
    sub = launch.add_subparsers(dest="engine", required=True)
    tr = sub.add_parser("torchrun", help="print (or --run) the per-node torchrun command, c10d rendezvous")
    tr.add_argument("--nnodes", required=True, metavar="N|MIN:MAX", help="MIN:MAX: elastic (the global batch is kept)")
    tr.add_argument("--nproc-per-node", type=int, required=True)
    tr.add_argument("--rdzv-endpoint", required=True, metavar="HOST:PORT")
    tr.add_argument("--max-restarts", type=int, default=0)
    tr.add_argument("--run", action="store_true", help="execute it here instead of printing it")
    sl = sub.add_parser("slurm", help="write an sbatch script (srun, one task per GPU, requeue)")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, required=True, help="0: a CPU partition (no GPU request)")
    sl.add_argument(
        "--ranks-per-node", type=int, help="with --gpus-per-node 0: ranks per node, each its share of the CPUs (1)"
    )
    sl.add_argument("--time", required=True, type=_slurm_time, metavar="HH:MM:SS", help="e.g. 90, 1:30:00, 2-00:00:00")
    sl.add_argument("--partition")
    sl.add_argument("--min-nodes", type=int, help="elastic: start (and requeue) on MIN to --nodes nodes")
    sl.add_argument("--output", default="distrain.sbatch")
    sl.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    k8 = sub.add_parser("k8s", help="write a Kubeflow PyTorchJob manifest")
    k8.add_argument("--nodes", type=int, required=True)
    k8.add_argument("--gpus-per-node", type=int, required=True)
    k8.add_argument("--image", required=True)
    k8.add_argument("--min-nodes", type=int, help="elastic: the PyTorchJob runs MIN to --nodes pods (torchrun c10d)")
    k8.add_argument("--output", default="pytorchjob.yaml")
    k8.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    sky = sub.add_parser("sky", help="write a SkyPilot task (AWS, GCP, Azure, Kubernetes, ...); --run launches it")
    sky.add_argument("--nodes", type=int, required=True)
    sky.add_argument("--gpus", required=True, metavar="NAME:COUNT", help="per node, e.g. A100:8 or H100:8")
    sky.add_argument("--cloud", choices=jobscripts.SKY_CLOUDS, help="default: wherever SkyPilot finds the GPUs")
    sky.add_argument("--spot", action="store_true", help="spot instances; a preempted job resumes (--resume auto)")
    sky.add_argument("--bucket", help="a storage bucket mounted at /checkpoints (where a recovered job finds them)")
    sky.add_argument("--name", default="distrain", help="the task and cluster name")
    sky.add_argument("--output", help="the file to write (default: NAME.sky.yaml)")
    sky.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    sky.add_argument(
        "--run", action="store_true", help="then launch it with `sky launch` (`sky jobs launch` for --spot)"
    )
    return launch


def _slurm_time(value: str) -> str:
    try:
        return jobscripts.check_slurm_time(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def launch(argv: list[str]) -> int:
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = launch_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.engine == "sky":
        args.output = args.output or f"{args.name}.sky.yaml"
    if args.engine != "torchrun" and Path(args.output).exists() and not args.force:
        return _error(f"{args.output} exists; --force overwrites it, or --output names another file")
    try:
        _check_job(args, train_args)
    except (ConfigError, ValueError) as e:
        return _error(f"{e}; no job file written")
    if args.engine == "torchrun":
        cmd = jobscripts.torchrun_command(
            args.nnodes, args.nproc_per_node, args.rdzv_endpoint, train_args, max_restarts=args.max_restarts
        )
        if args.run:
            import subprocess

            return subprocess.call([sys.executable, *cmd[1:]])  # the agent in this interpreter
        print(shlex.join(cmd))
        return 0
    if args.engine == "sky":
        return launch_sky(args, train_args)
    if args.engine == "slurm":
        text = jobscripts.sbatch_script(
            args.nodes,
            args.gpus_per_node,
            args.time,
            train_args,
            args.partition,
            min_nodes=args.min_nodes,
            ranks_per_node=args.ranks_per_node,
        )
        refused = jobscripts.refused_by_sbatch(text, Path(args.output).resolve().parent)
        if refused:
            return _error(f"sbatch --test-only refused the job: {refused}; no job file written")
    else:
        text = jobscripts.pytorchjob_manifest(
            args.nodes, args.gpus_per_node, args.image, train_args, min_nodes=args.min_nodes
        )
    Path(args.output).write_text(text)
    print(f"distrain: wrote {args.output}")
    return 0


def _check_job(args, train_args: list[str]) -> None:
    """The run a job file will start, resolved and checked here as ``distrain train`` will resolve it on the
    cluster (the launcher's node and device counts included): a wrong key, value or layout is one line now, not
    a failed job after the allocation was granted."""
    from distrain.strategies import registry

    train = train_parser().parse_intermixed_args(train_args)
    if train.config is not None and not Path(train.config).is_file():
        print(f"distrain: warning: {train.config} is not on this machine; the job's config is not checked here")
        return
    flags = _flag_values(train)
    if args.engine == "torchrun":
        nodes, devices = int(str(args.nnodes).split(":")[-1]), args.nproc_per_node
    else:
        nodes, devices = args.nodes, jobscripts.parse_gpus(args.gpus)[1] if args.engine == "sky" else args.gpus_per_node
    if args.engine == "slurm":  # on a CPU partition, its ranks per node
        devices = jobscripts.slurm_ranks_per_node(args.gpus_per_node, args.ranks_per_node)
    flags.update({"distributed.num_nodes": nodes, "distributed.devices": devices})
    config = build_config(train.config, flags, train.overrides)
    # srun, or torchrun, starts every rank of these jobs; a PyTorchJob's pod runs distrain, which starts its own
    starter = "torchrun" if args.engine in ("torchrun", "sky") or getattr(args, "min_nodes", None) else None
    starter = "srun" if args.engine == "slurm" else starter
    strategy = config.distributed.strategy
    if starter and registry.starts_replica_groups(strategy):
        raise ConfigError(
            f"strategy {strategy} starts its replica groups itself (distrain train on one machine, or one torchrun "
            f"per replica group that you start), and the ranks of this job are started by {starter}"
        )


def launch_sky(args, train_args: list[str]) -> int:
    try:
        text = jobscripts.skypilot_task(
            args.nodes, args.gpus, train_args, cloud=args.cloud, spot=args.spot, bucket=args.bucket, name=args.name
        )
    except ValueError as e:
        return _error(e)
    output = args.output
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
        return _error("the `sky` command is not installed: pip install 'distrain[sky]'")
    print(f"distrain: wrote {output}; running: {shlex.join(command)}", flush=True)
    return subprocess.call(command)


def doctor_parser() -> argparse.ArgumentParser:
    doctor = Parser(
        prog="distrain doctor",
        description="versions, devices, launcher variables; "
        "with --devices N (or under a launcher) an all-reduce check and bandwidth test",
    )
    doctor.add_argument("--devices", type=int, help="start N local ranks for the check")
    doctor.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=1)
    doctor.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every rank")
    return doctor


def plot_parser() -> argparse.ArgumentParser:
    plot = Parser(
        prog="distrain plot",
        description="loss, learning rate, throughput, MFU and memory against the step, from each run's "
        "metrics.jsonl; several runs overlay",
    )
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    plot.add_argument("-o", "--output", default="distrain-plot.png", help="the PNG to write")
    plot.add_argument("--labels", nargs="+", help="one name per run for the legend (default: the directory names)")
    plot.add_argument("--title")
    return plot


def bench_parser() -> Parser:
    """``distrain bench``'s options (distrain/bench.py's; that module imports torch)."""
    from distrain import bench

    parser = bench.bench_parser()
    return Parser(prog=parser.prog, description=parser.description, parents=[parser], add_help=False)


def config_parser() -> Parser:
    config = Parser(
        prog="distrain config",
        description="every config key: its type, default, range and what it means. Set one as key=value after a "
        "command's options (distrain train training.learning_rate=3e-4), or in a --config file's section",
    )
    config.add_argument("sections", nargs="*", metavar="SECTION", help="only these sections (training, fsdp, ...)")
    return config


def config_listing(sections: list[str] | None = None) -> str:
    """One line per key, ``section.key  type  default  — what it means``, read from the config's dataclasses
    (``config.config_keys``): a key added there is listed here."""
    parser = train_parser()
    flags = {key: _option_of(parser, dest) for dest, key in FLAG_KEYS.items()}
    keys = [k for k in config_keys() if not sections or any(k.key == s or k.key.startswith(f"{s}.") for s in sections)]
    rows = []
    for k in keys:
        notes = [k.summary] if k.summary else []
        if k.bounds is not None:
            notes.append(f"Range: {k.bounds.describe()}.")
        if flags.get(k.key):
            notes.append(f"Option: {flags[k.key]}.")
        rows.append((k.key, k.type, _shown(k.default), " ".join(notes)))
    header = ("# key", "type", "default", "what it means (set one with key=value, or in a --config file)")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    lines = [
        f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  — {d}"
        if d
        else f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}"
        for a, b, c, d in [header, *rows]
    ]
    return "".join(line.rstrip() + "\n" for line in lines)


def _shown(value) -> str:
    """A default as it is written in a config file or after key=."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value)
    return str(value) if value != "" else '""'


def config_command(argv: list[str]) -> int:
    args = config_parser().parse_args(argv)
    keys = [k.key for k in config_keys()]
    known = {".".join(key.split(".")[:n]) for key in keys for n in range(1, key.count(".") + 2)}  # sections, keys
    for section in args.sections:
        if section not in known:
            close = difflib.get_close_matches(section, known, n=1)
            tops = ", ".join(dict.fromkeys(key.split(".")[0] for key in keys if "." in key))
            hint = f"; did you mean {close[0]}?" if close else f" (sections: {tops})"
            print(f"distrain config: error: no config section {section!r}{hint}", file=sys.stderr)
            return 2
    print(config_listing(args.sections), end="")
    return 0


COMMANDS = {
    "train": train_parser,
    "plan": plan_parser,
    "verify": verify_parser,
    "convert": convert_parser,
    "launch": launch_parser,
    "doctor": doctor_parser,
    "plot": plot_parser,
    "bench": bench_parser,
    "config": config_parser,
}
#: one line per command, for ``distrain --help`` (which builds no parser: bench's imports torch)
SUMMARIES = {
    "train": "train the built-in GPT, a Hugging Face model or your own distrain.Module, on any strategy",
    "plan": "memory and step time per rank of every strategy for this run; nothing is allocated",
    "verify": "a few steps of this exact run against one process: losses, gradients, weights, checkpoints",
    "convert": "a (sharded) checkpoint into one weights file, or a Hugging Face model directory",
    "launch": "job files for torchrun, SLURM, Kubernetes and SkyPilot, checked here before they are written",
    "doctor": "versions, devices, launcher variables; with --devices N an all-reduce and bandwidth check",
    "plot": "loss, learning rate, throughput, MFU and memory of runs, overlaid, as a PNG",
    "bench": "tokens/s, step time and MFU of the built-in GPT sizes per strategy",
    "config": "every key=value config key: type, default, range and what it means",
}


def main_help() -> str:
    width = max(map(len, COMMANDS))
    commands = "".join(f"  {name:<{width}}  {SUMMARIES[name]}\n" for name in COMMANDS)
    return (
        "usage: distrain COMMAND [options] [key=value ...]\n\n"
        "Train PyTorch models on 1 process, N processes or N nodes; the strategy is one option.\n\n"
        f"commands:\n{commands}\n"
        "`distrain COMMAND --help` shows a command's options, `distrain config` the key=value config keys,\n"
        "`distrain --version` the version. Options without a command are train's (`distrain --config run.yaml`).\n"
    )


def version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("distrain")
    except PackageNotFoundError:
        from distrain._version import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ConfigError as e:  # any command's (``distrain config`` reading the strategies' sections, too): one line
        return _error(e)
    finally:
        if argv is None:  # the program, not a call from Python: it ends now, without the final garbage collection
            from distrain.cluster import end_fast_at_exit

            end_fast_at_exit()


def _error(message: object) -> int:
    """``distrain: error: MESSAGE`` on stderr, one line; returns 2, the exit code of a refused command."""
    print(f"distrain: error: {message}", file=sys.stderr)
    return 2


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):  # no command: the commands, not a training run
        print(main_help(), end="")
        return 0
    if argv[0] == "--version":
        print(f"distrain {version()}")
        return 0
    explicit = argv[0] in COMMANDS
    if explicit:
        command = argv.pop(0)
    elif argv[0].startswith("-") or "=" in argv[0]:  # options (or key=value) without a command: train's, as ever
        command = "train"
    else:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return _error(f"unknown command {argv[0]!r}{hint} (`distrain --help` lists them)")
    if command in _OWN_GRAMMAR:  # `launch`'s `-- <train args>` pass through untouched
        return _OWN_GRAMMAR[command](argv)
    parser = COMMANDS[command]()
    if command == "train" and not explicit:  # `distrain --verison`: distrain's own options are candidates too
        parser.also_flags = ("--version",)
    # intermixed: `key=value` overrides may stand between and after the options
    return _RUNS[command](parser.parse_intermixed_args(argv))


def _run_convert(args) -> int:
    try:
        return convert(args.checkpoint, args.output, args.to, args.tokenizer)
    except (FileNotFoundError, RuntimeError) as e:
        return _error(e)


def _run_plan(args) -> int:
    shapes = None  # a list of node or device counts: one plan per cluster shape (what-if)
    lists = [flag for flag in ("num_nodes", "devices") if isinstance(getattr(args, flag), list)]
    if len(lists) > 1:
        return _error("give a list to --num-nodes or to --devices, not both")
    if lists:
        shapes = [(lists[0], v) for v in getattr(args, lists[0])]
        setattr(args, lists[0], None)
    flags = _flag_values(args)
    if args.strategy == "all":  # every option: the plan's own value, not a strategy
        flags.pop("distributed.strategy", None)
    config = build_config(args.config, flags, args.overrides)  # a ConfigError: main's one line
    from distrain.planner.cli import TimingArgs, plan_command, what_if_command

    try:
        timing = TimingArgs.from_args(args)
        if shapes:
            return what_if_command(config, shapes, timing, args.json)
        return plan_command(config, args.strategy, args.json, timing)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _error(e)


def _run_train(args) -> int:
    return _run_config(args, lambda config: train(config, resume=args.resume, overwrite=args.overwrite))


def _run_verify(args) -> int:
    from distrain.jobs.run import shrink, verify

    def run(config) -> int:
        if args.shrink:
            shrink(config)
        return verify(config, args.steps, args.json)

    return _run_config(args, run)


def _run_config(args, run) -> int:
    """``run(config)`` of the run's config (``--print-config``: printed instead, the keys written the spec's way
    said first); a failure is one line."""
    config = build_config(args.config, _flag_values(args), args.overrides)  # a ConfigError: main's one line
    if args.print_config:
        import yaml

        print("".join(f"# {note}\n" for note in config.mapped_keys), end="")
        print(yaml.safe_dump(redacted(config.to_dict()), sort_keys=False), end="")
        return 0
    try:
        return run(config)
    except Exception as e:
        return _failed(e, config)


def _failed(e: Exception, config) -> int:
    """A run that failed: one line, the error's traceback in the rank's log when it is not distrain's own."""
    if getattr(e, "distrain_reported", False):  # the launcher already named the rank and the log
        return 1
    if _is_distrain_message(e):  # a problem distrain names itself (a config key, a file): one line
        return _error(e)
    # anything else (torch's, a library's, a bug): its traceback in this rank's log, one line here
    from distrain.launch import rank_log, record_failure

    rank = int(os.environ.get("RANK", "0"))
    log_dir = str(Path(config.output_dir) / "logs")
    if not getattr(e, "distrain_recorded", False):  # raised before the rank's log existed
        record_failure(log_dir, rank, e)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if getattr(e, "distrain_memory_plan", None):  # out of memory: what the plan says, on the same line
        first += f"; {e.distrain_memory_plan}"
    log = rank_log(log_dir, rank)
    print(f"distrain: error on rank {rank}: {type(e).__name__}: {first} (traceback: {log})", file=sys.stderr)
    return 1


#: each command's run, from its parsed arguments; the commands that parse their own arguments
_RUNS = {
    "train": _run_train,
    "plan": _run_plan,
    "verify": _run_verify,
    "convert": _run_convert,
    "doctor": lambda args: importlib.import_module("distrain.doctor").run(args.devices, args.num_nodes, args.timeout),
    "plot": lambda args: plot(args.runs, args.output, args.labels, args.title),
    "bench": lambda args: importlib.import_module("distrain.bench").main(args),
}
_OWN_GRAMMAR = {"launch": launch, "config": config_command}


def _is_distrain_message(error: BaseException) -> bool:
    """distrain's own one-line errors: a ConfigError, a missing file (or one in the way), or a ValueError distrain
    itself raised (argument checks). A ValueError from inside torch or another library is not one: it needs its
    traceback."""
    from distrain.checkpoint import CheckpointError

    if isinstance(error, (ConfigError, FileNotFoundError, FileExistsError, CheckpointError)):
        return True
    if not isinstance(error, ValueError):
        return False
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    package = str(Path(__file__).parent)
    return bool(frames) and frames[-1].filename.startswith(package)


def train(config: RunConfig, resume: str | None = None, overwrite: bool = False) -> int:
    from distrain.jobs import run

    return run(config, resume, overwrite)


def plot(runs: list[str], output: str, labels: list[str] | None, title: str | None) -> int:
    from distrain.plotting import plot_runs

    if labels and len(labels) != len(runs):
        return _error(f"{len(labels)} --labels for {len(runs)} runs")
    try:
        path = plot_runs(runs, output, labels, title)
    except (FileNotFoundError, ValueError) as e:
        return _error(e)
    print(f"distrain: wrote {path}")
    return 0


def convert(checkpoint: str, output: str, to: str, tokenizer: str | None = None) -> int:
    """Full model weights from any distrain checkpoint (DDP's or FSDP's shards), no process group."""
    from distrain.checkpoint import remote as object_storage
    from distrain.checkpoint.state import read_model_weights

    if object_storage.is_url(checkpoint):  # object storage: the committed checkpoint (or `last`'s), downloaded first
        remote, name = object_storage.at(checkpoint)
        name = remote.last_name() if name == "last" else name
        if name is None:
            raise FileNotFoundError(f"no checkpoint at {checkpoint}")
        checkpoint = str(remote.fetch(name))
    if to == "hf":  # a directory: config + safetensors + tokenizer, from the checkpoint's own hyperparameters
        from distrain.hf.export import export_checkpoint

        directory = export_checkpoint(checkpoint, output, tokenizer=tokenizer)
        print(f"distrain: wrote the Hugging Face model directory {directory}")
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
