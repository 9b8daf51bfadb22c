"""Lightning's own example scripts (``tests/lightning_examples/``, verbatim) run under distrain with only their imports
switched (``distrain.lightning.migrate``), and every backward pass's loss equals the stored Lightning run's, on 1
process and on 2 DDP ranks (the layout in Lightning's own ``PL_TRAINER_*`` variables: the scripts set none), and so
do the files a script writes under ``predictions/``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lightning_examples.make_reference import EXAMPLES as SCRIPTS
from lightning_examples.make_reference import example_env, outputs

from distrain.lightning import migrate
from helpers import run_harness

EXAMPLES = Path(__file__).resolve().parent / "lightning_examples"


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_lightning_example_runs_with_its_imports_switched_and_logs_lightnings_losses(tmp_path, script, devices):
    source = (EXAMPLES / script).read_text()
    migrated = migrate(source)
    assert "lightning.pytorch" not in migrated and "distrain.lightning" in migrated
    migrated_path = tmp_path / Path(script).name
    migrated_path.write_text(migrated)
    env = example_env(migrated_path, str(tmp_path / "out"), devices)
    harness = EXAMPLES / "run_example.py"
    if devices == 1:  # forked from the imported server: the script's own process, without a new interpreter's imports
        run = run_harness(harness, env, tmp_path)
    else:  # its ranks start by running the command again, as a user's do
        run = subprocess.run([sys.executable, str(harness)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reference = json.loads((EXAMPLES / "reference" / Path(script).with_suffix(".json").name).read_text())
    expected = reference["losses"][str(devices)]
    for rank in range(devices):
        got = json.loads((tmp_path / "out" / f"losses_rank{rank}.json").read_text())
        want = expected[str(rank)]
        assert len(got) == len(want) and got, (rank, got, want)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, got, want)
    # the files it wrote (its predictions, and the samples each holds): Lightning's, by name, sample for sample
    written, expected = outputs(tmp_path), reference.get("outputs", {}).get(str(devices), {})
    assert written.keys() == expected.keys(), (sorted(written), sorted(expected))
    for name, want in expected.items():
        assert _same_numbers(written[name], want), (name, written[name], want)


def _same_numbers(got, want) -> bool:
    """The same nesting of lists, the same integers (sample indices) and floats within the losses' tolerance."""
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same_numbers, got, want))
    if isinstance(want, float):
        return isinstance(got, float) and got == pytest.approx(want, rel=1e-5, abs=1e-6)
    return type(got) is type(want) and got == want
