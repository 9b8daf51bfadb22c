"""Typed run configuration: dataclasses are the single source of truth.

A run's config is built in layers — defaults ← YAML/JSON file ← CLI flags ← ``key=value``
overrides — and validated once, before any process starts. Every error names the key and where
the bad value came from (the file, or "the command line").

The section layout is the one users already write (``training``, ``distributed``,
``checkpointing``, ``logging``) plus ``data`` and ``model`` for the built-in job.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from distrain.run_dir import DEFAULT as DEFAULT_OUTPUT_DIR

#: the precisions distrain runs (``distrain.precision``)
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "fp8")
#: Lightning's older spellings, as Lightning 2.x maps them (integers too: ``precision=16``); it warns for 16 and bf16
PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}
#: Lightning's precisions distrain does not run, and what to use instead
PRECISIONS_NOT_RUN = {
    "transformer-engine": "NVIDIA Transformer Engine's layers; distrain's float8 training is 'fp8' (torchao, "
    "on an H100-class GPU)",
    "transformer-engine-float16": "NVIDIA Transformer Engine's layers in fp16; distrain's float8 training is "
    "'fp8' (torchao, on an H100-class GPU)",
}


def canonical_precision(precision: str | int, key: str = "precision") -> str:
    """``precision`` as distrain names it: Lightning's older spellings mapped as Lightning maps them (``16`` and
    ``"16"`` to ``16-mixed``, ``"bf16"`` to ``bf16-mixed`` with Lightning's warning; ``32`` to ``32-true``). A
    precision distrain does not run is refused in one line naming ``key`` and what to use."""
    name = str(precision) if isinstance(precision, (str, int)) and not isinstance(precision, bool) else None
    if name in PRECISION_ALIASES:
        if name in ("16", "bf16"):
            warnings.warn(
                f"{key}={precision!r} is Lightning's older spelling of {PRECISION_ALIASES[name]!r}: set that instead",
                stacklevel=3,
            )
        name = PRECISION_ALIASES[name]
    if name in PRECISIONS:
        return name
    if name in PRECISIONS_NOT_RUN:
        spelled = "" if name == precision else f" ({name})"
        raise ValueError(f"{key}={precision!r}{spelled} is not run by distrain: {PRECISIONS_NOT_RUN[name]}")
    raise ValueError(
        f"{key} must be {', '.join(PRECISIONS[:-1])} or {PRECISIONS[-1]} (or Lightning's 16, 32, 'bf16'), "
        f"got {precision!r}"
    )


#: checks of the strategies' own keys, each registered by its strategy's file (``registry.register``): config.py
#: knows no strategy
CHECKS: list = []


class ConfigError(ValueError):
    """A configuration problem, phrased so that one line tells the user what to fix."""


class Refusal(ConfigError):
    """A run distrain will not run as asked, found by a check that fires inside the run (a model's forward under a
    layout, a strategy's setup of the model): the planner's simulated step runs that same code before any rank
    starts, and a Refusal it meets stops the launch with this line (``planner/decide.py``), where any other failure
    of the simulation only leaves the run unplanned. ``tests/test_refusals.py`` walks every one."""


# --------------------------------------------------------------------------------------------
# the values a numeric key accepts: declared next to the field (``number(...)``), checked by ``validate``


@dataclass(frozen=True, eq=False)
class Bounds:
    """What a numeric key accepts: a finite number within the range (``gt``/``ge``/``lt``/``le``), or one of
    ``means``, values with a meaning of their own (``-1``: keep all; ``0``: off), which the field's docstring
    explains too. NaN and ±inf are never in range. A value of another type (``auto``, null, ``80GB``) is the
    type check's and the key's own check's business, except a memory ``size``, checked by its bytes."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    means: Mapping[float, str] = field(default_factory=dict)
    size: bool = False

    def in_range(self, value: float) -> bool:
        return (
            math.isfinite(value)
            and (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def allows(self, value: float) -> bool:
        return value in self.means or self.in_range(value)

    def describe(self) -> str:
        """``> 0``, ``in [0, 1)``, ``> 0 or -1 (keep all)``: the range, then the documented values outside it."""
        low = (">", "(", self.gt) if self.gt is not None else (">=", "[", self.ge) if self.ge is not None else None
        high = ("<", ")", self.lt) if self.lt is not None else ("<=", "]", self.le) if self.le is not None else None
        if low and high:
            text = f"in {low[1]}{low[2]:g}, {high[2]:g}{high[1]}"
        elif low or high:
            op, _, end = low or high
            text = f"{op} {end:g}"
        else:
            text = "a finite number"
        extra = [f"{value:g} ({meaning})" for value, meaning in self.means.items() if not self.in_range(value)]
        return " or ".join([text, *extra])

    def check(self, key: str, value: Any) -> None:
        """A ConfigError naming ``key`` and ``value`` unless ``value`` is allowed (a bool is not a number)."""
        number = value
        if self.size and isinstance(value, str):
            from distrain.units import parse_size

            try:
                number = parse_size(value)
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or self.allows(number):
            return
        finite = "" if math.isfinite(number) else "a finite number "
        raise ConfigError(f"{key} must be {finite}{self.describe()}, got {value!r}")


def number(default: Any, **bounds: Any) -> Any:
    """A numeric config field and the values it accepts (``Bounds``): ``validate`` checks every section's."""
    return field(default=default, metadata={"bounds": Bounds(**bounds)})


def bounds_of(f: dataclasses.Field) -> Bounds:
    """A field's declared ``Bounds``; a numeric field that declares none still must be finite."""
    return f.metadata.get("bounds") or Bounds()


def check_numbers(obj: Any, prefix: str = "") -> None:
    """Every numeric key of ``obj`` (a config section, its subsections too) against its ``Bounds``."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_numbers(value, f"{prefix}{f.name}.")
        else:
            bounds_of(f).check(f"{prefix}{f.name}", value)


@dataclass
class TrainingConfig:
    """What to train and how the optimizer steps."""

    model_name: str = "gpt-tiny"
    """A built-in GPT size (``gpt-tiny``, ``gpt-mini``, ``gpt-small``, ``gpt-124m``, ...), or a Hugging Face
    model: a hub name (``org/name``) or a local directory with ``config.json``."""
    task: str | None = None
    """Hugging Face models: ``causal_lm`` or ``sequence_classification``; null → from the model's config."""
    pretrained: bool = True
    """Hugging Face models: load the model's weights (``from_pretrained``); false → fresh ones (``from_config``)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """Hugging Face models: fields of the model's config to override (e.g. ``{num_hidden_layers: 2}``; other
    shapes need ``pretrained: false``). ``distrain verify --shrink`` sets them."""
    trust_remote_code: bool = False
    """Hugging Face models: let a model repository's own Python code run to load its config and tokenizer
    (``trust_remote_code``). Off by default: a repository's code runs with your permissions."""
    num_labels: int | None = number(None, gt=0)
    """sequence_classification: number of classes; null → from the dataset's labels."""
    batch_size_per_gpu: int = number(8, gt=0)
    """Micro-batch size on each rank (the global batch is this × ranks × accumulation)."""
    gradient_accumulation_steps: int = number(1, gt=0)
    learning_rate: float = number(1e-3, gt=0)
    num_epochs: int = number(1, gt=0)
    max_steps: int = number(200, gt=0, means={-1: "run num_epochs epochs"})
    """Optimizer steps to run; -1 means run ``num_epochs`` epochs."""
    warmup_ratio: float = number(0.05, ge=0, lt=1, means={0: "no warmup"})
    """The fraction of the steps over which the learning rate rises from 0; 0: no warmup."""
    lr_schedule: str = "cosine"
    """``cosine``, ``linear`` or ``constant`` decay after the warmup."""
    weight_decay: float = number(0.01, ge=0, means={0: "no weight decay"})
    """AdamW's decoupled weight decay; 0: none."""
    max_grad_norm: float | None = number(1.0, ge=0, means={0: "no clipping, as null"})
    """Clip the global gradient norm to this; null or 0: no clipping."""
    precision: str | int = number("32-true", ge=16, le=64)
    """32-true, 16-mixed (a GPU), bf16-mixed, 16-true, bf16-true, 64-true or fp8 (an H100-class GPU); Lightning's 16,
    32, 64 and bf16 read as Lightning reads them (16-mixed, 32-true, 64-true, bf16-mixed); a number is one of those."""
    seed: int = number(1234, ge=0, means={0: "seed 0, a seed like any other"})
    """A non-negative integer (0 is a seed like any other); Hugging Face datasets refuse negative ones."""
    val_check_interval: int = number(100, ge=0, means={0: "validate at each epoch's end only"})
    """Run validation every this many optimizer steps (and at the end); 0: only at the end of each epoch (and
    of the run)."""
    limit_val_batches: int = number(20, ge=0, means={0: "no validation batches: validation is off"})
    """Validation batches per rank each time validation runs; 0: none (validation is off)."""
    activation_checkpointing: bool | str = False
    """Recompute each transformer block's activations in backward (any strategy). ``auto``: the memory
    planner checkpoints just enough blocks (the first ones) for the run to fit in device memory."""
    activation_checkpointing_mode: str = "full"
    """How a checkpointed block recomputes: ``full`` (its whole forward again), or ``selective`` (per operation, as
    torchtitan's ``selective_ac_option = "op"``: it keeps its matmuls' and attention's outputs but every second
    matmul's, and recomputes the rest). Not with DeepSpeed, whose checkpointing is reentrant."""
    on_nonfinite: str = "stop"
    """A NaN/inf loss or gradient norm: ``stop`` the run at that step (naming step and rank), ``skip`` the
    step on every rank, or ``ignore`` it (no check)."""
    on_anomaly: str | None = None
    """A loss spike (robust z-score above ``anomaly_zscore`` over the last ``anomaly_window`` steps) or a non-finite
    loss: the step is run again to tell bad data from bad hardware, recorded in ``<output_dir>/anomalies.jsonl``,
    then ``stop`` ends the run, ``skip`` drops the step, ``rollback`` trains on from the newest checkpoint without
    its samples. null: off (no per-step loss all-gather)."""
    anomaly_zscore: float = number(6.0, gt=0)
    anomaly_window: int = number(50, gt=0)
    module: str | None = None
    """A ``distrain.Module`` of your own instead of a built-in or Hugging Face model: ``package.module:Class`` or
    ``path/to/file.py:Class``. It brings its data (``train_dataloader()``, optionally ``val_dataloader()``) and
    is built with ``module_args``; ``model_name`` and ``data`` are then unused."""
    module_args: dict[str, Any] = field(default_factory=dict)
    low_precision_norms: bool = False
    """Every RMSNorm and LayerNorm computed in the compute dtype by torch's kernel, keeping only its bf16/fp16 input
    for the backward (``distrain.models.norms``): as torchtitan's fused RMSNorm and llm-foundry's low-precision
    LayerNorm. Saves 4 bytes per token and hidden unit per norm on a GPU (Hugging Face's RMSNorms and autocast's
    norms keep an fp32 copy). Off by default: in bf16 its rounding differs from the model's own norms."""
    n_experts: int = number(0, ge=0, means={0: "a dense MLP in every block"})
    """The built-in GPT: each block's MLP a mixture of this many experts (``distrain.models.moe``), ``top_k`` of them
    per token, for expert parallelism (``distributed.expert_parallel_size``) and its plan. A Hugging Face model's
    experts are its config's (``model_config``). 0: a dense MLP in every block."""
    top_k: int = number(2, gt=0)
    """The built-in GPT with ``n_experts``: the experts each token is routed to."""
    compile: bool = False
    """``torch.compile``: each transformer block under FSDP and DeepSpeed (before sharding; activation
    checkpointing stays outside the compiled region), the whole model under single and DDP. Off by
    default: compiling takes tens of seconds, and on CPU it does not speed up the built-in GPT."""


@dataclass
class DistributedConfig:
    """Where the ranks run and how they talk."""

    strategy: str = "auto"
    accelerator: str = "auto"
    devices: int | str = number("auto", gt=0)
    num_nodes: int = number(1, gt=0)
    backend: str | None = None
    """``gloo`` or ``nccl``; by default nccl on CUDA, gloo on CPU."""
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    timeout_seconds: float = number(1800.0, gt=0)
    """How long process-group init (and checkpoint IO) waits for every rank: nodes come up at different times."""
    collective_timeout_seconds: float = number(300.0, gt=0)
    """Any other collective fails after this long, with an error naming the rank(s) that did not arrive
    and the step and phase where they stopped."""
    comm_hook: str | None = None
    """``fp16_compress``, ``bf16_compress``, ``powersgd`` or ``post_localsgd``."""
    gpu_memory: str | int | None = number(None, gt=0, size=True)
    """Memory per GPU the memory planner plans for (``80GB``); null → this machine's."""
    cpu_memory: str | int | None = number(None, gt=0, size=True)
    """Host memory per node the planner plans for (``1TB``; on a CPU run, the ranks share it); null → this machine's."""
    # model parallelism (strategy model_parallel or pipeline): ranks = pipeline stages × data × tensor parallel
    tensor_parallel_size: int | str = number("auto", gt=0)
    """model_parallel: ranks that split each layer (DTensor; built-in plans for the GPT and Llama-style models);
    ``auto`` → the devices of one node (pipeline: 1)."""
    data_parallel_size: int | str = number("auto", gt=0)
    """model_parallel / pipeline: replicas, FSDP2-sharded over each other; ``auto`` → the ranks that remain."""
    sequence_parallel: bool = True
    """Tensor parallel: also split the norms and the residual stream along the sequence (needs sequence lengths
    divisible by tensor_parallel_size)."""
    expert_parallel_size: int = number(1, gt=0)
    """ddp / fsdp: ranks that split each mixture-of-experts layer's experts, 1/N each; tokens reach their experts by
    all-to-all. It divides the ranks and every layer's expert count. 1: every rank holds every expert."""
    context_parallel_size: int = number(1, gt=0)
    """model_parallel: ranks that split each sequence (long context: each holds 1/N of every sequence's
    activations; Ulysses attention needs the heads divisible by it). They share samples; 1: none."""
    pipeline_stages: int | None = number(None, gt=0)
    """pipeline: pipeline ranks (null → every rank that tensor parallelism leaves); model_parallel: null → 1."""
    pipeline_schedule: str = "1F1B"
    """``1F1B``, ``GPipe`` or ``Interleaved1F1B``."""
    pipeline_microbatches: int | None = number(None, gt=0)
    """The pipeline's micro-batches per optimizer step; they are the accumulation micro-batches, so this sets
    training.gradient_accumulation_steps when that is left at 1 (null → gradient_accumulation_steps)."""
    pipeline_split_points: list | None = None
    """Block indices or names (``gpt.blocks.2``) where stages 2, 3, ... begin; null → balanced by parameter count."""
    pipeline_stages_per_rank: int | None = number(None, gt=0)
    """Interleaved1F1B: model pieces per pipeline rank (null → 2; other schedules: 1)."""
    # per-step fault tolerance (strategy ddp_torchft): replica groups of ``devices`` ranks each
    replica_groups: int = number(2, gt=0)
    """ddp_torchft: replica groups distrain starts on this machine (each a torchrun of ``devices`` ranks)."""
    min_replicas: int = number(1, gt=0)
    """ddp_torchft: the fewest replica groups a step commits with (the lighthouse's quorum floor too)."""
    lighthouse: str | None = None
    """ddp_torchft: the address of a running ``torchft_lighthouse`` (``http://host:29510``); null → distrain starts
    one."""
    max_restarts: int = number(3, ge=0, means={0: "a replica group whose rank dies is not restarted"})
    """ddp_torchft: how often torchrun restarts one replica group whose rank died; 0: never."""
    semi_sync: str | None = None
    """ddp_torchft over slow links: ``local_sgd`` (the groups average their weights) or ``diloco`` (their
    pseudo-gradients, through an outer optimizer) every ``sync_every`` steps instead of their gradients every step;
    torchft's own LocalSGD and DiLoCo. null: every step."""
    sync_every: int = number(8, gt=0)
    """semi_sync: the steps each replica group takes alone between meetings (cross-group traffic falls this-fold)."""
    outer_lr: float = number(0.7, gt=0)
    """semi_sync diloco: the outer optimizer's learning rate (SGD on the averaged pseudo-gradient)."""
    outer_momentum: float = number(0.9, gt=0, lt=1, means={0: "plain SGD: no momentum"})
    """semi_sync diloco: the outer optimizer's Nesterov momentum; 0: plain SGD (no momentum)."""


@dataclass
class CheckpointingConfig:
    save_every_n_steps: int | None = number(100, ge=0, means={0: "as null: no step checkpoints"})
    """Write a checkpoint every this many optimizer steps; null or 0: none by step, one at the end of each
    epoch instead. The end of the run always writes one (``last``)."""
    checkpoint_dir: str | None = None
    """Defaults to ``<output_dir>/checkpoints``."""
    keep_last_n: int = number(2, gt=0, means={-1: "keep every checkpoint"})
    """How many of the newest checkpoints stay on disk (the one ``last`` points to always does); -1: all."""
    async_save: bool = False
    """Write checkpoints in the background (DCP ``async_save``): a save stalls training only while the state is
    copied into host memory; it is committed (atomically, as a synchronous one, and ``last`` moved to it) at the first
    step after every rank's writes finished. Not with DeepSpeed, whose engine writes its own files."""
    export_hf: bool = True
    """Hugging Face models: write a ``from_pretrained`` directory to ``<output_dir>/hf`` when training ends."""


@dataclass
class LoggingConfig:
    log_every_n_steps: int = number(10, gt=0)
    """Log loss, throughput, memory and the host/GPU readings every this many optimizer steps."""
    use_tensorboard: bool = True
    use_wandb: bool = False
    """Weights & Biases (``pip install 'distrain[wandb]'``); rank 0 logs, a resumed run continues the same W&B run."""
    wandb_project: str = "distrain"
    wandb_mode: str | None = None
    """``online``, ``offline`` (written under ``<output_dir>/wandb``, ``wandb sync`` later) or ``disabled``;
    null → W&B's own default (``WANDB_MODE``)."""
    use_mlflow: bool = False
    """MLflow (``pip install 'distrain[mlflow]'``); rank 0 logs, a resumed run continues the same MLflow run."""
    mlflow_tracking_uri: str | None = None
    """e.g. ``sqlite:///mlflow.db``, ``file:./mlruns`` or a server's URL; null → MLflow's default
    (``MLFLOW_TRACKING_URI``)."""
    mlflow_experiment: str = "distrain"
    histogram_every_n_steps: int | None = number(None, gt=0)
    """TensorBoard histograms of every parameter and its gradient every this many steps (null: never).
    Sharded parameters are gathered one at a time, never the whole model on one rank."""
    straggler_threshold: float = number(0.2, gt=0, means={0: "no straggler check"})
    """Name a rank whose own part of the step (data wait + compute) exceeds the other ranks' by more than this
    fraction of the step time over a logging window: on the console and as ``straggler_rank`` in the metrics;
    0: no straggler check."""
    plot_summary: bool = True
    """Draw ``<output_dir>/plots/summary.png`` (loss, lr, throughput, MFU, memory) when training ends."""
    progress_bar: bool = True


@dataclass
class DataConfig:
    dataset: str = "builtin:stdlib"
    """``builtin:stdlib`` (Python's own source, byte level) or a path to a UTF-8 text file. With a Hugging
    Face model: a hub dataset name, or a local file (.txt, .json/.jsonl, .csv, .parquet) or directory."""
    seq_len: int = number(128, gt=0)
    """Bytes per sample of the built-in job (and the default of ``max_length``)."""
    dataset_config: str | None = None
    """Hugging Face datasets: the dataset's configuration name (e.g. ``wikitext-2-raw-v1``)."""
    split: str = "train"
    """Hugging Face datasets: the split to train on."""
    eval_split: str | None = None
    """A split name of ``dataset`` (``validation``, ``test``) or a local file; null → hold out ``val_fraction``
    of the training split."""
    text_column: str = "text"
    label_column: str = "label"
    """sequence_classification: the column of class ids or class names."""
    max_length: int | None = number(None, gt=0)
    """Tokens per sample (truncation; the block size when packing); null → ``seq_len``."""
    padding: str = "longest"
    """``longest`` (pad each batch to its longest sample) or ``max_length``."""
    packing: bool = False
    """causal_lm: concatenate the texts (EOS between them) and cut fixed blocks of ``max_length`` tokens."""
    tokenizer: str | None = None
    """A hub name or local directory; null → the model's own (``training.model_name``)."""
    max_bytes: int = number(4_000_000, gt=0)
    """The built-in job: read at most this many bytes of the corpus (the start of the file)."""
    val_fraction: float = number(0.05, gt=0, lt=1)
    """The fraction held out for validation (when there is no ``eval_split``)."""
    num_workers: int = number(0, ge=0, means={0: "load batches in the training process"})
    """DataLoader worker processes per rank; 0: the batches are loaded in the training process itself."""


@dataclass
class CoreSections:
    """The sections every run has, whatever its strategy: ``training``, ``distributed``, ``checkpointing``,
    ``logging``, ``data`` and ``output_dir``. ``RunConfig`` adds the strategies' own (``sections``)."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    output_dir: str = DEFAULT_OUTPUT_DIR
    """Where the run writes its config, metrics, TensorBoard events, checkpoints, plot and logs. A folder that holds
    an earlier run is refused unless --resume (go on with it) or --overwrite (remove its files)."""

    def to_dict(self) -> dict:
        """Every section and its fields as nested plain dicts (``dataclasses.asdict``)."""
        return dataclasses.asdict(self)


#: the entry point group in which a package declares a config section of its own, ``name = "module:Dataclass"``:
#: distrain's strategies declare theirs there (``pyproject.toml``) as a plug-in does, so config.py knows no strategy
SECTION_GROUP = "distrain.config"
_sections: dict[str, type] | None = None
_run_config: type | None = None


def sections() -> dict[str, type]:
    """The config sections the installed packages declare (``SECTION_GROUP``), name → dataclass, by name. A
    section's class may say where the spec's files put its keys (``spec_keys``) and adopt a file of its engine's
    own format given as the run's config (``own_file``). One that cannot load, or is no section, is one line."""
    global _sections
    if _sections is None:
        from importlib.metadata import entry_points

        core = {f.name for f in dataclasses.fields(CoreSections)}
        points = sorted(entry_points(group=SECTION_GROUP), key=lambda p: p.name)
        if not any(point.dist is not None and point.dist.name == "distrain" for point in points):
            raise ConfigError(_stale_metadata())
        found: dict[str, type] = {}
        for point in points:
            where = f"config section {point.name!r} ({point.value}, entry point group {SECTION_GROUP})"
            try:
                section = point.load()
            except Exception as e:
                raise ConfigError(f"{where} could not be loaded: {type(e).__name__}: {e}") from None
            if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
                raise ConfigError(f"{where} is not a dataclass")
            if point.name in core or not point.name.isidentifier() or found.get(point.name, section) is not section:
                raise ConfigError(f"{where}: the name is taken, or is not a valid key")
            found[point.name] = section
        _sections = found
    return _sections


def _stale_metadata() -> str:
    """What to do when distrain's own metadata declares no section: where that metadata is, and how to renew it."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        found = Path(str(distribution("distrain").locate_file(""))).resolve()
        where = f"its metadata in {found} is older than this code"
    except PackageNotFoundError:
        where = "it is not installed"
    return (
        f"distrain's strategies declare their config sections in its package metadata (entry point group "
        f"{SECTION_GROUP}), but {where}: install it again (./install.sh, or pip install -e . in a checkout; a "
        "distrain.egg-info folder left in the checkout by an old install shadows the new one: remove it)"
    )


def run_config_class() -> type:
    """``RunConfig``: the core sections, then each declared one (``sections``), made once per process."""
    global _run_config
    if _run_config is None:
        declared = [(name, section, field(default_factory=section)) for name, section in sections().items()]
        doc = (
            "A whole run's configuration, as the CLI runs it: the core sections (``training``, ``distributed``, "
            "``checkpointing``, ``logging``, ``data``, ``output_dir``) and the strategies' own ("
            + ", ".join(f"``{name}``" for name in sections())
            + "). ``build_config`` makes one from the defaults, a config file and overrides."
        )
        namespace = {"__module__": __name__, "__doc__": doc}
        _run_config = dataclasses.make_dataclass("RunConfig", declared, bases=(CoreSections,), namespace=namespace)
    return _run_config


if typing.TYPE_CHECKING:  # the core sections are what a type checker can know of it
    RunConfig = CoreSections


def __getattr__(name: str) -> Any:
    if name == "RunConfig":  # made on first use: the strategies' sections are read from the installed packages
        return run_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# building a config from layers


def load_config_file(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``training.learning_rate=3e-4`` → (``training.learning_rate``, 0.0003). Values are YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part!r} is not a section")
    node[parts[-1]] = value


def build_config(
    file: str | os.PathLike | None = None,
    overrides: dict[str, Any] | None = None,
    cli_items: list[str] | None = None,
) -> RunConfig:
    """Defaults ← file ← ``overrides`` (dotted keys from CLI flags) ← ``key=value`` items."""
    config = run_config_class()()
    config.mapped_keys = []  # spec-style keys and where they went, for --print-config
    if file is not None:
        tree = load_config_file(file)
        for section in sections().values():  # a file in an engine's own format (DeepSpeed's JSON) as the config
            adopted = section.own_file(tree, Path(file)) if hasattr(section, "own_file") else None
            if adopted is not None:
                tree = adopted
                break
        tree = map_spec_keys(tree, config.mapped_keys)
        apply_tree(config, tree, source=str(file))
    flag_tree: dict = {}
    for key, value in (overrides or {}).items():
        set_dotted(flag_tree, key, value)
    apply_tree(config, flag_tree, source="the command line")
    item_tree: dict = {}
    for item in cli_items or []:
        key, value = parse_override(item)
        set_dotted(item_tree, key, value)
    apply_tree(config, map_spec_keys(item_tree, config.mapped_keys), source="the command line")
    validate(config)
    return config


#: where keys written as the spec's config files write them live in this schema (the strategies' sections add
#: their own: ``spec_keys``)
SPEC_KEYS = {"training.max_length": "data.max_length"}


def map_spec_keys(tree: dict, notes: list[str]) -> dict:
    """``tree`` with the spec's key names moved to this schema's (``SPEC_KEYS``, each section's ``spec_keys``);
    ``notes`` records each move as ``from → to``. A key given both ways is an error: which one was meant?"""
    moves = {**SPEC_KEYS}
    for section in sections().values():
        moves.update(getattr(section, "spec_keys", {}))
    flat = _flatten(tree)
    out: dict = {}
    moved: dict[str, str] = {}
    for key, value in flat.items():
        target = key
        for old, new in moves.items():  # applied in order: a section first, then its renamed keys
            if target == old or target.startswith(f"{old}."):
                target = new + target[len(old) :]
        if target != key:
            if target in flat or target in moved:
                raise ConfigError(f"{key} and {moved.get(target, target)} both set {target}; keep one")
            moved[target] = key
            notes.append(f"{key} → {target}")
        set_dotted(out, target, value)
    return out


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def apply_tree(obj: Any, tree: dict, source: str, prefix: str = "") -> None:
    """Write a nested dict onto a dataclass, checking every key and type against the schema."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else f" (known: {', '.join(fields)})"
            raise ConfigError(f"unknown key {dotted!r} in {source}{hint}")
        hint_type = hints[key]
        if dataclasses.is_dataclass(hint_type):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted} in {source}: expected a section (mapping), got {value!r}")
            apply_tree(getattr(obj, key), value, source, prefix=f"{dotted}.")
        else:
            setattr(obj, key, coerce(value, hint_type, dotted, source))


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (dict, list):
        return f"a {typing.get_origin(tp).__name__}"
    args = typing.get_args(tp)
    if args:
        return " or ".join(_type_name(a) for a in args)
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Accept ``value`` if it fits ``tp`` (ints widen to floats); otherwise a ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg, key, source)
            except ConfigError:
                continue
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (dict, list):
        if isinstance(value, origin):
            return value
    else:
        return value
    raise ConfigError(f"{key} in {source}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def validate(config: RunConfig) -> None:
    """Every numeric key against its declared ``Bounds`` (``number(...)`` next to the field), then the checks
    that span several keys or name a choice; types are already right here."""
    check_numbers(config)
    t, d = config.training, config.distributed
    if config.logging.wandb_mode not in (None, "online", "offline", "disabled"):
        raise ConfigError(
            f"logging.wandb_mode must be online, offline, disabled or null, got {config.logging.wandb_mode!r}"
        )
    if isinstance(t.activation_checkpointing, str) and t.activation_checkpointing != "auto":
        raise ConfigError(
            f"training.activation_checkpointing must be true, false or auto, got {t.activation_checkpointing!r}"
        )
    if t.activation_checkpointing_mode not in ("full", "selective"):
        raise ConfigError(
            f"training.activation_checkpointing_mode must be full or selective, got {t.activation_checkpointing_mode!r}"
        )
    try:  # Lightning's spellings too (16, "bf16"), as the Trainer takes them
        t.precision = canonical_precision(t.precision, "training.precision")
    except ValueError as refused:
        raise ConfigError(str(refused)) from None
    if t.on_nonfinite not in ("stop", "skip", "ignore"):
        raise ConfigError(f"training.on_nonfinite must be stop, skip or ignore, got {t.on_nonfinite!r}")
    if t.on_anomaly not in (None, "stop", "skip", "rollback"):
        raise ConfigError(f"training.on_anomaly must be stop, skip, rollback or null, got {t.on_anomaly!r}")
    if t.task not in (None, "causal_lm", "sequence_classification"):
        raise ConfigError(f"training.task must be causal_lm, sequence_classification or null (infer), got {t.task!r}")
    if config.data.padding not in ("longest", "max_length"):
        raise ConfigError(f"data.padding must be longest or max_length, got {config.data.padding!r}")
    if t.lr_schedule not in ("cosine", "linear", "constant"):
        raise ConfigError(f"training.lr_schedule must be cosine, linear or constant, got {t.lr_schedule!r}")
    if isinstance(d.devices, str) and d.devices != "auto":
        raise ConfigError(f"distributed.devices must be an integer or 'auto', got {d.devices!r}")
    if d.accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ConfigError(f"distributed.accelerator must be auto, cpu or gpu, got {d.accelerator!r}")
    if t.n_experts and t.module:  # a Hugging Face model_name: refused where it is known to be one (check_experts_key)
        raise ConfigError(
            f"training.n_experts makes the built-in GPT a mixture of experts; {t.module!r} is not one (a module of "
            "your own builds its own layers)"
        )
    if t.n_experts and t.top_k > t.n_experts:
        raise ConfigError(f"training.top_k ({t.top_k}) must be at most training.n_experts ({t.n_experts})")
    if d.backend not in (None, "gloo", "nccl"):
        raise ConfigError(f"distributed.backend must be gloo or nccl, got {d.backend!r}")
    for check in CHECKS:
        check(config)


# --------------------------------------------------------------------------------------------
# secrets: what is written or logged never carries them; the running process keeps the real values

REDACTED = "***"
#: the words of a name (a query parameter's, a key's) that say its value is a secret
SECRET_WORDS = frozenset(
    {"token", "key", "apikey", "password", "passwd", "pwd", "secret", "sig", "signature", "credential", "credentials"}
)
#: a URL's userinfo: ``scheme://user:pass@`` or ``scheme://token@`` (up to the authority's last ``@``)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s]*@")
#: a query (or fragment) parameter ``name=value``
_PARAM = re.compile(r"(?P<lead>[?&;#])(?P<name>[^=&;#?\s]+)=(?P<value>[^&;#\s]*)")


def is_secret_name(name: str) -> bool:
    """``token``, ``access_token``, ``api_key``, ``X-Amz-Signature``, ``password``: a name whose value is a secret
    (its words, split at ``_``, ``-``, ``.``; ``tokenizer`` is not one)."""
    return any(word in SECRET_WORDS for word in re.split(r"[_\-.\s]+", str(name).lower()))


def redact_text(text: str) -> str:
    """``text`` with every URL's userinfo and every secret-looking query parameter's value replaced by ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    return _PARAM.sub(
        lambda m: f"{m['lead']}{m['name']}={REDACTED}" if is_secret_name(m["name"]) and m["value"] else m[0], text
    )


def redacted(tree: Any) -> Any:
    """A copy of ``tree`` (a config's ``to_dict()``, hyperparameters: dicts, lists, strings, numbers) to write or
    log: credentials in URLs (``https://user:token@host``), secret-looking query parameters (``?token=...``) and
    the string values of secret-looking keys (``api_key``) replaced by ``***``, in any key at any depth. The one
    place every writer of a config goes through (config.yaml, checkpoints, trackers' hyperparameters,
    ``--print-config``); the config the run uses keeps the real values. Redacting twice changes nothing more."""
    if isinstance(tree, Mapping):
        return {k: REDACTED if is_secret_name(k) and isinstance(v, str) and v else redacted(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return (list if isinstance(tree, list) else tuple)(redacted(v) for v in tree)
    if isinstance(tree, str):
        return redact_text(tree)
    return tree


def save_config(config: RunConfig, path: str | os.PathLike) -> None:
    """The run's config as YAML, redacted (``redacted``)."""
    Path(path).write_text(yaml.safe_dump(redacted(config.to_dict()), sort_keys=False))


# --------------------------------------------------------------------------------------------
# every key, listed (``distrain config``): read from the dataclasses above, so a new field is listed as it is added


@dataclass(frozen=True)
class KeyDoc:
    """One config key as ``distrain config`` lists it."""

    key: str
    """Dotted: ``training.learning_rate``, ``fsdp.mixed_precision.param_dtype``, ``output_dir``."""
    type: str
    """``int``, ``float``, ``str|null``, ``bool|str``, ``dict``, ..."""
    default: Any
    doc: str
    """The string under the field (what the key means), or "" where it has none."""
    bounds: Bounds | None = None
    """A numeric key's declared range (``number(...)``)."""

    @property
    def summary(self) -> str:
        """The doc's first sentence, on one line (``code`` as `code`)."""
        text = " ".join(self.doc.split("\n\n")[0].split()).replace("``", "`")
        return re.split(r"(?<=\.)(?<!e\.g\.)(?<!i\.e\.)\s+(?=[A-Z`])", text, maxsplit=1)[0]


def config_keys(cls: type | None = None, prefix: str = "") -> list[KeyDoc]:
    """Every key of ``cls`` (a section's keys, its subsections' too) in declaration order, with its type, default,
    doc and range (``cls`` None: ``RunConfig``)."""
    cls = run_config_class() if cls is None else cls
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += config_keys(tp, f"{prefix}{f.name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        keys.append(KeyDoc(f"{prefix}{f.name}", _key_type(tp), default, docs.get(f.name, ""), f.metadata.get("bounds")))
    return keys


def _key_type(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return "|".join(_key_type(arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return getattr(typing.get_origin(tp) or tp, "__name__", str(tp))


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass and of the dataclasses it derives from (the fields' docs
    here), read from their source."""
    import ast
    import inspect
    import textwrap

    docs = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0].body
        except (OSError, TypeError):  # no source (a frozen build, a class made at run time): keys without docs
            continue
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs
