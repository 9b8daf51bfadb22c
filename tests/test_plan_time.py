"""The planner's time per step: the traced work against the model's arithmetic, the bytes each option
communicates, the step's arithmetic on given rates, "auto" choosing as its prediction says, and the
what-if table over cluster shapes. (Predicted against measured step times: benchmarks/plan_time.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from distrain import cli
from distrain.planner import Budget, Job, ModelSpec, Option, Planner
from distrain.planner.model_stats import trace_step
from distrain.planner.timing import (
    Collective,
    Hardware,
    StepTime,
    collective_seconds,
    copy_seconds,
    cpu_hardware,
    gloo_allreduce,
    step_at_depth,
    work_seconds,
)

B, T, D, L, V = 4, 64, 128, 4, 256  # gpt-tiny: 4 blocks of width 128, a byte vocabulary, at 4 × 64 tokens
LINEAR = 2 * B * T * (12 * D * D * L + D * V)  # qkv, proj, fc, fc proj per block; the (tied) head
ATTENTION = 4 * B * T * T * D * L  # q·kᵀ and scores·v over the full T×T, as torch counts it
LAST_MATMUL = 2 * B * T * 4 * D * D  # each block's mlp.proj


@pytest.fixture(scope="module")
def traces():
    spec = ModelSpec.builtin_gpt("gpt-tiny", T)
    return {ac: trace_step(spec, B, checkpoint=ac) for ac in (0, None)}


def test_traced_flops_are_the_models_arithmetic(traces):
    work = traces[0].work.phases
    # the fused attention kernel's FLOPs apart from the matmuls' (a GPU runs them at another rate)
    assert work["forward"].flops == LINEAR and work["forward"].attention_flops == ATTENTION
    # backward: the input and the weight gradient of every matmul; attention's backward is 2.5× its forward
    assert work["backward"].flops == 2 * LINEAR and work["backward"].attention_flops == 2.5 * ATTENTION
    assert work["step"].flops == work["step"].attention_flops == 0 and work["step"].bytes > 0  # AdamW: memory-bound
    # bytes: at least each parameter, gradient and both moments read and written once by the step
    assert work["step"].bytes >= 2 * 4 * traces[0].param_bytes


def test_per_element_operations_and_softmax_are_counted_by_element_and_timed(traces):
    """GELU (and its backward) computes per element, and the loss's log-softmax over the vocabulary per logit: on a
    CPU core both run far below memory speed (GPT-2's 50k-vocabulary cross-entropy took 2.5 s of a 24 s step), so
    they are counted by element, not by byte, and timed at the measured seconds per element."""
    work = traces[0].work.phases
    for phase in ("forward", "backward"):
        assert work[phase].elements == B * T * 4 * D * L  # the MLP's hidden activation, once per block
        assert work[phase].softmax_elements == B * T * V  # the logits
    assert work["step"].elements == work["step"].softmax_elements == 0
    fb = traces[0].work.forward_backward
    base = Hardware(1e9, 1e9, 1e-6, intra_bandwidth=1e8, inter_bandwidth=1e8, collective_seconds=0.0)
    costly = replace(base, element_seconds=1e-8, softmax_element_seconds=5e-8)
    added = work_seconds(fb, costly) - work_seconds(fb, base)
    assert added == pytest.approx(2 * B * T * (4 * D * L * 1e-8 + V * 5e-8))
    # their memory pass is counted as any operation's (all a GPU pays, where the per-element figures are 0)
    import torch

    from distrain.planner.work import WorkCounter

    counter, x = WorkCounter(), torch.randn(10, 100)
    with counter:
        torch.nn.functional.gelu(x)
        torch.log_softmax(x, -1)
    alone = counter.work.phases["forward"]
    assert (alone.elements, alone.softmax_elements, alone.bytes) == (1000, 1000, 2 * 2 * 4 * 1000)


def test_activation_checkpointing_recomputes_each_blocks_forward_in_backward(traces):
    """Recomputation stops once the saved tensors are back (torch's non-reentrant checkpoint): each
    block's forward again, but for its last matmul, whose output backward never needs."""
    plain, every = traces[0].work.phases, traces[None].work.phases
    assert every["forward"].flops == plain["forward"].flops
    head = 2 * B * T * D * V
    assert every["backward"].flops - plain["backward"].flops == LINEAR - head - L * LAST_MATMUL
    assert every["backward"].attention_flops - plain["backward"].attention_flops == ATTENTION


def collectives(option: Option, job: Job, trace, units: int) -> list:
    """What the option's cost model says one step sends."""
    return option.model.collectives(option, job, trace, units)


def step_time(option: Option, job: Job, trace, units: int, hw: Hardware):
    """The option's cost model's time of a step of ``trace``."""
    return option.model.time_of(option, job, trace, units, hw)


def _job(world: int, accumulate: int = 1, nodes: int = 1) -> Job:
    return Job(ModelSpec.builtin_gpt("gpt-tiny", T), B, world_size=world, accumulate=accumulate, num_nodes=nodes)


def test_bytes_each_option_communicates(traces):
    trace, units = traces[0], L + 1
    grads, params = trace.grad_bytes, trace.param_bytes
    job = _job(4, accumulate=3)
    shape = lambda c: (c.kind, c.size, c.passes, c.calls_per_pass, c.copied)  # noqa: E731
    (ddp,) = collectives(Option("ddp"), job, trace, units)
    assert shape(ddp) == ("all_reduce", grads, 1, 1, False)  # no_sync while accumulating; buckets are views
    gather, reduce = collectives(Option("fsdp", sharding="FULL_SHARD"), job, trace, units)
    assert shape(gather) == ("all_gather", params, 2 * 3, units, True)  # forward + backward, each micro-batch
    assert shape(reduce) == ("reduce_scatter", grads, 1, units, True)  # fp32, at the last micro-batch's backward
    gather_once, _ = collectives(Option("fsdp", sharding="SHARD_GRAD_OP"), job, trace, units)
    assert gather_once.passes == 3
    stage1 = collectives(Option("zero", stage=1), job, trace, units)
    stage2 = collectives(Option("zero", stage=2), job, trace, units)
    stage3 = collectives(Option("zero", stage=3), job, trace, units)
    assert [(c.kind, c.passes) for c in stage1] == [("reduce_scatter", 1), ("all_gather", 1)]
    assert [(c.kind, c.passes) for c in stage2] == [("reduce_scatter", 3), ("all_gather", 1)]  # every backward
    assert [(c.kind, c.passes) for c in stage3] == [("all_gather", 6), ("reduce_scatter", 3)]
    hybrid = collectives(Option("fsdp", sharding="HYBRID_SHARD"), _job(8, nodes=2), trace, units)
    assert [(c.kind, c.ranks, c.inter_node) for c in hybrid] == [
        ("all_gather", 4, False),
        ("reduce_scatter", 4, False),
        ("all_reduce", 2, True),
    ]
    assert collectives(Option("ddp"), _job(1), trace, units) == []
    # copies without bucket views
    (copied,) = collectives(Option("ddp"), replace(job, gradient_as_bucket_view=False), trace, units)
    assert copied.copied


def test_collective_seconds_follow_the_ring_algorithms():
    hw = Hardware(1e12, 1e10, 0.0, intra_bandwidth=1e9, inter_bandwidth=1e8, collective_seconds=1e-3)
    assert collective_seconds(Collective("all_reduce", 4e9, 4, 1, 2), hw) == pytest.approx(2 * 3 / 4 * 4 + 2e-3)
    assert collective_seconds(Collective("all_gather", 4e9, 4, 3, 5), hw) == pytest.approx(3 * 3 / 4 * 4 + 15e-3)
    assert collective_seconds(Collective("all_reduce", 4e9, 2, 1, 1, True), hw) == pytest.approx(4e9 / 1e8 + 1e-3)
    assert collective_seconds(Collective("all_reduce", 4e9, 1, 1, 1), hw) == 0
    # a copy into and out of a flat buffer reads and writes the set once per pass
    assert copy_seconds(Collective("all_gather", 4e9, 4, 3, 5, copied=True), hw) == pytest.approx(3 * 2 * 4e9 / 1e10)
    assert copy_seconds(Collective("all_reduce", 4e9, 4, 1, 1), hw) == 0


def test_step_time_on_given_rates(traces):
    trace, job = traces[0], _job(2, accumulate=2)
    slow = Hardware(1e9, 1e9, 1e-6, intra_bandwidth=1e8, inter_bandwidth=1e8, collective_seconds=0.0)
    fast_link = replace(slow, intra_bandwidth=2e8)
    ddp_slow = step_time(Option("ddp"), job, trace, L + 1, slow)
    ddp_fast = step_time(Option("ddp"), job, trace, L + 1, fast_link)
    assert ddp_fast.communication == pytest.approx(ddp_slow.communication / 2)
    assert ddp_fast.compute == ddp_slow.compute
    fb = trace.work.forward_backward
    matmuls = fb.flops + fb.attention_flops  # one rate for both where none is given for attention (a CPU)
    assert ddp_slow.compute == pytest.approx(2 * (matmuls / 1e9 + fb.bytes / 1e9 + fb.ops * 1e-6))
    slow_attention = step_time(Option("ddp"), job, trace, L + 1, replace(slow, attention_flops=0.5e9))
    assert slow_attention.compute == pytest.approx(ddp_slow.compute + 2 * fb.attention_flops / 1e9)
    # the sharded optimizer steps on half the state
    fsdp = step_time(Option("fsdp", sharding="FULL_SHARD"), job, trace, L + 1, slow)
    assert fsdp.optimizer == pytest.approx(ddp_slow.optimizer - trace.work.step.bytes / 2 / 1e9, rel=1e-6)
    # on a CPU communication takes the cores (adds up); on a GPU it runs beside compute
    assert ddp_slow.seconds == pytest.approx(ddp_slow.compute + ddp_slow.communication + ddp_slow.optimizer)
    gpu = replace(slow, overlap=True)
    overlapped = step_time(Option("fsdp", sharding="FULL_SHARD"), job, trace, L + 1, gpu)
    parts = collectives(Option("fsdp", sharding="FULL_SHARD"), job, trace, L + 1)
    exposed = sum(collective_seconds(c, gpu) / c.calls for c in parts)  # the first gather, the last reduction
    expected = max(overlapped.compute, overlapped.communication) + exposed + overlapped.optimizer
    assert overlapped.seconds == pytest.approx(expected)
    assert overlapped.seconds < fsdp.seconds


def _planner(hw: Hardware) -> Planner:
    job = Job(ModelSpec.builtin_gpt("gpt-mini", 128), 8, world_size=2)
    return Planner(job, Budget(8 << 30, 8 << 30, False, "test"), hw)


def test_auto_prefers_the_fastest_prediction_and_breaks_near_ties_by_the_ranking():
    """Within 10% the simpler option wins (less sharding first); beyond, the faster one."""
    planner = _planner(Hardware(1e12, 1e11, 1e-6, intra_bandwidth=1e9, inter_bandwidth=1e9, collective_seconds=0.0))
    ddp, fsdp = planner.row(Option("ddp")), planner.row(Option("fsdp", sharding="FULL_SHARD"))
    timed = lambda row, s: replace(row, step=StepTime(s, 0.0, 0.0, s))  # noqa: E731
    assert Planner.prefer([timed(fsdp, 1.0), timed(ddp, 1.09)]).option == ddp.option
    assert Planner.prefer([timed(fsdp, 1.0), timed(ddp, 1.2)]).option == fsdp.option
    assert Planner.prefer([timed(ddp, 1.0), timed(fsdp, 0.95)]).option == ddp.option


def test_auto_takes_what_the_plan_predicts_fastest():
    """The choice (``choose``, as ``strategy: auto`` makes it) is the plan's fastest row that fits, by
    the rule above, tensor-parallel and pipeline layouts included, each at the accumulation that keeps the
    global batch: a slow link makes the pipeline (it sends activations, not gradients) the fastest; among
    data-parallel options DDP's single all-reduce beats FSDP's gathers; a budget DDP does not fit leaves
    sharding, and says so."""
    link_bound = Hardware(1e15, 1e15, 0.0, intra_bandwidth=1e7, inter_bandwidth=1e7, collective_seconds=0.0)
    planner = _planner(link_bound)
    chosen, _ = planner.choose("auto", "auto")
    plan = planner.plan("all")
    eligible = [r for r in plan.rows if r.fits and r.option.family in ("ddp", "fsdp", "tp", "pp")]
    assert {r.option.family for r in eligible} == {"ddp", "fsdp", "tp", "pp"}
    assert chosen.option == plan.recommendation.option == Planner.prefer(eligible).option
    assert chosen.option.family == "pp" and "the fastest that fits" in plan.reason
    assert chosen.accumulate == 2 and "accumulation 2 instead of 1" in plan.reason
    assert chosen.tokens_per_step == planner.job.tokens_per_step  # the same global batch as DDP's
    comm = {r.option: r.step.communication for r in eligible if r.option.checkpoint == 0}
    assert comm[chosen.option] < comm[Option("ddp")] < comm[Option("fsdp", sharding="FULL_SHARD")]
    ddp_peak = planner.row(Option("ddp")).peak
    tight = Planner(planner.job, Budget(int(ddp_peak * 0.95 / 0.9), 8 << 30, False, "test"), link_bound)
    chosen, _ = tight.choose("auto", "auto")
    assert chosen.option.family != "ddp" or chosen.option.checkpoint != 0
    assert chosen.fits and chosen.step.seconds > 0
    # without rates: the ranking order (less sharding first)
    assert Planner(planner.job, planner.budget).choose("auto")[0].option.family == "ddp"


def test_this_cpus_rates_are_measured():
    bandwidth, latency, between_computations, busy_bandwidth = gloo_allreduce(2, size=1 << 20)
    assert bandwidth > 1e6 and 0 < latency <= between_computations < 0.1 and 0 < busy_bandwidth <= bandwidth
    hw = cpu_hardware(2)
    assert hw.matmul_flops > 1e8 and hw.memory_bandwidth > 1e8 and 0 < hw.op_seconds < 1e-3
    assert hw.matmul_flops * 4 > hw.memory_bandwidth  # a matmul does more per byte than an add
    assert not hw.overlap and "measured" in hw.source


def test_what_if_over_cluster_shapes_keeps_the_global_batch_and_prices_the_tokens(capsys):
    args = ["plan", "--num-nodes", "1,2,4", "--devices", "8", "--gpu-memory", "80GB", "--model-name", "gpt-mini"]
    args += ["--batch-size", "8", "--tokens", "1e9", "--gpu-hour-price", "2"]
    assert cli.main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shapes = out["shapes"]
    assert [s["world_size"] for s in shapes] == [8, 16, 32] and out["global_batch"] == 64
    for s in shapes:
        assert s["micro_batch"] * s["accumulate"] * s["data_parallel_size"] == 64
        assert s["tokens_per_second"] == pytest.approx(64 * 128 / s["step_seconds"])
        assert s["seconds_for_tokens"] == pytest.approx(1e9 / s["tokens_per_second"])
        assert s["cost"] == pytest.approx(s["seconds_for_tokens"] / 3600 * s["world_size"] * 2)
    # the same global batch on more GPUs: each does less, so the step is shorter
    assert shapes[0]["step_seconds"] > shapes[2]["step_seconds"]
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert "time for 1e+09 tokens" in table and "cost" in table and "H100" in table


def test_plan_flags_and_their_errors(capsys):
    base = ["plan", "--devices", "2", "--accelerator", "cpu", "--model-name", "gpt-tiny"]
    assert cli.main([*base, "--no-time"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" not in out and "fastest" not in out
    assert cli.main([*base, "--bandwidth", "5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert "--bandwidth" in rows["rates"] and all(r["step_seconds"] > 0 for r in rows["rows"])
    for flags, message in [
        (["--bandwidth", "0"], "--bandwidth must be positive"),
        (["--gpu-type", "Z80", "--gpu-memory", "80GB", "--accelerator", "gpu"], "--gpu-type 'Z80' is not in"),
        (["--num-nodes", "1,2", "--devices", "2,4"], "not both"),
        (["--num-nodes", "1,2", "--no-time"], "drop --no-time"),
        (["--precision", "fp8"], "precision='fp8' runs on GPUs with float8 tensor cores"),
        (["--precision", "fp8", "--gpu-type", "A100", "--gpu-memory", "80GB", "--accelerator", "gpu"], "A100 lacks"),
    ]:
        assert cli.main([*base, *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


#: rates like this CPU's (collectives cost milliseconds between computations), and like a GPU node's (fast links,
#: slow compute per operation): the first leaves model-parallel layouts far behind DDP, the second does not
CPU_LIKE = Hardware(5e10, 1e10, 5e-6, 1e9, 1e9, 2e-4, blocking_collective_seconds=2e-3, blocking_bandwidth=4e8)
LINK_RICH = Hardware(1e10, 1e11, 1e-7, 1e12, 1e12, 1e-7)


def test_auto_simulates_a_model_parallel_layout_only_when_it_could_win_and_chooses_as_a_full_walk(monkeypatch):
    """``choose`` walks the options fastest first by a bound that needs no simulated step: the bound is never
    above an option's time, and the choice and the rows it names are those of a walk that times every option.
    On rates like this CPU's, tensor parallelism is never simulated; on fast links it is looked at."""
    from distrain.planner import simulate

    job = Job(ModelSpec.builtin_gpt("gpt-tiny", 64), 4, world_size=2, accumulate=2)
    planner = Planner(job, Budget(8 << 30, 8 << 30, False, "test"), CPU_LIKE)
    simulated = []
    real = simulate.simulate_tensor_parallel
    monkeypatch.setattr(simulate, "simulate_tensor_parallel", lambda *a, **k: simulated.append(1) or real(*a, **k))
    walks = {}
    for hw in (CPU_LIKE, LINK_RICH):  # one planner (its traces and simulations are kept), timed on each
        for p in [planner] + [p for p, _ in planner.model_parallel_planners()]:
            p.hardware = hw
        walks[hw] = planner.choose("auto", False)
        if hw is CPU_LIKE:
            assert simulated == []
        assert any(r.option.family == "tp" for r in walks[hw][1]) == (hw is LINK_RICH)
        bounds = {o: planner.seconds_at_least(p, o) for p, o in planner.model_parallel_planners()}
        with monkeypatch.context() as m:
            m.setattr(Planner, "seconds_at_least", lambda self, p, o: p.seconds(o))  # every option timed
            chosen, seen = planner.choose("auto", False)
        assert walks[hw][0].option == chosen.option and walks[hw][0].step == chosen.step
        assert [(r.option, r.step) for r in walks[hw][1]] == [(r.option, r.step) for r in seen]
        for p, o in planner.model_parallel_planners():
            assert bounds[o] <= p.seconds(o) * (1 + 1e-9), o


def test_a_hugging_face_mixture_of_experts_is_traced_with_each_tokens_experts_counted(tmp_path):
    """Mixtral's experts run ``torch._grouped_mm``, whose fake kernel takes bf16 only (torch 2.13): planning any
    transformers MoE failed with a traceback. Traced now through transformers' per-expert loop, every token's
    ``top_k`` experts counted: one more expert per token adds exactly its three matmuls per layer."""
    transformers = pytest.importorskip("transformers")
    flops = {}
    for top_k in (1, 2):
        config = transformers.MixtralConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=4,
            num_experts_per_tok=top_k,
            max_position_embeddings=T,
        )
        spec = ModelSpec.huggingface("mixtral", T, task="causal_lm", hf_config=config)
        phases = trace_step(spec, B).work.phases
        flops[top_k] = (phases["forward"].flops, phases["backward"].flops)
    one_expert = 2 * B * T * 3 * 64 * 96 * 2  # gate, up and down for each token, in each of the 2 layers
    assert flops[2][0] - flops[1][0] == one_expert
    assert flops[2][1] - flops[1][1] == 2 * one_expert


def test_expert_parallel_rows_split_the_experts_and_send_the_tokens_by_all_to_all():
    """A mixture of experts (the GPT with 4 experts per block, top-2): DDP with the experts over 2 of 4 ranks holds
    half the experts' bytes, all-reduces each expert's gradient over the 2 ranks that hold it, and sends every
    micro-batch's tokens to their experts and back, forward and backward; FSDP with it gathers only a rank's own
    experts, over those 2 ranks. A dense model is offered no such row."""
    from distrain.planner.estimate import Estimator
    from distrain.planner.plan import candidate_options

    E, K = 4, 2
    spec = ModelSpec.builtin_gpt("gpt-tiny", T, n_experts=E, top_k=K)
    trace = trace_step(spec, B)
    experts = L * E * 2 * 4 * D * D * 4  # fc and proj of each expert, fp32
    assert trace.expert_bytes == experts and trace.moe_layers == L and trace.expert_tensors == 2 * L
    assert trace.dispatched == L * B * T * K * D  # each token's 2 copies of its width, in each layer
    job = Job(spec, micro_batch=B, world_size=4, accumulate=3)
    assert {o.get("experts") for o in candidate_options(job) if o.get("experts")} == {E}  # gcd(4 ranks, 4 experts)
    dense = Job(ModelSpec.builtin_gpt("gpt-tiny", T), micro_batch=B, world_size=4)
    assert not [o for o in candidate_options(dense) if o.get("experts")]

    ep = Option("ddp", experts=2)
    shared, own, moved = ep.model.collectives(ep, job, trace)
    assert (shared.kind, own.kind, moved.kind) == ("all_reduce", "all_reduce", "all_to_all")
    assert shared.size == pytest.approx(trace.grad_bytes - experts) and shared.ranks == 4
    assert own.size == pytest.approx(experts / 2) and own.ranks == 2
    assert (
        moved.size == trace.dispatched * 4 and moved.ranks == 2 and moved.passes == 4 * 3 and moved.calls_per_pass == L
    )
    estimator = Estimator(job)
    ddp, split = estimator.estimate(Option("ddp")), estimator.estimate(ep)
    assert ddp.params - split.params == experts // 2  # half the experts stay on the other rank
    assert ddp.optimizer - split.optimizer == pytest.approx(2 * experts / 2, rel=1e-3)  # Adam's two moments

    fsdp = Option("fsdp", sharding="FULL_SHARD", experts=2)
    sent = fsdp.model.collectives(fsdp, job, trace, units=L)
    gathers = [c for c in sent if c.kind == "all_gather"]
    assert [c.ranks for c in gathers] == [4, 2]  # the rest over every rank; a rank's experts over their 2 holders
    assert gathers[1].size == pytest.approx(experts / 2) and sent[-1].kind == "all_to_all"


@pytest.mark.parametrize(
    "ranks,experts,top_k,times",
    [(2, 4, 2, 2), (8, 8, 2, 4), (4, 8, 2, 4), (8, 128, 8, 8), (3, 3, 2, 2), (2, 4, 1, 2)],
)
def test_the_worst_routing_sends_a_rank_every_token_copy_its_experts_can_take(ranks, experts, top_k, times):
    """Mixtral's 8 experts over 8 ranks, top-2: a rank holds one expert, so each token can send it one of its 2
    copies: 8 ranks' tokens at half their copies, 4 times its share. With as many experts per rank as top_k or more
    every copy can go there (N times); rounded up where the share is not whole (3 experts over 3 ranks, top-2)."""
    from distrain.planner.model_stats import worst_routing

    assert worst_routing(ranks, experts, top_k) == times


def test_the_worst_routing_is_traced_with_a_ranks_experts_taking_every_tokens_copies():
    """The plan's worst routing traces the step with one rank's experts taking what the worst router sends them:
    with 4 experts over 2 ranks, top-2, twice their share, so exactly the experts' forward FLOPs once more (16 D²
    per token copy: fc and proj), and more activations. Its row's worst-routing peak is above the even peak by
    those activations, and the table says it in one line."""
    from distrain.planner.estimate import Estimator

    spec = ModelSpec.builtin_gpt("gpt-tiny", T, n_experts=4, top_k=2)
    even, worst = trace_step(spec, B), trace_step(spec, B, routed_over=2)
    extra = worst.work.phases["forward"].flops - even.work.phases["forward"].flops
    assert extra == L * B * T * 2 * 16 * D * D
    assert worst.activations > even.activations
    job = Job(spec, micro_batch=B, world_size=2)
    row = Estimator(job).estimate(Option("ddp", experts=2))
    assert row.worst_routing_peak == row.peak + worst.activations - even.activations
    assert Estimator(job).estimate(Option("ddp")).worst_routing_peak == 0  # no experts split: no such figure
    plan = Planner(job, Budget(8 << 30, 8 << 30, False, "test")).plan("all", "both")
    line = next(line for line in plan.table().splitlines() if line.startswith("worst routing"))
    assert "ddp + experts over 2" in line and "\n" not in line


def test_a_decision_for_expert_parallelism_reaches_the_strategy_and_reads_back_checked():
    from distrain.planner.decide import Decision

    decision = Decision(strategy="fsdp", sharding="FULL_SHARD", experts=4)
    assert decision.strategy_options(()) == {"sharding_strategy": "FULL_SHARD", "expert_parallel_size": 4}
    values = decision.shared_values()
    assert Decision.from_values(values) == decision
    assert Decision.from_values({**values, "experts": 0}) is None  # read as untrusted: no size below 1
    assert Decision.from_values({**values, "experts": "4"}) is None


def test_fsdp_that_reduces_each_micro_batch_is_offered_when_accumulating_and_reaches_the_run():
    """With gradient accumulation FSDP holds every rank's unsharded gradients between micro-batches, unless it
    reduce-scatters after each (``fsdp.sync_each_micro_batch``): ``auto`` is offered that row (less memory, one
    reduce-scatter per micro-batch), and a decision for it sets the option."""
    from distrain.planner.decide import Decision
    from distrain.planner.estimate import Estimator
    from distrain.planner.plan import candidate_options

    spec = ModelSpec.builtin_gpt("gpt-tiny", T)
    assert not [o for o in candidate_options(Job(spec, micro_batch=B, world_size=2)) if o.get("sync_each")]
    job = Job(spec, micro_batch=B, world_size=2, accumulate=4)
    offered = [o for o in candidate_options(job) if o.get("sync_each")]
    assert {(o.get("sharding"), o.checkpoint) for o in offered} == {("FULL_SHARD", 0), ("FULL_SHARD", None)}
    estimator = Estimator(job)
    once, each = estimator.estimate(Option("fsdp", sharding="FULL_SHARD")), estimator.estimate(offered[0])
    assert each.peak < once.peak  # no unsharded gradients kept between micro-batches
    trace = estimator.trace("fsdp", 0)
    scatter = {o.get("sync_each"): [c for c in o.model.collectives(o, job, trace, L) if c.kind == "reduce_scatter"]
               for o in (Option("fsdp", sharding="FULL_SHARD"), offered[0])}  # fmt: skip
    assert scatter[None][0].passes == 1 and scatter[True][0].passes == 4
    assert Decision("fsdp", sharding="FULL_SHARD", sync_each=True).strategy_options(()) == {
        "sharding_strategy": "FULL_SHARD",
        "sync_each_micro_batch": True,
    }


def test_compiled_work_fuses_the_memory_bound_operations_between_matmuls():
    """``torch.compile`` at its best: the element-wise operations between two matmuls are one kernel, which reads
    what it did not make and writes what is read after it (by a matmul, or by the backward). Eager mode reads and
    writes every intermediate."""
    from distrain.planner import fake
    from distrain.planner.work import WorkCounter

    n = 64 * 32 * 4  # bytes of one fp32 [64, 32] tensor
    with fake.fake_tensor_mode(allow_non_fake_inputs=True):
        x, w = torch.randn(64, 32), torch.randn(32, 32, requires_grad=True)
        counter = WorkCounter()
        with counter:
            y = (x * 2 + 1).relu() @ w  # one kernel: reads x, writes what the matmul reads
            z = y.sigmoid() * 3  # another: reads y; sigmoid's output (kept for its backward) and z are written
            counter.phase = "backward"
            z.sum().backward()
    forward = counter.work.phases["forward"]
    assert forward.bytes == 5 * 2 * n  # five operations, each reading and writing one tensor
    assert forward.fused_bytes == 5 * n  # x, relu's output, y, sigmoid's output, z: once each
    assert (forward.ops, forward.fused_ops) == (7, 3)  # 5 + the matmul + sigmoid's save; 2 fused kernels + the matmul
    backward = counter.work.phases["backward"]
    assert 0 < backward.fused_bytes < backward.bytes
    compiled = counter.work.compiled()
    assert compiled.phases["forward"].bytes == forward.fused_bytes and compiled.step == counter.work.step


def test_a_gpu_plan_with_compile_is_faster_and_a_cpu_plan_is_not(capsys):
    """``training.compile=true``: on a GPU the plan fuses the memory-bound operations (a shorter step, the same
    memory: the fused step keeps what eager keeps); on a CPU, where compiling measured no faster, it is eager's."""
    gpu = ["plan", "--devices", "1", "--gpu-type", "H100", "--gpu-memory", "80GB", "--model-name", "gpt-mini"]
    cpu = ["plan", "--devices", "1", "--accelerator", "cpu", "--cpu-memory", "16GB", "--model-name", "gpt-tiny"]
    for args, faster in ((gpu, True), (cpu, False)):
        rows = {}
        for value in ("false", "true"):
            assert cli.main([*args, "--strategy", "single", "--json", f"training.compile={value}"]) == 0
            rows[value] = json.loads(capsys.readouterr().out)["rows"][0]
        assert rows["true"]["peak_bytes"] == rows["false"]["peak_bytes"]
        if faster:
            assert rows["true"]["step_seconds"] < 0.97 * rows["false"]["step_seconds"]
        else:
            assert rows["true"]["step_seconds"] == rows["false"]["step_seconds"]


def test_fp8_is_planned_with_torchaos_float8_linears_at_the_float8_rate_and_gathered_in_float8():
    """``precision: fp8``: the planner traces the model as the run converts it (torchao's float8 linear layers,
    the head kept in bf16). Their matmuls count apart and run at the float8 tensor cores' rate (twice the bf16
    peak); FSDP gathers their weights in float8, a byte each; DeepSpeed, which refuses fp8, is not offered."""
    pytest.importorskip("torchao")
    from distrain.planner.models import model_of
    from distrain.planner.timing import gpu_hardware
    from distrain.planner.work import PhaseWork

    spec = ModelSpec.builtin_gpt("gpt-tiny", T)
    bf16 = trace_step(spec, B, autocast=torch.bfloat16, param_dtype=torch.bfloat16)
    fp8 = trace_step(spec, B, autocast=torch.bfloat16, param_dtype=torch.bfloat16, float8=True)
    blocks, head = 2 * B * T * 12 * D * D * L, 2 * B * T * D * V
    for phase, passes in (("forward", 1), ("backward", 2)):  # backward: the input's and the weight's gradients
        work = fp8.work.phases[phase]
        assert (work.float8_flops, work.flops) == (passes * blocks, passes * head), phase
        assert bf16.work.phases[phase].flops == passes * (blocks + head) and bf16.work.phases[phase].float8_flops == 0
    # torchao's scaling and casting are memory traffic of their own
    assert fp8.work.forward_backward.bytes > bf16.work.forward_backward.bytes
    assert (fp8.float8_elements, fp8.float8_bytes) == (12 * D * D * L, 2 * 12 * D * D * L)

    hw = gpu_hardware("H100", "fp8")
    assert hw.float8_flops == 2 * hw.matmul_flops
    assert work_seconds(PhaseWork(float8_flops=1e12), hw) == pytest.approx(1e12 / hw.float8_flops)
    job = Job(spec, B, precision="fp8", world_size=8, gpu=True)
    gather, _ = collectives(Option("fsdp", sharding="FULL_SHARD"), job, fp8, L + 1)
    assert gather.size == fp8.param_bytes - 12 * D * D * L  # bf16 weights gathered as float8: a byte saved each
    assert model_of("zero").offered(job) == []
    with pytest.raises(ValueError, match="not supported with deepspeed_stage_2"):
        model_of("zero").option_for_run("deepspeed_stage_2", job)


def test_the_tokens_all_to_all_is_waited_for_on_a_gpu_and_costs_a_busy_collectives_time_on_a_cpu():
    """The tokens' all-to-all sits between the router and the experts (and back): what runs next needs it. On a
    GPU it is not hidden under compute, as FSDP's prefetched gathers are; on a CPU it costs what a collective
    between two computations costs (gloo's threads wait for cores the ranks hold). Before, expert parallelism was
    planned faster than FSDP alone on 2 CPU ranks where it measured slower (benchmarks/moe_expert_parallel.py).
    A deep model keeps it so at depth."""
    spec = ModelSpec.builtin_gpt("gpt-tiny", T, n_experts=4, top_k=2)
    trace, job = trace_step(spec, B), Job(spec, micro_batch=B, world_size=2)
    ep = Option("ddp", experts=2)
    sent = ep.model.collectives(ep, job, trace)
    moved = next(c for c in sent if c.awaited)
    assert moved.kind == "all_to_all" and [c.awaited for c in sent].count(True) == 1
    idle = Hardware(1e12, 1e12, 1e-6, intra_bandwidth=1e10, inter_bandwidth=1e10, collective_seconds=1e-5)
    busy = replace(idle, blocking_collective_seconds=1e-3, blocking_bandwidth=1e9)
    cpu = step_time(ep, job, trace, L + 1, busy)
    assert cpu.awaited == pytest.approx(collective_seconds(moved, busy, blocking=True))
    assert cpu.awaited > collective_seconds(moved, busy)  # the busy figures, not the idle ones
    gpu = step_time(ep, job, trace, L + 1, replace(idle, overlap=True))
    rest = [c for c in sent if not c.awaited]
    exposed = sum(collective_seconds(c, idle) / c.calls for c in rest)
    hidden = max(gpu.compute, gpu.communication - gpu.awaited)
    assert gpu.seconds == pytest.approx(hidden + gpu.awaited + exposed + gpu.optimizer)
    assert gpu.seconds >= gpu.compute + gpu.awaited + gpu.optimizer  # never under the compute it waits between
    # at 4 and 8 blocks: max(compute, the rest of communication) + awaited + optimizer + 0.1 s exposed
    shallow = {4: StepTime(1.0, 0.1, 2.0, 2.4, 1.2), 8: StepTime(2.0, 0.2, 2.5, 3.7, 1.4)}
    deep = step_at_depth(shallow, 32, overlap=True)
    assert deep.awaited == pytest.approx(2.6)
    assert deep.seconds == pytest.approx(8.0 + 2.6 + 0.8 + 0.1)  # compute-bound, the all-to-all waited for


def test_a_deep_step_is_extrapolated_by_its_parts_and_overlapped_at_its_depth():
    """A deep model is timed at two shallow depths. On a GPU its step takes the longer of compute and communication:
    shallow, the embeddings' gathers can bind it; deep, compute does. Each part is extrapolated, then the overlap is
    taken at depth (a line through the shallow seconds gave a step shorter than its own compute); on a CPU, where
    the parts add up, both ways agree."""
    shallow = {4: StepTime(1.0, 0.1, 2.0, 2.2), 8: StepTime(2.0, 0.2, 2.5, 2.8)}  # + 0.1 s exposed at each depth
    deep = step_at_depth(shallow, 32, overlap=True)
    assert (deep.compute, deep.optimizer, deep.communication) == pytest.approx((8.0, 0.8, 5.5))
    assert deep.seconds == pytest.approx(8.0 + 0.8 + 0.1)  # compute-bound at 32 blocks
    # what is exposed (one unit's gather and reduction) shrinks as the model is cut into more units: held, not taken
    # below zero along a line
    shrinking = {4: StepTime(1.0, 0.1, 2.0, 2.3), 8: StepTime(2.0, 0.2, 2.5, 2.8)}
    assert step_at_depth(shrinking, 32, overlap=True).seconds == pytest.approx(8.0 + 0.8 + 0.1)
    added = {
        d: StepTime(c, o, m, c + o + m + 0.05 * d) for d, (c, o, m) in ((4, (1.0, 0.1, 2.0)), (8, (2.0, 0.2, 2.5)))
    }
    line = 1.0 + 0.1 + 2.0 + 0.2 + (2.0 + 0.2 + 2.5 + 0.4 - 3.3) * (32 - 4) / 4
    assert step_at_depth(added, 32, overlap=False).seconds == pytest.approx(line)
