"""Strategies other libraries name that distrain does not run: one line naming what replaces each, from the API and
from the CLI, before any plan or process start (``registry.REPLACED``)."""

import pytest

import distrain
from distrain import cli


@pytest.mark.parametrize(
    "name, replacement",
    [
        ("colossalai", "'fsdp' or 'deepspeed_stage_3'"),
        ("ColossalAIStrategy", "'model_parallel'"),
        ("hivemind", "'ddp_torchft'"),
        ("HivemindStrategy", "'ddp_torchft'"),
        ("bagua", "comm_hook="),
    ],
)
def test_a_strategy_distrain_does_not_run_names_what_replaces_it_in_one_line(name, replacement, capsys):
    with pytest.raises(ValueError) as info:
        distrain.Trainer(accelerator="cpu", strategy=name, logger=False)
    assert replacement in str(info.value) and "\n" not in str(info.value)
    assert cli.main(["train", "--strategy", name, "--max-steps", "1"]) == 2  # the CLI: before any plan or process
    error = capsys.readouterr().err
    assert replacement in error and "Traceback" not in error
