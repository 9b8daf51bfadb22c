"""Every private or version-sensitive call into torch, DeepSpeed and transformers, in one place.

Each function names what it relies on and the versions it was checked against; each has a test in
``tests/test_compat.py`` that exercises the real call, so an upgrade that moves one fails there,
by name, instead of deep inside a training run. Supported torch: see ``pyproject.toml``. The planner's own
private calls (fake tensors, memory trackers, the fake process group) are in ``distrain/planner/fake.py``, under
the same rule.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("distrain")

# ---- torch.distributed ------------------------------------------------------------------------------


def default_store() -> dist.Store:
    """The default group's rendezvous store (the hang watch writes progress records into it).
    ``distributed_c10d._get_default_store``: checked on torch 2.13.0; torchtitan uses it too."""
    return dist.distributed_c10d._get_default_store()


def set_group_timeouts(timeout: timedelta) -> None:
    """The timeout of every process group this rank belongs to. torch has no public setter;
    ``_set_pg_timeout`` (checked on torch 2.13.0) is what torchtitan uses for the same purpose."""
    c10d = dist.distributed_c10d
    groups = [None] + [pg for pg in list(c10d._world.pg_map) if pg is not c10d._get_default_group()]
    for group in groups:
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, RuntimeError, AssertionError) as e:  # not a member, or a backend without timeouts
            logger.debug("distrain: could not set the timeout of process group %s: %s", group, e)


def bf16_compress_hook_gloo(process_group, bucket):
    """torch's own bf16 compression hook, under a name DDP does not refuse on gloo: DDP rejects any
    hook *named* ``bf16_compress_hook`` unless NCCL is used, yet gloo all-reduces bf16 fine.
    ``default_hooks._compress_hook``: checked on torch 2.13.0."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def checkpoint_wrapper_api():
    """torch's activation-checkpoint wrappers (``checkpoint_wrapper``, ``apply_activation_checkpointing``,
    ``CheckpointImpl``) live in a private module path: checked on torch 2.13.0 (FSDP2 docs use it)."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

    return checkpoint_wrapper


def fsdp1_policy_targets(root: torch.nn.Module, policy: Any) -> list[torch.nn.Module]:
    """The modules below ``root`` that FSDP1's ``auto_wrap_policy`` would wrap, found by FSDP1's own walk: torch's
    ``_recursive_wrap`` (a callable called as ``policy(module=, recurse=, nonwrapped_numel=)``, the remainder counting
    the parameters no wrapped child took: ``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy`` and
    ``lambda_auto_wrap_policy`` partials) with a "wrapper" that only records, or a ``_Policy``'s ``_run_policy``
    (``ModuleWrapPolicy``, ``CustomPolicy``). Both private in ``torch.distributed.fsdp.wrap``; checked on torch
    2.13.0, as Lightning's FSDPStrategy hands them to FSDP1."""
    from torch.distributed.fsdp import wrap

    if isinstance(policy, wrap._Policy):
        chosen = policy._run_policy(root, set(), {})
    else:
        chosen = []

        def record(module, **_):
            chosen.append(module)
            return module

        wrap._recursive_wrap(root, policy, record, set(), set(), only_wrap_children=True)
    return [m for m in root.modules() if m is not root and m in chosen]


@functools.cache  # asked at every selectively checkpointed forward; torch's list is fixed for the process
def compute_intensive_ops() -> frozenset:
    """The operations torch's partitioner counts as compute-intensive (matmuls, convolutions, the fused attention
    kernels of CUDA), whose outputs selective activation checkpointing keeps: ``torch._functorch.partitioners.
    get_default_op_list().compute_intensive_ops``, as torchtitan's selective checkpointing reads it. Checked on torch
    2.13.0."""
    from torch._functorch.partitioners import get_default_op_list

    return frozenset(op.default for op in get_default_op_list().compute_intensive_ops)


