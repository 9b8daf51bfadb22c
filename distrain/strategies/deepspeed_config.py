"""The DeepSpeed JSON config: built from the strategy's options, or read from the user's file,
with every ``"auto"`` filled from what the Trainer knows. Pure functions, no process group.

A value the user wrote (not ``"auto"``) that disagrees with the Trainer — a batch size, the
accumulation, clipping, precision — is an error naming both values and where each came from:
silently preferring one would train a different run than either side describes.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.config import number

logger = logging.getLogger("distrain")

CONFIG_ENV = "DISTRAIN_DEEPSPEED_CONFIG_PATH"

#: the string presets, as Lightning users know them
PRESETS: dict[str, dict[str, Any]] = {
    "deepspeed": {"stage": 2},
    "deepspeed_stage_1": {"stage": 1},
    "deepspeed_stage_2": {"stage": 2},
    "deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "deepspeed_stage_3": {"stage": 3},
    "deepspeed_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    "deepspeed_stage_3_offload_nvme": {
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
        "offload_params_device": "nvme",
        "offload_optimizer_device": "nvme",
    },
}


#: top-level keys of a DeepSpeed JSON (not distrain's sections): such a file given as the run's config
DEEPSPEED_KEYS = {
    "zero_optimization",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "zero_allow_untested_optimizer",
}


@dataclass
class DeepSpeedSectionConfig:
    """The ``deepspeed:`` section of a run's config, used when ``distributed.strategy`` is ``deepspeed`` or a
    ``deepspeed_stage_*`` preset; declared by this package (``pyproject.toml``, the ``distrain.config`` entry point
    group) as a plug-in's section would be."""

    config: str | None = None
    """A DeepSpeed JSON config (its "auto" values are filled from this run); overrides the keys below.
    ``--config ds_config.json`` sets it."""
    stage: int = number(2, ge=0, le=3, means={0: "ZeRO off: DeepSpeed's plain data parallelism"})
    """The ZeRO stage: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too; 0: none."""
    offload_optimizer: bool = False
    offload_parameters: bool = False
    offload_optimizer_device: str = "cpu"
    offload_params_device: str = "cpu"
    nvme_path: str = "/local_nvme"
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    save_full_weights: bool = False
    """Also write a consolidated fp32 ``model.safetensors`` into each checkpoint."""

    def activation_checkpointing_every(self) -> int | None:
        """The DeepSpeed JSON says how activations are checkpointed (partitioned, on the CPU): every block is (1);
        None when it says nothing of them."""
        if self.config is None:
            return None
        section = (read_user_config(self.config)[0] or {}).get("activation_checkpointing") or {}
        keys = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        return 1 if any(section.get(k) for k in keys) else None

    @classmethod
    def own_file(cls, tree: dict, path: Path) -> dict | None:
        """A DeepSpeed JSON given as the run's whole config (the spec's ``deepspeed_config.json``): the config of a
        run of strategy ``deepspeed`` that reads it. None: ``tree`` is distrain's own sections."""
        if not tree.keys() & DEEPSPEED_KEYS:
            return None
        return {"distributed": {"strategy": "deepspeed"}, "deepspeed": {"config": str(Path(path).resolve())}}


@dataclass
class TrainingFacts:
    """What the Trainer (or a Runtime user) knows, for filling ``"auto"`` and checking conflicts."""

    micro_batch_size: int | None = None
    accumulate: int = 1
    world_size: int = 1
    gradient_clip_val: float | None = None
    precision: str = "32-true"
    on_cuda: bool = False
    total_steps: int | None = None
    hidden_size: int | None = None
    optimizer_defaults: dict[str, Any] | None = None  # lr, betas, eps, weight_decay of the client optimizer


