"""The planner's tensor-parallel layouts (``strategy: model_parallel`` without a pipeline): memory simulated
with distrain's own ModelParallelStrategy on a fake process group, against MemTracker's peak of a real run
(2 ranks in tests/test_planner.py's accuracy grid, 4 ranks of TP × FSDP here), and the collectives the
simulated step sends, which its predicted time is made of. (Predicted against measured step times:
benchmarks/plan_time.py.)"""

from __future__ import annotations

import json

import pytest
from plan_measure import Case, hf_dirs, measure_cases, predict

from distrain import cli
from distrain.planner import Estimator, Job, ModelSpec, Option
from distrain.planner.simulate import simulate_tensor_parallel
from distrain.planner.timing import Hardware
from helpers import run_ranks

MiB = 2**20
B, T = 8, 128


@pytest.fixture(scope="module")
def gpt_mini():
    spec = ModelSpec.builtin_gpt("gpt-mini", T)
    return spec, {sp: simulate_tensor_parallel(spec, B, world_size=2, tensor=2, sequence_parallel=sp) for sp in (0, 1)}


def test_each_rank_holds_half_the_model_and_sends_each_layers_activations(gpt_mini):
    """TP2: parameters, gradients and Adam's moments split in two. Without sequence parallelism every
    block all-reduces its attention and MLP outputs (one activation, B × T × C fp32) in forward and their
    inputs' gradients in backward; with it, the same activations travel as all-gathers and
    reduce-scatters instead (one all-reduce is left, at the tied embedding and head)."""
    spec, sim = gpt_mini
    whole = Estimator(Job(spec, B, world_size=2)).estimate(Option("ddp"))
    for step in sim.values():
        assert abs(2 * step.params - whole.params) / whole.params < 0.01
        assert step.grads == step.params  # AdamW: two moments, and a step count per parameter
        assert 2 * step.params <= step.optimizer < 2 * step.params + 4096
    activation = B * T * 384 * 4
    layers = spec.num_blocks
    plain = [size for kind, size, _, _ in sim[0].collectives if kind == "all_reduce" and size == activation]
    assert len(plain) >= 2 * layers, sim[0].collectives
    split = sim[1].collectives
    assert len([s for kind, s, _, _ in split if kind == "all_reduce" and s == activation]) <= 1  # the tied head's
    gathered = [s for kind, s, _, _ in split if kind == "all_gather" and s == activation]
    scattered = [s for kind, s, _, _ in split if kind == "reduce_scatter" and s == activation]
    assert len(gathered) >= 2 * layers and len(scattered) >= 2 * layers
    assert all(ranks == 2 and not fsdp for _, _, ranks, fsdp in sim[0].collectives + split)