def unwrapped_name(name: str) -> str:
    """A parameter's name without what torch's wrappers insert: activation checkpointing's
    ``_checkpoint_wrapped_module.`` and ``torch.compile``'s ``_orig_mod.`` (checked on torch 2.13.0)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def optimizer_load_options(stored: dict, options):
    """``set_optimizer_state_dict`` with a full state dict asserts ("Expected device to be set", torch
    2.13.0) when the stored state holds no tensor at all — plain SGD, say. There is nothing to
    distribute then: load it as a local state dict (param groups by name). Decided on what was stored:
    a freshly built optimizer has no state yet, whatever it will hold."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    per_param = stored.get("state", {}).values() if isinstance(stored, dict) else []
    has_tensors = any(
        isinstance(v, torch.Tensor) and v.dim() > 0 for s in per_param if isinstance(s, dict) for v in s.values()
    )
    if options.full_state_dict and not has_tensors:
        return StateDictOptions(full_state_dict=False, strict=options.strict)
    return options


def plain_random_sampler(sampler: Any) -> bool:
    """A RandomSampler that is a plain shuffle (no replacement, no fixed ``num_samples``), which
    distrain can replace by its distributed sampler. ``RandomSampler._num_samples``: torch 2.13.0."""
    from torch.utils.data import RandomSampler

    return type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None


def flatten_mesh(mesh, name: str):
    """Several dimensions of a ``DeviceMesh`` as one (FSDP2 over data × context parallel ranks, torchtitan's
    ``dp_shard_cp``): ``DeviceMesh._flatten``, private in torch 2.13."""
    return mesh._flatten(name)


def all_gather_differentiable(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim``, with a backward that hands each rank its part's
    gradient (context parallelism: the whole sequence's logits). ``torch.distributed.nn.functional.all_gather``
    is deprecated for this functional collective (torch 2.13)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    return wait_tensor(all_gather_single_autograd(tensor.contiguous(), dim, group))


# ---- fake tensors ------------------------------------------------------------------------------------


def is_fake(tensor: torch.Tensor) -> bool:
    """A tensor of ``FakeTensorMode`` (also inside a DTensor): no values. ``torch._subclasses.fake_tensor.is_fake``:
    checked on torch 2.13.0."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(getattr(tensor, "_local_tensor", tensor))


# ---- DeepSpeed ----------------------------------------------------------------------------------------
# Checked against deepspeed 0.19.8.


@contextlib.contextmanager
def deepspeed_without_shm_op():
    """``deepspeed.init_distributed`` on CPU JIT-loads its shared-memory all-reduce op
    (``deepspeed_shm_comm``), which only its inference all-reduce uses. Each load takes torch's file
    lock in ~/.cache/torch_extensions; a rank killed inside that window leaves the lock behind, and
    every later DeepSpeed run on the machine waits on it forever. Training never uses the op: mark it
    incompatible for the call (``deepspeed.ops.__compatible_ops__``, read by
    ``deepspeed.comm.torch.build_shm_op``: deepspeed 0.19.8)."""
    import deepspeed.ops

    ops = deepspeed.ops.__compatible_ops__
    before = ops.get("deepspeed_shm_comm")
    ops["deepspeed_shm_comm"] = False
    try:
        yield
    finally:
        if before is None:
            ops.pop("deepspeed_shm_comm", None)
        else:
            ops["deepspeed_shm_comm"] = before


#: an entry of ``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder parses it: major.minor, maybe +PTX
_PLAIN_ARCH = re.compile(r"^\d+\.\d+(\+PTX)?$")
#: an entry with an architecture variant ("9.0a": Hopper's, "10.0f": Blackwell's family), as torch and images write it
_VARIANT_ARCH = re.compile(r"^(\d+\.\d+)[a-z]+(\+PTX)?$")


@contextlib.contextmanager
def deepspeed_parsable_arch_list():
    """DeepSpeed's JIT op builder (``CUDAOpBuilder.compute_capability_args``, deepspeed 0.19.8; deepspeedai/DeepSpeed
    PR #8619, open) parses each ``TORCH_CUDA_ARCH_LIST`` entry's numbers with ``int()``, so an architecture variant
    ("9.0a", which Hopper images set) kills the build of FusedAdam and CPU Adam before anything compiles, and ZeRO
    ran with torch's AdamW without a word. For the build only, each such entry becomes its plain number ("9.0a" →
    "9.0": what these ops need); an entry neither form reads, and an empty list, become the devices' capabilities.
    The variable is given back as it was afterwards. A list DeepSpeed parses is left alone."""
    import os

    raw = os.environ.get("TORCH_CUDA_ARCH_LIST")
    entries = [e.strip() for e in (raw or "").replace(" ", ";").split(";") if e.strip()]
    if raw is None or all(_PLAIN_ARCH.match(e) for e in entries):
        yield
        return
    plain = [f"{m[1]}{m[2] or ''}" for m in map(_VARIANT_ARCH.match, entries) if m is not None]
    plain += [e for e in entries if _PLAIN_ARCH.match(e)]
    if not plain or len(plain) < len(entries):
        plain = [f"{a}.{b}" for a, b in map(torch.cuda.get_device_capability, range(torch.cuda.device_count()))]
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(plain))
    try:
        yield
    finally:
        os.environ["TORCH_CUDA_ARCH_LIST"] = raw


#: ``deepspeed.utils.groups``' module globals that hold process groups, and their values before any is made
_DEEPSPEED_GROUP_GLOBALS = {
    **dict.fromkeys(("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"), None),
    **dict.fromkeys(("_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mpu", "mesh_device"), None),
    **dict.fromkeys(("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK"), None),
    **dict.fromkeys(("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"), dict),
    **dict.fromkeys(("_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS"), dict),
}


def deepspeed_forget_ended_groups() -> bool:
    """DeepSpeed keeps the process groups it makes (its copy of the world group, ZeRO's, the experts') in module
    globals of ``deepspeed.utils.groups`` for the life of the process (deepspeed 0.19.8). When the process group
    they were made from has ended and another begun in the same process (a second run after one that ended its
    group: distrain verify's cells sharing their ranks, a notebook), the next engine broadcasts over a destroyed
    group: "Group ... is not registered". Before an engine is made, if any of them belongs to no live group
    (``distributed_c10d._world.pg_map``, torch 2.13.0), all of them are forgotten, and DeepSpeed makes them again.
    True when it forgot."""
    from deepspeed.utils import groups

    live = dist.distributed_c10d._world.pg_map

    def ended(value) -> bool:
        if isinstance(value, dict):
            return any(ended(v) for v in value.values())
        return isinstance(value, dist.ProcessGroup) and value not in live

    if not any(ended(getattr(groups, name, None)) for name in _DEEPSPEED_GROUP_GLOBALS):
        return False
    for name, initial in _DEEPSPEED_GROUP_GLOBALS.items():
        setattr(groups, name, initial() if initial is dict else initial)
    return True


def cpu_info_asked_once() -> None:
    """py-cpuinfo's ``get_cpu_info()`` answers from a new Python process on every call (about 1 s on this machine's
    2 cores, more when they are busy), and DeepSpeed asks it for each CPU Adam it builds and for each op it checks
    (``deepspeed.ops.adam.cpu_adam``, ``op_builder.builder``: three or four times as an offloaded run starts, on every
    rank). The answer does not change while a process lives: kept after the first call. DeepSpeed imports the
    function where it calls it (deepspeed 0.19.8), so the module's attribute is the one to replace."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    import copy
    import functools

    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())  # each caller its own copy, as from the real function

    get_cpu_info.asked_once = True
    cpuinfo.get_cpu_info = get_cpu_info


