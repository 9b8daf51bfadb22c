"""Each private or version-sensitive call in distrain/compat/ and distrain/planner/fake.py, exercised for real; and
checkpoints written by an earlier distrain (tests/data/previous/) still resume."""

import dataclasses
import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import RandomSampler

import distrain
from distrain import compat
from distrain.parallel import pipeline_memory
from distrain.planner import fake
from helpers import TinyGPT, loader, make_trainer, run_ranks, torchs_interleaved_operations

PREVIOUS = Path(__file__).parent / "data" / "previous"


def test_the_cpu_is_described_once_per_process(monkeypatch):
    import cpuinfo

    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or {"flags": ["avx2"], "arch": "X86_64"})
    compat.cpu_info_asked_once()
    compat.cpu_info_asked_once()  # a second strategy's set-up wraps nothing again
    first, second = cpuinfo.get_cpu_info(), cpuinfo.get_cpu_info()
    assert len(asked) == 1 and first == second == {"flags": ["avx2"], "arch": "X86_64"}
    first["flags"].append("mutated")  # each caller has its own copy, as from the real function
    assert cpuinfo.get_cpu_info()["flags"] == ["avx2"]


def _group_calls(rank):
    distrain.Runtime(strategy="ddp", devices=2, accelerator="cpu").setup_environment()
    store = compat.default_store()
    store.set(f"k{rank}", "v")
    compat.set_group_timeouts(timedelta(seconds=42))
    dist.barrier()  # the group still works under its new timeout
    # bf16 compression of a DDP bucket on gloo: gradients are the bf16-rounded mean
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 1, bias=False))
    ddp.register_comm_hook(None, compat.bf16_compress_hook_gloo)
    ddp(torch.full((1, 4), float(rank + 1))).sum().backward()
    return store.get(f"k{1 - rank}").decode(), ddp.module.weight.grad.tolist()


def test_process_group_store_timeouts_and_bf16_hook():
    results = run_ranks(_group_calls, 2)
    assert [r[0] for r in results] == ["v", "v"]
    assert results[0][1] == results[1][1] == [[1.5, 1.5, 1.5, 1.5]]


def test_checkpoint_wrapper_and_random_sampler():
    api = compat.checkpoint_wrapper_api()
    model = nn.Sequential(nn.Linear(2, 2))
    api.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    assert isinstance(model[0], api.CheckpointWrapper)
    wrapped = [n for n, _ in torch.compile(model).named_parameters()]  # what both wrappers insert into the names
    assert [compat.unwrapped_name(n) for n in wrapped] == ["0.weight", "0.bias"] != wrapped
    assert compat.plain_random_sampler(RandomSampler(range(4)))
    assert not compat.plain_random_sampler(RandomSampler(range(4), replacement=True))
    assert not compat.plain_random_sampler(RandomSampler(range(4), num_samples=2))


def test_deepspeed_record_classes_load_weights_only(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from distrain.checkpoint import safe_load

    torch.save({"stage": ZeroStageEnum.weights}, tmp_path / "x.pt")
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(tmp_path / "x.pt", weights_only=True)
    assert safe_load.load_torch_file(tmp_path / "x.pt")["stage"] == ZeroStageEnum.weights
    with safe_load.deepspeed_loading():
        torch.load(tmp_path / "x.pt", weights_only=False)  # forced to weights_only=True, allowed class
    assert torch.load is torch.serialization.load  # the replacement ends with the context
    assert ZeroStageEnum not in torch.serialization.get_safe_globals()  # allowed only while loading


# ---- checkpoints written by distrain 0.1.0 (tests/data/make_previous_checkpoints.py) ----------------
def _install(tmp: Path, previous: str) -> None:
    shutil.copytree(PREVIOUS / previous, tmp / "checkpoints" / "old")
    (tmp / "checkpoints" / "last").symlink_to("old")


def _continue(tmp, previous: str | None, strategy: str, devices: int, max_steps: int = 6):
    """Train TinyGPT to ``max_steps`` as the fixtures were made (one thread per rank); with ``previous``,
    resume from that checkpoint, written at step 3 by distrain 0.1.0."""
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=devices,
        max_steps=max_steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
    )
    distrain.seed_everything(0)
    module = TinyGPT(dropout=0.1)
    trainer.fit(module, loader(4), ckpt_path="last" if previous else None)
    return distrain.checkpoint_state_of(module), rec.losses


