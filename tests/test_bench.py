"""`distrain bench` runs a row through the real Trainer and reports consistent numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_row_on_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "bench", "--sizes", "gpt-tiny", "--strategies", "single",
         "--steps", "2", "--warmup", "1", "--batch-size", "4", "--seq-len", "64", "--json", str(tmp_path / "r.json")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["size"] == "gpt-tiny" and row["strategy"] == "single" and row["ranks"] == 1
    # tokens/s is the step's tokens over its time
    assert abs(row["tokens_per_sec"] * row["step_time"] - 4 * 64) < 1e-6 * 4 * 64
    assert row["precision"] == "32-true" and row["peak_measured"] and 0 < row["mfu"] < 2
    assert "gpt-tiny   single" in out.stdout and "MFU against this CPU's measured fp32 matmul rate" in out.stdout


def test_bench_unknown_size_is_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "bench", "--sizes", "gpt-huge"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith("distrain: error: unknown size 'gpt-huge'")
