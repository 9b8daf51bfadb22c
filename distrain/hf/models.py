"""Hugging Face configs, models and tokenizers from a hub name or a local directory.

The same calls serve both: a local directory never touches the network, and a hub name that
cannot be fetched (offline, ``HF_HUB_OFFLINE=1``) fails with one error that says how to use a
local copy instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distrain.config import ConfigError

TASKS = ("causal_lm", "sequence_classification")


def looks_local(name: str) -> bool:
    """A path rather than a hub id (``org/name``): it exists, or it is written like a path."""
    return (
        os.path.exists(os.path.expanduser(name))
        or name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def not_loadable(key: str, name: str, error: BaseException, what: str = "model") -> ConfigError:
    """One error for "this is neither a usable local directory nor reachable on the Hub"."""
    if looks_local(name):
        return ConfigError(f"{key}: {name!r} is not a directory holding a Hugging Face {what} ({_first_line(error)})")
    repo_type = " --repo-type dataset" if what == "dataset" else ""
    return ConfigError(
        f"{key}: could not load {name!r} from the Hugging Face Hub ({_first_line(error)}). Without network "
        f"(or with HF_HUB_OFFLINE=1), download it on a machine that has network "
        f"(`hf download {name}{repo_type} --local-dir DIR`) and pass the local directory instead: {key}=DIR"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _hub_errors() -> tuple[type[BaseException], ...]:
    # OSError covers "not found", "offline" and connection errors; an invalid repo id is a ValueError
    from huggingface_hub.errors import HFValidationError

    return (OSError, HFValidationError)


def load_config(name: str, key: str = "training.model_name", **overrides: Any):
    """``AutoConfig`` of a hub name or local directory; ``overrides`` set config fields (num_labels, ...)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        from distrain.models.gpt import GPT_SIZES

        raise ConfigError(
            f"{key} {name!r} is not a built-in GPT size ({', '.join(GPT_SIZES)}); Hugging Face models "
            "need transformers, datasets and tokenizers: ./install.sh hf"
        ) from None

    path = os.path.expanduser(name)
    if looks_local(name) and not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"{key}: {name!r} is not a built-in GPT size, and no Hugging Face model directory "
            f"(with a config.json) is there"
        )
    try:
        return AutoConfig.from_pretrained(path, **overrides)
    except _hub_errors() as e:
        raise not_loadable(key, name, e) from None


def config_from_dict(values: dict):
    """The inverse of ``json.loads(config.to_json_string())``: how checkpoints carry the config."""
    from transformers import AutoConfig

    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def infer_task(config, task: str | None = None, name: str = "the model") -> str:
    """``task`` if given, else from the config's ``architectures`` (what ``save_pretrained`` recorded)."""
    if task:
        if task not in TASKS:
            raise ConfigError(f"training.task must be one of {', '.join(TASKS)}, got {task!r}")
        return task
    for arch in getattr(config, "architectures", None) or []:
        if arch.endswith("ForSequenceClassification"):
            return "sequence_classification"
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal_lm"
    raise ConfigError(
        f"training.task: cannot tell the task of {name} from its config (architectures: "
        f"{getattr(config, 'architectures', None)}); set training.task=causal_lm or sequence_classification"
    )


def auto_class(task: str):
    import transformers

    return {
        "causal_lm": transformers.AutoModelForCausalLM,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
    }[task]


def build_model(name: str, task: str, config, pretrained: bool = True, seed: int = 0) -> nn.Module:
    """The full model on the current device, in fp32 (the Trainer's precision casts it later).

    ``pretrained=False``: fresh weights from a private seed, so that every strategy (and rank 0
    alone, under FSDP) builds exactly the same ones whatever else drew from the RNG before."""
    cls = auto_class(task)
    if pretrained:
        try:
            # ignore_mismatched_sizes: a classifier head for another num_labels is re-initialized, not an error
            return cls.from_pretrained(
                os.path.expanduser(name),
                config=config,
                dtype=torch.float32,
                ignore_mismatched_sizes=task == "sequence_classification",
            )
        except _hub_errors() as e:
            raise not_loadable("training.model_name", name, e) from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls.from_config(config, dtype=torch.float32)


def build_skeleton(task: str, config) -> nn.Module:
    """The model's structure on the meta device: no memory, no weights, no download."""
    with torch.device("meta"):
        return auto_class(task).from_config(config)


def block_classes(model: nn.Module) -> set[type]:
    """The model's repeated layers (``_no_split_modules``: LlamaDecoderLayer, BertLayer, ...): the FSDP
    units and the activation-checkpointed layers — the spec's ``auto_wrap_policy: transformer_based``."""
    from distrain.strategies.fsdp import _default_block_classes

    return _default_block_classes(model) or set()


def load_tokenizer(name: str, key: str = "data.tokenizer"):
    from transformers import AutoTokenizer

    path = os.path.expanduser(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except _hub_errors() as e:
        raise not_loadable(key, name, e, what="tokenizer") from None
    if tokenizer.pad_token_id is None:
        # causal LMs often have none; padding is masked out by the attention mask anyway
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"{key}: the tokenizer of {name!r} has no pad, eos or unk token to pad batches with")
    return tokenizer