def _loads_exactly_and_continues(continued, ref, ref_losses, stored_model) -> None:
    """The fixtures were written on another machine, whose CPU kernels round differently (a matmul on AVX-512
    is not bit-equal to one on AVX2), so this machine's own run to step 3 differs from the fixture in the last
    bits. What is portable is the load, checked bit for bit; the continuation is checked against this
    machine's uninterrupted run within fp32 rounding (exact resumes on one machine: tests/test_resume.py,
    tests/test_checkpoint_faults.py)."""
    loaded, losses, final = continued
    for name, tensor in stored_model.items():
        assert torch.equal(loaded[f"model.{name}"], tensor), name  # restored exactly as written
    assert losses == pytest.approx(ref_losses[3:], rel=1e-5)
    for k in ref:  # as a whole tensor: Adam turns a rounding-level gradient into an lr-sized step on a few elements
        assert (final[k] - ref[k]).norm() <= 1e-4 * ref[k].norm(), k


def _install_twice(tmp: Path, previous: str) -> None:
    for run in ("load", "continue"):
        _install(tmp / run, previous)


def _resume_and_stop_at(tmp, previous, strategy, devices):
    """Resume the fixture with max_steps 3 (nothing to train: the state as loaded), then train on to 6."""
    loaded, _ = _continue(tmp / "load", previous, strategy, devices, max_steps=3)
    final, losses = _continue(tmp / "continue", previous, strategy, devices)
    return loaded, losses, final


def test_previous_single_checkpoint_loads_exactly_and_continues(tmp_path):
    from distrain.checkpoint.state import read_model_weights

    ref, ref_losses = _continue(tmp_path / "ref", None, "single", 1)
    _install_twice(tmp_path, "single-step3")
    continued = _resume_and_stop_at(tmp_path, "single-step3", "single", 1)
    _loads_exactly_and_continues(continued, ref, ref_losses, read_model_weights(PREVIOUS / "single-step3"))


def _fsdp_rank(rank, tmp, previous):
    if previous is None:
        return _continue(tmp, None, "fsdp", 2)
    return _resume_and_stop_at(tmp, previous, "fsdp", 2)


@pytest.mark.slow
def test_previous_fsdp_checkpoint_loads_exactly_and_continues(tmp_path):
    from distrain.checkpoint.state import read_model_weights

    ref, ref_losses = run_ranks(_fsdp_rank, 2, tmp_path / "ref", None)[0]
    _install_twice(tmp_path, "fsdp2-step3")
    continued = run_ranks(_fsdp_rank, 2, tmp_path, "fsdp2-step3")[0]
    _loads_exactly_and_continues(continued, ref, ref_losses, read_model_weights(PREVIOUS / "fsdp2-step3"))


def test_dcp_metadata_reader_and_extents():
    from distrain.checkpoint import safe_load

    source = PREVIOUS / "fsdp2-step3"
    metadata = safe_load.read_dcp_metadata(source)
    assert any(k.startswith("model.") for k in metadata.state_dict_metadata)
    extents: dict[str, int] = {}
    for info in metadata.storage_data.values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    assert extents == {name: (source / name).stat().st_size for name in extents}  # each shard file, whole
    assert (
        safe_load.dcp_reader(source).read_metadata().state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    )


def test_stateless_optimizer_resumes(tmp_path):
    """Plain SGD has no tensor state; torch 2.13's full-state-dict loading asserts on it."""

    class SGDGPT(TinyGPT):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    first, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=2, logger=False)
    first.fit(SGDGPT(), loader(4))
    second, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=3, logger=False)
    second.fit(SGDGPT(), loader(4), ckpt_path="last")
    assert second.global_step == 3


def test_transformers_builds_without_initializers():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    before = torch.get_rng_state()
    with compat.transformers_no_init_weights():
        LlamaForCausalLM(
            LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
        )
    assert torch.equal(torch.get_rng_state(), before)  # no initializer drew a random number


def test_importing_torchao_through_transformers_is_quiet():
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "import distrain, transformers.modeling_utils, torchao"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr, (
        proc.stderr
    )


