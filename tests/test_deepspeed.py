"""DeepSpeed ZeRO on real gloo ranks: parity with DDP, offload, the JSON config with "auto",
exact resume through engine checkpoints, conversion to one fp32 state dict, clear errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")

import distrain  # noqa: E402
from distrain.models.gpt import GPT, Block, GPTConfig  # noqa: E402
from helpers import TinyGPT, loader, make_trainer, params_of, run_cli, run_ranks  # noqa: E402

STEPS = 6


class LazyTinyGPT(TinyGPT):
    """Builds its GPT in configure_model: under ZeRO-3 that runs inside deepspeed.zero.Init."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gpt = None

    def configure_model(self):
        if self.gpt is None:
            self.gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


def _train(tmp, strategy, devices, batch, accumulate=1, steps=STEPS, **kw):
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        **kw,
    )
    trainer.fit(LazyTinyGPT(), loader(batch))
    return rec.losses, rec.grad_norms


def _variants(rank, tmp):
    out = {"ddp": _train(tmp / "ddp", "ddp", 2, 4)}
    for name, strategy, batch, acc in [
        ("stage0", distrain.DeepSpeedStrategy(stage=0), 4, 1),  # no ZeRO: the engine steps a plain torch optimizer
        ("stage1", "deepspeed_stage_1", 4, 1),
        ("stage2", "deepspeed_stage_2", 4, 1),
        ("stage3", "deepspeed_stage_3", 4, 1),
        ("stage2+accumulate", "deepspeed_stage_2", 2, 2),
        (
            "stage3+activation_checkpointing",
            distrain.DeepSpeedStrategy(stage=3, activation_checkpointing_policy={Block}),
            4,
            1,
        ),
        ("stage2+offload_optimizer", "deepspeed_stage_2_offload", 4, 1),
    ]:
        out[name] = _train(tmp / name, strategy, 2, batch, acc)
    return out


@pytest.mark.slow
def test_zero_stages_reproduce_ddp_losses(tmp_path):
    """fp32, global batch 8: every stage (and ZeRO-Offload with DeepSpeedCPUAdam) follows DDP's
    loss trajectory. Tolerance 1e-5 relative: ZeRO reduces flat buckets in another order."""
    results = run_ranks(_variants, 2, tmp_path)[0]
    ddp, ddp_norms = results.pop("ddp")
    assert len(ddp) == STEPS and ddp[-1] < ddp[0]
    for name, (losses, norms) in results.items():
        assert len(losses) == STEPS, name
        tol = 1e-4 if "offload" in name else 1e-5  # DeepSpeedCPUAdam's vectorized update rounds differently
        for a, b in zip(ddp, losses):
            assert abs(a - b) <= tol * abs(a), (name, ddp, losses)
        # the engine's pre-clip global norm: Adam would hide a wrong gradient scale from the losses
        for a, b in zip(ddp_norms, norms, strict=True):
            assert abs(a - b) <= tol * abs(a), (name, ddp_norms, norms)


def _offload_stage3(rank, tmp):
    import cpuinfo

    asked, ask = [], cpuinfo.get_cpu_info  # how often the CPU's description is really asked for (a process each)
    cpuinfo.get_cpu_info = lambda: asked.append(1) or ask()
    return _train(tmp, "deepspeed_stage_3_offload", 2, 4, steps=8)[0], len(asked)


@pytest.mark.slow
def test_stage3_with_parameter_and_optimizer_offload_trains(tmp_path):
    """And each rank asks py-cpuinfo once, where DeepSpeed's CPU Adam and op checks ask three or four times."""
    (losses, asked), (_, asked_1) = run_ranks(_offload_stage3, 2, tmp_path)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05, losses
    assert asked == asked_1 == 1


# ---- checkpoints ----------------------------------------------------------------------------
def _run(tmp, strategy, steps, resume=False):
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=2,
        max_steps=steps,
        logger=False,
        gradient_clip_val=0.5,
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)],
    )
    module = LazyTinyGPT(dropout=0.1)  # dropout: the RNG streams must resume too
    trainer.fit(module, loader(4), ckpt_path="last" if resume else None)
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        weights = params_of(module)
    return rec.losses, weights