@contextlib.contextmanager
def deepspeed_universal_loading(engine):
    """Load the next checkpoint in DeepSpeed's universal format (resharded to this world size).
    The switch is the engine config's ``load_universal_checkpoint`` (deepspeed 0.19.8); DeepSpeed
    reads it on each ``load_checkpoint``."""
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False


def deepspeed_to_universal(input_folder: str, output_folder: str) -> None:
    """DeepSpeed's ``ds_to_universal`` converter, called as its command line would (it has no
    function API): deepspeed 0.19.8."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(
        input_folder=input_folder,
        output_folder=output_folder,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )  # the version record Megatron clients write
    with contextlib.redirect_stdout(None):
        ds_to_universal.main(args)


# ---- transformers ---------------------------------------------------------------------------------------
# Checked against transformers 5.23.


def transformers_no_init_weights():
    """Build a model without running its initializers (``transformers.initialization.no_init_weights``
    in 5.x)."""
    from transformers.initialization import no_init_weights

    return no_init_weights()


# ---- torchao (precision="fp8") ------------------------------------------------------------------------------
class DropImportNoise(logging.Filter):
    """torchao 0.18 on a CPU build of torch: importing it (transformers does, for any model) warns that its
    CUDA kernels cannot load and makes torch warn about its enum registrations. Neither says anything a
    user can act on; only these two messages are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cpu_kernels = message.startswith("Failed to load") and ".so" in message and not torch.cuda.is_available()
        return not (cpu_kernels or "is an Enum subclass and is now natively supported by torch.compile" in message)


