"""DeepSpeed's private and version-sensitive calls: its op builder on a CPU machine, its process-group globals,
universal checkpoints. Each names what it relies on and the versions it was checked against;
``tests/test_compat.py`` exercises each for real (``distrain/compat/__init__.py``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import re

import torch
import torch.distributed as dist

logger = logging.getLogger("distrain")

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
