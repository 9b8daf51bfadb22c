"""The registry's promise: a new strategy is one file, and its cost model one more. A tiny one, in a package of its
own that names it under the ``distrain.strategies`` entry point group, trains through ``distrain train --strategy
tiny`` and checks its config keys; its cost model puts it in ``distrain plan``; nothing else changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from helpers import env_without_rank

ROOT = Path(__file__).resolve().parents[1]

TINY = '''
from dataclasses import dataclass

from distrain.config import ConfigError
from distrain.strategies.registry import register
from distrain.strategies.single import SingleDeviceStrategy


@dataclass
class TinyConfig:
    """The tiny strategy's own section of the config."""

    word: str = "step"
    """What the strategy says at each optimizer step."""


class TinyStrategy(SingleDeviceStrategy):
    """One process that says each optimizer step it takes."""

    def __init__(self, word="step", **options):
        super().__init__(**options)
        self.word = word

    def optimizer_step(self, optimizer, module=None):
        print(f"tiny strategy: {self.word}", flush=True)
        super().optimizer_step(optimizer, module)


def check(config):
    if config.distributed.strategy == "tiny" and config.training.compile:
        raise ConfigError("training.compile is not supported with distributed.strategy 'tiny'")
    if not config.tiny.word.isalpha():
        raise ConfigError(f"tiny.word must be letters, got {config.tiny.word!r}")


def options_from_config(config, block_classes):
    return {"word": config.tiny.word}


register("tiny", TinyStrategy, "one process, from a plugin", options_from_config, "tiny", check, cost_model="tiny_plan")
'''

TINY_PLAN = '''
from dataclasses import replace

from distrain.planner.models import CostModel, model_of
from distrain.planner.options import Option


class Tiny(CostModel):
    """Priced as one process (which it is), shown beside it, never chosen for the user. Its options carry a
    setting of its own (the word its section configures), which nothing in the planner knows of."""

    kinds = ("tiny",)

    def from_config(self, config):
        return {"word": config.tiny.word}

    def offered(self, job):
        return [self.option_for_run("tiny", job)] if job.world_size == 1 else []

    def option_for_run(self, strategy, job):
        return Option("tiny", word=self.configured(job).get("word", "step"))

    def auto_may_choose(self, option):
        return False

    def label(self, option, accumulate=None):
        return f"tiny one process saying {option.get('word')}"

    def short(self, option):
        return "Tiny"

    def estimate(self, estimator, option):
        one = model_of("single")
        return replace(one.estimate(estimator, replace(option, family="single")), option=option)

    def step_time(self, estimator, option, hw):
        return model_of("single").step_time(estimator, replace(option, family="single"), hw)


