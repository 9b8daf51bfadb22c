"""Low-precision norms (``training.low_precision_norms``): every RMSNorm and LayerNorm of a model computed by
torch's own kernel in the compute dtype, keeping only its input in that dtype for the backward.

Why: a model's norms can hold more activation memory than its attention. Hugging Face's RMSNorms (Llama, Mistral,
Qwen, Mixtral, ...) compute in fp32 by hand and keep an fp32 copy of their input for the backward, and under CUDA
autocast torch's ``layer_norm`` and ``rms_norm`` run in fp32 and keep one too: 4 bytes per token and hidden unit
per norm, 12 GiB for Llama 2 13B at 2 × 4096 tokens. torchtitan's Llama (``norm_type = "fused_rmsnorm"``) and
llm-foundry's MPT (``norm_type: low_precision_layernorm``) keep the compute dtype; this is the same switch.

Numerics: in fp32 the result is the model's own norm's (the same operations); in bf16 the output is rounded once,
where Hugging Face's RMSNorm rounds the normalized input and then its product with the weight. Not bit-equal to
the model's own norm in bf16, hence off by default.

Norms are found by what they compute, not by their class name: a leaf module whose one parameter is a 1-D
``weight`` (and, for a LayerNorm, a ``bias``) and whose output on a probe input is torch's ``rms_norm`` of it.
Norms that compute something else (Gemma's ``1 + weight``, a norm without a weight) keep their own code. The
replacement holds the model's own parameters under the same names: checkpoints, ties, sharding and tensor-parallel
plans see no difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distrain.strategies import sharded_init

#: the attribute names Hugging Face's RMSNorms give their epsilon
_EPSILON_NAMES = ("variance_epsilon", "eps", "epsilon")


class LowPrecisionNorm(nn.Module):
    """An RMSNorm or LayerNorm in the compute dtype: autocast's where autocast is on (input and weights cast to it,
    as autocast casts a matmul's), else the input's; autocast's fp32 upcast of norms is skipped."""

    def __init__(self, kind: str, shape: tuple[int, ...], eps: float, weight: nn.Parameter, bias=None):
        super().__init__()
        self.kind = kind
        self.normalized_shape = tuple(shape)
        self.eps = eps
        self.weight = weight  # the model's own parameter: names, ties and shards unchanged
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        weight = None if self.weight is None else self.weight.to(dtype)
        with torch.autocast(device, enabled=False):
            if self.kind == "rms":
                return F.rms_norm(x.to(dtype), self.normalized_shape, weight, self.eps)
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.normalized_shape}, eps={self.eps}"


def low_precision_norms(model: nn.Module) -> list[str]:
    """Replace ``model``'s RMSNorms and LayerNorms by ``LowPrecisionNorm``s, in place; returns the names replaced.
    Works on a model built on the meta device or partitioned by ZeRO-3 (the probe runs on its own CPU tensors)."""
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, LowPrecisionNorm):
            continue
        new = _replacement(module)
        if new is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        replaced.append(name)
    return replaced


def _replacement(module: nn.Module) -> LowPrecisionNorm | None:
    # torch's own norms, not a subclass that computes something else in its forward
    if type(module).forward is nn.LayerNorm.forward:
        if not module.elementwise_affine:
            return None
        return LowPrecisionNorm("layer", module.normalized_shape, module.eps, module.weight, module.bias)
    if type(module).forward is nn.RMSNorm.forward:
        if module.weight is None:
            return None
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        return LowPrecisionNorm("rms", module.normalized_shape, eps, module.weight)
    params = dict(module.named_parameters(recurse=False))
    if list(module.children()) or set(params) != {"weight"}:
        return None
    eps = next((getattr(module, n) for n in _EPSILON_NAMES if isinstance(getattr(module, n, None), float)), None)
    shape = tuple(sharded_init.built_shape(params["weight"]))  # under ZeRO-3's zero.Init the weight is a placeholder
    if eps is None or len(shape) != 1 or not _computes_rms_norm(module, shape[0], eps):
        return None
    return LowPrecisionNorm("rms", shape, eps, params["weight"])


def _computes_rms_norm(module: nn.Module, width: int, eps: float) -> bool:
    """Whether ``module`` is torch's ``rms_norm`` with its weight: run on a probe input and probe weight, in fp32,
    on the CPU (whatever device or partition the module's own weight is on)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, width, generator=g, device="cpu")
    weight = torch.rand(width, generator=g, device="cpu") + 0.5
    try:
        with torch.no_grad():
            out = torch.func.functional_call(module, {"weight": weight}, (x,))
    except Exception:  # a forward that needs more than one tensor, or other devices: not a plain norm
        return False
    expected = F.rms_norm(x, (width,), weight, eps)
    return isinstance(out, torch.Tensor) and out.shape == x.shape and torch.allclose(out, expected, 1e-5, 1e-6)
