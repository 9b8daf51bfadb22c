"""Lightning's tutorials (``tests/lightning_tutorials/upstream/``, verbatim from Lightning-AI/tutorials) run under
distrain with only their imports switched (``distrain.lightning.migrate``), on the stand-ins of ``stand_ins/``
(synthetic data sets in the real ones' shapes; ``README.md`` there says what each changes), and every backward pass's
loss equals the stored Lightning run's. Each stage runs a few batches, through Lightning's own ``PL_TRAINER_LIMIT_*``
variables, which the tutorials leave unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning_tutorials.make_reference import APART, HARNESS, TUTORIALS, tutorial_env

from distrain.lightning import migrate

HERE = Path(__file__).resolve().parent / "lightning_tutorials"


@pytest.mark.slow
@pytest.mark.parametrize("tutorial", TUTORIALS + (APART if os.environ.get("DISTRAIN_TUTORIALS") == "all" else []))
def test_a_lightning_tutorial_runs_with_its_imports_switched_and_logs_lightnings_losses(tmp_path, tutorial):
    migrated = migrate((HERE / "upstream" / tutorial).read_text())
    assert "import pytorch_lightning" not in migrated and "distrain.lightning" in migrated
    script = tmp_path / tutorial
    script.write_text(migrated)
    env = tutorial_env(script, str(tmp_path / "out"), str(tmp_path / "data"))
    run = subprocess.run([sys.executable, str(HARNESS)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = json.loads((HERE / "reference" / Path(tutorial).with_suffix(".json").name).read_text())["losses"]
    got = json.loads((tmp_path / "out" / "losses_rank0.json").read_text())
    assert len(got) == len(want) and got, (got, want)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7), (got, want)
