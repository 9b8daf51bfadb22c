"""The planner's fake-tensor kit: torch's memory trackers, fake tensors, a fake process group, and the two patches
a traced step needs (device meshes built outside fake mode, transformers' masks answered as in eager mode).

Every call here is private or version-sensitive, as in ``distrain/compat/``, and the same rule holds: each
function names what it relies on and the versions it was checked against, and each has a test in
``tests/test_compat.py`` that exercises the real call. Only the planner uses these; ``compat/`` keeps what the
training path needs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def memory_tracker_class() -> type:
    """torch's ``MemTracker``: a dispatch mode that attributes live tensor memory to parameters,
    gradients, activations, temporaries and optimizer states, and keeps the peak (``_without_sharding_propagation``).
    Public class in a private package (``torch.distributed._tools``): checked on torch 2.13.0."""
    from torch.distributed._tools import MemTracker

    return _without_sharding_propagation(MemTracker)


#: DTensor's sharding propagation runs each operation once more on fake tensors of the whole (global) shape, in the
#: fake mode it finds active (``ShardingPropagator._propagate_tensor_meta_non_cached``, torch 2.13.0). Under the
#: planner's own fake mode a memory tracker would count those whole tensors: a tensor-parallel loss over a 128k
#: vocabulary at 8192 tokens added 7.6 GiB of logits no rank holds. While it propagates, trackers look away.
_propagating = threading.local()


@functools.cache
def _without_sharding_propagation(tracker: type) -> type:
    """``tracker`` (a MemTracker class) that does not count what DTensor's sharding propagation computes."""

    class Tracker(tracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._mod_tracker = _module_tracker_naming_each_root()

        def __enter__(self):
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            if getattr(self, "_propagation_patch", None) is None:
                original = ShardingPropagator._propagate_tensor_meta_non_cached

                def propagate(propagator, op_schema):
                    _propagating.depth = getattr(_propagating, "depth", 0) + 1
                    try:
                        return original(propagator, op_schema)
                    finally:
                        _propagating.depth -= 1

                ShardingPropagator._propagate_tensor_meta_non_cached = propagate
                self._propagation_patch = original
            return super().__enter__()

        def __exit__(self, *args):
            super().__exit__(*args)
            if getattr(self, "_depth", 0) == 0 and getattr(self, "_propagation_patch", None) is not None:
                from torch.distributed.tensor._sharding_prop import ShardingPropagator

                ShardingPropagator._propagate_tensor_meta_non_cached = self._propagation_patch
                self._propagation_patch = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(_propagating, "depth", 0):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    Tracker.__name__ = Tracker.__qualname__ = tracker.__name__
    return Tracker


def _module_tracker_naming_each_root():
    """torch's ``ModTracker`` (which the memory trackers keep as ``_mod_tracker``), naming each module called outside
    the traced model's hierarchy apart. torch names such a root by its class alone, so two different roots of one
    class that nest read as one module entered twice, and it warns "The module hierarchy tracking maybe be messed up"
    on the console at each layer. The ``kernels`` package (which transformers uses when it is installed) makes
    functions such as Llama's ``apply_rotary_pos_emb`` modules of one class, ``Func``, one calling the other: a plan of
    Llama-2-7B printed it 39 times where ``kernels`` is installed (fresh installs of transformers bring it). The first
    root of a class keeps its bare name (the model's own), later ones get ``#2``, ``#3``...
    Overrides ``_get_mod_name`` and sets ``_known_modules``: checked on torch 2.13.0."""
    from torch.distributed._tools.mod_tracker import ModTracker

    class RootNamingModTracker(ModTracker):
        def __init__(self):
            super().__init__()
            self._roots_of_class: dict[str, int] = {}

        def _get_mod_name(self, mod):
            if mod not in self._known_modules:  # a root: not reached as any known module's child
                name = type(mod).__name__
                count = self._roots_of_class[name] = self._roots_of_class.get(name, 0) + 1
                self._known_modules[mod] = name if count == 1 else f"{name}#{count}"
            return super()._get_mod_name(mod)

    return RootNamingModTracker()


def timeline_memory_tracker(on_sample):
    """A ``MemTracker`` that hands its current snapshot (``{device: {kind: bytes}}``, kinds being
    ``_MemRefType`` members and ``"Total"``) to ``on_sample`` after every operation, instead of
    keeping per-module peaks: MemTracker scans every module it has seen after every operation
    (ops × modules: minutes for a 7B model), and the planner needs only the running totals.
    Overrides ``_update_peak_stats`` and reads ``_curr_mem_snap``: checked on torch 2.13.0."""
    MemTracker = memory_tracker_class()

    class TimelineTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            on_sample(self._curr_mem_snap)

    return TimelineTracker()


def peak_memory_tracker():
    """A ``MemTracker`` for whole training runs: MemTracker refuses to see a root module run a
    second time ("does not support memory tracking for multiple iterative calls") unless its
    per-module statistics are reset in between; this one resets them itself, so it can wrap
    ``Trainer.fit``. Overrides ``_pre_fw_hook``: checked on torch 2.13.0."""
    MemTracker = memory_tracker_class()

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the next iteration: only the module statistics start over
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        def peak_bytes(self) -> int:
            """The peak of tensor memory on real devices (meta tensors take none)."""
            snapshot = self.get_tracker_snapshot("peak")
            return sum(per_device["Total"] for device, per_device in snapshot.items() if device.type != "meta")

    return PeakTracker()


def fsdp_memory_tracker_class() -> type:
    """torch's ``FSDPMemTracker`` (the same, aware of FSDP2's sharded/unsharded parameters and its
    all-gather/reduce-scatter buffers); ``torch.distributed._tools``, checked on torch 2.13.0."""
    from torch.distributed._tools import FSDPMemTracker

    return _without_sharding_propagation(FSDPMemTracker)


def fake_tensor_mode(**kwargs: Any):
    """``FakeTensorMode``: tensors with shapes, dtypes and devices but no storage, so a forward and
    backward of a 70B model runs in a few MB. ``torch._subclasses.fake_tensor``: checked on torch 2.13.0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


@contextlib.contextmanager
def fake_process_group(world_size: int, forked_child: bool = False):
    """A default process group of ``world_size`` ranks in this one process that communicates
    nothing (we are rank 0): FSDP2 shards, all-gathers and reduce-scatters as on a real group.
    The "fake" backend registers itself when ``torch.testing._internal.distributed.fake_pg`` is
    imported (checked on torch 2.13.0; torchtitan's memory estimator does the same).

    ``forked_child``: a child forked from a process that holds a group (planning inside a rank, or after a
    run in a notebook) forgets that group — a fresh ``distributed_c10d._World()`` (torch 2.13.0) — and never
    destroys anything: destroying joins the inherited group's threads, which did not survive the fork."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    c10d = dist.distributed_c10d
    inherited = dist.is_initialized()
    if inherited and not forked_child:
        raise RuntimeError("a process group already exists in this process; the fake one needs a process of its own")
    if inherited:
        c10d._world = c10d._World()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        if not inherited:
            dist.destroy_process_group()


@contextlib.contextmanager
def device_meshes_outside_fake_mode():
    """FSDP2 over a tensor-parallel mesh builds a 2-D ``DeviceMesh`` while it shards; a mesh computes
    this rank's coordinates from its rank tensor (``nonzero``), which fake tensors cannot answer. While
    a simulation runs, meshes are built with fake mode off (their rank tensors are small and real).
    ``DeviceMesh.__init__`` and ``unset_fake_temporarily``: checked on torch 2.13.0."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def transformers_as_in_eager():
    """Under fake tensors, transformers' causal-mask code cannot read the values it reads in eager
    mode (are the positions one packed sequence? ``find_packed_sequence_indices``; is the offset a
    traced tensor? ``_ignore_causal_mask_sdpa``), assumes the worst and builds an explicit 4-D mask
    that an eager run of a batch without padding or packing skips (it uses SDPA's ``is_causal``).
    While the planner traces such a batch, both answer as eager does, so the traced step allocates
    what the run will. A mixture of experts' grouped matmul (``torch._grouped_mm``) has a fake kernel that
    takes bf16 only (torch 2.13): its experts run transformers' own per-expert loop instead
    (``grouped_mm_fallback``, the same FLOPs and the same tensors), whose fake is registered and whose FLOPs
    ``work.py`` counts. ``transformers.masking_utils``, ``transformers.integrations.moe``: checked on
    transformers 5.x. A model that did not import transformers runs none of it: nothing to patch (importing it
    costs seconds)."""
    if "transformers" not in sys.modules:
        yield
        return
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = masking_utils._ignore_causal_mask_sdpa

    def eager_answer(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        no_window = local_attention_size is None or kv_length < local_attention_size
        if padding_mask is None and no_window and (q_length == 1 or kv_length == q_length):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    packed = masking_utils.find_packed_sequence_indices
    masking_utils._ignore_causal_mask_sdpa = eager_answer
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # positions 0..T-1: one sequence
    moe = sys.modules.get("transformers.integrations.moe")
    grouped = getattr(moe, "_can_use_grouped_mm", None)
    if grouped is not None:
        moe._can_use_grouped_mm = lambda input, weight, offs: False
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original
        masking_utils.find_packed_sequence_indices = packed
        if grouped is not None:
            moe._can_use_grouped_mm = grouped


@contextlib.contextmanager
def norms_as_on_cuda(enabled: bool = True):
    """A GPU plan traced on the CPU: torch's norms keep what their CUDA kernels keep for the backward.
    - Under CUDA autocast, ``layer_norm`` and ``rms_norm`` run in fp32: their bf16/fp16 inputs are cast, and the
      fp32 copy is what they keep. The CPU's autocast leaves both in bf16.
    - On CUDA, ``rms_norm`` is one fused kernel (``_fused_rms_norm``) that keeps its input and the per-row
      reciprocal RMS. On the CPU it is composed of fp32 operations that keep an fp32 copy of the input.
    Autocast's dispatch keys (``AutocastCUDA`` for both, no ``AutocastCPU``) and the fused kernel: checked on torch
    2.13.0 (``torch._C._dispatch_dump``)."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor import DTensor

    rms_norm, layer_norm = F.rms_norm, F.layer_norm

    def cuda_rms_norm(input, normalized_shape, weight=None, eps=None):
        input, weight = _as_cuda_autocast(input, weight)
        shape = list(normalized_shape)
        eps = torch.finfo(input.dtype).eps if eps is None else float(eps)
        with torch.autocast(input.device.type, enabled=False):
            if isinstance(input, DTensor):  # sequence-parallel norms: no sharding rule for the stand-in kernel
                return rms_norm(input, shape, weight, eps)
            return fused_rms_norm(input, weight, shape, eps)[0]

    def cuda_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        input, weight, bias = _as_cuda_autocast(input, weight, bias)
        with torch.autocast(input.device.type, enabled=False):
            return layer_norm(input, normalized_shape, weight, bias, eps)

    F.rms_norm, F.layer_norm = cuda_rms_norm, cuda_layer_norm
    try:
        yield
    finally:
        F.rms_norm, F.layer_norm = rms_norm, layer_norm


def _as_cuda_autocast(*tensors):
    """``tensors`` as CUDA autocast hands them to a norm: in fp32 where autocast is on (``None`` stays)."""
    if not tensors[0].is_floating_point() or not torch.is_autocast_enabled(tensors[0].device.type):
        return tensors
    return tuple(None if t is None else t.float() for t in tensors)


@torch.library.custom_op("distrain_planner::fused_rms_norm", mutates_args=())
def fused_rms_norm(
    input: torch.Tensor, weight: torch.Tensor | None, shape: list[int], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in for CUDA's ``_fused_rms_norm`` in the planner's traces: one kernel (the work counter sees its
    input, weight, output and per-row reciprocal RMS, as the GPU moves them) that returns the normalized input and
    the reciprocal RMS it keeps for the backward."""
    dims = tuple(range(-len(shape), 0))
    rstd = torch.rsqrt(input.float().pow(2).mean(dims, keepdim=True) + eps)
    out = input.float() * rstd
    return (out if weight is None else out * weight.float()).to(input.dtype), rstd


@fused_rms_norm.register_fake
def _(input, weight, shape, eps):
    rows = input.shape[: input.dim() - len(shape)]
    return torch.empty_like(input), input.new_empty((*rows, *[1] * len(shape)), dtype=torch.float32)


@torch.library.custom_op("distrain_planner::fused_rms_norm_backward", mutates_args=())
def fused_rms_norm_backward(
    grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, shape: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's fused backward, as one kernel: the gradients of the input and of the weight (empty without one)."""
    dims = tuple(range(-len(shape), 0))
    x, g = input.float(), grad.float()
    normed = x * rstd
    gw = g if weight is None else g * weight.float()
    grad_input = rstd * (gw - normed * (gw * normed).mean(dims, keepdim=True))
    rows = tuple(range(input.dim() - len(shape)))
    grad_weight = input.new_empty(0) if weight is None else (g * normed).sum(rows).to(weight.dtype)
    return grad_input.to(input.dtype), grad_weight


@fused_rms_norm_backward.register_fake
def _(grad, input, weight, rstd, shape):
    return torch.empty_like(input), input.new_empty(0) if weight is None else torch.empty_like(weight)


def _keep_for_backward(ctx, inputs, output):
    input, weight, shape, _ = inputs
    ctx.save_for_backward(input, weight, output[1])
    ctx.shape = shape


def _fused_backward(ctx, grad, _grad_rstd):
    input, weight, rstd = ctx.saved_tensors
    grad_input, grad_weight = fused_rms_norm_backward(grad, input, weight, rstd, ctx.shape)
    return grad_input, (None if weight is None else grad_weight), None, None


fused_rms_norm.register_autograd(_fused_backward, setup_context=_keep_for_backward)
