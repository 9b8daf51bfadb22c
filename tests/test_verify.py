"""`distrain verify` / `Trainer.verify`: it passes where the layout is right (every strategy × model kind of the
matrix; CI runs each strategy once, the kinds taking turns, DISTRAIN_FULL_MATRIX=1 every cell) and catches the
mistakes users make, each naming the check or parameter at fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matrix_models
import pytest
import torch
import torch.nn.functional as F
from test_matrix import FULL, KINDS, MODEL_PARALLEL, NO_PLAN, SHARED, UNAVAILABLE, _job, _options
from test_matrix import tiny as tiny  # noqa: F401  (the fixture)
from torch import nn

import distrain
from helpers import env_without_rank, run_cli, run_ranks

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = [s for s in (*SHARED, *MODEL_PARALLEL, "ddp_spawn") if s not in UNAVAILABLE]


def _trainer(root, strategy, devices=2, **options):
    options.setdefault("accumulate_grad_batches", 2 if strategy in MODEL_PARALLEL else 1)
    options.setdefault("gradient_clip_val", 1.0)
    return distrain.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        seed=7,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=str(root),
        **options,
    )


def _verify_cell(rank, strategy, kind, tiny_dirs, root):
    module, loader = _job(kind, tiny_dirs, multiple_of=2 if strategy == "model_parallel" else 1)
    options = {"tensor_parallel_size": 2} if strategy == "model_parallel" else _options(strategy, Path(root))
    report = _trainer(root, strategy, **options).verify(module, loader, steps=2)
    return None if report is None else report.to_json()


def _cells():
    cells = [(s, k) for s in STRATEGIES for k in KINDS if (s, k) not in NO_PLAN]
    if FULL:
        return cells
    chosen, turn = [], 0
    for strategy in STRATEGIES:
        kinds = [k for k in KINDS if (strategy, k) not in NO_PLAN]
        chosen.append((strategy, kinds[turn % len(kinds)]))
        turn += 1
    return chosen


def _verify_cells(rank, cells, tiny_dirs, root):
    import gc

    reports = {}
    for strategy, kind in cells:
        # verify ends its process group; the next one meets on the same port, in keys of its own (while rank 0 runs
        # the one-process reference alone, rank 1 waits for it there)
        reports[strategy, kind] = _verify_cell(rank, strategy, kind, tiny_dirs, Path(root) / f"{strategy}-{kind}")
        gc.collect()  # the trainer, its engine and the module refer to each other
    return reports


#: the cells share one pair of rank processes, one cell after the other: each verify ends its process group and
#: the next one begins another in the same processes, on the same port (DeepSpeed's groups of the ended one are
#: forgotten: ``compat.deepspeed_forget_ended_groups``)
VERIFY_SESSIONS = (tuple(s for s in STRATEGIES if s != "ddp_spawn"),)


@pytest.fixture(scope="module")
def verified(tiny, tmp_path_factory):
    """A cell's report. The cells of a VERIFY_SESSIONS entry are verified one after the other in one pair of
    ranks, when the first of them is asked for: each pair of new ranks imports transformers (and DeepSpeed)
    afresh, seconds each on 2 cores."""
    root, reports = tmp_path_factory.mktemp("verify"), {}

    def report_of(strategy: str, kind: str) -> dict:
        if (strategy, kind) not in reports:
            if strategy == "ddp_spawn":  # it starts its own workers: verify runs in this process
                reports[strategy, kind] = _verify_cell(0, strategy, kind, tiny, root / f"{strategy}-{kind}")
            else:
                session = next(s for s in VERIFY_SESSIONS if strategy in s)
                cells = [c for c in _cells() if c[0] in session and c not in reports]
                try:
                    reports.update(run_ranks(_verify_cells, 2, cells, tiny, root)[0])
                except Exception as error:  # every cell of the pair fails with it (not run once more for each)
                    reports.update({c: error for c in cells})
        if isinstance(reports[strategy, kind], Exception):
            raise reports[strategy, kind]
        return reports[strategy, kind]

    return report_of


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("strategy,kind", _cells(), ids=[f"{s}-{k}" for s, k in _cells()])
def test_verify_passes_where_the_layout_is_right(verified, strategy, kind):
    report = verified(strategy, kind)
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["ok"]]
    assert report["ok"], failed
    assert len(report["steps"]) == 2 and {c["name"] for c in report["checks"]} >= {
        "initial weights (step 0)",
        "losses, gradients, weights",
        "data",
        "replicated parameters agree",
        "checkpoint round trip",
        "precision",
    }


# ---- the mistakes it catches ----------------------------------------------------------------------------------
def _failed(report: dict) -> dict[str, str]:
    return {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}


def _run(rank, module_factory, strategy, root, options, loader_options):
    module = module_factory()
    loader = module.train_dataloader(**loader_options)
    report = _trainer(root, strategy, **options).verify(module, loader, steps=2)
    return None if report is None else report.to_json()


class SummedLoss(matrix_models.MLP):
    """The loss summed over the micro-batch where it should be averaged: each rank's micro-batch is smaller
    than the one process's, so its gradient is a fraction of what it should be."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y, reduction="sum")


