"""Writes ``reference/<tutorial>.json``: the loss of each backward pass of Lightning's tutorials under Lightning, with
the stand-ins of ``stand_ins/`` (``python tests/lightning_tutorials/make_reference.py``, in an environment with
Lightning 2.6.6 and ``pytorch-lightning`` installed, and no torchvision)."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE.parent / "lightning_examples" / "run_example.py"
#: Lightning's tutorials (``upstream/``, verbatim) whose dependencies install here, with the stand-ins
TUTORIALS = ["mnist_hello_world.py", "datamodules.py", "basic_gan.py"]
#: run apart, too long for the suite (ResNet-18 on 2 cores: 3 minutes under Lightning, 1.5 under distrain):
#: ``DISTRAIN_TUTORIALS=all python -m pytest tests/test_lightning_tutorials.py``
APART = ["cifar10_baseline.py"]
#: a few batches of each stage, through Lightning's own variables (the tutorials set none of these)
LIMITS = {f"PL_TRAINER_LIMIT_{stage}_BATCHES": "2" for stage in ("TRAIN", "VAL", "TEST")}


def tutorial_env(script: Path, out: str, data: str) -> dict:
    """The harness's paths, the stand-ins first on the path, the tutorials' data folder, and the limits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env.update(EXAMPLE_SCRIPT=str(script), EXAMPLE_OUT=out, PATH_DATASETS=data, **LIMITS)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "stand_ins"), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    return env


def losses(script: Path) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = tutorial_env(script, tmp, tmp)
        subprocess.run([sys.executable, str(HARNESS)], cwd=tmp, env=env, check=True)
        return json.loads((Path(tmp) / "losses_rank0.json").read_text())


if __name__ == "__main__":
    import lightning

    for name in sys.argv[1:] or TUTORIALS + APART:
        record = {"lightning": lightning.__version__, "torch": __import__("torch").__version__}
        record["losses"] = losses(HERE / "upstream" / name)
        (HERE / "reference" / Path(name).with_suffix(".json").name).write_text(json.dumps(record, indent=1) + "\n")