def _save_and_resume(rank, tmp, strategy):
    full_losses, full_weights = _run(tmp / "full", strategy, 8)
    first, _ = _run(tmp / "cut", strategy, 4)
    second, resumed_weights = _run(tmp / "cut", strategy, 8, resume=True)
    # a fresh Trainer evaluates the checkpoint (ZeRO-3: an engine without optimizer, partitioned)
    trainer, _ = make_trainer(tmp / "eval", strategy=strategy, devices=2, logger=False)
    val = trainer.validate(
        LazyTinyGPT(), loader(4, shuffle=False), ckpt_path=str(tmp / "full" / "checkpoints" / "last")
    )
    return full_losses, first + second, full_weights, resumed_weights, val[0]["val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_resume_equals_uninterrupted_and_converts(tmp_path, strategy):
    full_losses, cut_losses, full_weights, resumed_weights, val_loss = run_ranks(
        _save_and_resume, 2, tmp_path, strategy
    )[0]
    assert cut_losses == full_losses  # bit-identical trajectory
    for k in full_weights:
        assert torch.equal(full_weights[k], resumed_weights[k]), k
    ckpt = tmp_path / "full" / "checkpoints" / "last"
    assert (ckpt / "deepspeed").is_dir() and (ckpt / "meta.pt").is_file()

    # the engine's ZeRO partitions → one fp32 state dict that loads into the plain model
    from distrain.cli import main

    out = tmp_path / "weights.safetensors"
    assert main(["convert", str(ckpt), str(out)]) == 0
    from safetensors.torch import load_file

    plain = LazyTinyGPT()
    plain.configure_model()
    plain.load_state_dict(load_file(str(out)))
    for k, v in plain.state_dict().items():
        assert torch.equal(v, full_weights[k]), k
    x = torch.randint(0, 256, (2, 16))
    plain.eval()
    reference = LazyTinyGPT()
    reference.configure_model()
    reference.load_state_dict(full_weights)
    reference.eval()
    assert torch.equal(plain.gpt(x), reference.gpt(x))
    # Lightning's conversion, as its ZeRO-3 page runs it: one file, torch.load-able, and load_from_checkpoint rebuilds
    from distrain.lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    lightning_file = tmp_path / "lightning_model.pt"
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "full" / "checkpoints" / "last.ckpt", lightning_file)
    converted = torch.load(lightning_file, weights_only=True)
    assert converted["global_step"] == 8 and "optimizers" not in converted
    rebuilt = LazyTinyGPT.load_from_checkpoint(lightning_file)
    for k, v in full_weights.items():
        assert torch.equal(converted["state_dict"][k], v) and torch.equal(rebuilt.state_dict()[k], v), k
    with pytest.raises(ValueError, match="tag='global_step8': a distrain checkpoint keeps one DeepSpeed folder"):
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, lightning_file, tag="global_step8")
    # the fresh evaluation saw the checkpoint's weights: same loss as the plain model's over the set
    data = loader(4, shuffle=False)
    with torch.no_grad():
        expected = sum(plain.gpt(x, y).item() * len(x) for x, y, _ in data) / len(data.dataset)
    assert abs(val_loss - expected) <= 1e-5 * expected, (val_loss, expected)


def _world_size_run(rank, tmp, strategy, ws, steps, resume):
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=ws,
        max_steps=steps,
        logger=False,
        gradient_clip_val=0.5,
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)],
    )
    module = LazyTinyGPT()
    trainer.fit(module, loader(12 // ws), ckpt_path="last" if resume else None)  # global batch 12 on 2 or 3 ranks
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return rec.losses, params_of(module)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_resume_on_another_world_size_through_universal_checkpoint(tmp_path, strategy):
    """Written on 2 ranks, resumed on 3: DeepSpeed's universal format re-partitions the fp32
    weights and Adam moments, so the run continues as if nothing changed (fp32 rounding: the
    reductions run over another number of ranks)."""
    full_losses, full_weights = run_ranks(_world_size_run, 2, tmp_path / "full", strategy, 2, 8, False)[0]
    run_ranks(_world_size_run, 2, tmp_path / "cut", strategy, 2, 4, False)
    resumed, weights = run_ranks(_world_size_run, 3, tmp_path / "cut", strategy, 3, 8, True)[0]
    assert len(resumed) == 4
    for a, b in zip(full_losses[4:], resumed):
        assert abs(a - b) <= 1e-5 * abs(a), (full_losses, resumed)
    for k, v in full_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-5)
    assert not list((tmp_path / "cut" / "checkpoints").glob(".*universal*"))  # the temporary conversion is gone


# ---- the JSON config through the CLI ------------------------------------------------------------
def _cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "distrain.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "--devices",
    "2",
    "data.seq_len=32",
    "training.batch_size_per_gpu=4",
    "logging.log_every_n_steps=1",
    "data.max_bytes=100000",
    "logging.progress_bar=false",
    "training.val_check_interval=100",
    "training.limit_val_batches=2",
    "checkpointing.save_every_n_steps=null",
]