def test_a_loss_summed_instead_of_averaged(tmp_path):
    report = run_ranks(_run, 2, SummedLoss, "ddp", tmp_path, {}, {})[0]
    failed = _failed(report)
    assert list(failed) == ["losses, gradients, weights"], failed
    assert failed["losses, gradients, weights"].startswith("step 1: loss"), failed


class HalfOptimized(matrix_models.MLP):
    """configure_optimizers forgets the output layer."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net[0].parameters(), lr=self.hparams["lr"])


def test_a_parameter_missing_from_the_optimizer(tmp_path):
    report = run_ranks(_run, 2, HalfOptimized, "fsdp", tmp_path, {}, {})[0]
    missing = _failed(report)["optimizer covers the model"]
    assert "net.2.weight" in missing and "net.2.bias" in missing, missing


class Bf16Storage(matrix_models.MLP):
    """Converts itself to bf16 under precision bf16-mixed, which asks for fp32 master weights."""

    def __init__(self):
        super().__init__()
        self.net.to(torch.bfloat16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x.bfloat16()).float(), y)


def test_bf16_storage_where_fp32_master_weights_were_asked_for(tmp_path):
    report = run_ranks(_run, 2, Bf16Storage, "ddp", tmp_path, {"precision": "bf16-mixed"}, {})[0]
    failed = _failed(report)
    assert "master weights bfloat16, where bf16-mixed asks float32" in failed["precision"], failed


class SameSamples(matrix_models.MLP):
    """Its own loader, unsharded (use_distributed_sampler=False): every rank trains on the same samples."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams["batch_size"], shuffle=False)


def test_a_sampler_that_gives_two_ranks_the_same_sample(tmp_path):
    report = run_ranks(_run, 2, SameSamples, "ddp", tmp_path, {"use_distributed_sampler": False}, {})[0]
    assert "ranks 0 and 1 both trained on one sample" in _failed(report)["data"], report["checks"]


class RankInit(nn.Linear):
    def reset_parameters(self) -> None:  # a scale that depends on the rank: each rank initializes its shard apart
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        nn.init.normal_(self.weight, std=0.1 * (1 + rank))
        nn.init.zeros_(self.bias)


class RankDependentInit(matrix_models.MLP):
    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:
            self.net = nn.Sequential(RankInit(8, 32), nn.Tanh(), RankInit(32, 1))


def test_a_module_whose_init_depends_on_the_rank(tmp_path):
    report = run_ranks(_run, 2, RankDependentInit, "fsdp", tmp_path, {}, {})[0]
    failed = _failed(report)
    assert "initial weights (step 0)" in failed and "net." in failed["initial weights (step 0)"], failed


class HandTensorParallel(matrix_models.MLP):
    """A hand-written tensor-parallel layer: the first layer's weight split by rows over the tensor-parallel ranks,
    its bias left whole on each (a plain tensor, not a DTensor) and sliced in forward — each rank's copy of the bias
    learns only its own slice."""

    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is not None:
            return
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        if self.device_mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            tp = self.device_mesh["tensor_parallel"]
            layer = self.net[0]
            layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), tp, [Shard(0)]))

    def training_step(self, batch, batch_idx):
        x, y = batch
        layer = self.net[0]
        if hasattr(layer.weight, "to_local"):
            from torch.distributed.tensor import DTensor, Shard

            mesh = layer.weight.device_mesh
            rows = layer.weight.to_local().shape[0]
            start = mesh.get_local_rank() * rows
            local = F.linear(x, layer.weight.to_local(), layer.bias[start : start + rows])
            hidden = DTensor.from_local(local, mesh, [Shard(1)]).full_tensor()
        else:
            hidden = layer(x)
        return F.mse_loss(self.net[2](self.net[1](hidden)), y)