# ---- ring attention (torch.distributed.tensor.experimental._context_parallel) ----------------------------------
# Checked against torch 2.13.0.


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


# ---- torch.distributed.pipelining -----------------------------------------------------------------------------
# Checked against torch 2.13.0.


def pipeline_stage(module, stage_index: int, num_stages: int, device, group):
    """A ``PipelineStage`` (public) whose shapes are learned from the first micro-batch at run time, and which holds
    what it receives and sends only while its micro-batch needs it (``_in_flight_stage``)."""
    return _in_flight_stage()(module, stage_index, num_stages, device, group=group)


@functools.cache
def _in_flight_stage():
    """A stage that holds a micro-batch's receive buffers and sends only while they are needed. torch 2.13 holds
    far more, which is what a rank runs out of memory on at many micro-batches:

    - ``PipelineStage`` allocates, once, a receive buffer for every micro-batch of a step, the activation from the
      stage before and the gradient from the stage after, for each of a rank's stages, for the life of the
      schedule. Here a micro-batch's buffers are allocated when its receive is posted and dropped once its
      backward is done.
    - GPipe and the looped schedules (``_PipelineScheduleRuntime``: Interleaved1F1B, LoopedBFS) keep each send's
      work, and through it the tensor sent, to the step's end. Here an activation sent forward is let go at its
      micro-batch's backward (the stage after has sent its gradient back, so it received the activation long
      ago), and, under a looped schedule, a gradient sent back once a later message from that rank proves it was
      received (``release_sent_gradients``). What is let go is the tensor the send holds (a detached alias, or
      the gradient itself), set to nothing: storage anything else holds stays.
    - The schedule keeps each micro-batch's loss to the step's end, and through its graph the last stage's received
      input and that input's gradient; a loss is detached once its backward is done.

    GPT-3 175B over 8 × 8 ranks at 64 micro-batches (docs/plan.md, ``K3``) held 36 GiB of buffers alone, where
    Megatron-LM holds only the micro-batches in flight.

    Relied on, checked on torch 2.13.0 (``stage.py``, ``schedules.py``): ``_setup_forward_recv_info(num_microbatches,
    has_backward)`` fills ``args_recv_info[chunk]`` with ``_RecvInfo``s, each chunk's alike but for its buffer;
    ``_create_grad_recv_info`` makes one chunk's ``grad_recv_info``; ``get_fwd_recv_ops`` / ``get_bwd_recv_ops``
    post a chunk's receives into ``info.buffer``, a buffer of None with a ``tensor_meta`` being a receive not yet
    posted; ``get_fwd_send_ops`` / ``get_bwd_send_ops`` return ``P2POp``s of the tensors sent; a looped schedule
    calls ``forward_one_chunk`` / ``backward_one_chunk`` once it has waited for the chunk's receives;
    ``_make_tensor_from_meta`` (``_utils.py``) is how torch makes a buffer."""
    import copy

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import _make_tensor_from_meta

    def received(infos):
        return [i for i in infos if not i.is_root_arg and i.tensor_meta is not None]

    def unallocated(infos):
        # a copy of each: the chunks' infos must not share one buffer
        return tuple(copy.copy(i) for i in infos)

    def release(infos):
        for info in received(infos):
            info.buffer = None

    def let_go(tensors):
        with torch.no_grad():
            for tensor in tensors:
                tensor.set_()

    class InFlightStage(PipelineStage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._sent_forward: dict[int, list[torch.Tensor]] = {}
            self.sent_gradients: _SentGradients | None = None  # a looped schedule's (release_sent_gradients)

        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            super()._setup_forward_recv_info(1, has_backward)  # one chunk's infos (and one buffer, dropped here)
            first = self.args_recv_info[0]
            release(first)
            for chunk in range(num_microbatches):
                self.args_recv_info[chunk] = unallocated(first)

        def _create_grad_recv_info(self, act_send_info):
            infos = unallocated(super()._create_grad_recv_info(act_send_info))
            release(infos)
            return infos

        def _allocate(self, infos):
            for info in received(infos):
                if info.buffer is None:
                    info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            self._allocate(self.args_recv_info[fwd_chunk_id])
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            self._allocate(self.grad_recv_info[bwd_chunk_id])
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            self._sent_forward[fwd_chunk_id] = [op.tensor for op in ops]
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            if self.sent_gradients is not None:
                self.sent_gradients.sent[(self.stage_index, bwd_chunk_id)] = [op.tensor for op in ops]
            return ops

        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            if self.sent_gradients is not None:
                let_go(self.sent_gradients.reached("F", self.stage_index, fwd_chunk_id))
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
            if self.sent_gradients is not None:
                let_go(self.sent_gradients.reached("B", self.stage_index, bwd_chunk_id))
            result = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            if full_backward:  # else the weights' backward, to come, may still need the input
                let_go(self._sent_forward.pop(bwd_chunk_id, ()))
                release(self.args_recv_info[bwd_chunk_id])
                release(self.grad_recv_info.get(bwd_chunk_id, ()))
                if loss is not None and loss.grad_fn is not None and not loss._is_view():
                    loss.detach_()
            return result

        def clear_runtime_states(self) -> None:
            super().clear_runtime_states()
            # an evaluation's forwards, which no backward releases; the step before's sends, waited for at its end
            self._sent_forward.clear()
            if self.sent_gradients is not None:
                self.sent_gradients.sent.clear()
            for infos in (*self.args_recv_info.values(), *self.grad_recv_info.values()):
                release(infos)

    return InFlightStage


class _SentGradients:
    """A looped schedule's gradients sent back, on one rank: each is let go when this rank's compute that first
    waits for a message its receiver sent after consuming it begins (``release_sent_gradients``)."""

    def __init__(self, releases: dict[tuple[str, int, int], list[tuple[int, int]]]):
        self.releases = releases
        self.sent: dict[tuple[int, int], list[torch.Tensor]] = {}

    def reached(self, kind: str, stage: int, chunk: int) -> list[torch.Tensor]:
        """The tensors sent that this compute's received messages prove were received."""
        return [t for sent in self.releases.get((kind, stage, chunk), ()) for t in self.sent.pop(sent, ())]


def release_sent_gradients(schedule, stages) -> None:
    """Under a looped schedule (``_PipelineScheduleRuntime``), let each of this rank's stages go of a gradient it
    sent back once the rank it went to has provably received it: that rank waited for it before its backward of
    that micro-batch, and any message it sends this rank after that backward is waited for here before a forward
    (an activation) or a backward (a gradient, with 2 ranks). The schedule is torch's own lowered order of every
    rank's actions, ``pipeline_order_with_comms`` (``stage_index_to_group_rank``, ``rank``: checked on torch 2.13.0);
    a gradient no later message vouches for (the last backwards of a step) stays to the step's end, as torch keeps
    it. Other schedules: nothing (1F1B waits for each send; GPipe sends nothing back to this rank)."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    registry = (
        _SentGradients(_gradient_releases(order, schedule.stage_index_to_group_rank)[schedule.rank]) if order else None
    )
    for stage in stages:
        stage.sent_gradients = registry


def sent_gradient_releases(orders: dict[int, list[tuple[bool, int, int]]], pipeline: int):
    """What ``release_sent_gradients`` lets each rank go of, and where, for the planner: ``orders`` each rank's
    (forward?, stage, micro-batch) computes in order, stage s on rank s % pipeline, lowered to sends and receives as
    torch lowers a looped schedule's (``schedules._add_send_recv``, checked on torch 2.13.0)."""
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    compute = {
        r: [_Action(stage, Kind.FORWARD if forward else Kind.FULL_BACKWARD, chunk) for forward, stage, chunk in order]
        for r, order in orders.items()
    }
    stages = 1 + max(stage for order in orders.values() for _, stage, _ in order)
    lowered = _add_send_recv(compute, stage_to_rank=lambda s: s % pipeline, num_stages=stages)
    return _gradient_releases(lowered, {s: s % pipeline for s in range(stages)})


def _gradient_releases(order, to_rank) -> dict[int, dict[tuple[str, int, int], list[tuple[int, int]]]]:
    """{rank: {(kind, stage, chunk) of a compute of that rank: the (stage, chunk) gradients it sent that the
    compute's received messages prove received}}. The ranks run ``order`` (each rank's lowered actions) to the end, each
    compute that waits for a message waiting for its send; each rank keeps a vector clock, the last action of
    every rank known to have happened, which a message carries from its send to the compute that waits for it. A
    gradient sent back to rank q is proven received at the sender's first compute whose clock has reached q's
    backward of that stage and chunk (which waited for it): directly or through other ranks' messages."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    backwards = (Kind.FULL_BACKWARD, Kind.BACKWARD_INPUT)

    def awaited(rank, a):
        """The message a compute waits for: ("F", stage, chunk) an activation, ("B", stage, chunk) a gradient."""
        s = a.stage_index
        if a.computation_type == Kind.FORWARD and s > 0 and to_rank[s - 1] != rank:
            return ("F", s, a.microbatch_index)
        if a.computation_type in backwards and s + 1 in to_rank and to_rank[s + 1] != rank:
            return ("B", s, a.microbatch_index)
        return None

    position = {r: 0 for r in order}
    clock = {r: dict.fromkeys(order, -1) for r in order}
    messages: dict[tuple[str, int, int], dict[int, int]] = {}
    # each rank's computes that waited for a message, with what they knew then
    waited: dict[int, list[tuple[tuple[str, int, int], dict[int, int]]]] = {r: [] for r in order}
    moved = True
    while moved:
        moved = False
        for r, actions in order.items():
            while position[r] < len(actions):
                a, i = actions[position[r]], position[r]
                message = awaited(r, a)
                if message is not None and message not in messages:
                    break  # blocked on a send not yet made
                clock[r][r] = i
                if message is not None:
                    for q, known in messages[message].items():
                        clock[r][q] = max(clock[r][q], known)
                    waited[r].append((message, dict(clock[r])))
                if a.computation_type == Kind.SEND_F:
                    messages[("F", a.stage_index + 1, a.microbatch_index)] = dict(clock[r])
                elif a.computation_type == Kind.SEND_B:
                    messages[("B", a.stage_index - 1, a.microbatch_index)] = dict(clock[r])
                position[r] += 1
                moved = True
    consumed = {
        (r, b.stage_index, b.microbatch_index): i
        for r, actions in order.items()
        for i, b in enumerate(actions)
        if b.computation_type in backwards
    }
    releases: dict[int, dict[tuple[str, int, int], list[tuple[int, int]]]] = {r: {} for r in order}
    for r, actions in order.items():
        for a in actions:
            if a.computation_type != Kind.SEND_B:
                continue
            stage, chunk = a.stage_index, a.microbatch_index
            receiver = to_rank[stage - 1]
            at = consumed.get((receiver, stage - 1, chunk))
            proof = next((message for message, known in waited[r] if at is not None and known[receiver] >= at), None)
            if proof is not None:
                releases[r].setdefault(proof, []).append((stage, chunk))
    return releases


def run_pipeline_schedule(schedule, stages, arg_mbs, kwarg_mbs, target_mbs, backward: bool) -> None:
    """One step of a pipelining schedule over micro-batches we made ourselves. The public ``step(batch)``
    splits one whole batch into equal chunks; a Trainer's micro-batches are already made (and may be
    dicts, or differ in length). So this is what ``step()`` does around ``_step_microbatches`` in torch
    2.13.0 (``_PipelineSchedule.eval`` sets ``_has_backward`` the same way): set ``has_backward`` on the
    schedule and its stages, clear each stage's per-step state, run the micro-batch lists."""
    schedule._has_backward = backward
    for stage in stages:
        stage.has_backward = backward
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, None, return_outputs=False)


# ---- transformers (pipeline stages of Llama-style models) -----------------------------------------------------------
def hf_causal_mask(config, inputs_embeds, attention_mask, position_ids):
    """The causal (and padding) mask a Llama-style model builds in its forward, for a pipeline stage that
    runs some of its layers: ``transformers.masking_utils.create_causal_mask(config, inputs_embeds,
    attention_mask, past_key_values, position_ids)`` (transformers 5.4+, pyproject's floor: 5.0–5.3 name the
    embeddings ``input_embeds`` and need ``cache_position``; may return None for SDPA's own causal path)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    # no cache: named ``cache`` since transformers 5.2x (``past_key_values`` is deprecated there, and warns)
    no_cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{no_cache: None},
    )
