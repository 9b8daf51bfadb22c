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
    "written/half_precision.py",
    "written/named_ddp.py",
    "written/prediction_writer.py",
    "written/weight_averaging.py",
    "written/stochastic_weight_averaging.py",
    "written/lr_finder.py",
    "written/mid_epoch_validation.py",
]
#: where a script writes files that are compared too (``torch.save``'d tensors and lists, read back as numbers)
OUTPUTS = "predictions"


def example_env(script: Path, out: str, devices: int) -> dict:
    """The harness's paths, and the layout in Lightning's own variables (the scripts set no devices)."""
    # Lightning's own variables only as set here: one left by the caller (PL_GLOBAL_SEED) would change the numbers
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env.update(EXAMPLE_SCRIPT=str(script), EXAMPLE_OUT=out, PL_TRAINER_ACCELERATOR="cpu")
    # one thread a process, under both frameworks: a sum over two threads rounds otherwise, and over a few epochs of
    # momentum that reaches the comparison's tolerance
    env["OMP_NUM_THREADS"] = "1"
    env.update(PL_TRAINER_DEVICES=str(devices), PL_TRAINER_STRATEGY="ddp" if devices > 1 else "auto")
    return env


def outputs(folder: Path) -> dict:
    """The files a script wrote under ``folder/OUTPUTS``, by their path there: what each holds, as numbers (its
    tensors as nested lists)."""
    import torch

    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    root = folder / OUTPUTS
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    return {str(p.relative_to(root)): plain(torch.load(p, weights_only=True)) for p in files}


def run(script: Path, devices: int) -> tuple[dict, dict]:
    """The losses of each rank's backward passes, and the files it wrote (``outputs``)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, str(HERE / "run_example.py")], cwd=tmp, env=example_env(script, tmp, devices), check=True
        )
        ranks = {rank: json.loads((Path(tmp) / f"losses_rank{rank}.json").read_text()) for rank in range(devices)}
        return ranks, outputs(Path(tmp))


if __name__ == "__main__":
    import lightning

    for name in sys.argv[1:] or EXAMPLES:  # the scripts named, else every one
        runs = {str(devices): run(HERE / name, devices) for devices in (1, 2)}
        record = {
            "lightning": lightning.__version__,
            "torch": __import__("torch").__version__,
            "losses": {devices: losses for devices, (losses, _) in runs.items()},
        }
        if any(files for _, files in runs.values()):
            record["outputs"] = {devices: files for devices, (_, files) in runs.items()}
        (HERE / "reference" / Path(name).with_suffix(".json").name).write_text(json.dumps(record, indent=1) + "\n")