def test_a_custom_tensor_parallel_plan_that_leaves_a_bias_replicated(tmp_path):
    options = {"tensor_parallel_size": 2, "accumulate_grad_batches": 2}
    report = run_ranks(_run, 2, HandTensorParallel, "model_parallel", tmp_path, options, {})[0]
    failed = _failed(report)
    assert "net.0.bias differs" in failed["replicated parameters agree"], failed
    assert "net.0.bias" in failed["losses, gradients, weights"], failed


# ---- the command line -----------------------------------------------------------------------------------------------
def test_distrain_verify_reports_json_and_exits_by_the_verdict(tmp_path):
    def verify(*args):
        return subprocess.run(
            [sys.executable, "-m", "distrain.cli", "verify", "--devices", "2", "--output-dir", str(tmp_path / "v"),
             "data.max_bytes=20000", "data.seq_len=16", "training.batch_size_per_gpu=4", "--json", *args],
            capture_output=True, text=True, cwd=tmp_path, env=env_without_rank(), timeout=600,
        )  # fmt: skip

    ok = verify("--strategy", "fsdp", "--steps", "2")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f", 2 steps → {tmp_path / 'v'}" in ok.stdout  # the steps it runs, not the config's max_steps
    report = json.loads(ok.stdout[ok.stdout.index("{") :])
    assert report["ok"] and len(report["steps"]) == 2 and report["header"].startswith("distrain verify: fsdp")
    # too big for this host: one line naming the option that shrinks it (refused before any rank starts: main(),
    # in this process, is what the console script would run)
    huge = run_cli(
        ["verify", "--devices", "2", "--output-dir", str(tmp_path / "huge"), "data.max_bytes=20000",
         "data.seq_len=16", "training.batch_size_per_gpu=4", "--json", "--strategy", "ddp", "--model-name", "gpt-70b"],
        cwd=tmp_path,
    )  # fmt: skip
    assert huge.returncode == 2 and "--shrink" in huge.stderr and len(huge.stderr.strip().splitlines()) == 1


def test_distrain_verify_of_replica_groups_gathers_every_group(tmp_path):
    """ddp_torchft: 2 replica groups of 1 rank. Each group logs its own mean loss and holds its own samples; the
    report is the job's (the loss the groups' mean, the samples of both, every group's copy of the weights), written
    once, and it passes: each group alone failed the loss and data checks against the one-process global batch."""
    proc = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "verify", "--strategy", "ddp_torchft", "--devices", "1",
         "--output-dir", str(tmp_path / "v"), "data.max_bytes=20000", "data.seq_len=16",
         "training.batch_size_per_gpu=4", "--steps", "2"],
        capture_output=True, text=True, cwd=tmp_path, env=env_without_rank(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count("result: PASS") == 1 and "result: FAIL" not in proc.stdout, proc.stdout[-3000:]
    assert "on 2 ranks (2 with their own data)" in proc.stdout
    assert "2 ranks × 2 steps: disjoint, together the global batch" in proc.stdout


def test_no_precision_and_strategy_gets_a_tolerance_no_run_can_cross():
    """A relative tolerance near 1 passes any run (DeepSpeed in bf16-mixed once got 1.0: bf16's 1e-1 times the
    factor meant for fp32). Every precision under every strategy class stays at most fp8's 0.2; DeepSpeed keeps
    its looser fp32 bound and, holding bf16 weights, bf16-true's."""
    from distrain.strategies import registry
    from distrain.verify.report import TOLERANCE, tolerance

    classes = {type(registry.make_strategy(name, 2)).__name__ for name in ("ddp", "fsdp", "deepspeed_stage_3")}
    for precision in TOLERANCE:
        for strategy in classes:
            assert 0 < tolerance(precision, strategy) <= 0.2, (precision, strategy, tolerance(precision, strategy))
    assert tolerance("32-true", "DeepSpeedStrategy") == 1e-3 and tolerance("32-true", "FSDPStrategy") == 1e-4
    assert tolerance("bf16-mixed", "DeepSpeedStrategy") == TOLERANCE["bf16-true"]
    assert tolerance("bf16-mixed", "FSDPStrategy") == TOLERANCE["bf16-mixed"]
