"""`distrain bench` runs a row through the real Trainer and reports consistent numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.alone  # it measures speed (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


def test_bench_rows_on_cpu(tmp_path):
    """tokens/s is the step's tokens over its time, counting only ranks that read their own samples: a
    pipeline's two stages share theirs, DDP's two ranks do not (4 × 64 tokens, 2 micro-batches a step)."""
    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "bench", "--sizes", "gpt-tiny", "--strategies", "ddp", "pipeline",
         "--devices", "2", "--accumulate", "2", "--steps", "2", "--warmup", "1", "--batch-size", "4",
         "--seq-len", "64", "--json", str(tmp_path / "r.json")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {row["strategy"]: row for row in json.loads((tmp_path / "r.json").read_text())}
    assert [rows[s]["ranks"] for s in ("ddp", "pipeline")] == [2, 2]
    for strategy, data_ranks in (("ddp", 2), ("pipeline", 1)):
        row = rows[strategy]
        tokens = 4 * 64 * 2 * data_ranks
        assert abs(row["tokens_per_sec"] * row["step_time"] - tokens) < 1e-6 * tokens, strategy
        assert row["precision"] == "32-true" and row["peak_measured"] and 0 < row["mfu"] < 2
    assert "gpt-tiny   pipeline" in out.stdout and "MFU against this CPU's measured fp32 matmul rate" in out.stdout


def test_bench_counts_every_replica_group(tmp_path):
    """ddp_torchft with 1 device: 2 replica groups of 1 rank. The row is the job's: 2 ranks, both groups' tokens,
    MFU over both ranks' peak (it was 1 rank and twice the MFU)."""
    from distrain.models.lm import GPTLanguageModel

    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "bench", "--sizes", "gpt-tiny", "--strategies", "ddp_torchft",
         "--devices", "1", "--accumulate", "2", "--steps", "2", "--warmup", "1", "--batch-size", "4",
         "--seq-len", "64", "--json", "rows/bench/r.json"],  # a folder not there yet (gpu_bench's layout)
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows" / "bench" / "r.json").read_text())
    tokens = 4 * 64 * 2 * 2
    assert row["ranks"] == 2 and abs(row["tokens_per_sec"] * row["step_time"] - tokens) < 1e-6 * tokens
    model = GPTLanguageModel("gpt-tiny", block_size=64)
    model.configure_model()
    flops = model.flops_per_token()
    expected = row["tokens_per_sec"] * flops / (row["peak_flops_per_rank"] * 2)
    assert abs(row["mfu"] - expected) < 1e-9 * expected
    assert out.stdout.count("gpt-tiny   ddp_torchft") == 1


def test_bench_unknown_size_is_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "bench", "--sizes", "gpt-huge"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith("distrain: error: unknown size 'gpt-huge'")


def test_a_row_that_ended_silently_says_how():
    """A row whose processes died without a word (the out-of-memory killer sends SIGKILL) names the signal."""
    from distrain.bench import _exit_status

    assert _exit_status(-9).startswith("SIGKILL (killed: the machine ran out of memory?")
    assert _exit_status(-15) == "SIGTERM" and _exit_status(3) == "exit code 3"
