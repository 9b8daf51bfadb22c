"""A distrain checkpoint of a Hugging Face task → a directory ``from_pretrained`` loads.

Needs only two things from the checkpoint, whatever strategy wrote it: the full weights
(``checkpoint.state.read_model_weights``: DDP's ``state.pt``, FSDP's DCP shards, ...) and the
module's hyperparameters (``read_checkpoint_meta``), which hold the model's config, its task and
its tokenizer's location. No process group, no copy of the original model directory.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from distrain import compat
from distrain.hf import models


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, tokenizer: str | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` (sharded with an index above 5 GB)
    and the tokenizer files of the model in ``checkpoint`` to ``out_dir``.

    ``tokenizer``: where its tokenizer is (a Hub id or a local directory). None: the one the checkpoint names, but only
    a Hub id: a local path inside a checkpoint is someone else's word for a directory on this machine, and its files
    would be copied into ``out_dir`` — such a path is named in a warning, to pass here."""
    from distrain.checkpoint.state import read_checkpoint_meta, read_model_weights

    hparams = read_checkpoint_meta(checkpoint).get("hyper_parameters") or {}
    if "hf_config" not in hparams or "task" not in hparams:
        raise RuntimeError(
            f"{checkpoint}: not a checkpoint of a Hugging Face model (distrain.hf task); "
            "`--to torch` or `--to safetensors` export its weights"
        )
    if tokenizer is None:
        named = hparams.get("tokenizer") or hparams.get("model_name")
        tokenizer = named if isinstance(named, str) and not models.looks_local(named) else None
        if isinstance(named, str) and tokenizer is None:
            warnings.warn(
                f"{checkpoint} names the local tokenizer {named!r}: not copied from a path a checkpoint names; "
                "pass it yourself (`distrain convert --tokenizer PATH`) to include its files",
                stacklevel=2,
            )
    weights = read_model_weights(checkpoint)  # the task module's state dict
    out = Path(out_dir)
    config = models.config_from_dict(hparams["hf_config"])
    model = models.build_skeleton(hparams["task"], config)  # meta: the weights below are the only copy
    # without what wrappers add to parameter names: activation checkpointing, compile, the task module's attribute
    state = {compat.unwrapped_name(k).removeprefix("model."): v.detach().cpu().contiguous() for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {name for name, _ in _tied_names(model)}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"the checkpoint's weights do not fit {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    model.save_pretrained(out, max_shard_size="5GB")  # transformers' own default is 50GB
    _save_tokenizer(tokenizer, out)
    return out


def _tied_names(model) -> list[tuple[str, str]]:
    """Parameters that share another's tensor (e.g. lm_head tied to the embeddings): absent from some
    checkpoints, restored by ``tie_weights``."""
    seen: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append((name, seen[id(p)]))
        else:
            seen[id(p)] = name
    return out


def _save_tokenizer(source: str | None, out: Path) -> None:
    if not source:
        return
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(os.path.expanduser(source)).save_pretrained(out)  # as it was, no pad added
    except Exception as e:  # the weights are what matters; say why the tokenizer is missing
        warnings.warn(
            f"exported {out} without tokenizer files: could not load the tokenizer {source!r} ({e})", stacklevel=2
        )