@pytest.mark.slow
def test_spec_json_with_auto_trains_via_cli(tmp_path):
    out = tmp_path / "run"
    proc = _cli(
        "train",
        "--config",
        "configs/deepspeed_config.json",
        "--max-steps",
        "6",
        "--output-dir",
        str(out),
        "training.gradient_accumulation_steps=2",
        "training.activation_checkpointing=true",
        *COMMON,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    filled = json.loads((out / "deepspeed_config.json").read_text())
    assert "auto" not in json.dumps(filled)
    assert filled["train_micro_batch_size_per_gpu"] == 4 and filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 16 and filled["gradient_clipping"] == 1.0
    assert filled["scheduler"]["params"]["total_num_steps"] == 6
    assert filled["zero_optimization"]["reduce_bucket_size"] == 128 * 128  # gpt-tiny's hidden size squared
    assert filled["bf16"]["enabled"] is False and filled["fp16"]["enabled"] is False
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "deprecated" not in proc.stderr  # torch's deprecation warnings from ZeRO are filtered


def test_config_conflict_names_both_values(tmp_path):
    from distrain.strategies.deepspeed_config import TrainingFacts, fill_config

    cfg = {"train_micro_batch_size_per_gpu": 16}
    with pytest.raises(ValueError) as e:
        fill_config(cfg, TrainingFacts(micro_batch_size=4, world_size=2), "ds.json")
    assert "train_micro_batch_size_per_gpu=16 in ds.json" in str(e.value) and "DataLoader's batch_size" in str(e.value)
    assert "4" in str(e.value)


def test_conflict_and_fp16_on_cpu_through_the_cli(tmp_path):
    conflict = tmp_path / "ds.json"
    conflict.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}))
    proc = _cli(
        "train",
        "--config",
        str(conflict),
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path / "a"),
        *COMMON,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "train_micro_batch_size_per_gpu=16" in proc.stderr and "batch_size" in proc.stderr and "4" in proc.stderr

    fp16 = tmp_path / "fp16.json"
    fp16.write_text(json.dumps({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    # the file's precision is known before any rank starts: refused there, in one line, in this process
    proc = run_cli(["train", "--config", str(fp16), "--max-steps", "2", "--output-dir", str(tmp_path / "b"), *COMMON])
    assert proc.returncode == 2 and "fp16, which needs a CUDA GPU" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "b" / "logs").exists(), proc.stderr


def test_nvme_offload_is_refused_where_it_runs_and_planned_anywhere(tmp_path):
    """A missing NVMe directory is refused when the run is built, before any rank starts; `distrain plan` on a
    machine without the run's drive still plans it (the planner reads the strategy's config)."""
    from distrain.config import build_config
    from distrain.planner.from_config import job_from_config
    from distrain.planner.plan import Option, option_for_run

    missing = str(tmp_path / "no-drive")
    nvme = dict(offload_parameters=True, offload_params_device="nvme", nvme_path=missing)
    refusal = rf"^NVMe offload: nvme_path '{missing}' \(in the strategy's options\) is not a writable directory"
    with pytest.raises(ValueError, match=refusal):
        distrain.Trainer(accelerator="cpu", devices=2, strategy=distrain.DeepSpeedStrategy(stage=3, **nvme))
    overrides = ["distributed.strategy=deepspeed", "deepspeed.stage=3"]
    overrides += [f"deepspeed.{k}={v}" for k, v in nvme.items()]
    config = build_config(None, {"distributed.devices": 2, "distributed.gpu_memory": "80GB"}, overrides)
    assert option_for_run("deepspeed", job_from_config(config, gpu=True)) == Option("zero", stage=3, offload="nvme")


def _nvme_run(rank, tmp, resume):
    (tmp / "nvme").mkdir(parents=True, exist_ok=True)
    strategy = distrain.DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        offload_optimizer_device="nvme",
        offload_params_device="nvme",
        nvme_path=str(tmp / "nvme"),
    )
    trainer, _ = make_trainer(tmp, strategy=strategy, devices=2, max_steps=4 if resume else 2, logger=False)
    distrain.seed_everything(0)
    module = TinyGPT(schedule=False)
    if resume:
        try:
            trainer.fit(module, loader(4, n=64), ckpt_path="last")
        except distrain.CheckpointError as e:
            return str(e)
        return None
    trainer.fit(module, loader(4, n=64))
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return params_of(module)


@pytest.mark.slow
def test_nvme_offload_checkpoint_holds_the_weights_and_an_inexact_resume_is_refused(tmp_path):
    """DeepSpeed writes the NVMe-swapped master weights and moments into its checkpoint as empty tensors and
    purges them on load: a resume trained on from other weights and moments, silently (the losses after it
    differed from the uninterrupted run's from the first resumed step). The checkpoint now holds the weights
    (read back exactly), and a resume is refused on every rank, in one line that says why and what to do."""
    from test_matrix import UNAVAILABLE

    from distrain.checkpoint.state import read_model_weights

    if "deepspeed_stage_3_offload_nvme" in UNAVAILABLE:
        pytest.skip(UNAVAILABLE["deepspeed_stage_3_offload_nvme"])
    trained = run_ranks(_nvme_run, 2, tmp_path, False)[0]
    weights = read_model_weights(tmp_path / "checkpoints" / "last")
    for name, tensor in weights.items():
        assert torch.equal(tensor, trained[name]), name
    assert weights.keys() == trained.keys()
    errors = run_ranks(_nvme_run, 2, tmp_path, True)
    for error in errors:
        assert error is not None and "NVMe" in error and "would not be exact" in error and "\n" not in error


class _LocalRankSeen(distrain.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append(os.environ.get("LOCAL_RANK"))


def _stage3_started_by_nobody(rank, tmp):
    # what a plain `python train.py` (or `distrain verify`) sees: no launcher's variables at all
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    seen = _LocalRankSeen()
    trainer, rec = make_trainer(tmp, strategy="deepspeed_stage_3", devices=1, max_steps=2, callbacks=[seen])
    torch.manual_seed(0)
    trainer.fit(TinyGPT(), loader(4))
    from distrain.cluster import detect_cluster

    # distrain verify, then fit on the same trainer: verify ended its process group, and the fit starts another
    again, rec_again = make_trainer(os.path.join(tmp, "again"), strategy="deepspeed_stage_3", devices=1, max_steps=2)
    torch.manual_seed(0)
    verdict = again.verify(TinyGPT(), loader(4), steps=2).ok
    again.loop.max_steps = 4  # the trainer goes on from verify's 2 steps, as a second fit of one goes on
    again.fit(TinyGPT(), loader(4))
    return rec.losses, seen.seen, detect_cluster().source, verdict, rec_again.losses


def test_zero3_in_a_process_no_launcher_started_gets_local_rank(tmp_path):
    """ZeRO-3 reads os.environ["LOCAL_RANK"] itself (``KeyError: 'LOCAL_RANK'`` from ``distrain verify`` on a GPU):
    the strategy sets it for its run, and a later run in the process is still one no launcher started. A fit after
    ``verify`` on the same trainer, in the same process, trains on (it took verify's ended process group for live, and
    ZeRO-3's ``zero.Init`` went looking for an MPI launcher: ``No module named 'mpi4py'``)."""
    losses, seen, later, verdict, again = run_ranks(_stage3_started_by_nobody, 1, tmp_path)[0]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert seen == ["0", "0"] and later == "local"
    assert verdict and again[:2] == losses, again  # verify's 2 steps: the run of a fresh trainer
    assert len(again) == 4 and all(loss == loss for loss in again), again  # then the fit's steps 3 and 4