# ---- memory planning: torch.distributed._tools, fake tensors and process groups, transformers masks ----------
def test_fake_tensors_fake_process_group_and_memory_trackers():
    with fake.fake_tensor_mode():
        huge = torch.empty(2**40)  # a TiB: shapes and dtypes only
        assert huge.numel() == 2**40
    with fake.fake_process_group(4):
        assert dist.get_world_size() == 4 and dist.get_rank() == 0
    assert not dist.is_initialized()
    samples = []
    model = nn.Linear(64, 64)
    with fake.timeline_memory_tracker(samples.append):
        model(torch.ones(8, 64)).sum().backward()
    totals = [sum(per_device["Total"] for per_device in s.values()) for s in samples]
    assert max(totals) >= 8 * 64 * 4  # at least the output was alive
    tracker = fake.peak_memory_tracker()
    with tracker:
        for _ in range(2):  # MemTracker alone refuses the second iteration
            model(torch.ones(8, 64)).sum().backward()
    assert tracker.peak_bytes() >= 8 * 64 * 4 + 64 * 65 * 4  # the output and the new gradients
    from torch.distributed._tools import FSDPMemTracker, MemTracker

    # torch's trackers, each made to look away from DTensor's sharding propagation (one class each, made once)
    assert issubclass(fake.fsdp_memory_tracker_class(), FSDPMemTracker) and issubclass(FSDPMemTracker, MemTracker)
    assert issubclass(fake.memory_tracker_class(), MemTracker)
    assert fake.memory_tracker_class() is fake.memory_tracker_class()


class _Func(nn.Module):
    """A function made a module outside the model's hierarchy, as the ``kernels`` package makes transformers' rotary
    embedding: a global instance that calls a private one of the same class."""

    def __init__(self, inner=None):
        super().__init__()
        self.__dict__["inner"] = inner  # not a child: each is a root of its own to the trackers

    def forward(self, x):
        return self.inner(x) * 2 if self.inner is not None else x + 1


def test_memory_trackers_see_nested_modules_of_one_class_outside_the_model_without_a_warning():
    """torch's ModTracker names a module outside the model by its class alone, so two such modules of one class
    that nest read as one module entered twice: it warned "The module hierarchy tracking maybe be messed up" on
    the console of `distrain plan` at every layer of Llama where ``kernels`` is installed."""
    stray = _Func(_Func())
    model = nn.Linear(8, 8)
    trackers = [
        lambda: fake.timeline_memory_tracker(lambda snapshot: None),
        fake.peak_memory_tracker,
    ]  # FSDPMemTracker is made by the same class factory (it takes FSDP modules only)
    for make in trackers:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the warning would raise inside the forward's hook
            with make():
                stray(model(torch.ones(4, 8))).sum().backward()


def test_transformers_as_in_eager_under_fake_tensors(tmp_path, monkeypatch):
    """A full-length batch traced under fake tensors holds the activations an eager step does
    (without the context, transformers builds a 4-D mask the eager run skips)."""
    pytest.importorskip("transformers")
    from distrain.hf.tiny import make_tiny_llama
    from distrain.planner.model_stats import (
        ModelSpec,
        Phases,
        create_optimizer_state,
        first_optimizer,
        to_empty_keeping_ties,
        trace_step,
    )

    spec = ModelSpec.huggingface(make_tiny_llama(tmp_path / "llama"), 64)
    traced = trace_step(spec, 4)
    module = spec.build()
    to_empty_keeping_ties(module)
    optimizer = first_optimizer(module.configure_optimizers())
    create_optimizer_state(module, optimizer)
    batch = spec.make_batch(4)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])  # what real data has
    phases = Phases()
    tracker = fake.timeline_memory_tracker(phases.sample)
    tracker.track_external(module, optimizer, *batch.values())
    with tracker:
        loss = module.training_step(batch, 0)
        phases.phase = "backward"
        loss.backward()
    assert traced.activations == pytest.approx(phases.act, rel=0.01)
    import contextlib

    monkeypatch.setattr(fake, "transformers_as_in_eager", contextlib.nullcontext)
    unknown = dataclasses.replace(spec, key=None)  # traced again, not read from the process's traces of this spec
    assert trace_step(unknown, 4).activations > 1.05 * phases.act  # the explicit-mask path the eager run skips


def test_deepspeed_model_state_estimates():
    pytest.importorskip("deepspeed")
    from helpers import deepspeed_model_state_estimates

    psi, layer = 7_000_000_000, 200_000_000
    estimates = deepspeed_model_state_estimates(psi, layer, 8, 1)
    assert estimates["zero2"][1] == 2 * psi + 18 * psi // 8  # 2Ψ + 18Ψ/N on each GPU
    assert estimates["zero2_offload"][1] == 2 * psi
    assert estimates["zero3"][1] == 4 * layer + 18 * psi // 8
    assert estimates["zero3_offload_params"][1] == 4 * layer


