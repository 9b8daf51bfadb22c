"""The next-token loss of a language model's logits, without the whole batch's fp32 log-probabilities at once.

Why: a causal LM's loss upcasts its logits to fp32 and keeps their log-softmax for the backward: 4 bytes per token
and vocabulary entry, on top of the bf16 logits. At 3 × 8192 tokens and a 50k vocabulary that is 4.6 GiB kept, and
13.8 GiB at the start of the backward (the kept log-probabilities, their gradient and the logits' fp32 gradient),
more than a layer's activations. Here the rows go through the loss in pieces of at most ``PIECE_ELEMENTS`` logits,
each recomputed in the backward (``torch.utils.checkpoint``): what stays is the logits themselves, and the fp32
work of one piece at a time. llm-foundry's fused cross-entropy and torchtitan's loss parallelism answer the same
cost.

The value is the same cross-entropy, summed piece by piece: within fp32 rounding of one sum over all rows (a
single piece, the usual case for small models, is exactly that sum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

#: cross_entropy's ignore_index, as context_parallel.IGNORE (which this module cannot import: it imports this one)
IGNORE = -100

#: logits per piece of the loss: 2^26 is 256 MiB in fp32, a few pieces for a 50k-128k vocabulary at 8k tokens
PIECE_ELEMENTS = 2**26


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``logits`` [..., vocab] against ``targets`` [...] (``IGNORE``: no loss), summed."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    rows = max(1, PIECE_ELEMENTS // logits.shape[-1])
    # tensor-parallel logits (a DTensor, sharded over the vocabulary) go through whole, as their loss is computed
    if logits.shape[0] <= rows or isinstance(logits, DTensor):
        return _piece_loss(logits, targets)
    pieces = zip(logits.split(rows), targets.split(rows))
    if not torch.is_grad_enabled():  # evaluation: nothing is kept, one piece's fp32 work at a time
        return torch.stack([_piece_loss(piece, t) for piece, t in pieces]).sum()
    return torch.stack([checkpoint(_piece_loss, piece, t, use_reentrant=False) for piece, t in pieces]).sum()


def _piece_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
