"""The front door, as a user meets it: ``distrain --help`` and each command's, a bare ``distrain``, ``--version``,
``distrain config``, the one line an option that is misspelt or unknown gets, and ``distrain launch``'s job files
(never written over without --force; Slurm's time formats). Real subprocesses where start-up is the subject, else
in-process; none trains."""

import dataclasses
import os
import subprocess
import sys

import pytest

from distrain import cli
from distrain.config import RunConfig, config_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def distrain(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "distrain.cli", *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=120
    )


def torch_loaded_after(argv: list[str]) -> bool:
    """Whether ``cli.main(argv)`` (as the console script calls it) imported torch, in a fresh interpreter."""
    code = (
        "import sys\nfrom distrain import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return proc.stderr.strip().splitlines()[-1] == "True"


def test_help_lists_every_command_one_line_each():
    proc = distrain("--help")
    assert proc.returncode == 0 and proc.stdout.endswith("\n"), proc.stderr
    for name in cli.COMMANDS:
        lines = [line for line in proc.stdout.splitlines() if line.split()[:1] == [name]]
        assert len(lines) == 1 and cli.SUMMARIES[name] in lines[0], (name, proc.stdout)
    assert distrain("-h").stdout == proc.stdout


def test_help_imports_no_torch():
    assert not torch_loaded_after(["--help"])
    assert not torch_loaded_after(["config"])
    assert not torch_loaded_after(["--version"])


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_help_is_fast(command):
    assert not torch_loaded_after([command, "--help"])


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_help_exits_0(command):
    proc = distrain(command, "--help")
    assert proc.returncode == 0 and f"distrain {command}" in proc.stdout and not proc.stderr.strip(), proc.stderr


def test_bare_distrain_prints_the_help_and_trains_nothing(tmp_path):
    proc = distrain(cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == distrain("--help").stdout
    assert list(tmp_path.iterdir()) == []  # no runs/ directory: nothing started


def test_version():
    from importlib.metadata import version

    proc = distrain("--version")
    assert proc.returncode == 0 and proc.stdout == f"distrain {version('distrain')}\n"


def test_unknown_command_is_one_line():
    proc = distrain("trian")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "did you mean train?" in proc.stderr


def test_abbreviations_are_refused_with_the_full_name(tmp_path):
    for command in ("train", "plan", "verify"):
        proc = distrain(command, "--max-step", "3", "--output-dir", str(tmp_path / "out"))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "--max-steps" in proc.stderr and "training.max_steps" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = distrain("doctor", "--devic", "2")  # every parser, not only train's
    assert proc.returncode == 2 and "did you mean --devices?" in proc.stderr
    proc = distrain("launch", "slurm", "--nod", "2", "--gpus-per-node", "8", "--time", "01:00:00", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("distrain launch slurm: error:")


def test_an_option_that_is_a_config_key_names_its_key_value_form(tmp_path):
    proc = distrain("train", "--learning-rate", "0.1", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "training.learning_rate=0.1" in proc.stderr
    proc = distrain("train", "--batch-size-per-gpu=4")  # the key's own option is named too
    assert "training.batch_size_per_gpu=4" in proc.stderr and "--batch-size 4" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_misspelt_option_without_a_command_can_mean_distrain_s_own():
    proc = distrain("--verison")
    assert proc.returncode == 2 and "did you mean --version?" in proc.stderr


def _dataclass_keys(section=None, prefix=""):
    """Every key of the config, found by walking an instance (independently of ``config_keys``)."""
    section = RunConfig() if section is None else section
    out = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out += _dataclass_keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


def test_config_lists_every_key():
    proc = distrain("config")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert listed == _dataclass_keys() == [k.key for k in config_keys()]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("training.max_steps "))
    assert line.split()[1:3] == ["int", "200"] and "— Optimizer steps to run" in line and "--max-steps" in line
    assert "Range: > 0" in next(line for line in proc.stdout.splitlines() if line.startswith("training.learning_rate "))
    assert distrain("train", "--help-config").stdout == proc.stdout
    only = distrain("config", "fsdp.mixed_precision").stdout.splitlines()[1:]
    assert [line.split()[0] for line in only] == [k for k in listed if k.startswith("fsdp.mixed_precision.")]
    proc = distrain("config", "trainin")
    assert proc.returncode == 2 and "did you mean training?" in proc.stderr


def test_a_new_key_is_listed_with_its_doc():
    @dataclasses.dataclass
    class Section:
        fresh: int = 3
        """What the fresh key does. More text."""

    (key,) = config_keys(Section, "extra.")
    assert (key.key, key.type, key.default, key.summary) == ("extra.fresh", "int", 3, "What the fresh key does.")


def test_the_package_names_are_lazy_and_all_there():
    import distrain

    assert sorted(distrain.__all__) == sorted(distrain._EXPORTS)
    assert set(distrain.__all__) <= set(dir(distrain))
    code = (
        "import sys, distrain\nassert 'torch' not in sys.modules\n"
        "from distrain import Trainer, wrap\n"
        "assert distrain.Trainer is Trainer and all(getattr(distrain, n) is not None for n in distrain.__all__)\n"
        "assert distrain.strategies.registry.names()\n"
        "try:\n    distrain.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_config_built_without_the_package_names_still_gets_the_strategy_checks():
    """The strategies' checks of their keys register when distrain.strategies is imported, which the package no
    longer does on import: building a config does it."""
    code = (
        "from distrain.config import ConfigError, build_config\n"
        "try:\n    build_config(None, {'distributed.strategy': 'horovod'})\nexcept ConfigError as e:\n"
        "    print(e)\nelse:\n    raise SystemExit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "Horovod" in proc.stdout, proc.stderr


def _launch(capsys, *args):
    """``distrain launch ARGS`` in-process (the same main() the console script runs): (exit code, stdout, stderr)."""
    try:
        code = cli.main(["launch", *args])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_launch_never_overwrites_a_job_file_without_force(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engines = {
        "distrain.sbatch": ("slurm", "--nodes", "1", "--gpus-per-node", "2", "--time", "1:00:00"),
        "pytorchjob.yaml": ("k8s", "--nodes", "1", "--gpus-per-node", "2", "--image", "reg/d:1"),
        "distrain.sky.yaml": ("sky", "--nodes", "1", "--gpus", "A100:2"),
    }
    for name, args in engines.items():
        (tmp_path / name).write_text("mine")
        code, out, err = _launch(capsys, *args, "--", "--strategy", "ddp")
        assert code == 2 and not out, (name, out)
        assert err == f"distrain: error: {name} exists; --force overwrites it, or --output names another file\n"
        assert (tmp_path / name).read_text() == "mine"
        code, out, err = _launch(capsys, *args, "--force", "--", "--strategy", "ddp")
        assert code == 0 and out.startswith(f"distrain: wrote {name}"), err
        assert "train --strategy ddp" in (tmp_path / name).read_text()


@pytest.mark.parametrize("time", ["10", "90:30", "1:00:00", "2-12", "2-12:30", "1-00:00:00", "UNLIMITED"])
def test_slurm_takes_every_time_format_sbatch_takes(tmp_path, capsys, monkeypatch, time):
    monkeypatch.chdir(tmp_path)
    code, _, err = _launch(capsys, "slurm", "--nodes", "1", "--gpus-per-node", "2", "--time", time)
    assert code == 0, err
    assert f"#SBATCH --time={time}\n" in (tmp_path / "distrain.sbatch").read_text()


@pytest.mark.parametrize("time", ["10m", "1h", "1:00:00:00", "1-", "90 min"])
def test_a_time_sbatch_would_refuse_is_one_line_and_no_file(tmp_path, capsys, monkeypatch, time):
    monkeypatch.chdir(tmp_path)
    code, out, err = _launch(capsys, "slurm", "--nodes", "1", "--gpus-per-node", "2", "--time", time)
    assert code == 2 and not out and err.count("\n") == 1, err
    assert f"argument --time: {time!r} is not a Slurm time: write MINUTES, MM:SS, HH:MM:SS, D-HH" in err
    assert not any(tmp_path.iterdir())