def read_user_config(config: dict | str | os.PathLike | None) -> tuple[dict | None, str]:
    """The user's config (a dict, a JSON file, or the file named by $DISTRAIN_DEEPSPEED_CONFIG_PATH)
    and a name for it in error messages."""
    if config is None and os.environ.get(CONFIG_ENV):
        config = os.environ[CONFIG_ENV]
        source_hint = f" (from ${CONFIG_ENV})"
    else:
        source_hint = ""
    if config is None:
        return None, "the strategy's options"
    if isinstance(config, dict):
        return copy.deepcopy(config), "the DeepSpeed config dict"
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file not found: {path}{source_hint}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}{source_hint}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}{source_hint}: a DeepSpeed config is a JSON object, got {type(data).__name__}")
    return data, str(path)


def options_config(
    stage: int,
    offload_optimizer: bool,
    offload_parameters: bool,
    offload_optimizer_device: str,
    offload_params_device: str,
    nvme_path: str,
    allgather_bucket_size: Any,
    reduce_bucket_size: Any,
    contiguous_gradients: bool,
    overlap_comm: bool,
    partition_activations: bool,
    cpu_checkpointing: bool,
) -> dict:
    """The config the strategy's keyword options describe."""
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": contiguous_gradients,
        "overlap_comm": overlap_comm,
        "allgather_bucket_size": allgather_bucket_size,
        "reduce_bucket_size": reduce_bucket_size,
    }
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer_device, "nvme_path": nvme_path, "pin_memory": "auto"}
    if offload_parameters:
        zero["offload_param"] = {"device": offload_params_device, "nvme_path": nvme_path, "pin_memory": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "activation_checkpointing": {
            "partition_activations": partition_activations,
            "cpu_checkpointing": cpu_checkpointing,
        },
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "steps_per_print": 10**12,  # distrain logs; DeepSpeed's own step print would interleave
        "wall_clock_breakdown": False,
    }


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def fill_config(config: dict, facts: TrainingFacts, source: str, extra: dict[str, Any] | None = None) -> dict:
    """A copy of ``config`` with every "auto" replaced and every conflict reported.
    ``extra``: values for keys only the caller knows (e.g. ``warmup_num_steps``), by leaf name."""
    cfg = copy.deepcopy(config)
    extra = dict(extra or {})
    check_precision(cfg, facts.precision, facts.on_cuda, source)
    _fill_batch(cfg, facts, source)
    _fill_clipping(cfg, facts, source)
    _fill_optimizer_and_scheduler(cfg, facts, source, extra)
    fill_buckets(cfg, facts, source)
    leftover = [path for path, value in _leaves(cfg) if value == "auto"]
    if leftover:
        raise ValueError(
            f'{source}: cannot fill {", ".join(leftover)} = "auto" (distrain knows no value for it); '
            "write a number instead"
        )
    return cfg


def check_precision(cfg: dict, precision: str, on_cuda: bool, source: str) -> None:
    """The file's bf16/fp16 sections against the Trainer's ``precision`` (``"auto"`` filled in ``cfg``), and fp16
    only on a GPU: known before any rank starts, so a conflict is refused there."""
    wants = {"bf16": precision.startswith("bf16"), "fp16": precision in ("16-mixed", "16-true")}
    for section in ("bf16", "fp16"):
        block = cfg.get(section)
        if block is None:
            if wants[section]:  # the Trainer asks for it and the file is silent: add the section
                cfg[section] = {"enabled": True}
            continue
        if block.get("enabled", "auto") == "auto":
            block["enabled"] = wants[section]
        elif bool(block["enabled"]) != wants[section] and (block["enabled"] is False or precision != "32-true"):
            # an explicit bf16/fp16 over the Trainer's default fp32 is the file's choice; any other mix is a conflict
            raise ValueError(
                f"{section}.enabled={block['enabled']} in {source} disagrees with the Trainer's "
                f'precision {precision!r}; set {section}.enabled to "auto" or make them agree'
            )
    if cfg.get("fp16", {}).get("enabled") and not on_cuda:
        raise ValueError(
            f"{source} enables fp16, which needs a CUDA GPU (DeepSpeed's fp16 loss scaling); "
            "on CPU use bf16 (precision='bf16-mixed') or fp32"
        )
    if cfg.get("fp16", {}).get("enabled") and cfg.get("bf16", {}).get("enabled"):
        raise ValueError(f"{source} enables both fp16 and bf16; choose one")


