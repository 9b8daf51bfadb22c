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

from distrain import compat
from distrain.checkpoint import safe_load
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


def load_config(name: str, key: str = "training.model_name", trust_remote_code: bool = False, **overrides: Any):
    """``AutoConfig`` of a hub name or local directory; ``overrides`` set config fields (num_labels, ...).
    A repository's own Python code runs only with ``trust_remote_code`` (the user's
    ``training.trust_remote_code``)."""
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
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **overrides)
    except _hub_errors() as e:
        raise not_loadable(key, name, e) from None
    except ValueError as e:
        raise _remote_code_refused(key, name, e) from None


def _remote_code_refused(key: str, name: str, error: ValueError) -> Exception:
    if "trust_remote_code" not in str(error):
        return error
    return ConfigError(
        f"{key}: {name} holds its own Python code, which must run to load it; distrain runs a model "
        "repository's code only when you set training.trust_remote_code=true (read that code first)"
    )


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


def build_empty(task: str, config) -> nn.Module:
    """The model's structure, its initializers not run, wherever the current context builds
    (the device, the meta device, or partitioned by ZeRO-3's ``zero.Init``): ``initialize`` gives it
    its weights, the same way under every strategy."""
    with compat.transformers_no_init_weights():
        model = auto_class(task).from_config(config, dtype=torch.float32)
    model.tie_weights()  # skipped with the initializers; tied embeddings share one parameter
    return model


def initialize(model: nn.Module, name: str, pretrained: bool, seed: int) -> None:
    """The weights of a model from ``build_empty``: with ``pretrained``, the checkpoint files'
    tensors, read one at a time (no rank ever holds a second copy of the model); what the files do
    not hold (a new classification head, buffers such as rotary frequencies) and, without
    ``pretrained``, everything comes from the library's own initializer under ``seed`` (a private
    RNG stream: the outer one is left as it was)."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        loaded = _load_pretrained(model, name) if pretrained else set()
        for path, module in model.named_modules():
            own = [
                compat.unwrapped_name(f"{path}.{n}" if path else n) for n, _ in module.named_parameters(recurse=False)
            ]
            has_buffers = any(b is not None for b in module.buffers(recurse=False))
            if has_buffers or any(key not in loaded for key in own):
                model._init_weights(module)


def _load_pretrained(model: nn.Module, name: str) -> set[str]:
    """Copy the checkpoint's tensors into ``model`` one at a time; returns the parameter names loaded.
    Names are matched as Hugging Face does for the common cases: exactly, with or without the base
    model's prefix (``bert.``), and LayerNorm's old ``gamma``/``beta``."""
    directory = _local_model_dir(name)
    targets = {compat.unwrapped_name(k): t for k, t in model.state_dict(keep_vars=True).items()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    loaded: set[str] = set()
    unexpected = []
    for key, read in checkpoint_tensors(directory):
        target_key = _match_key(key, targets, prefix)
        if target_key is None:
            unexpected.append(key)
            continue
        target = targets[target_key]
        tensor = read()
        if tuple(tensor.shape) != tuple(target.shape):  # e.g. a classifier head for another num_labels
            continue
        target.copy_(tensor)
        loaded.add(target_key)
    if not loaded and targets:
        raise ConfigError(
            f"training.model_name: none of the weights in {directory} match {type(model).__name__} (checkpoint keys "
            f"such as {', '.join(unexpected[:3])}; the model's: {', '.join(list(targets)[:3])})"
        )
    return loaded


def _match_key(key: str, targets: dict, prefix: str) -> str | None:
    candidates = [key, key.replace(".gamma", ".weight").replace(".beta", ".bias")]
    if prefix:
        candidates += [f"{prefix}.{c}" for c in candidates] + [
            c[len(prefix) + 1 :] for c in candidates if c.startswith(f"{prefix}.")
        ]
    return next((c for c in candidates if c in targets), None)


def checkpoint_tensors(directory: Path):
    """``(name, read)`` for each tensor of a Hugging Face checkpoint directory, ``read()`` loading that
    one tensor: safetensors (one file or an index of shards), else ``pytorch_model.bin`` read with
    ``weights_only=True``."""
    import json

    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else (["model.safetensors"] if (directory / "model.safetensors").is_file() else [])
    )
    if files:
        for file in files:
            with safe_open(str(directory / file), framework="pt") as f:
                for key in f.keys():
                    yield key, (lambda f=f, key=key: f.get_tensor(key))
        return
    bin_file = directory / "pytorch_model.bin"
    if not bin_file.is_file():
        raise ConfigError(f"training.model_name: {directory} holds no model.safetensors or pytorch_model.bin")
    for key, tensor in safe_load.load_torch_file(bin_file, mmap=True).items():
        yield key, (lambda tensor=tensor: tensor)


def _local_model_dir(name: str) -> Path:
    """The directory holding the model's files: a local path as given, a hub name from the local cache
    (``snapshot_download``; no network with HF_HUB_OFFLINE=1)."""
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.safetensors", "*.json", "*.bin"]))
    except _hub_errors() as e:
        raise not_loadable("training.model_name", name, e) from None


def build_skeleton(task: str, config) -> nn.Module:
    """The model's structure on the meta device: no memory, no weights, no download."""
    with torch.device("meta"):
        return auto_class(task).from_config(config)


def load_tokenizer(name: str, key: str = "data.tokenizer", trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = os.path.expanduser(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except _hub_errors() as e:
        raise not_loadable(key, name, e, what="tokenizer") from None
    except ValueError as e:
        raise _remote_code_refused(key, name, e) from None
    if tokenizer.pad_token_id is None:
        # causal LMs often have none; padding is masked out by the attention mask anyway
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"{key}: the tokenizer of {name!r} has no pad, eos or unk token to pad batches with")
    return tokenizer