MODELS = (Tiny(),)
'''


def _plugin(root: Path) -> None:
    (root / "tiny_strategy.py").write_text(TINY)
    (root / "tiny_plan.py").write_text(TINY_PLAN)
    info = root / "tiny_strategy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-strategy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[distrain.strategies]\ntiny = tiny_strategy\n\n[distrain.config]\ntiny = tiny_strategy:TinyConfig\n"
    )


def _train(tmp: Path, *args: str, command: str = "train", strategy: str = "tiny") -> subprocess.CompletedProcess:
    env = {**env_without_rank(), "PYTHONPATH": f"{tmp / 'plugin'}:{ROOT}"}
    argv = [sys.executable, "-m", "distrain.cli", command, "--strategy", strategy, "--devices", "1", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=env, timeout=300)


def test_a_strategy_in_one_file_trains_and_checks_its_config(tmp_path):
    """Its own config section too: set from the command line, saved with the run, listed by ``distrain config``
    with its doc, its keys checked by the schema (a misspelt one named) and by the strategy's file."""
    (tmp_path / "plugin").mkdir()
    _plugin(tmp_path / "plugin")
    proc = _train(tmp_path, "--max-steps", "2", "--output-dir", "run", "logging.progress_bar=false", "tiny.word=hop")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("tiny strategy: hop") == 2, proc.stdout
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["tiny"] == {"word": "hop"}
    env = {**env_without_rank(), "PYTHONPATH": f"{tmp_path / 'plugin'}:{ROOT}"}
    argv = [sys.executable, "-m", "distrain.cli", "config", "tiny"]
    listed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60).stdout.splitlines()
    assert [line.split()[:3] for line in listed[1:]] == [["tiny.word", "str", "step"]], listed
    assert "What the strategy says at each optimizer step." in listed[1]
    refused = _train(tmp_path, "--output-dir", "run2", "training.compile=true")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "distrain: error: training.compile is not supported with distributed.strategy 'tiny'"
    ), refused.stderr
    misspelt = _train(tmp_path, "--output-dir", "run2", "tiny.wrd=hop")
    assert misspelt.returncode == 2 and "unknown key 'tiny.wrd'" in misspelt.stderr, misspelt.stderr
    assert "did you mean 'tiny.word'?" in misspelt.stderr
    wrong = _train(tmp_path, "--output-dir", "run2", "tiny.word=h0p")
    assert wrong.returncode == 2 and "tiny.word must be letters, got 'h0p'" in wrong.stderr, wrong.stderr
    assert not (tmp_path / "run2").exists()
    unknown = _train(tmp_path.parent, "--output-dir", str(tmp_path / "run3"))  # without the plugin on the path
    assert unknown.returncode == 2


def test_its_cost_model_puts_it_in_the_plan_beside_the_built_in_ones(tmp_path):
    """``distrain plan --strategy tiny`` plans the plug-in's run, with the setting its model read from the plug-in's
    own section; ``--strategy all`` shows it beside one process,
    priced the same (it is one process), and the recommendation is still one process (its model never lets
    ``auto`` choose it)."""
    (tmp_path / "plugin").mkdir()
    _plugin(tmp_path / "plugin")
    plan = _train(tmp_path, "--model-name", "gpt-tiny", "--no-time", "tiny.word=hop", command="plan")
    assert plan.returncode == 0, plan.stderr[-2000:]
    (mine,) = [line for line in plan.stdout.splitlines() if line.split("  ")[0] == "tiny one process saying hop"]
    assert mine.endswith("← this run"), plan.stdout
    every = _train(tmp_path, "--model-name", "gpt-tiny", "--no-time", "--json", command="plan", strategy="all")
    assert every.returncode == 0, every.stderr[-2000:]
    shown = json.loads(every.stdout)
    rows = {r["strategy"]: r for r in shown["rows"] if r["activation_checkpointing"] == 0}
    assert rows["tiny"]["label"] == "tiny one process saying step"  # the section's default
    assert rows["tiny"]["peak_bytes"] == rows["single"]["peak_bytes"] > 0
    assert shown["recommendation"] == "single", shown["reason"]
    # a cost model that cannot load is named, with the strategy that names it, in one line
    (tmp_path / "plugin" / "tiny_plan.py").write_text("import no_such_module_here\n")
    broken = _train(tmp_path, "--model-name", "gpt-tiny", "--no-time", command="plan", strategy="all")
    assert broken.returncode != 0
    last = broken.stderr.strip().splitlines()[-1]
    assert "'tiny_plan' of strategy tiny could not be loaded" in last and "no_such_module_here" in last, broken.stderr


def _distrain(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**env_without_rank(), "PYTHONPATH": f"{path}:{ROOT}"}
    argv = [sys.executable, "-m", "distrain.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=path, env=env, timeout=120)


def test_a_config_section_that_cannot_be_one_is_one_line_naming_its_entry_point(tmp_path):
    """A plug-in's section whose module is missing, that is no dataclass, or that takes a core section's name; and
    distrain's own metadata older than the code (a stale ``distrain.egg-info`` first on the path): every command
    that reads the config says so in one line, before anything starts."""
    cases = {
        "gone = no_such_module_here:Section": "config section 'gone' (no_such_module_here:Section",
        "notdc = json:dumps": "config section 'notdc' (json:dumps, entry point group distrain.config) is not a",
        "training = tiny_strategy:TinyConfig": "config section 'training' (tiny_strategy:TinyConfig",
    }
    for n, (line, said) in enumerate(cases.items()):
        root = tmp_path / f"case{n}"
        root.mkdir()
        _plugin(root)
        (root / "tiny_strategy-0.1.dist-info" / "entry_points.txt").write_text(f"[distrain.config]\n{line}\n")
        for args in (("config",), ("train", "--max-steps", "1", "--output-dir", "run")):
            proc = _distrain(root, *args)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (line, args, proc.stderr)
            assert said in proc.stderr, (line, args, proc.stderr)
        assert not (root / "run").exists()
    stale = tmp_path / "stale"
    (stale / "distrain.egg-info").mkdir(parents=True)
    (stale / "distrain.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: distrain\nVersion: 0.0.1\n")
    (stale / "distrain.egg-info" / "entry_points.txt").write_text("[console_scripts]\ndistrain = distrain.cli:main\n")
    for args in (("config",), ("train", "--max-steps", "1", "--output-dir", "run"), ("plan",)):
        proc = _distrain(stale, *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert f"its metadata in {stale} is older than this code" in proc.stderr and "install it again" in proc.stderr
    assert not (stale / "run").exists()
