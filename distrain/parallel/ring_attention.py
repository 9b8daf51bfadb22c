"""Ring attention on any device: torch's ring (``torch.distributed.tensor.experimental._context_parallel``, private,
checked against torch 2.13.0) under an autograd function of our own, with an attention kernel each device has.
Context parallelism's ring engine (``parallel/context_parallel.py``) calls it."""

from __future__ import annotations

import contextlib

import torch


def ring_attention(query, key, value, group, scale: float | None = None, balanced: bool = True):
    """Causal attention of this rank's slice of a sequence against the whole sequence, the key/value slices passed
    around the ``group`` (ring attention). ``query``/``key``/``value``: ``[batch, heads, local tokens, head_dim]``,
    the same heads on every rank. ``balanced``: the rank holds chunks ``r`` and ``2N-1-r`` of ``2N`` (torch's
    round-robin layout, which evens out the causal work); else one contiguous slice, chunk ``r`` of ``N``.

    torch runs ring attention inside its DTensor dispatcher (``context_parallel``), on CUDA kernels only. Its
    forward and backward are ``_templated_ring_attention`` and ``_templated_ring_attention_backward``, generic over
    the attention kernel (``_context_parallel._attention``, torch 2.13.0): here they run under an autograd function
    of our own, with CUDA's memory-efficient kernel (any dtype) or, on a CPU, ``_scaled_dot_product_flash_attention
    _for_cpu`` and its backward, so the same ring is tested on gloo (``tests/test_context_parallel.py``: it needs
    ranks). The layout flag the templates read (``_cp_options.enable_load_balance``) is set for the call only.

    Context parallelism's ring engine (``SequenceShard``, for heads that Ulysses cannot split) calls it."""
    return _RingAttention.apply(query, key, value, group, scale, balanced)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, scale, balanced):
        kernel = _RingKernel.of(query, scale)
        with _ring_layout(balanced) as ring:
            out, lse, *rest = ring._templated_ring_attention(
                group, 2, kernel.forward, query, key, value, is_causal=True, **kernel.forward_kwargs
            )
        ctx.save_for_backward(query, key, value, out, lse, *rest)
        ctx.group, ctx.kernel, ctx.balanced = group, kernel, balanced
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, *rest = ctx.saved_tensors
        kernel = ctx.kernel
        with _ring_layout(ctx.balanced) as ring:
            grads = ring._templated_ring_attention_backward(
                ctx.group,
                2,
                kernel.backward,
                grad_out=grad_out.contiguous(),
                query=query,
                key=key,
                value=value,
                out=out,
                logsumexp=lse,
                is_causal=True,
                **kernel.backward_kwargs(rest),
            )
        return grads[0], grads[1], grads[2], None, None, None


class _RingKernel:
    """The attention kernel the ring runs on the query's device, with its schema's keywords: CUDA's
    memory-efficient kernel (fp32, bf16 and fp16 alike), else the CPU flash kernel. No dropout."""

    def __init__(self, forward, backward, forward_kwargs: dict, backward_kwargs: dict, philox: bool):
        self.forward, self.backward, self.forward_kwargs = forward, backward, forward_kwargs
        self._backward_kwargs, self._philox = backward_kwargs, philox

    @classmethod
    def of(cls, query, scale: float | None) -> _RingKernel:
        aten = torch.ops.aten
        common = {"dropout_p": 0.0, "scale": scale}
        if query.device.type == "cuda":  # the ring merges log-sum-exps, so the kernel always computes them
            return cls(
                aten._scaled_dot_product_efficient_attention,
                aten._scaled_dot_product_efficient_attention_backward.default,
                {**common, "attn_bias": None, "compute_log_sumexp": True},
                {
                    **common,
                    "grad_out_name": "grad_out_",
                    "attn_bias": None,
                    "grad_input_mask": (True, True, True, False),
                },
                philox=True,
            )
        return cls(
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            common,
            {**common, "grad_out_name": "grad_out"},
            philox=False,
        )

    def backward_kwargs(self, rest: list) -> dict:
        """``rest``: what the forward kernel returned beyond the output and its log-sum-exp (CUDA's philox seed and
        offset, which its backward takes back)."""
        if not self._philox:
            return self._backward_kwargs
        return {**self._backward_kwargs, "philox_seed": rest[0], "philox_offset": rest[1]}


@contextlib.contextmanager
def _ring_layout(balanced: bool):
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    before = ring._cp_options.enable_load_balance
    ring._cp_options.enable_load_balance = balanced
    try:
        yield ring
    finally:
        ring._cp_options.enable_load_balance = before
