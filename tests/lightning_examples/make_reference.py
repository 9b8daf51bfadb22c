"""Writes ``reference/<script>.json``: the losses of each example under Lightning, on 1 process and on 2 DDP ranks
(``python tests/lightning_examples/make_reference.py``, in an environment with Lightning installed)."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"  # the verbatim copies (ruff leaves them as they are: pyproject.toml)
#: the scripts run: Lightning's own (upstream/), and ones written as its users write them (written/)
EXAMPLES = [
    "upstream/bug_report_model.py",
    "written/boring_report.py",
    "written/random_streams.py",
    "written/unseeded_datamodule.py",
    "written/double_precision.py",
    "written/named_ddp.py",
]


def example_env(script: Path, out: str, devices: int) -> dict:
    """The harness's paths, and the layout in Lightning's own variables (the scripts set no devices)."""
    # Lightning's own variables only as set here: one left by the caller (PL_GLOBAL_SEED) would change the numbers
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env.update(EXAMPLE_SCRIPT=str(script), EXAMPLE_OUT=out, PL_TRAINER_ACCELERATOR="cpu")
    env.update(PL_TRAINER_DEVICES=str(devices), PL_TRAINER_STRATEGY="ddp" if devices > 1 else "auto")
    return env


def losses(script: Path, devices: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, str(HERE / "run_example.py")], cwd=tmp, env=example_env(script, tmp, devices), check=True
        )
        return {rank: json.loads((Path(tmp) / f"losses_rank{rank}.json").read_text()) for rank in range(devices)}


if __name__ == "__main__":
    import lightning

    for name in EXAMPLES:
        runs = {str(devices): losses(HERE / name, devices) for devices in (1, 2)}
        record = {"lightning": lightning.__version__, "torch": __import__("torch").__version__, "losses": runs}
        (HERE / "reference" / Path(name).with_suffix(".json").name).write_text(json.dumps(record, indent=1) + "\n")
