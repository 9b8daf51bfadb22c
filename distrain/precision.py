"""Precision plugins: what autocast to enter, how to convert the module, whether to scale."""

from __future__ import annotations

import contextlib

import torch

from distrain.config import canonical_precision

#: the dtype each precision computes in (fp8: the matmuls of linear layers run in float8, the rest in bf16; MFU is
#: against the bf16 peak); any other precision computes in fp32
COMPUTE_DTYPES = {
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
    "fp8": torch.bfloat16,
}
#: the precisions that run under autocast in their compute dtype
AUTOCAST = ("16-mixed", "bf16-mixed", "fp8")
#: the precisions whose weights, inputs and new tensors are all of one dtype (Lightning's "true" precisions)
TRUE_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16, "64-true": torch.float64}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """``dtype`` as torch's default floating-point dtype inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def compute_dtype(name: str) -> torch.dtype:
    """The dtype precision ``name`` computes in (``COMPUTE_DTYPES``, ``TRUE_DTYPES``)."""
    return COMPUTE_DTYPES.get(name) or TRUE_DTYPES.get(name, torch.float32)


class Precision:
    """``32-true`` | ``16-mixed`` | ``bf16-mixed`` | ``16-true`` | ``bf16-true`` | ``64-true`` | ``fp8``.

    The "true" precisions (``16-true``, ``bf16-true``, ``64-true``) hold the weights in their dtype, build
    ``configure_model``'s layers and the forward's new tensors in it, and convert each batch's floating-point tensors
    to it, as Lightning's do.

    ``fp8``: torchao's float8 training (the torchtitan choice): the model's linear layers compute
    their matmuls in float8 with dynamic per-tensor scales, everything else runs under bf16
    autocast; under FSDP2 the weights are all-gathered in float8 (half the bytes of bf16).
    Needs a GPU with float8 tensor cores (H100-class) and torchao.

    ``simulated``: the planner's CPU simulation of a GPU run (``planner/simulate.py``): fp8 converts the model as on
    the GPU (torchao's float8 layers run under fake tensors on any device), so this machine's GPU is not asked for."""

    def __init__(self, name: str, device_type: str, *, simulated: bool = False):
        name = canonical_precision(name)
        if name == "16-mixed" and device_type != "cuda":
            raise ValueError("precision='16-mixed' needs a CUDA GPU (fp16 with a GradScaler); on CPU use 'bf16-mixed'")
        if name == "fp8" and not simulated:
            check_fp8_support(device_type)
        self.name = name
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler("cuda") if name == "16-mixed" else None
        #: fp8 under FSDP2: weights all-gathered in float8; their scales are computed once per step
        self.float8_all_gather = False
        self._float8_module: torch.nn.Module | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.name)

    @property
    def gathered_param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 gathers parameters in for compute (``MixedPrecisionPolicy.param_dtype``), under FSDP and
        model parallelism alike: the compute dtype under mixed precision and fp8 (its float8 linears cast their own
        weights), None (as stored) otherwise."""
        return self.compute_dtype if self.name in AUTOCAST else None

    @property
    def true_dtype(self) -> torch.dtype | None:
        """The one dtype of a "true" precision (``TRUE_DTYPES``); None for the others."""
        return TRUE_DTYPES.get(self.name)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.name == "fp8":
            convert_to_float8(module, fsdp_float8_all_gather=self.float8_all_gather)
            self._float8_module = module
            return module
        return module.to(self.true_dtype) if self.true_dtype is not None else module

    def autocast(self):
        """Around each forward: autocast for the mixed precisions; a "true" one's dtype as torch's default."""
        if self.name in AUTOCAST:
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        if self.true_dtype is not None:
            return default_dtype(self.true_dtype)
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping, gradients must be in true units."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)  # skips the step when grads overflowed
            self.scaler.update()
        if self.float8_all_gather and self._float8_module is not None:
            # one all-reduce for every layer's weight scale, instead of one per layer in the next forward
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self._float8_module)

    def agree_on_overflow(self) -> None:
        """Several ranks: each sees only some of the gradients (FSDP shards, tensor-parallel slices, a
        pipeline's stages) or, with local SGD, its own. torch's ``ShardedGradScaler`` all-reduces the
        overflow flag in ``unscale_``, so every rank skips an overflowed step (and lowers its scale) alike."""
        if self.scaler is None:
            return
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.scaler = ShardedGradScaler(self.device_type, init_scale=self.scaler.get_scale())

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


#: compute capability from which NVIDIA GPUs have float8 tensor cores (Ada: L4, L40S; Hopper: H100, H200)
FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_support(device_type: str) -> None:
    """One line saying what fp8 training needs, when this machine lacks it."""
    need = "precision='fp8' needs an NVIDIA GPU with float8 tensor cores (compute capability 8.9+: H100, H200, L4)"
    if device_type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"{need}; this run has no CUDA GPU (use 'bf16-mixed')")
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise ValueError(f"{need}; this {name} is {capability[0]}.{capability[1]} (use 'bf16-mixed')")
    require_torchao(need)


def require_torchao(need: str) -> None:
    """``need`` (a sentence about fp8) and what to install, in one line, where torchao is missing."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"{need} and torchao: pip install 'distrain[fp8]'")


def convert_to_float8(module: torch.nn.Module, fsdp_float8_all_gather: bool = False) -> list[str]:
    """Swap the module's linear layers for torchao's ``Float8Linear`` in place (before sharding);
    returns their names. Layers whose sizes are not multiples of 16 (float8 matmuls need that) and
    the output head (``head``, ``lm_head``, ``output``: kept in bf16 for accuracy, as torchtitan does)
    stay as they are."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # public torchao API, checked on 0.18.0

    converted: list[str] = []

    def eligible(layer: torch.nn.Module, name: str) -> bool:
        ok = (
            isinstance(layer, torch.nn.Linear)
            and layer.in_features % 16 == 0
            and layer.out_features % 16 == 0
            and name.rsplit(".", 1)[-1] not in ("head", "lm_head", "output")
        )
        if ok:
            converted.append(name)
        return ok

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    convert_to_float8_training(module, config=config, module_filter_fn=eligible)
    return converted