def _agree(cfg: dict, key: str, ours: Any, ours_from: str, source: str) -> None:
    value = cfg.get(key, "auto")
    if value == "auto" or value is None:
        cfg[key] = ours
    elif ours is not None and value != ours:
        raise ValueError(
            f'{key}={value} in {source} disagrees with {ours} ({ours_from}); set it to "auto" or make them agree'
        )


def _fill_batch(cfg: dict, facts: TrainingFacts, source: str) -> None:
    micro = facts.micro_batch_size
    if micro is None:  # no loader batch size (your own loop, evaluation, an IterableDataset)
        # with the loop calling backward/step itself, DeepSpeed uses it for bookkeeping only
        written = cfg.get("train_micro_batch_size_per_gpu", "auto")
        micro = 1 if written in ("auto", None) else int(written)
    _agree(cfg, "train_micro_batch_size_per_gpu", micro, "the train DataLoader's batch_size", source)
    _agree(cfg, "gradient_accumulation_steps", facts.accumulate, "the Trainer's accumulate_grad_batches", source)
    _agree(
        cfg,
        "train_batch_size",
        micro * facts.accumulate * facts.world_size,
        f"batch {micro} × accumulation {facts.accumulate} × {facts.world_size} ranks",
        source,
    )


def _fill_clipping(cfg: dict, facts: TrainingFacts, source: str) -> None:
    value = cfg.get("gradient_clipping", "auto")
    clip = facts.gradient_clip_val or 0.0
    if value == "auto":
        cfg["gradient_clipping"] = clip
    elif facts.gradient_clip_val and float(value) != clip:
        raise ValueError(
            f"gradient_clipping={value} in {source} disagrees with the Trainer's gradient_clip_val={clip}; "
            'set it to "auto" or make them agree'
        )


def _fill_optimizer_and_scheduler(cfg: dict, facts: TrainingFacts, source: str, extra: dict) -> None:
    known = dict(facts.optimizer_defaults or {})
    params = cfg.get("optimizer", {}).get("params", {})
    for key, value in list(params.items()):
        if value == "auto":
            if key not in known:
                raise ValueError(
                    f'{source}: optimizer.params.{key} is "auto" but no client optimizer gives it '
                    "(return one from configure_optimizers, or write the value)"
                )
            params[key] = list(known[key]) if isinstance(known[key], tuple) else known[key]
    lr = params.get("lr", known.get("lr"))
    sched = cfg.get("scheduler", {}).get("params", {})
    derived = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "total_num_steps": facts.total_steps, **extra}
    for key, value in list(sched.items()):
        if value == "auto":
            if derived.get(key) is None:
                raise ValueError(
                    f'{source}: scheduler.params.{key} is "auto" but distrain cannot tell its value; '
                    f"pass DeepSpeedStrategy(auto_values={{'{key}': ...}}) or write the value"
                )
            sched[key] = derived[key]


def fill_buckets(cfg: dict, facts: TrainingFacts, source: str) -> None:
    """Hugging Face's rules of thumb, from the model's hidden size."""
    zero = cfg.get("zero_optimization", {})
    h = facts.hidden_size
    rules = {
        "reduce_bucket_size": lambda: h * h,
        "allgather_bucket_size": lambda: h * h,
        "stage3_prefetch_bucket_size": lambda: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda: 10 * h,
    }
    for key, rule in rules.items():
        if zero.get(key) == "auto":
            if h is None:  # a model of one's own: DeepSpeed's defaults are made for that
                del zero[key]
                logger.debug(
                    '%s: zero_optimization.%s is "auto" and the model has no hidden size '
                    "(config.hidden_size / n_embd): DeepSpeed's default applies",
                    source,
                    key,
                )
            else:
                zero[key] = rule()
    for section in ("offload_optimizer", "offload_param"):
        block = zero.get(section)
        if isinstance(block, dict) and block.get("pin_memory") == "auto":
            block["pin_memory"] = facts.on_cuda  # pinned host memory needs a GPU driver


def _leaves(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    else:
        yield prefix, tree