def test_deepspeed_groups_of_an_ended_process_group_are_forgotten():
    """A second process group in one process (verify, then fit): DeepSpeed's copy of the first one's world group is
    forgotten before the next engine, and made again from the live group; the live one is never forgotten."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.utils import groups

    def begin():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        with compat.deepspeed_without_shm_op():
            deepspeed.init_distributed("gloo", dist_init_required=False, verbose=False)

    for _ in range(2):
        begin()
        try:
            assert not compat.deepspeed_forget_ended_groups()  # nothing ended yet in this group's life
            first = groups._clone_world_group()
            assert not compat.deepspeed_forget_ended_groups() and groups._clone_world_group() is first
            assert dist.get_global_rank(groups._get_data_parallel_group(), 0) == 0
        finally:
            dist.destroy_process_group()
        begin()
        try:
            with pytest.raises(ValueError, match="not registered"):  # what the next engine's broadcast met
                dist.get_global_rank(groups._clone_world_group(), 0)
            assert compat.deepspeed_forget_ended_groups()
            assert groups._clone_world_group() is not first
            assert dist.get_global_rank(groups._get_data_parallel_group(), 0) == 0
        finally:
            dist.destroy_process_group()
            compat.deepspeed_forget_ended_groups()


def test_deepspeed_init_does_not_load_its_shm_op():
    """Loading it takes a file lock that a killed rank leaves behind (later runs then wait forever)."""
    pytest.importorskip("deepspeed")
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    before = dict(deepspeed.ops.__compatible_ops__)
    with compat.deepspeed_without_shm_op():
        assert build_shm_op() is None
    assert deepspeed.ops.__compatible_ops__ == before


@pytest.mark.parametrize(
    "arch_list, built_for",
    [("8.0;9.0a", "8.0;9.0+PTX"), ("9.0a 10.0f+PTX", "9.0;10.0+PTX"), ("8.6;9.0", "8.6;9.0+PTX")],
)
def test_deepspeed_builds_its_cuda_ops_whatever_variant_the_arch_list_names(monkeypatch, arch_list, built_for):
    """DeepSpeed 0.19.8's CUDA op builder parses the arch list's minor numbers with int(): Hopper images' "9.0a"
    failed every FusedAdam build (issue 59 on an H200). Its real parser, on CPU (``jit_mode``: it reads the
    variable and writes back what it builds for), runs inside distrain's guard; the variable is given back."""
    from importlib import import_module

    builder = import_module("deepspeed.ops.op_builder.fused_adam").FusedAdamBuilder()  # the CUDA one, not CPU's
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    if arch_list != "8.6;9.0":  # when DeepSpeed parses variants itself, this fails: the guard can go
        with pytest.raises(ValueError, match="invalid literal for int"):  # the installed builder's own parse
            builder.compute_capability_args()
    with compat.deepspeed_parsable_arch_list():
        builder.compute_capability_args()
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == built_for
    variant = arch_list != "8.6;9.0"  # a plain list is left to DeepSpeed, which writes back what it built for
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == (arch_list if variant else built_for)


def test_compute_intensive_ops_are_torchs_matmuls_and_attention_kernels():
    """``compat.compute_intensive_ops``: what selective activation checkpointing keeps, read off torch's
    partitioner; the operations must be the ones a block's matmuls and CUDA attention dispatch to."""
    ops = compat.compute_intensive_ops()
    assert {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default} <= ops
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in ops


