"""The GPU suite, part 2: what a CUDA run shows — NVML readings and CUDA memory statistics in metrics.jsonl,
MFU against the device's listed peak, ``distrain bench`` on the GPU, and NCCL's flight recorder (on, recording
with distrain's collective timeout, dumping into the run directory; with two GPUs, a stuck rank leaves dumps that
name it). What stays unproven on one GPU is listed in ``test_gpu_training.py``'s docstring."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_gpu_training import CUDA, GPUS, NO_CUDA, SEQ, STEPS, TWO_RANK_BACKEND, TWO_RANKS, session

from distrain.accelerators import CUDAAccelerator
from distrain.models.gpt import GPT, GPTConfig, gpt_config
from distrain.training.monitor import HOST_KEYS, NVML_KEYS, SystemMonitor
from helpers import env_without_rank, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=NO_CUDA)]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 42  # the collective timeout of the monitored runs: the flight recorder must carry it


def _records(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """One bf16 DDP run at world size 1 (NCCL) and one on 2 ranks, both logging every step to metrics.jsonl;
    the first also reads its flight recorder at step 2."""
    root = tmp_path_factory.mktemp("monitored")
    run = dict(strategy="ddp", precision="bf16-mixed", logger=True, collective_timeout=TIMEOUT_S)
    one = run_ranks(session, 1, str(root / "one"), [("run", dict(inspect=("trace",), **run))])[0]["run"]
    run_ranks(session, 2, str(root / "two"), [("run", dict(devices=2, batch=4, **run, **TWO_RANKS))])
    return {"one": _records(root / "one" / "run"), "two": _records(root / "two" / "run"), "trace": one}


def test_nvml_and_cuda_memory_figures_appear_in_metrics_jsonl(monitored):
    records = monitored["one"]
    assert len(records) == STEPS
    last = records[-1]
    device = torch.device("cuda", 0)
    missing = set(NVML_KEYS) - set(last)
    assert not missing, f"no {sorted(missing)} in metrics.jsonl; NVML here: {SystemMonitor(device).nvml_error}"
    total = torch.cuda.get_device_properties(device).total_memory / 2**20
    assert abs(last["gpu_mem_total_mb"] - total) < 1
    assert 0 <= last["gpu_util_percent"] <= 100 and 0 < last["gpu_temp_c"] < 120 and last["gpu_power_w"] > 0
    # torch's allocator: allocated ≤ peak, allocated ≤ reserved; NVML sees at least what this process reserved
    assert 0 < last["mem_allocated_mb"] <= last["mem_max_allocated_mb"]
    assert last["mem_allocated_mb"] <= last["mem_reserved_mb"] <= last["gpu_mem_used_mb"] <= total
    assert set(HOST_KEYS) <= set(last) and last["host_rss_mb"] > 0
    assert all(set(NVML_KEYS) <= set(r) for r in records)  # every logged step, not only the last


def test_two_ranks_log_each_gpu_reading_as_max_min_and_mean(monitored):
    last = monitored["two"][-1]
    for key in (*NVML_KEYS, "mem_allocated_mb", "mem_reserved_mb"):
        assert last[f"{key}_min"] <= last[f"{key}_mean"] <= last[key], key
    assert len(last["mem_per_rank_mb"]) == 2 and all(v > 0 for v in last["mem_per_rank_mb"])
    if TWO_RANK_BACKEND == "gloo":  # both ranks on cuda:0: the same device's total
        assert last["gpu_mem_total_mb_min"] == last["gpu_mem_total_mb"]


def test_mfu_is_computed_against_the_devices_listed_peak(monitored):
    device = torch.device("cuda", 0)
    peak = CUDAAccelerator().peak_flops(device, torch.bfloat16)
    name = torch.cuda.get_device_name(device)
    if "H100" in name or "H200" in name:
        assert peak == 989e12  # dense bf16 tensor cores, the figure torchtitan uses
    flops_per_token = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=SEQ)).flops_per_token()
    for record in monitored["one"]:
        if peak is None:  # a GPU without a listed peak: no made-up MFU
            assert "mfu" not in record, (name, record)
            continue
        expected = record["tokens_per_sec"] * flops_per_token / peak
        assert math.isclose(record["mfu"], expected, rel_tol=1e-9), (record["mfu"], expected)
        assert 0 < record["mfu"] < 1
    assert CUDAAccelerator().peak_flops(device, torch.float32) is None  # fp32 without TF32: no MFU claimed


def test_distrain_bench_on_the_gpu(tmp_path):
    """bf16-mixed by default on a GPU, MFU against the listed peak (not a measured one), tokens/s the step's
    tokens over its time, one row per strategy."""
    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "bench", "--sizes", "gpt-tiny", "--strategies", "single", "ddp",
         "--steps", "3", "--warmup", "2", "--batch-size", "8", "--seq-len", "128", "--json", str(tmp_path / "r.json")],
        env={**env_without_rank(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(r["strategy"], r["ranks"]) for r in rows] == [("single", 1), ("ddp", GPUS)]
    flops_per_token = GPT(gpt_config("gpt-tiny", block_size=128)).flops_per_token()
    peak = CUDAAccelerator().peak_flops(torch.device("cuda", 0), torch.bfloat16)
    for row in rows:
        assert row["precision"] == "bf16-mixed" and not row["peak_measured"]
        assert row["device"] == torch.cuda.get_device_name(0)
        tokens = 8 * 128 * row["ranks"]
        assert math.isclose(row["tokens_per_sec"] * row["step_time"], tokens, rel_tol=1e-6)
        assert row["peak_flops_per_rank"] == peak
        if peak is None:
            assert row["mfu"] is None
        else:
            expected = row["tokens_per_sec"] * flops_per_token / (peak * row["ranks"])
            assert math.isclose(row["mfu"], expected, rel_tol=1e-9) and 0 < row["mfu"] < 1
    assert "GPU " + torch.cuda.get_device_name(0) in out.stdout and "bf16-mixed" in out.stdout


# ---- NCCL's flight recorder -----------------------------------------------------------------------------------
def test_flight_recorder_records_nccl_collectives_with_the_collective_timeout(monitored, tmp_path_factory):
    """One GPU: the recorder is on under NCCL, holds the run's collectives with distrain's collective timeout
    (not process-group init's 30 minutes), and would dump into <output_dir>/flight_recorder/rank_N."""
    run = monitored["trace"]
    entries = run["trace"]
    assert entries, "the flight recorder recorded nothing: TORCH_FR_BUFFER_SIZE was not set before NCCL started"
    names = {e["profiling_name"] for e in entries}
    assert all(n.startswith("nccl:") for n in names), names
    assert "nccl:all_reduce" in names, names  # DDP's gradient buckets and the logged loss
    # the tight timeout is set right after init, before any collective: every one of them carries it
    timeouts = {e["timeout_ms"] for e in entries if "barrier" not in e["profiling_name"]}
    assert timeouts == {TIMEOUT_S * 1000}, timeouts
    seq = [e["collective_seq_id"] for e in entries]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)
    assert run["dump_prefix"].endswith(os.path.join("one", "run", "flight_recorder", "rank_")), run["dump_prefix"]
    assert Path(run["dump_prefix"]).parent.is_dir()


