"""`distrain plan` for replica groups (ddp_torchft): the groups' gradient average every step against
semi-synchronous meetings (local SGD, DiLoCo) every ``sync_every`` steps, over the link that joins the groups
(``--inter-node-bandwidth``), and the what-if a slow link asks. Rates are given (no measuring), traces are of
gpt-tiny: in-process and fast."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from distrain import cli
from distrain.planner import Budget, Job, ModelSpec, Planner
from distrain.planner.plan import option_for_run
from distrain.planner.timing import Hardware

LINK = Hardware(
    matmul_flops=50e12,
    memory_bandwidth=1e12,
    op_seconds=5e-6,
    intra_bandwidth=100e9,
    inter_bandwidth=100e9,
    collective_seconds=20e-6,
    overlap=True,
    source="test",
)
GBIT = 0.125e9  # 1 Gbit/s in bytes per second


def _rows(sync_every=8, groups=2, per_group=2, semi_sync="diloco", inter=GBIT, precision="32-true", momentum=0.9):
    job = Job(
        ModelSpec.builtin_gpt("gpt-tiny", 64), 4, precision=precision, world_size=groups * per_group, gpu=True,
        replica_groups=groups, semi_sync=semi_sync, sync_every=sync_every, outer_momentum=momentum,
    )  # fmt: skip
    plan = Planner(job, Budget(8 << 30, 8 << 30, True, "test"), replace(LINK, inter_bandwidth=inter))
    rows = plan.plan("all", checkpoint=False)
    return plan, {r.label: r for r in rows.rows}, rows


def test_replica_groups_are_planned_synchronous_and_semi_synchronous():
    _, rows, plan = _rows()
    assert list(rows) == ["ddp", "ddp + local_sgd every 8 steps", "ddp + diloco every 8 steps"]
    # nothing else spans replica groups, and auto never turns a run semi-synchronous (it changes the optimization)
    assert plan.recommendation.label == "ddp"
    # ... and says what a meeting every 8 steps would gain over this link
    assert "ddp + local_sgd every 8 steps would train" in plan.reason and "the tokens/s" in plan.reason
    out = plan.to_json()
    assert [(r["semi_sync"], r["sync_every"]) for r in out["rows"]] == [(None, 1), ("local_sgd", 8), ("diloco", 8)]


def test_the_cross_group_time_falls_sync_every_fold():
    """c(H) = within-group + cross-group / H: the meeting moves the fp32 parameters (what fp32 gradients weigh),
    so H=1 costs what the synchronous average costs, and the times for H = 1, 2, 8 lie on that line."""
    comm = {h: _rows(sync_every=h)[1][f"ddp + diloco every {h} steps"].step.communication for h in (1, 2, 8)}
    sync = _rows(sync_every=8)[1]["ddp"].step.communication
    assert comm[1] == pytest.approx(sync, rel=1e-9)
    cross = (comm[1] - comm[8]) * 8 / 7
    assert comm[2] == pytest.approx(comm[1] - cross / 2, rel=1e-9)
    assert cross > 0.9 * comm[1]  # over 1 Gbit/s the link between groups is nearly all of it
    # one rank per group: no within-group average at all
    alone = _rows(sync_every=4, per_group=1)[1]
    assert alone["ddp + local_sgd every 4 steps"].step.communication == pytest.approx(
        alone["ddp"].step.communication / 4, rel=1e-9
    )


def test_diloco_pays_over_a_slow_link_and_not_over_a_fast_one():
    _, slow, _ = _rows(inter=GBIT)
    _, fast, _ = _rows(inter=1000e9)
    rate = lambda r: r.tokens_per_step / r.step.seconds  # noqa: E731
    assert rate(slow["ddp + diloco every 8 steps"]) > 4 * rate(slow["ddp"])
    assert rate(fast["ddp + diloco every 8 steps"]) == pytest.approx(rate(fast["ddp"]), rel=0.1)


def test_diloco_holds_the_last_meetings_parameters_and_its_momentum():
    _, rows, _ = _rows()
    ddp, local, diloco = rows["ddp"], rows["ddp + local_sgd every 8 steps"], rows["ddp + diloco every 8 steps"]
    fp32_params = ddp.params  # 32-true, no buffers in gpt-tiny
    assert local.optimizer == ddp.optimizer and local.peak == ddp.peak
    assert diloco.optimizer - ddp.optimizer == 2 * fp32_params
    _, plain, _ = _rows(momentum=0)
    assert plain["ddp + diloco every 8 steps"].optimizer - ddp.optimizer == fp32_params


def test_the_run_is_marked_and_a_group_of_one_stays_ddp():
    job = Job(ModelSpec.builtin_gpt("gpt-tiny", 64), 4, world_size=4, replica_groups=2, semi_sync="local_sgd")
    run = option_for_run("ddp_torchft", job)
    assert (run.family, run.get("semi_sync"), run.get("sync_every", 1)) == ("ddp", "local_sgd", 8)
    assert option_for_run("ddp_torchft", replace(job, semi_sync=None)).get("semi_sync") is None
    assert option_for_run("ddp", job).get("semi_sync") is None


def test_the_what_if_over_a_slow_link_through_the_cli(capsys):
    code = cli.main([
        "plan", "--model-name", "gpt-tiny", "--devices", "1", "--batch-size", "4", "--seq-len", "64",
        "--accelerator", "gpu", "--gpu-type", "H100", "--gpu-memory", "80GB", "--inter-node-bandwidth", "0.125",
        "--json", "distributed.strategy=ddp_torchft", "distributed.replica_groups=3", "distributed.semi_sync=diloco",
        "distributed.sync_every=16",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["label"]: r for r in out["rows"]}
    sync, diloco = rows["ddp"], rows["ddp + diloco every 16 steps"]
    assert sync["step_seconds"] > 4 * diloco["step_seconds"]
    assert [r["label"] for r in out["rows"] if r["this_run"]] == ["ddp + diloco every 16 steps"]
