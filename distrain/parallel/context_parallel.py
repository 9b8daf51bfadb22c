"""Context parallelism: every sequence split over the ranks of one group, attention computed whole.

The ranks of a context-parallel group receive the same samples (the data is split over the data-parallel
dimension only) and each keeps its slice of every sequence. Everything but attention works on a token alone, so it
runs on the slice. Attention needs every earlier token, and an engine provides it, chosen by the model's heads
(``engine_for``):

- ``ulysses``: DeepSpeed's ``DistributedAttention`` (DeepSpeed-Ulysses). An all-to-all trades the sequence split
  for a split of the heads, so each rank runs the ordinary causal attention (torch's SDPA) over the whole
  sequence for ``heads/N`` heads, and a second all-to-all trades back. Taken when N divides the heads (each
  rank's share of them, under tensor parallelism). Rank ``c`` of ``N`` holds tokens ``[c·T/N, (c+1)·T/N)``.
- ``ring``: torch's ring attention (``parallel/ring_attention.py``: the templates of
  ``torch.distributed.tensor.experimental.context_parallel`` with CUDA's or the CPU's attention kernel). Every
  rank computes all its heads for its own queries against the key/value slices of the others. Taken when the heads
  do not split; any head count runs. Its layout is torch's load-balanced one: the sequence is cut into ``2N``
  pieces and rank ``c`` holds pieces ``c`` and ``2N-1-c``, so each does as much of the causal work. Grouped-query
  key/value heads are repeated to the query heads first; attention dropout is refused.

Neither engine masks a sliding window (Mistral's): a sequence longer than the window is refused (``check_window``);
one within it attends to every earlier token either way.

What stays global, not per slice (``SequenceShard``):

- position ids: each token's position in the whole sequence (``c·T/N`` for Ulysses's rank ``c``'s first);
- a sequence whose length is not a multiple of the pieces (N, or 2N) is padded at its end, with targets that count for
  nothing (``IGNORE``). Under a causal mask no real token attends to a pad, so the real tokens compute what one process
  computes;
- the loss is the mean over the group's real tokens: its value is the whole sequence's mean on every rank of the
  group (what one process logs), and its gradient is ``N ×`` this rank's share, because the data-parallel
  reduction (FSDP2 over data × context) averages over the N ranks as well as over the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distrain.config import Refusal

IGNORE = -100  # cross_entropy's ignore_index: a pad's target counts for nothing


@dataclass
class SequenceShard:
    """How one rank of a context-parallel group sees a sequence."""

    group: Any
    rank: int
    size: int
    engine: str = "ulysses"
    """What gives attention every earlier token (``engine_for``; the strategy reports it)."""
    length: int | None = None
    """The length of the last sequence split, before its padding (what a sliding window is held against)."""
    last_slice: tuple[tuple[int, int, int], ...] | None = None
    """The (start, stop, padded length) of each piece of the last sequence this rank computed: what ``distrain
    verify`` checks."""

    def __post_init__(self):
        if self.engine == "ring":
            from distrain.parallel.ring_attention import ring_attention

            # eager inside a compiled block (dynamo fails on the ring's Python: group calls, a layout flag). Made
            # here, not where compat defines it: disabling imports torch._dynamo (seconds), which no run without a
            # ring should pay
            self._ring = torch.compiler.disable(ring_attention)

    # ---- the slice -----------------------------------------------------------------------------------------------
    @property
    def pieces(self) -> int:
        """How many pieces a sequence is cut into: one per rank; two per rank for the ring's balanced layout."""
        return 2 * self.size if self.engine == "ring" else self.size

    def padded_length(self, length: int) -> int:
        """``length`` rounded up to a multiple of the pieces: every rank's slice is as long."""
        return -(-length // self.pieces) * self.pieces

    def ranges(self, padded: int, rank: int | None = None) -> list[tuple[int, int]]:
        """The [start, stop) of each piece that ``rank`` (this one) holds of a sequence padded to ``padded``."""
        rank = self.rank if rank is None else rank
        piece = padded // self.pieces
        held = [rank, self.pieces - 1 - rank] if self.engine == "ring" else [rank]
        return [(p * piece, (p + 1) * piece) for p in held]

    def split(self, tensor: torch.Tensor, pad_value: int | float) -> torch.Tensor:
        """This rank's slice of dim 1 (the sequence), the sequence padded at its end with ``pad_value`` to a
        multiple of the pieces first."""
        length = self.length = tensor.shape[1]
        padded = self.padded_length(length)
        if padded != length:
            pad = [0, 0] * (tensor.dim() - 2) + [0, padded - length]
            tensor = F.pad(tensor, pad, value=pad_value)
        parts = [tensor[:, start:stop] for start, stop in self.ranges(padded)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """The global position ids of this rank's slice."""
        padded = local_length * self.size
        ranges = self.ranges(padded)
        self.last_slice = tuple((start, stop, padded) for start, stop in ranges)
        return torch.cat([torch.arange(start, stop, device=device) for start, stop in ranges])

    def gather(self, tensor: torch.Tensor, length: int) -> torch.Tensor:
        """The whole sequence (dim 1, ``length`` long, pads dropped) from every rank's slice; differentiable
        (a loss of your own on the logits)."""
        from distrain.compat import all_gather_differentiable

        if hasattr(tensor, "full_tensor"):  # tensor parallel: logits split by vocabulary (a DTensor)
            tensor = tensor.full_tensor()
        whole = all_gather_differentiable(tensor, 1, self.group)  # rank 0's pieces, then rank 1's, ...
        if self.engine == "ring":  # back into the sequence's order
            padded = whole.shape[1]
            held = [torch.arange(a, b) for r in range(self.size) for a, b in self.ranges(padded, r)]
            whole = whole.index_select(1, torch.argsort(torch.cat(held)).to(whole.device))
        return whole[:, :length]

    # ---- attention -----------------------------------------------------------------------------------------------
    def attention(self, local_attention):
        """``local_attention(q, k, v)`` on ``[batch, sequence, heads, head_dim]`` tensors of the whole sequence →
        the same on this rank's slice of the sequence (all heads). The ring runs its own kernel: it needs no
        ``local_attention``."""
        if self.engine == "ring":
            return self._ring_attention
        _deepspeed_comm_ready()
        from deepspeed.sequence.layer import DistributedAttention

        # [B, T/N, H, d] → all-to-all: scatter the heads (dim 2), gather the sequence (dim 1) → [B, T, H/N, d]
        attend = DistributedAttention(local_attention, self.group, scatter_idx=2, gather_idx=1)
        return lambda q, k, v, **kwargs: attend(q, k, v, 0, None, **kwargs)

    def _ring_attention(self, q, k, v, scaling: float | None = None, dropout: float = 0.0, **kwargs):
        """Causal attention of this rank's pieces, ``[batch, sequence, heads, head_dim]`` in and out; keys and
        values may have fewer heads (grouped-query attention). ``scaling``/``dropout``: a Hugging Face layer's."""
        if dropout:
            raise Refusal(RING_REFUSES.format(what=f"attention dropout ({dropout})"))
        check_window(kwargs.get("sliding_window"), self.length or q.shape[1] * self.size)
        check_no_extras(kwargs)
        if k.shape[2] != q.shape[2]:  # each key/value head serves a group of query heads (transformers' repeat_kv)
            k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], dim=2) for x in (k, v))
        heads_first = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  ([B, H, T, d], the ring's)
        out = self._ring(heads_first(q), heads_first(k), heads_first(v), self.group, scaling, balanced=True)
        return out.transpose(1, 2)

    # ---- the loss ------------------------------------------------------------------------------------------------
    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next-token loss summed over the group's real tokens, and their count. The sum's value is the whole
        sequence's on every rank of the group (what one process computes); its gradient is ``N ×`` this rank's
        share, because the data-parallel reduction averages over the group's N ranks too."""
        flat_targets = targets.reshape(-1)
        from distrain.models.loss import token_loss_sum  # distrain.models imports this module

        local_sum = token_loss_sum(logits, flat_targets)
        if hasattr(local_sum, "full_tensor"):  # tensor parallel: the logits (and so the loss) are a DTensor
            local_sum = local_sum.full_tensor()
        totals = torch.stack([local_sum.detach(), (flat_targets != IGNORE).sum().to(local_sum.dtype)])
        dist.all_reduce(totals, group=self.group)
        share = local_sum * self.size
        return share + (totals[0] - share).detach(), totals[1]

    def mean_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The next-token loss over the group's real tokens: the whole sequence's mean (``loss_sum``)."""
        total, count = self.loss_sum(logits, targets)
        return total / count.clamp(min=1)


def _deepspeed_comm_ready() -> None:
    """DeepSpeed's collectives go through ``deepspeed.comm``, which wraps the process group torch already has."""
    import os

    # named, so that DeepSpeed does not guess (and warn about guessing) at import
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed.comm as ds_comm

    from distrain.compat import deepspeed_without_shm_op

    if not ds_comm.is_initialized():
        with deepspeed_without_shm_op():  # a CPU op only inference uses, JIT-built (a minute) at init otherwise
            ds_comm.init_distributed(
                dist_backend=dist.get_backend(), dist_init_required=False, auto_mpi_discovery=False, verbose=False
            )


def apply_context_parallel(module: torch.nn.Module, shard: SequenceShard) -> int:
    """Give every model in ``module`` that supports context parallelism its ``SequenceShard``; returns how many took
    it. A model supports it by a method ``enable_context_parallel(shard)`` (distrain's GPT has one)."""
    taken = 0
    for m in module.modules():
        enable = getattr(type(m), "enable_context_parallel", None)
        if callable(enable):
            enable(m, shard)
            taken += 1
    return taken


def attention_heads(module: torch.nn.Module) -> list[int] | None:
    """The head counts context parallelism splits (``engine_for``) in the first model inside ``module`` that can
    split its sequences: one
    that says them (``context_parallel_heads()``: distrain's GPT), or a Hugging Face model with Llama-style attention
    (its query and key/value heads); None when there is none."""
    for m in module.modules():
        says = getattr(type(m), "context_parallel_heads", None)
        if callable(says):
            return says(m)
        config = getattr(m, "config", None)
        if hasattr(config, "get_text_config") and any(hasattr(x, "num_key_value_groups") for x in m.modules()):
            text = config.get_text_config()
            return [text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads]
    return None


RING_REFUSES = (
    "context parallelism's ring engine (heads that context_parallel_size does not divide) cannot run {what}: "
    "choose a context_parallel_size that divides the heads (Ulysses), or turn it off"
)


def check_window(window: int | None, length: int) -> None:
    """A Hugging Face layer's sliding window (``sliding_window``: Mistral's, Qwen2's sliding layers) against the
    length of the whole sequence: within the window it changes nothing, beyond it the engines (causal attention
    over every earlier token) would compute another model."""
    if window is not None and length > window:
        raise Refusal(
            f"context parallelism cannot run a sliding window of {window} tokens over sequences of {length} "
            f"(distributed.context_parallel_size): its engines attend to every earlier token; keep sequences within "
            f"{window} tokens (data.max_length), or train without context parallelism"
        )


#: what a Hugging Face layer may hand its attention that neither engine applies: Gemma's logit soft-capping,
#: gpt-oss's attention sinks, a relative position bias (over every head, where an engine's rank holds some)
UNSUPPORTED_EXTRAS = {"softcap": "logit soft-capping", "s_aux": "attention sinks", "position_bias": "a position bias"}


def check_no_extras(kwargs: dict) -> None:
    """Refuse, in one line, an attention of a Hugging Face layer that the engines would compute without its extras."""
    for key, what in UNSUPPORTED_EXTRAS.items():
        if kwargs.get(key) is not None:
            raise Refusal(
                f"context parallelism (distributed.context_parallel_size) cannot run this model's attention: it asks "
                f"for {what} ({key}), which neither engine applies; train it without context parallelism"
            )


def engine_for(heads: list[int] | None, context: int, tensor: int, model: str) -> str:
    """Ulysses where it gives each rank of a group whole heads (``heads / (tensor × context)`` of every attention's
    query and key/value heads), else the ring, which splits no head. Heads that tensor parallelism cannot split
    are refused in one line. Unknown heads (a model of the user's own that does not say them): Ulysses."""
    for count in heads or []:
        if count % tensor:
            raise Refusal(
                f"{model} has {count} attention heads, which tensor_parallel_size={tensor} does not divide: tensor "
                f"parallelism gives each rank whole heads; choose a size that divides {count}"
            )
    return "ulysses" if all((count // tensor) % context == 0 for count in heads or []) else "ring"


# ---- Hugging Face models (Llama-, Qwen-, Mistral-style attention) ------------------------------------------------
HF_ATTENTION = "distrain_context_parallel"


def use_engine_in_hf(model: torch.nn.Module, shard: SequenceShard) -> None:
    """Route a Hugging Face model's attention through the group's engine: an attention implementation of its own
    name (transformers' ``AttentionInterface``) that runs the model's SDPA attention inside Ulysses's all-to-alls,
    or the ring. The causal mask is the engine's own: the callers pass right-padded sequences and no mask
    (``right_padded``)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if attention_heads(model) is None:
        raise ValueError(no_support_message(model))
    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, sdpa_mask)  # pure causal: no mask built (SDPA's is_causal)
    attention_layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    for layer in attention_layers:

        def local(q, k, v, _layer=layer, **kwargs):  # [B, T, heads/N, d] → the same
            check_window(kwargs.get("sliding_window"), shard.length or q.shape[1])  # SDPA's causal mask has none
            check_no_extras(kwargs)
            t = lambda x: x.transpose(1, 2)  # noqa: E731  (transformers' attention takes [B, heads, T, d])
            return sdpa_attention_forward(_layer, t(q), t(k), t(v), None, is_causal=True, **kwargs)[0]

        layer.distrain_attend = shard.attention(local)
    model.set_attn_implementation(HF_ATTENTION)


def _hf_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention call → the engine: [B, heads, T/N, d] in, ([B, T/N, heads, d], no weights) out."""
    kwargs.pop("is_causal", None)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return module.distrain_attend(t(query), t(key), t(value), **kwargs), None


def right_padded(attention_mask: torch.Tensor | None) -> bool:
    """Whether every row's real tokens come first (padding only at the end): then a causal mask alone keeps real
    tokens from pads, and the split needs no mask."""
    if attention_mask is None:
        return True
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def no_support_message(module: torch.nn.Module) -> str:
    return (
        f"context parallelism (distributed.context_parallel_size) needs a model that splits its sequences: "
        f"{type(module).__name__} has no enable_context_parallel(shard); distrain's built-in GPT has one"
    )