HANG_SCRIPT = """
import signal, sys, time
sys.path.insert(0, {tests!r})
import distrain
from helpers import TinyGPT, loader

class Hang(distrain.Callback):  # rank 1 stops inside optimizer step 3; only the launcher's SIGTERM ends it
    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_rank == 1 and trainer.global_step + 1 == 3:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(600)

trainer = distrain.Trainer(accelerator="gpu", strategy="ddp", devices=2, max_steps=8, collective_timeout={timeout},
                           default_root_dir={out!r}, log_every_n_steps=1, enable_progress_bar=False, logger=False,
                           enable_checkpointing=False, enable_plots=False, callbacks=[Hang()])
trainer.fit(TinyGPT(), loader(4))
"""


def _read_dump(path: Path) -> list[dict]:
    """The dump's records of the default process group (NCCL numbers collectives per group)."""
    return [e for e in pickle.loads(path.read_bytes())["entries"] if e["process_group"][0] == "0"]


@pytest.mark.skipif(
    CUDA and GPUS < 2, reason="a stuck rank needs 2 NCCL ranks, which need 2 GPUs (NCCL refuses 2 ranks on one)"
)
def test_a_stuck_rank_leaves_flight_recorder_dumps_that_name_it(tmp_path):
    """Rank 1 hangs in optimizer step 3; rank 0 waits in the next collective until NCCL's watchdog times out
    (10 s) and ends the job. Every rank dumps its last collectives to <output_dir>/flight_recorder/rank_N; rank 0's
    holds a collective rank 1 never issued, and torch's analysis (torchfrtrace) names rank 1 as missing."""
    script, out = tmp_path / "hang.py", tmp_path / "run"
    script.write_text(HANG_SCRIPT.format(tests=str(ROOT / "tests"), timeout=10, out=str(out)))
    start = time.time()
    proc = subprocess.run([sys.executable, str(script)], env=env_without_rank(), capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    assert proc.returncode != 0 and time.time() - start < 300, proc.stderr[-3000:]
    dumps = out / "flight_recorder"
    assert {p.name for p in dumps.iterdir()} >= {"rank_0", "rank_1"}, (sorted(dumps.iterdir()), proc.stderr[-3000:])
    entries = {rank: _read_dump(dumps / f"rank_{rank}") for rank in (0, 1)}
    last = {rank: max(e["collective_seq_id"] for e in entries[rank]) for rank in (0, 1)}
    assert last[0] > last[1], last  # rank 0 went on to a collective rank 1 never reached
    stuck = [e for e in entries[0] if e["collective_seq_id"] == last[0]]
    assert stuck and stuck[-1]["state"] != "completed", stuck
    analysis = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    report = analysis.stdout + analysis.stderr
    assert "missing ranks: {1}" in report, report[-3000:]
