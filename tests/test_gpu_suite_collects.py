"""The GPU suite (tests/gpu) and the GPU benchmark runner, checked where there is no GPU: every GPU test is
collected, marked ``gpu`` and skipped because CUDA is missing; ``benchmarks/gpu_bench.py --dry-run`` prints the
``distrain bench``, ``distrain plan`` and ``distrain train`` commands that fill the GPU tables of docs/benchmarks.md."""

import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from helpers import env_without_rank

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the GPU suite itself")

#: tests the suite must hold (one per path of issue 24), by name
EXPECTED = {
    "test_every_strategy_at_world_size_1_under_nccl_matches_one_process_fp32",
    "test_every_strategy_at_world_size_1_matches_one_process_in_bf16_and_fp16",
    "test_two_ranks_ddp_fsdp_and_tensor_parallel_match_one_process",
    "test_pipeline_on_two_gpus_matches_one_process",
    "test_a_mixture_of_experts_under_model_parallel_on_two_gpus_in_bf16",
    "test_fp16_grad_scaler_skips_an_overflowed_step_on_every_rank_alike",
    "test_fsdp_mixed_precision_gathers_bf16_parameters_and_reduces_in_fp32",
    "test_fp8_trains_close_to_bf16_and_fsdp_matches_it",
    "test_fsdp_all_gathers_float8_weights_on_two_gpus",
    "test_expert_parallel_on_two_gpus_in_fp16_and_bf16",
    "test_experts_run_one_grouped_matmul_on_cuda_in_bf16_with_the_loops_results",
    "test_low_precision_norms_keep_what_the_planner_says_on_cuda",
    "test_fp8_step_holds_what_the_planner_traced_on_the_cpu",
    "test_deepspeed_cpu_adam_offload_pins_host_memory",
    "test_deepspeed_without_offload_steps_with_its_fused_adam_cuda_op",
    "test_compile_on_cuda_matches_eager",
    "test_nvml_and_cuda_memory_figures_appear_in_metrics_jsonl",
    "test_two_ranks_log_each_gpu_reading_as_max_min_and_mean",
    "test_mfu_is_computed_against_the_devices_listed_peak",
    "test_distrain_bench_on_the_gpu",
    "test_flight_recorder_records_nccl_collectives_with_the_collective_timeout",
    "test_a_stuck_rank_leaves_flight_recorder_dumps_that_name_it",
    "test_ring_attention_on_cuda_matches_whole_sequence_attention",
    "test_the_planner_simulates_fsdp_and_tensor_parallelism_in_a_process_that_has_used_cuda",
}


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env=_new_session_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _new_session_env() -> dict[str, str]:
    """A pytest session of its own: not an xdist worker of this one, with its own folders (tests/conftest.py)."""
    ours = ("PYTEST_XDIST_", "DISTRAIN_TEST_", "DISTRAIN_PLAN_CACHE")
    return {k: v for k, v in env_without_rank().items() if not k.startswith(ours)}


def test_gpu_suite_collects_and_skips_for_want_of_cuda(tmp_path):
    report = tmp_path / "gpu.xml"
    run = _pytest("-m", "gpu", "-q", "-rs", f"--junitxml={report}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {}
    for case in cases:
        skipped = case.find("skipped")
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = None if skipped is None else skipped.get("message")
    names = {key.split("::")[1].split("[")[0] for key in outcomes}
    assert names == EXPECTED, (sorted(names - EXPECTED), sorted(EXPECTED - names))
    # bf16/fp16, clipping/no-clipping and the ring's fp32/bf16 are two cases each, the two-rank test three (ddp,
    # fsdp, model_parallel)
    assert len(outcomes) == len(EXPECTED) + 2 + 2 + 1
    for key, message in outcomes.items():
        assert message is not None, f"{key} was not skipped"
        assert "CUDA is missing" in message, (key, message)
    # `-m gpu` selected every expected test: each carries the marker
    assert f"{len(outcomes)} skipped" in run.stdout and "deselected" not in run.stdout, run.stdout[-2000:]


def test_gpu_bench_dry_run_prints_the_bench_plan_and_train_commands(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_bench.py", "--dry-run", "--out", str(out)],
        cwd=ROOT, env=env_without_rank(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    commands = [shlex.split(line) for line in run.stdout.splitlines() if line.startswith("distrain ")]
    bench = [c for c in commands if c[1] == "bench"]
    plan = [c for c in commands if c[1] == "plan"]
    train = [c for c in commands if c[1] == "train"]
    # one GPU assumed without one: single and FSDP × bf16, bf16 + compile, fp8 + compile, for the three sizes
    assert len(bench) == 3 * 2 * 3
    settings = {(c[c.index("--sizes") + 1], c[c.index("--strategies") + 1], c[c.index("--precision") + 1],
                 "--compile" in c) for c in bench}  # fmt: skip
    for size in ("gpt-124m", "gpt-350m", "gpt-1.3b"):
        for strategy in ("single", "fsdp"):
            assert {(size, strategy, "bf16-mixed", False), (size, strategy, "bf16-mixed", True),
                    (size, strategy, "fp8", True)} <= settings, (size, strategy)  # fmt: skip
    for c in bench:
        assert c[c.index("--seq-len") + 1] == "2048" and c[c.index("--devices") + 1] == "1"
        assert Path(c[c.index("--json") + 1]).parent == out / "bench"
    # the largest model with offload: the plan of each size first, then training, for both offload strategies
    for listing in (plan, train):
        assert {c[c.index("--strategy") + 1] for c in listing} == {"deepspeed_stage_3_offload", "fsdp_cpu_offload"}
        assert len(listing) == 2 * 7 and all(c[c.index("--devices") + 1] == "1" for c in listing)
    assert all("--json" in c and "training.activation_checkpointing=true" in c for c in plan)
    assert all(c[c.index("--max-steps") + 1] == "3" and "training.pretrained=false" in c for c in train)
    assert "--plan-row" in run.stdout  # the fallback where `distrain plan` does not plan offload at one rank
    assert not out.exists()  # a dry run writes nothing