def test_the_plan_has_a_row_for_the_layout_model_parallel_runs(capsys, tmp_path, monkeypatch):
    """``distrain plan --strategy model_parallel`` plans the layout the run would take (tensor parallel
    over the node's devices; sequence parallelism as configured), with its time; the whole plan lists it
    beside the others (at the accumulation that keeps the global batch), tracing no step twice; a model without a
    plan, or a size that does not divide its heads, gets the run's own one line."""
    from distrain.planner import estimate

    traced = []

    def trace_step(spec, micro_batch, **kwargs):
        traced.append((spec.name, micro_batch, tuple(sorted(kwargs.items()))))
        return original(spec, micro_batch, **kwargs)

    original = estimate.trace_step
    monkeypatch.setattr(estimate, "trace_step", trace_step)
    args = ["plan", "--devices", "2", "--accelerator", "cpu", "--json"]
    assert cli.main([*args, "--strategy", "model_parallel", "distributed.sequence_parallel=false"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["activation_checkpointing"] for r in out["rows"]] == [0, "all"]  # with and without
    for row in out["rows"]:
        assert row["strategy"] == "model_parallel" and row["tensor_parallel_size"] == 2
        assert row["sequence_parallel"] is False and row["fits"] and row["step_seconds"] > 0
    traced.clear()
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert "model_parallel" in [r["strategy"] for r in out["rows"]]
    assert out["recommendation"] in ("ddp", "fsdp")
    # the layouts' planners (another accumulation) share the traced steps: each was traced once, not once a layout
    assert traced and len(set(traced)) == len(traced), traced
    # a pipeline is planned, and so is one of tensor-parallel stages (3-D): tests/test_plan_pipeline.py
    assert cli.main([*args, "--strategy", "model_parallel", "distributed.pipeline_stages=2"]) == 0
    assert {r["pipeline_stages"] for r in json.loads(capsys.readouterr().out)["rows"]} == {2}
    from distrain.hf.tiny import make_tiny_bert

    bert = ["--model-name", make_tiny_bert(str(tmp_path / "bert"))]
    assert cli.main([*args, *bert, "--strategy", "model_parallel"]) == 2
    assert "has no built-in tensor-parallel plan" in capsys.readouterr().err
    # tensor_parallel_size=1: nothing split (FSDP over both ranks runs any model), so no plan is needed
    assert cli.main([*args, *bert, "--strategy", "model_parallel", "distributed.tensor_parallel_size=1"]) == 2
    assert "is not planned" in capsys.readouterr().err
    assert cli.main([*args, *bert]) == 0  # the whole plan leaves the layout out
    assert "model_parallel" not in [r["strategy"] for r in json.loads(capsys.readouterr().out)["rows"]]
    four = ["plan", "--devices", "4", "--accelerator", "cpu", "--model-name", "gpt-mini"]
    assert cli.main([*four, "--strategy", "model_parallel", "distributed.tensor_parallel_size=4"]) == 2
    assert "tensor_parallel_size=4 must divide the model's n_head=6" in capsys.readouterr().err


def test_fsdp_over_the_data_parallel_ranks_crosses_nodes_and_tensor_parallel_does_not():
    """TP2 × FSDP on 4 ranks: the simulated step sends FSDP's gathers and reductions over the 2 data-parallel
    ranks beside the tensor-parallel collectives. Over 2 nodes only FSDP's take the slow link."""
    spec = ModelSpec.builtin_gpt("gpt-tiny", 64)
    option = Option("tp", sharding="FULL_SHARD", tensor=2, sequence_parallel=True)
    step = simulate_tensor_parallel(spec, 4, world_size=4, tensor=2)
    assert {fsdp for *_, fsdp in step.collectives} == {True, False}
    hw = Hardware(1e15, 1e15, 0.0, intra_bandwidth=1e10, inter_bandwidth=1e7, collective_seconds=0.0)
    one_node = Estimator(Job(spec, 4, world_size=4)).step_time(option, hw)
    two_nodes = Estimator(Job(spec, 4, world_size=4, num_nodes=2)).step_time(option, hw)
    fsdp_bytes = sum(size for kind, size, _, fsdp in step.collectives if fsdp)
    # ring over 2 ranks: each sends half of what it gathers or reduces, at 1e7 B/s instead of 1e10
    slower = 0.5 * fsdp_bytes * (1 / 1e7 - 1 / 1e10)
    assert two_nodes.communication - one_node.communication == pytest.approx(slower, rel=1e-6)
    tp_only = Estimator(Job(spec, 4, world_size=2)).step_time(Option("tp", tensor=2, sequence_parallel=True), hw)
    assert tp_only.communication < one_node.communication


@pytest.mark.slow
def test_tensor_parallel_with_fsdp_peaks_within_ten_percent_of_measured_on_4_ranks(tmp_path):
    """TP2 × FSDP2 on 4 real ranks (GPT, Llama, and a GPT whose blocks are mixtures of experts): the simulated peak
    against MemTracker's."""
    cases = [
        Case("gpt-mini", "tp×fsdp", False, 8),
        Case("tiny-llama", "tp×fsdp", False, 16),
        Case("gpt-tiny-moe", "tp×fsdp", False, 8),
    ]
    hf = hf_dirs(str(tmp_path))
    measured = run_ranks(measure_cases, 4, cases, 4, hf, str(tmp_path))
    for i, case in enumerate(cases):
        peak = max(rank[i] for rank in measured)
        predicted = predict(case, 4, hf).peak
        print(f"{case.label}: predicted {predicted / MiB:.1f} MiB, measured {peak / MiB:.1f} MiB")
        assert abs(predicted - peak) / peak < 0.10, case.label


def test_memory_trackers_count_a_dtensors_local_shard_not_its_sharding_propagation():
    """DTensor finds each operation's output shape by running it again on fake tensors of the whole (global)
    shape, in the fake mode it finds active: the planner's own. The planner's trackers count only the local
    shards an operation computes: a tensor-parallel loss over a 128k vocabulary at 8192 tokens was planned with
    7.6 GiB of logits no rank holds."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from distrain.planner import fake

    with fake.fake_process_group(8):
        mesh = init_device_mesh("cpu", (8,))
        with fake.fake_tensor_mode(allow_non_fake_inputs=True):
            local = torch.randn(1, 2**20)  # 4 MiB a rank, 32 MiB whole
            whole = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            tracker = fake.peak_memory_tracker()
            with tracker:
                doubled = whole * 2
                shifted = doubled + 1
            assert tracker.peak_bytes() == 2 * 4 * MiB  # the two local results, not 2 × 32 MiB
            del doubled, shifted
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    # put back when the tracker exits
    assert ShardingPropagator._propagate_tensor_meta_non_cached.__name__ == "_propagate_tensor_meta_non_cached"
    # FSDP's tracker (whose parameters are DTensors) looks away the same way
    assert "__torch_dispatch__" in vars(fake.fsdp_memory_tracker_class())
