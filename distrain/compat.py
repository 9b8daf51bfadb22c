"""Every private or version-sensitive call into torch, DeepSpeed and transformers, in one place.

Each function names what it relies on and the versions it was checked against; each has a test in
``tests/test_compat.py`` that exercises the real call, so an upgrade that moves one fails there,
by name, instead of deep inside a training run. Supported torch: see ``pyproject.toml``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
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


# ---- memory planning (torch.distributed._tools, fake tensors, the fake process group) --------------------


def memory_tracker_class() -> type:
    """torch's ``MemTracker``: a dispatch mode that attributes live tensor memory to parameters,
    gradients, activations, temporaries and optimizer states, and keeps the peak. Public class in a
    private package (``torch.distributed._tools``): checked on torch 2.13.0."""
    from torch.distributed._tools import MemTracker

    return MemTracker


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

    return FSDPMemTracker


def fake_tensor_mode(**kwargs: Any):
    """``FakeTensorMode``: tensors with shapes, dtypes and devices but no storage, so a forward and
    backward of a 70B model runs in a few MB. ``torch._subclasses.fake_tensor``: checked on torch 2.13.0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake(tensor: torch.Tensor) -> bool:
    """A tensor of ``FakeTensorMode`` (also inside a DTensor): no values. ``torch._subclasses.fake_tensor.is_fake``:
    checked on torch 2.13.0."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(getattr(tensor, "_local_tensor", tensor))


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
def transformers_masks_as_in_eager():
    """Under fake tensors, transformers' causal-mask code cannot read the values it reads in eager
    mode (are the positions one packed sequence? ``find_packed_sequence_indices``; is the offset a
    traced tensor? ``_ignore_causal_mask_sdpa``), assumes the worst and builds an explicit 4-D mask
    that an eager run of a batch without padding or packing skips (it uses SDPA's ``is_causal``).
    While the planner traces such a batch, both answer as eager does, so the traced step allocates
    what the run will. ``transformers.masking_utils``: checked on transformers 5.x. A model that did not import
    transformers runs none of it: nothing to patch (importing it costs seconds)."""
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
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original
        masking_utils.find_packed_sequence_indices = packed


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
    in 5.x; ``modeling_utils.no_init_weights`` before)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


# ---- torchao (precision="fp8") ------------------------------------------------------------------------------
class _DropImportNoise(logging.Filter):
    """torchao 0.18 on a CPU build of torch: importing it (transformers does, for any model) warns that its
    CUDA kernels cannot load and makes torch warn about its enum registrations. Neither says anything a
    user can act on; only these two messages are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cpu_kernels = message.startswith("Failed to load") and ".so" in message and not torch.cuda.is_available()
        return not (cpu_kernels or "is an Enum subclass and is now natively supported by torch.compile" in message)


def deepspeed_model_state_estimates(
    total_params: int, largest_layer_params: int, gpus_per_node: int, num_nodes: int
) -> dict[str, tuple[int, int]]:
    """DeepSpeed's own estimators of ZeRO-2/3 model-state memory (fp16/bf16 params + Adam), as
    ``{option: (host bytes, device bytes)}``, for cross-checking the planner. The functions live
    in ``deepspeed.runtime.zero.stage_1_and_2`` / ``stage3`` (deepspeed 0.19.8); their
    ``additional_buffer_factor`` pads the host figure only, and is left at 1 here."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    out = {}
    for offload in (False, True):
        host, device = estimate_zero2_model_states_mem_needs(
            total_params, gpus_per_node, num_nodes, cpu_offload=offload, additional_buffer_factor=1
        )
        out[f"zero2{'_offload' if offload else ''}"] = (host, device)
    for offload, offload_params in ((False, False), (True, False), (True, True)):
        host, device, _ = estimate_zero3_model_states_mem_needs(
            total_params,
            largest_layer_params,
            gpus_per_node,
            num_nodes,
            cpu_offload=offload,
            cpu_offload_params=offload_params,
            zero_init=True,
            additional_buffer_factor=1,
        )
        name = "zero3" + ("_offload_params" if offload_params else "_offload" if offload else "")
        out[name] = (host, device)
    return out


# ---- torch.distributed.pipelining -----------------------------------------------------------------------------
# Checked against torch 2.13.0.


def pipeline_stage(module, stage_index: int, num_stages: int, device, group):
    """A ``PipelineStage`` (public) whose shapes are learned from the first micro-batch at run time."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(module, stage_index, num_stages, device, group=group)


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
    attention_mask, past_key_values, position_ids)`` (transformers 5.x; may return None for SDPA's
    own causal path)."""
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
