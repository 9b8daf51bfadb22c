"""The work of a traced step: each operation's FLOPs (matmuls, convolutions, attention) and the bytes
the others move, by phase. ``timing.py`` turns it into seconds on a device.

Counted under fake tensors inside ``trace_step``, so it is the module's own step as it runs, with
its autocast casts, activation checkpointing's recomputation (in backward) and the optimizer's
per-tensor or multi-tensor kernels."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

PHASES = ("forward", "backward", "step")

#: operations that allocate without touching memory, or only change metadata
_NO_TRAFFIC = {
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
    torch.ops.aten.detach,
    torch.ops.aten.lift_fresh,
    torch.ops.aten._local_scalar_dense,
    torch.ops.aten.set_,
    torch.ops.aten._unsafe_view,
    torch.ops.aten.alias,
}


#: element-wise operations that compute per element (a transcendental function, random numbers): on a CPU they run
#: at a core's pace, several times below memory speed (GPT-2's tanh GELU and dropout)
_PER_ELEMENT = {
    torch.ops.aten.exp,
    torch.ops.aten.exp_,
    torch.ops.aten.log,
    torch.ops.aten.tanh,
    torch.ops.aten.tanh_backward,
    torch.ops.aten.erf,
    torch.ops.aten.sigmoid,
    torch.ops.aten.sigmoid_backward,
    torch.ops.aten.gelu,
    torch.ops.aten.gelu_backward,
    torch.ops.aten.silu,
    torch.ops.aten.silu_backward,
    torch.ops.aten.sin,
    torch.ops.aten.cos,
    torch.ops.aten.rsqrt,
    torch.ops.aten.bernoulli,
    torch.ops.aten.bernoulli_,
    torch.ops.aten.native_dropout,
    torch.ops.aten.rand,
    torch.ops.aten.rand_like,
}
#: softmax and its backward: a max, an exponential, a sum and a division per element (a 50k-token vocabulary's
#: cross-entropy took 2.5 of GPT-2's 24 s step on one CPU core)
_SOFTMAX = {
    torch.ops.aten._softmax,
    torch.ops.aten._log_softmax,
    torch.ops.aten._softmax_backward_data,
    torch.ops.aten._log_softmax_backward_data,
}


@dataclass
class PhaseWork:
    """One phase's work: FLOPs of the compute-bound operations, bytes read and written by the
    memory-bound ones, elements of those that compute per element (``elements``; softmax's apart), and how
    many operations ran (each has a fixed cost on a CPU)."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: int = 0
    elements: float = 0.0
    softmax_elements: float = 0.0
    attention_flops: float = 0.0
    """FLOPs of the fused attention kernels (SDPA's flash, memory-efficient, cuDNN and CPU kernels), apart from
    ``flops``: on a GPU they run below the matmuls' rate (``timing.ATTENTION_EFFICIENCY``)."""
    fused_bytes: float = 0.0
    """``bytes`` as ``torch.compile`` moves them (``WorkCounter``): the memory-bound operations between two
    compute-bound ones are one kernel, which reads what it did not make and writes what is read after it."""
    fused_ops: int = 0
    """``ops`` under ``torch.compile``: the compute-bound kernels and one fused kernel per run of memory-bound ones."""
    float8_flops: float = 0.0
    """FLOPs of the matmuls whose operands are float8 (torchao's float8 linear layers, ``precision: fp8``), apart
    from ``flops``: they run at the float8 tensor cores' rate (``timing.Hardware.float8_flops``)."""

    def scaled(self, factor: float) -> PhaseWork:
        """This work ``factor`` times over: its amounts scale, its count of kernels does not."""
        return PhaseWork(
            **{f.name: getattr(self, f.name) * (1 if f.name in _KERNELS else factor) for f in fields(self)}
        )

    def compiled(self) -> PhaseWork:
        """This work as ``torch.compile`` runs it: the fused bytes and kernels in place of eager's."""
        return replace(self, bytes=self.fused_bytes, ops=self.fused_ops)

    def __add__(self, other: PhaseWork) -> PhaseWork:
        return PhaseWork(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


#: ``PhaseWork``'s counts of kernels, which a larger amount of work (``scaled``) does not change
_KERNELS = ("ops", "fused_ops")


@dataclass
class StepWork:
    phases: dict[str, PhaseWork] = field(default_factory=lambda: {p: PhaseWork() for p in PHASES})

    @property
    def forward_backward(self) -> PhaseWork:
        return self.phases["forward"] + self.phases["backward"]

    @property
    def step(self) -> PhaseWork:
        return self.phases["step"]

    def compiled(self) -> StepWork:
        """The forward and backward as ``torch.compile`` runs them (the optimizer's step stays eager's)."""
        return StepWork({p: w.compiled() if p != "step" else w for p, w in self.phases.items()})


def _cpu_attention_flops(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


#: torch's FLOP counter knows the CUDA attention kernels, not the CPU one SDPA takes here; counted the same
#: way (the full T×S scores, as torch and MFU figures count them, causal or not)
_FLOPS = {
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


#: a mixture of experts' matmuls, as transformers runs them where ``torch._grouped_mm`` cannot (and where the
#: planner traces, ``fake.transformers_as_in_eager``): each token's row through its expert's weight, forward; its
#: input's and the weight's gradients, backward (multiples of one pass)
_EXPERT_MATMULS = {"grouped_mm_fallback": 1, "grouped_mm_fallback_backward": 2}


def _expert_matmul_flops(tokens: torch.Tensor, weight: torch.Tensor) -> int:
    """``tokens`` [rows, in] through ``weight`` [experts, in, out], each row through one expert's."""
    return 2 * tokens.shape[0] * tokens.shape[1] * weight.shape[2]


#: the fused attention kernels among them
_ATTENTION = {packet for packet in _FLOPS if "attention" in packet.__name__}


def _moves_data(func, out) -> bool:
    """Whether an operation reads and writes its tensors: not a view, not metadata (``prim.device``, a
    size), not an allocation; it returns a tensor, or writes one in place."""
    if func.is_view or func._overloadpacket in _NO_TRAFFIC or func.namespace == "prim":
        return False
    return any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]) or func._schema.is_mutable


def _written_in_place(func, args, kwargs) -> int:
    """Bytes an in-place operation writes back to arguments it returns nothing for (``_fused_adamw_``
    updates parameters and moments and returns None): they are read, then written."""
    if func._schema.returns:
        return 0
    written = [
        kwargs.get(a.name, args[i] if i < len(args) else None)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    return _tensor_bytes(written)


def _float8_operands(args) -> bool:
    """A matmul of torchao's float8 tensors: wrappers (``Float8TrainingTensor``, torchao 0.18) whose data is a
    float8 tensor, which this dispatch mode sees before they unwrap to ``torch._scaled_mm``."""
    return any(
        isinstance(t, torch.Tensor) and isinstance(data := getattr(t, "_data", None), torch.Tensor) and _is_float8(data)
        for t in args
    )


def _is_float8(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point and t.dtype.itemsize == 1


def _largest(values) -> int:
    return max((t.numel() for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)), default=0)


def _tensor_bytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor))


class WorkCounter(TorchDispatchMode):
    """Counts every operation of the current ``phase`` (the caller moves it along), as eager mode runs it and as
    ``torch.compile`` would (``PhaseWork.fused_bytes``).

    The compiled count assumes Inductor's fusion at its best: every run of memory-bound operations between two
    compute-bound ones (matmuls, attention) is one kernel. It reads the tensors it did not make (a matmul's output,
    a parameter, a tensor made before the last matmul) and writes the tensors it makes that are read later: by a
    matmul, after the next matmul, or in a later phase (what the backward keeps)."""

    def __init__(self):
        super().__init__()
        self._phase = "forward"
        self.work = StepWork()
        self._segment = 0  # compute-bound operations so far: a fused kernel spans one segment
        self._fused_segment = -1  # the last segment a fused kernel was counted in
        #: tensors the memory-bound operations made, by storage: [phase, segment, bytes, written, alive]
        self._made: dict[int, list] = {}

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        # what the last phase made and a later one reads (the backward's saved tensors) was written to memory
        for key, made in list(self._made.items()):
            if made[4].expired():
                del self._made[key]
            elif not made[3]:
                self.work.phases[made[0]].fused_bytes += made[2]
                made[3] = True
        self._phase = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        phase = self.work.phases[self.phase]
        packet = func._overloadpacket
        if func.namespace != "prim":  # a device or size query: no kernel
            phase.ops += 1
        experts = func.namespace == "transformers" and packet.__name__ in _EXPERT_MATMULS
        if packet in _ATTENTION or packet in _FLOPS or experts:  # a compute-bound kernel: a fused one ends here
            self._segment += 1
            phase.fused_ops += 1
            self._read((args, kwargs), counted=False)
        if packet in _ATTENTION:
            phase.attention_flops += _FLOPS[packet](*args, **kwargs, out_val=out)
            return out
        if packet in _FLOPS:
            flops = _FLOPS[packet](*args, **kwargs, out_val=out)
            if _float8_operands(args):
                phase.float8_flops += flops
            else:
                phase.flops += flops
            return out
        if experts:
            phase.flops += _EXPERT_MATMULS[packet.__name__] * _expert_matmul_flops(*args[:2])
            return out
        # the per-element work beyond a memory pass (a GPU's is 0); the memory pass is counted below, as for any
        if packet in _SOFTMAX:
            phase.softmax_elements += _largest(out)
        elif packet in _PER_ELEMENT:
            phase.elements += _largest((out, args[:1]))  # bernoulli_ writes its argument
        if _moves_data(func, out):
            written = _written_in_place(func, args, kwargs)
            phase.bytes += _tensor_bytes((args, kwargs)) + _tensor_bytes(out) + written
            if self._fused_segment != self._segment:
                self._fused_segment = self._segment
                phase.fused_ops += 1
            phase.fused_bytes += self._read((args, kwargs), counted=True) + written
            self._make(out)
        return out

    def _read(self, values, counted: bool) -> int:
        """Bytes a fused kernel reads of ``values`` (``counted``; a matmul's reads are in its FLOPs), writing first
        the tensors an earlier kernel made and kept in registers until now."""
        read = 0
        for t in tree_flatten(values)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            made = self._made.get(_storage_key(t))
            if made is not None and made[4].expired():  # a freed storage whose address a new one took
                made = None
            if made is not None and made[0] == self.phase and made[1] == self._segment and counted:
                continue  # made in this kernel: never leaves it
            if made is not None and not made[3]:
                self.work.phases[made[0]].fused_bytes += made[2]
                made[3] = True
            read += t.numel() * t.element_size() if counted else 0
        return read

    def _make(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key not in self._made or self._made[key][4].expired():
                    size = t.numel() * t.element_size()
                    self._made[key] = [self.phase, self._segment, size, False, _alive(t)]

    def __exit__(self, *exc):
        self.phase = self.phase  # the last phase's kept tensors
        return super().__exit__(*exc)


def _alive(t: torch.Tensor):
    """Something whose ``expired()`` says when ``t``'s storage is freed."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return _Forever()


class _Forever:
    @staticmethod
    def expired() -> bool:
        return False


def _storage_key(t: torch.Tensor) -> int:
    """A tensor's storage, shared with its views (a wrapper subclass without one, a DTensor: the tensor)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t)