@pytest.mark.parametrize("pipeline,per_rank,micro", [(2, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_a_sent_gradient_is_let_go_only_after_its_receiver_consumed_it(pipeline, per_rank, micro):
    """``pipeline_memory.release_sent_gradients`` on torch's own lowered Interleaved1F1B order (its rank operations and
    ``_add_send_recv``, the names the looped schedule runs on): each gradient a rank sends back is let go at a
    compute of that rank which first waits for a message its receiver sent after the backward that consumed it, and
    all but the step's last few are let go before the step's end."""
    from torch.distributed.pipelining.schedules import _add_send_recv
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    compute = torchs_interleaved_operations(pipeline, per_rank, micro)
    order = _add_send_recv(compute, stage_to_rank=lambda s: s % pipeline, num_stages=pipeline * per_rank)
    to_rank = {s: s % pipeline for s in range(pipeline * per_rank)}

    def awaited(rank, a):  # the message a compute waits for, by the stage it is sent to
        s, kind = a.stage_index, a.computation_type
        if kind == Kind.FORWARD and s > 0 and to_rank[s - 1] != rank:
            return ("F", s, a.microbatch_index)
        if kind == Kind.FULL_BACKWARD and s + 1 in to_rank and to_rank[s + 1] != rank:
            return ("B", s, a.microbatch_index)
        return None

    # happens-before as a graph (each rank's order, and each send before the compute that waits for it), searched
    # independently of the vector clocks the code keeps
    sends = {}
    for r, actions in order.items():
        for i, a in enumerate(actions):
            if a.computation_type == Kind.SEND_F:
                sends[("F", a.stage_index + 1, a.microbatch_index)] = (r, i)
            elif a.computation_type == Kind.SEND_B:
                sends[("B", a.stage_index - 1, a.microbatch_index)] = (r, i)
    before = {(r, i): [(r, i - 1)] if i else [] for r, actions in order.items() for i in range(len(actions))}
    where = {}
    for r, actions in order.items():
        for i, a in enumerate(actions):
            message = awaited(r, a)
            if message is not None:
                before[(r, i)].append(sends[message])
                where[(r, message)] = i

    def happened_before(first, then):
        seen, todo = set(), [then]
        while todo:
            node = todo.pop()
            if node == first:
                return True
            if node not in seen:
                seen.add(node)
                todo += before[node]
        return False

    every = pipeline_memory._gradient_releases(order, to_rank)
    for me in range(pipeline):
        releases = every[me]
        sent = [(a.stage_index, a.microbatch_index) for a in order[me] if a.computation_type == Kind.SEND_B]
        released = [s for vouched in releases.values() for s in vouched]
        assert sorted(released) == sorted(set(released)) and set(released) <= set(sent)
        assert len(released) >= len(sent) - micro, (me, len(released), len(sent))
        for message, vouched in releases.items():
            for stage_sent, chunk_sent in vouched:
                receiver = to_rank[stage_sent - 1]
                consumed = next(
                    i
                    for i, a in enumerate(order[receiver])
                    if (a.computation_type, a.stage_index, a.microbatch_index)
                    == (Kind.FULL_BACKWARD, stage_sent - 1, chunk_sent)
                )
                assert happened_before((receiver, consumed), (me, where[(me, message)]))


def _is_layer_norm(module):
    return isinstance(module, nn.LayerNorm)


def _is_block(module):
    from distrain.models.gpt import Block

    return isinstance(module, Block)


def _fsdp1_policies():
    """FSDP1's policies, as Lightning's documentation writes them (built in the rank: a partial does not pickle)."""
    import functools

    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    from distrain.models.gpt import Block

    return [
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        ModuleWrapPolicy({Block, nn.Embedding}),
        functools.partial(size_based_auto_wrap_policy, min_num_params=5_000),
        functools.partial(lambda_auto_wrap_policy, lambda_fn=_is_layer_norm),
        CustomPolicy(_is_block),
    ]


def _fsdp1_wrapped(rank):
    """The modules FSDP1 itself wraps under each policy, named; beside what compat.fsdp1_policy_targets finds."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo")
    results = []
    for policy in _fsdp1_policies():
        torch.manual_seed(0)
        found = TinyGPT().gpt
        names = {id(m): n for n, m in found.named_modules()}
        ours = sorted(names[id(m)] for m in compat.fsdp1_policy_targets(found, policy))
        torch.manual_seed(0)
        theirs = FullyShardedDataParallel(
            TinyGPT().gpt, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu")
        )
        wrapped = sorted(
            compat.unwrapped_name(n).replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module")
            for n, m in theirs.named_modules()
            if isinstance(m, FullyShardedDataParallel) and m is not theirs
        )
        results.append((ours, wrapped))
    return results


def test_fsdp1_wrap_policies_choose_the_modules_fsdp1_wraps():
    """``compat.fsdp1_policy_targets`` walks FSDP1's own ``_recursive_wrap`` / ``_run_policy``: the modules it
    returns are those FSDP1's FullyShardedDataParallel wraps under the same policy (Lightning's FSDPStrategy hands
    these to FSDP1; distrain makes each chosen module an FSDP2 unit)."""
    results = run_ranks(_fsdp1_wrapped, 1)[0]
    for i, (ours, theirs) in enumerate(results):
        assert ours == theirs, (i, ours, theirs)
    assert results[0][0] == ["blocks.0", "blocks.1"]
    assert len({tuple(ours) for ours, _ in results}) >= 4  # the policies choose differently: each walk is checked
