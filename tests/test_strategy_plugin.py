"""The registry's promise: a new strategy is one file. A tiny one, in a package of its own that names it under the
``distrain.strategies`` entry point group, trains through ``distrain train --strategy tiny`` and checks its config
keys, with nothing else changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import env_without_rank

ROOT = Path(__file__).resolve().parents[1]

TINY = '''
from distrain.config import ConfigError
from distrain.strategies.registry import register
from distrain.strategies.single import SingleDeviceStrategy


class TinyStrategy(SingleDeviceStrategy):
    """One process that says each optimizer step it takes."""

    def optimizer_step(self, optimizer, module=None):
        print("tiny strategy: step", flush=True)
        super().optimizer_step(optimizer, module)


def check(config):
    if config.distributed.strategy == "tiny" and config.training.compile:
        raise ConfigError("training.compile is not supported with distributed.strategy 'tiny'")


register("tiny", TinyStrategy, "one process, from a plugin", check=check)
'''


def _plugin(root: Path) -> None:
    (root / "tiny_strategy.py").write_text(TINY)
    info = root / "tiny_strategy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-strategy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[distrain.strategies]\ntiny = tiny_strategy\n")


def _train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**env_without_rank(), "PYTHONPATH": f"{tmp / 'plugin'}:{ROOT}"}
    command = [sys.executable, "-m", "distrain.cli", "train", "--strategy", "tiny", "--devices", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp, env=env, timeout=300)


def test_a_strategy_in_one_file_trains_and_checks_its_config(tmp_path):
    (tmp_path / "plugin").mkdir()
    _plugin(tmp_path / "plugin")
    proc = _train(tmp_path, "--max-steps", "2", "--output-dir", "run", "logging.progress_bar=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("tiny strategy: step") == 2, proc.stdout
    refused = _train(tmp_path, "--output-dir", "run2", "training.compile=true")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "distrain: error: training.compile is not supported with distributed.strategy 'tiny'"
    ), refused.stderr
    unknown = _train(tmp_path.parent, "--output-dir", str(tmp_path / "run3"))  # without the plugin on the path
    assert unknown.returncode == 2
