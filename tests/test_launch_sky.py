"""`distrain launch sky` writes a SkyPilot task that SkyPilot itself accepts. No cloud is contacted.

SkyPilot cannot be in the test extra (it pins click<8.2, the Hugging Face hub needs click>=8.4), so
the task is checked against SkyPilot's published task and resources schemas, as SkyPilot's own
validator applies them (tests/data/skypilot_schema.json, dumped from skypilot 0.14.1 by
``python tests/test_launch_sky.py --dump-schema``), and, where the package is installed, loaded with
``sky.Task.from_yaml``.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distrain import jobscripts

SCHEMA = Path(__file__).parent / "data" / "skypilot_schema.json"


def _cli(tmp, capsys, monkeypatch, *args):
    """``distrain launch sky ARGS`` in ``tmp`` (in-process: the same main() the console script runs)."""
    from distrain.cli import main

    monkeypatch.chdir(tmp)
    code = main(["launch", "sky", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def _validator(schema):
    """SkyPilot's validator: JSON Schema plus its ``case_insensitive_enum`` keyword."""
    import jsonschema

    def case_insensitive_enum(validator, enums, instance, schema):
        if isinstance(instance, str) and instance.lower() not in [e.lower() for e in enums]:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {enums}")

    base = jsonschema.validators.validator_for(schema)
    return jsonschema.validators.extend(base, {"case_insensitive_enum": case_insensitive_enum})(schema)


def _check_against_schema(task: dict) -> None:
    schemas = json.loads(SCHEMA.read_text())
    _validator(schemas["task"]).validate(task)
    _validator(schemas["resources"]).validate(task["resources"])


def test_spot_task_on_aws_two_nodes(tmp_path, capsys, monkeypatch):
    flags = ["--nodes", "2", "--gpus", "A100:8", "--cloud", "aws", "--spot", "--bucket", "ckpts"]
    out = _cli(tmp_path, capsys, monkeypatch, *flags, "--", "--strategy", "fsdp", "--precision", "bf16-mixed")
    assert out.returncode == 0, out.stderr
    assert "sky jobs launch --yes --name distrain distrain.sky.yaml" in out.stdout  # spot: a managed job
    text = (tmp_path / "distrain.sky.yaml").read_text()
    task = yaml.safe_load(text)
    _check_against_schema(task)
    assert task["num_nodes"] == 2
    assert task["resources"] == {
        "accelerators": "A100:8",
        "infra": "aws",
        "use_spot": True,
        "job_recovery": {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 3},
    }
    assert task["file_mounts"] == {"/checkpoints": {"name": "ckpts", "mode": "MOUNT_CACHED"}}
    assert "./install.sh" in task["setup"]
    run = task["run"]
    for variable in ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_NUM_NODES"):
        assert f"${variable}" in run
    train = re.search(r"-m distrain.cli train (.*)", run).group(1).split()
    # recovery after a preemption continues from the newest checkpoint, kept in the bucket
    assert train == ["--strategy", "fsdp", "--precision", "bf16-mixed", "--output-dir", "/checkpoints/distrain",
                     "--num-nodes", "2", "--devices", "8", "--resume", "auto"]  # fmt: skip

    sky = pytest.importorskip("sky", reason="skypilot is not installed (not in the test extra: see the docstring)")
    loaded = sky.Task.from_yaml(str(tmp_path / "distrain.sky.yaml"))
    (resources,) = list(loaded.resources)
    assert loaded.num_nodes == 2 and resources.accelerators == {"A100": 8} and resources.use_spot
    assert str(resources.cloud) == "AWS" and "/checkpoints" in loaded.storage_mounts


@pytest.mark.parametrize("cloud,infra", [("kubernetes", "k8s"), ("gcp", "gcp"), (None, None)])
def test_on_demand_tasks_for_each_cloud(tmp_path, cloud, infra):
    text = jobscripts.skypilot_task(1, "H100:8", ["--max-steps", "10"], cloud=cloud)
    task = yaml.safe_load(text)
    _check_against_schema(task)
    assert task["resources"].get("infra") == infra and "use_spot" not in task["resources"]
    assert "file_mounts" not in task and "--output-dir runs/distrain" in task["run"]
    assert jobscripts.sky_launch_command("t.yaml", spot=False) == ["sky", "launch", "--yes", "--cluster", "distrain",
                                                                   "t.yaml"]  # fmt: skip


def test_bad_gpus_and_cloud_are_one_line_errors(tmp_path, capsys, monkeypatch):
    out = _cli(tmp_path, capsys, monkeypatch, "--nodes", "2", "--gpus", "A100:x")
    assert out.returncode == 2 and "--gpus 'A100:x': expected NAME:COUNT" in out.stderr
    with pytest.raises(ValueError, match="--cloud must be one of aws, gcp, azure, kubernetes"):
        jobscripts.skypilot_task(1, "A100:8", [], cloud="mars")


def test_schema_file_rejects_what_skypilot_rejects():
    # the schema check is not vacuous: a misspelt key and an unknown cloud fail it
    with pytest.raises(Exception, match="num_node"):
        _check_against_schema({"num_node": 2, "resources": {}})
    with pytest.raises(Exception, match="mars"):
        _check_against_schema({"num_nodes": 2, "resources": {"cloud": "mars"}})


if __name__ == "__main__" and sys.argv[1:] == ["--dump-schema"]:
    import sky
    from sky.utils import schemas

    SCHEMA.write_text(
        json.dumps(
            {
                "source": f"skypilot {sky.__version__}: sky.utils.schemas.get_task_schema() and "
                "get_resources_schema(), dumped by tests/test_launch_sky.py --dump-schema",
                "task": schemas.get_task_schema(),
                "resources": schemas.get_resources_schema(),
            },
            indent=1,
            sort_keys=True,
        )
    )
