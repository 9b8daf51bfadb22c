"""``lightning.pytorch.utilities.deepspeed``: the conversion Lightning's DeepSpeed page tells users to run after a
ZeRO-3 fit."""

from __future__ import annotations

import os
from typing import Any

from distrain.checkpoint.state import DEEPSPEED_TAG

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict"]

#: what the file keeps of a checkpoint beside the weights: not the optimizers' state (a ZeRO partition's, or their
#: whole state: Lightning's file has none either)
_LEFT_OUT = ("model", "optimizers", "optimizer_states", "lr_schedulers")


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike, tag: str | None = None
) -> dict[str, Any]:
    """Lightning's: one file with the whole model in fp32 under ``"state_dict"`` (``torch.load(file)["state_dict"]``
    loads into the plain model) beside the checkpoint's counters and ``hyper_parameters``, so that
    ``Model.load_from_checkpoint(file)`` rebuilds it. The weights are DeepSpeed's own consolidation of the ZeRO
    partitions (``zero_to_fp32``); a checkpoint of any other strategy converts the same way. ``tag``: DeepSpeed's
    folder inside the checkpoint, which distrain names itself (``deepspeed``): leave it out."""
    import torch

    from distrain.checkpoint.state import read_plain

    if tag is not None and tag != DEEPSPEED_TAG:
        raise ValueError(
            f"convert_zero_checkpoint_to_fp32_state_dict: tag={tag!r}: a distrain checkpoint keeps one DeepSpeed "
            f"folder, {DEEPSPEED_TAG!r}; leave tag out and name the checkpoint itself (e.g. checkpoints/last.ckpt)"
        )
    plain = read_plain(checkpoint_dir)
    state = {k: v for k, v in plain.items() if k not in _LEFT_OUT}  # Lightning's keys with distrain's, less the rest
    print(f"Saving fp32 state dict to {output_file}")  # Lightning's line
    torch.save(state, output_file)
    return state
