"""Model parallelism (pipeline, tensor parallel, FSDP×TP, 3-D) on real gloo ranks: each layout matches one
process accumulating the same global batch (fp32, 1e-5 relative on losses and gradient norms), evaluation
and predict work, checkpoints resume across layouts, the pipeline sends what its schedule says and tensor
parallelism all-reduces no gradient of a parameter it splits. Models: the built-in GPT (built in
``configure_model``: meta device, sharded initialization) and a tiny Hugging Face Llama."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from torch.utils.data import DataLoader

import distrain
from distrain.parallel.layout import ParallelLayout
from helpers import IndexedTokens, run_ranks

STEPS = 3


class SmallGPT(distrain.Module):
    """The built-in GPT (2 heads, 32 wide), built in configure_model; ``experts``: each block a mixture of that
    many, top-2, its balance loss in the loss × 0.1."""

    def __init__(self, n_layer: int = 4, lr: float = 3e-3, experts: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.gpt = None

    def configure_model(self):
        if self.gpt is None:
            from distrain.models.gpt import GPT, GPTConfig

            experts = self.hparams["experts"]
            moe = {"n_experts": experts, "top_k": 2, "aux_loss_coef": 0.1} if experts else {}
            self.gpt = GPT(GPTConfig(n_layer=self.hparams["n_layer"], n_head=2, n_embd=32, block_size=16, **moe))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = self.gpt(x, y)
        self.log("train_loss", loss)
        for name, value in self.gpt.load_balance().items():  # a mixture: its balance, as the built-in job logs it
            self.log(name, value)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", self.gpt(x, y))
        self.log("val_samples", len(x), reduce_fx="sum")

    def predict_step(self, batch, batch_idx):
        return self.gpt(batch[0]).argmax(-1)

    def configure_optimizers(self):
        from distrain.optim import warmup_decay

        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup_decay(opt, 2, 20), "interval": "step"}}


class OwnPlanMLP(distrain.Module):
    """A user's own model that brings its own tensor-parallel plan, applied in configure_model on the mesh
    the strategy hands it (Lightning's ModelParallelStrategy way); on one process there is no mesh."""

    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is not None:
            return
        from torch import nn
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        if self.device_mesh is not None:
            tp = self.device_mesh["tensor_parallel"]
            parallelize_module(self.net, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _regression(n: int, seed: int):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).tanh())


class Recorder(distrain.Callback):
    """Per step: loss, gradient norm and what the module logged, as rank 0's logger view has them."""

    def __init__(self):
        self.rows: list[tuple[float | None, ...]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        row = (m["loss"], m["grad_norm"], m.get("train_loss"), m.get("moe_aux_loss"), m.get("moe_load_max_over_mean"))
        self.rows.append(row)


def _fit(tmp, strategy, devices: int, job: str, accumulate: int, batch: int, llama: str | None = None, **kw):
    """Train ``job`` (gpt / gpt2 / gpt8 / gpt-moe / llama) for STEPS steps; returns the per-step rows, validation
    metrics, predictions (gpt), and the trainer (for the tests that look inside)."""
    recorder = Recorder()
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0,
        seed=7,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=kw.pop("checkpoint", False),
        logger=False,
        default_root_dir=str(tmp),
        callbacks=[recorder, *kw.pop("callbacks", [])],
    )
    distrain.seed_everything(0)
    if job == "llama":
        module, train, val = _llama_job(llama, batch, pad_to=kw.pop("pad_to", None))
    elif job == "own":
        module = OwnPlanMLP()
        train = DataLoader(_regression(48, 3), batch_size=batch, shuffle=True)
        val = DataLoader(_regression(10, 4), batch_size=4)
    else:
        module = SmallGPT(n_layer={"gpt": 4, "gpt-moe": 4, "gpt8": 8}.get(job, 2), experts=4 * job.endswith("moe"))
        train = DataLoader(IndexedTokens(48), batch_size=batch, shuffle=True)
        val = DataLoader(IndexedTokens(10, seed=1), batch_size=4)
    trainer.fit(module, train, val)
    predictions = None
    if job.startswith("gpt"):
        predictions = torch.cat(trainer.predict(module, val)).tolist()
    metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    return recorder.rows, metrics, predictions, trainer


def _llama_job(path: str, batch: int, pad_to: int | None):
    import matrix_models

    from distrain.hf.data import PadCollator
    from distrain.hf.models import load_tokenizer

    samples = matrix_models.hf_samples(path, "causal_lm")
    collate = PadCollator(load_tokenizer(path).pad_token_id, pad_to)
    module = matrix_models.hf_causal(path)
    train = DataLoader(samples, batch_size=batch, shuffle=True, collate_fn=collate)
    return module, train, DataLoader(samples[:10], batch_size=4, collate_fn=collate)


def _assert_close(reference, result, what: str, tolerance: float = 1e-5) -> None:
    ref_rows, ref_metrics, ref_predictions = reference[:3]
    rows, metrics, predictions = result[:3]
    assert len(rows) == len(ref_rows) == STEPS, what
    for step, (a, b) in enumerate(zip(ref_rows, rows), start=1):
        for name, x, y in zip(("loss", "grad_norm", "train_loss", "moe_aux_loss", "moe_load_max_over_mean"), a, b):
            if x is None and y is None:
                continue
            assert y is not None and math.isclose(x, y, rel_tol=tolerance), f"{what}: {name} at step {step}: {x} vs {y}"
    assert ref_metrics.keys() == metrics.keys(), what
    for name in ref_metrics:
        assert math.isclose(ref_metrics[name], metrics[name], rel_tol=tolerance), f"{what}: {name}"
    assert predictions == ref_predictions, f"{what}: predictions"


# ---- which layouts are possible: refused before any rank starts ----------------------------------------------------
def test_impossible_layouts_are_refused_in_one_line_before_any_rank_starts(capsys):
    with pytest.raises(ValueError, match=r"3 ranks cannot hold tensor_parallel_size=2 .* multiple of 2"):
        distrain.Trainer(accelerator="cpu", devices=3, strategy=distrain.ModelParallelStrategy(tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"data_parallel_size=2 × tensor_parallel_size=2 .* but 2 ranks run"):
        distrain.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=distrain.ModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=2),
        )
    with pytest.raises(ValueError, match="at least 2 stages"):
        distrain.Trainer(accelerator="cpu", devices=1, strategy="pipeline")
    with pytest.raises(ValueError, match="pipeline_schedule.*1F1B, GPipe, Interleaved1F1B"):
        distrain.PipelineStrategy(schedule="ZeroBubble")
    from distrain.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="3 ranks cannot hold"):
        build_config(
            None, {"distributed.strategy": "pipeline", "distributed.devices": 3}, ["distributed.pipeline_stages=2"]
        )
    # a layout asked of a strategy that has none would be ignored silently: refused, naming the key
    with pytest.raises(ConfigError, match=r"distributed.tensor_parallel_size=2 applies to strategy model_parallel"):
        build_config(None, {"distributed.strategy": "fsdp"}, ["distributed.tensor_parallel_size=2"])
    # more stages than the model has blocks (gpt-tiny: 4): the CLI says so before starting a rank
    from distrain import cli

    code = cli.main(
        ["train", "--strategy", "pipeline", "--devices", "2", "--accelerator", "cpu", "--output-dir", "/nonexistent/x"]
        + ["distributed.pipeline_schedule=Interleaved1F1B", "distributed.pipeline_stages_per_rank=3"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "6 pipeline stages but the model has 4 blocks" in err, err  # the plan's refusal
    assert len(err.strip().splitlines()) == 1
    # distrain plan refuses the same layout with the same line; and a pipeline of tensor-parallel stages (3-D) whose
    # tensor-parallel size does not divide the heads (gpt-tiny: 4) with the run's own line
    plan = ["plan", "--strategy", "pipeline", "--accelerator", "cpu"]
    interleaved = ["distributed.pipeline_schedule=Interleaved1F1B", "distributed.pipeline_stages_per_rank=3"]
    assert cli.main([*plan, "--devices", "2", *interleaved]) == 2
    assert "6 pipeline stages but the model has 4 blocks" in capsys.readouterr().err
    three_d = ["distributed.pipeline_stages=2", "distributed.tensor_parallel_size=3"]
    assert cli.main([*plan, "--devices", "6", *three_d]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size=3 must divide the model's n_head=4" in err and len(err.strip().splitlines()) == 1
    # a model of the user's own that no plan covers (layers built in __init__): refused before launching
    import matrix_models

    for strategy, says in (
        (distrain.ModelParallelStrategy(tensor_parallel_size=2), "MLP has no built-in tensor-parallel plan"),
        (distrain.PipelineStrategy(stages=2), "MLP holds no model the pipeline strategy has a built-in plan for"),
    ):
        trainer = distrain.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        module = matrix_models.MLP()
        with pytest.raises(ValueError, match=says) as info:
            trainer.fit(module, module.train_dataloader())
        assert "\n" not in str(info.value)


def test_layout_and_block_split():
    assert ParallelLayout.resolve(8, tensor_parallel_size=2, pipeline_stages=2) == ParallelLayout(2, 2, 2)
    # "auto" sizes: the config check reads them as the strategies do (one rule, layout_for): model_parallel on 4
    # devices with 2 stages puts tensor parallelism over the 2 devices each stage has
    from distrain.config import build_config
    from distrain.parallel.layout import layout_for

    assert layout_for(4, 4, pipeline_strategy=False, pipeline_stages=2) == ParallelLayout(pipeline=2, tensor=2)
    options = {"distributed.strategy": "model_parallel", "distributed.devices": 4}
    build_config(None, options, ["distributed.pipeline_stages=2"])  # refused before: it took tensor = 4
    from distrain.models.gpt import GPT, GPTConfig
    from distrain.parallel.pipeline_split import _balanced, gpt_split, split_blocks

    # embeddings weigh on the first stage, the head on the last: balanced by parameter count
    assert _balanced([10] * 6, 2, extra_first=0, extra_last=0) == [range(0, 3), range(3, 6)]
    assert _balanced([10] * 6, 2, extra_first=25, extra_last=0) == [range(0, 2), range(2, 6)]
    assert _balanced([10] * 6, 3, extra_first=0, extra_last=15) == [range(0, 2), range(2, 5), range(5, 6)]
    with torch.device("meta"):
        plan = gpt_split(GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16)))
    assert split_blocks(plan, 2, split_points=[1]) == [range(0, 1), range(1, 4)]
    assert split_blocks(plan, 2, split_points=["blocks.3"]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="5 pipeline stages but the model has 4 blocks"):
        split_blocks(plan, 5)
    with pytest.raises(ValueError, match="names no block"):
        split_blocks(plan, 2, split_points=["ln_f"])


# ---- parity on 2 ranks: pipeline (GPipe, 1F1B, Interleaved1F1B), tensor parallel; GPT and Llama ----------------
TWO_RANK = {
    # name: (strategy, job, per-rank batch, accumulation); one process: batch 4, the same accumulation (one replica)
    "pp-gpipe": (lambda: distrain.PipelineStrategy(stages=2, schedule="GPipe"), "gpt", 4, 2),
    "pp-1f1b": (lambda: distrain.PipelineStrategy(stages=2, schedule="1F1B"), "gpt", 4, 4),
    "pp-interleaved": (lambda: distrain.PipelineStrategy(stages=2, schedule="Interleaved1F1B"), "gpt", 4, 2),
    # a mixture of experts: each stage adds its blocks' balance loss to the sum it received, and sends it on
    "pp-1f1b-moe": (lambda: distrain.PipelineStrategy(stages=2, schedule="1F1B"), "gpt-moe", 4, 4),
    "pp-interleaved-moe": (lambda: distrain.PipelineStrategy(stages=2, schedule="Interleaved1F1B"), "gpt-moe", 4, 2),
    "tp": (lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2), "gpt", 4, 1),
    "tp-llama": (lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2), "llama", 4, 1),
    "pp-llama": (lambda: distrain.PipelineStrategy(stages=2), "llama", 4, 2),
    "tp-own-plan": (lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2), "own", 4, 1),
    # activation checkpointing of every block: the same numbers (recomputed forwards)
    "pp-1f1b-ac": (
        lambda: distrain.PipelineStrategy(stages=2, activation_checkpointing_policy={_block()}),
        "gpt",
        4,
        4,
    ),
    "tp-ac": (
        lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2, activation_checkpointing_policy={_block()}),
        "gpt",
        4,
        1,
    ),
}


def _block():
    from distrain.models.gpt import Block

    return Block


class PipelineTrace(distrain.Callback):
    """Records, on each rank, the forward/backward order of its stage and the P2P sends asked of torch in
    step 1 (pass-through wrappers: the real methods run)."""

    def __init__(self):
        self.actions, self.sends = [], {"fwd": 0, "bwd": 0}

    def on_fit_start(self, trainer, module):
        runner = trainer.strategy.runner
        (stage,) = runner.stages
        for method, tag in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            real = getattr(stage, method)
            setattr(stage, method, self._record(real, tag, trainer, stage.stage_index))
        for method, kind in (("get_fwd_send_ops", "fwd"), ("get_bwd_send_ops", "bwd")):
            real = getattr(stage, method)
            setattr(stage, method, self._count(real, kind, trainer))

    def _record(self, real, tag, trainer, stage):
        def wrapped(chunk, *args, **kwargs):
            if trainer.global_step == 0:
                self.actions.append(f"{stage}{tag}{chunk}")  # torch's own notation: stage, F/B, micro-batch
            return real(chunk, *args, **kwargs)

        return wrapped

    def _count(self, real, kind, trainer):
        def wrapped(chunk):
            ops = real(chunk)
            if trainer.global_step == 0:
                self.sends[kind] += len(ops)
            return ops

        return wrapped


def _schedule_order(schedule: str, stage: int, stages: int, n: int) -> list[str]:
    """What a stage runs in one step, by the schedules' definitions (GPipe: every forward, then every
    backward; 1F1B, PipeDream-flush: ``stages - stage - 1`` warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards). torch 2.13's own IR of 1F1B
    (``pipeline_order``) numbers the last stage's forwards from 1, so it is not used here."""
    if schedule == "GPipe":
        actions = [f"F{i}" for i in range(n)] + [f"B{i}" for i in range(n)]
    else:
        warmup = min(n, stages - stage - 1)
        actions = [f"F{i}" for i in range(warmup)]
        for i in range(warmup, n):
            actions += [f"F{i}", f"B{i - warmup}"]
        actions += [f"B{i}" for i in range(n - warmup, n)]
    return [f"{stage}{a[0]}{a[1:]}" for a in actions]


class TensorParallelCollectives(distrain.Callback):
    """Every functional collective DTensor issues in step 1 after the forward (backward, clipping, optimizer
    step: where gradients are reduced), with the shape of what it reduces (a pass-through TorchDispatchMode)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls = []
        self.after_forward = False
        spy = self

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if spy.after_forward and "_c10d_functional" in name and "wait" not in name:
                    calls.append((name.split(".")[1], tuple(args[0].shape)))
                return func(*args, **(kwargs or {}))

        self.mode = Spy()

    def on_train_epoch_start(self, trainer, module):
        if trainer.global_step == 0:
            step = module.training_step

            def training_step(*args):  # the forward ends when the step returns its loss
                loss = step(*args)
                self.after_forward = True
                return loss

            module.training_step = training_step
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.mode.__exit__(None, None, None)
            self.after_forward = False
            del module.training_step
            params = dict(module.named_parameters())
            self.split = {n: tuple(p.shape) for n, p in params.items() if any(pl.is_shard() for pl in p.placements)}
            self.split_local = {n: tuple(p.to_local().shape) for n, p in params.items() if n in self.split}
            self.replicated = {n: tuple(p.shape) for n, p in params.items() if n not in self.split}


def _two_rank_session(rank, tmp, llama):
    out = {}
    for name, (make, job, batch, accumulate) in TWO_RANK.items():
        callbacks = []
        if name in ("pp-gpipe", "pp-1f1b"):
            callbacks.append(PipelineTrace())
        if name == "tp":
            callbacks.append(TensorParallelCollectives())
        rows, metrics, predictions, trainer = _fit(
            tmp / name,
            make(),
            2,
            job,
            accumulate,
            batch,
            llama,
            pad_to=16 if name == "tp-llama" else None,
            callbacks=callbacks,
            checkpoint=job == "llama",
        )
        extra = {}
        if job == "llama":  # the weights this rank trained (a pipeline stage: its layers), to check the export
            state = distrain.checkpoint_state_of(trainer.module)
            extra = {"weights": {k[len("model.") :]: v for k, v in state.items()}}
        if name.endswith("-ac"):  # this rank's blocks run under activation checkpointing
            extra = {"wrapped": sum(type(m).__name__ == "CheckpointWrapper" for m in trainer.module.modules())}
        if name == "tp-own-plan":  # the module's own plan split its layers (distrain applied none of its own)
            params = trainer.module.named_parameters()
            extra = {"split": sorted(n for n, p in params if any(pl.is_shard() for pl in getattr(p, "placements", ())))}
            extra["plan"] = trainer.strategy.tensor_plan
        if name in ("pp-gpipe", "pp-1f1b"):
            trace = callbacks[0]
            extra = {"actions": trace.actions, "sends": trace.sends}
        if name == "tp":
            spy = callbacks[0]
            extra = {
                "calls": spy.calls,
                "split": spy.split,
                "split_local": spy.split_local,
                "replicated": spy.replicated,
            }
        out[name] = (rows, metrics, predictions, extra)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from distrain.hf import tiny

    return tiny.make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def test_pipeline_and_tensor_parallel_on_two_ranks_match_one_process(tmp_path, llama):
    results = run_ranks(_two_rank_session, 2, tmp_path, llama)
    references = {}
    for name, (_, job, _, accumulate) in TWO_RANK.items():
        data_parallel = 1  # every 2-rank layout here is one model replica
        key = (job, accumulate * data_parallel, name == "tp-llama")
        if key not in references:
            references[key] = _fit(
                tmp_path / f"single-{name}",
                "single",
                1,
                job,
                key[1],
                4,
                llama,
                pad_to=16 if key[2] else None,
            )
        for rank in range(2):
            _assert_close(references[key], results[rank][name], f"{name} rank {rank}")
        val = results[0][name][1]
        if job == "gpt":
            assert val["val_samples"] == 10, name  # each evaluation sample counted once (not once per rank)
        elif job == "llama":
            assert val["val_tokens"] == references[key][1]["val_tokens"], name

    assert [results[r]["pp-1f1b-ac"][3]["wrapped"] for r in range(2)] == [2, 2]  # 4 blocks, 2 per stage
    assert [results[r]["tp-ac"][3]["wrapped"] for r in range(2)] == [4, 4]
    own = results[0]["tp-own-plan"][3]
    assert own["split"] == ["net.0.bias", "net.0.weight", "net.2.weight"], own
    assert own["plan"] == "the module's own plan (configure_model)", own

    # the pipeline ran what its schedule says, and sent one activation (stage 0) or one gradient (stage 1)
    # per micro-batch: nothing more
    for name, schedule, micro_batches in (("pp-gpipe", "GPipe", 2), ("pp-1f1b", "1F1B", 4)):
        first, last = results[0][name][3], results[1][name][3]
        for stage, trace in enumerate((first, last)):
            expected = _schedule_order(schedule, stage, 2, micro_batches)
            assert trace["actions"] == expected, (name, stage, trace["actions"], expected)
        assert first["sends"] == {"fwd": micro_batches, "bwd": 0}, name
        assert last["sends"] == {"fwd": 0, "bwd": micro_batches}, name

    # tensor parallelism: after the forward, no all-reduce of a tensor shaped like a parameter it splits; the
    # replicated norms' gradients (sequence parallel: each rank saw part of the sequence) are all-reduced
    tp = results[0]["tp"][3]
    split_shapes = set(tp["split"].values()) | set(tp["split_local"].values())
    reduced = [shape for op, shape in tp["calls"] if op == "all_reduce"]
    assert not split_shapes & set(reduced), (split_shapes & set(reduced), tp["calls"])
    assert any(shape == tp["replicated"]["gpt.blocks.0.ln1.weight"] for shape in reduced), tp["calls"]
    assert "gpt.blocks.0.attn.qkv.weight" in tp["split"] and "gpt.blocks.0.mlp.fc.weight" in tp["split"]

    # the Llama checkpoints (TP=2, PP=2) export to Hugging Face directories holding exactly the trained weights
    from transformers import AutoModelForCausalLM

    from distrain.hf.export import export_checkpoint

    for name in ("tp-llama", "pp-llama"):
        trained = {**results[0][name][3]["weights"], **results[1][name][3]["weights"]}  # both stages' layers
        directory = export_checkpoint(tmp_path / name / "checkpoints" / "last", tmp_path / f"hf-{name}")
        exported = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        assert {f"model.{k}" for k in exported} == trained.keys(), name
        for key, value in exported.items():
            assert torch.equal(value, trained[f"model.{key}"]), (name, key)


# ---- 4 ranks: FSDP × TP (2×2), pipeline × TP (3-D), pipeline × FSDP --------------------------------------------
FOUR_RANK = {  # name: (strategy, job, per-rank batch, accumulation, data-parallel replicas)
    "fsdp2xtp2": (lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2), "gpt2", 2, 1, 2),
    "fsdp2xtp2-llama": (lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2), "llama", 2, 1, 2),
    "pp2xtp2": (lambda: distrain.PipelineStrategy(stages=2, tensor_parallel_size=2), "gpt2", 4, 2, 1),
    "pp2xtp2-moe": (lambda: distrain.PipelineStrategy(stages=2, tensor_parallel_size=2), "gpt-moe", 4, 2, 1),
    "pp2xfsdp2": (lambda: distrain.PipelineStrategy(stages=2), "gpt2", 2, 2, 2),
    # 8 stages, 2 a rank: a gradient sent back is let go once a message proves it received, through other ranks'
    # messages too (pipeline_memory.release_sent_gradients); let go too early, gloo would send freed memory
    "pp4-interleaved": (
        lambda: distrain.PipelineStrategy(stages=4, schedule="Interleaved1F1B", stages_per_rank=2),
        "gpt8",
        4,
        4,
        1,
    ),
}


class ReplicaGather(distrain.Callback):
    """A user's collectives mid-run: over every rank, and over ``strategy.data_parallel_group`` (each sample once)."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != 1:
            return
        strategy, place = trainer.strategy, torch.tensor(trainer.strategy.layout.coordinates(trainer.global_rank))
        group = strategy.data_parallel_group
        self.seen = (
            module.all_gather(place).tolist(),
            module.all_gather({"place": place}, group=group)["place"].tolist(),
            strategy.all_reduce(torch.tensor(1.0), "sum", group=group).item(),
            strategy.all_reduce(torch.tensor(float(trainer.global_rank)), "mean", group=group).item(),
        )


class ParameterGathers(distrain.Callback):
    """FSDP's parameter all-gathers while the training batches run (FSDP2 calls ``dist.all_gather_single`` in torch
    2.13, ``all_gather_into_tensor`` before), and the optimizer steps they made."""

    def __init__(self):
        import torch.distributed as dist

        self.calls, self.steps = 0, 0
        self.name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        import torch.distributed as dist

        real = self.real = getattr(dist, self.name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        setattr(dist, self.name, counted)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        import torch.distributed as dist

        setattr(dist, self.name, self.real)
        self.steps = trainer.global_step


def _four_rank_session(rank, tmp, llama):
    out = {}
    for name, (make, job, batch, accumulate, data_parallel) in FOUR_RANK.items():
        gather, parameters = ReplicaGather(), ParameterGathers()
        rows, metrics, predictions, trainer = _fit(
            tmp / name, make(), 4, job, accumulate, batch, llama, pad_to=16 if job == "llama" else None,
            callbacks=[gather, parameters],
        )  # fmt: skip
        out[f"{name} gathers"] = gather.seen
        if name == "pp2xfsdp2":
            from torch.distributed.fsdp import FSDPModule

            units = sum(
                isinstance(m, FSDPModule) for stage in trainer.strategy.runner.stage_modules for m in stage.modules()
            )
            out[f"{name} parameter gathers"] = (parameters.calls, parameters.steps, units)
        if data_parallel > 1 and name.startswith("fsdp"):  # a value logged without sync_dist is this replica's
            rows = [(loss, norm, None) for loss, norm, *_ in rows]
        if data_parallel > 1:  # each replica predicts its share of the samples
            predictions = None
        out[name] = (rows, metrics, predictions)
    return out


@pytest.mark.slow
def test_fsdp_x_tensor_parallel_and_3d_on_four_ranks_match_one_process(tmp_path, llama):
    results = run_ranks(_four_rank_session, 4, tmp_path, llama)
    # a pipeline stage's FSDP units are gathered once per step, not again in every micro-batch's backward (no
    # resharding after forward under a pipeline): the first stage's ranks, 2 micro-batches a step (it gathered 14
    # times in 3 steps with resharding, 8 without; the last stage gathers for more than its units, a question open)
    for rank in (0, 1):
        calls, steps, units = results[rank]["pp2xfsdp2 parameter gathers"]
        assert calls <= units * (steps + 1), (rank, calls, steps, units)
    for name, (_, job, batch, accumulate, data_parallel) in FOUR_RANK.items():
        # a user's collectives: every rank's copy by default; over data_parallel_group, one per replica (the ranks
        # at this one's pipeline, context and tensor place, each at another data place)
        for rank in range(4):
            everyone, replicas, count, mean = results[rank][f"{name} gathers"]
            assert len(everyone) == 4
            mine = everyone[rank]
            assert [p[1] for p in replicas] == list(range(data_parallel)), (name, rank, replicas)
            assert all(p[:1] + p[2:] == mine[:1] + mine[2:] for p in replicas), (name, rank, replicas)
            assert count == data_parallel
            peers = [r for r in range(4) if everyone[r][:1] + everyone[r][2:] == mine[:1] + mine[2:]]
            assert mean == sum(peers) / len(peers), (name, rank, peers, mean)
        # one process: the same global batch (per-rank batch × replicas × accumulation), in batches of 4
        accumulate_one = batch * data_parallel * accumulate // 4
        rows, metrics, predictions, _ = _fit(
            tmp_path / f"single-{name}", "single", 1, job, accumulate_one, 4, llama, pad_to=16
        )
        for rank in range(4):
            result = results[rank][name]
            expected_rows = [(loss, norm, None) for loss, norm, *_ in rows] if result[0][0][2] is None else rows
            expected = (expected_rows, metrics, predictions if result[2] is not None else None)
            _assert_close(expected, result, f"{name} rank {rank}")


# ---- checkpoints resume across layouts --------------------------------------------------------------------------
TOTAL, CUT = 4, 2
LAYOUTS = {
    "tp": lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2),
    "pp": lambda: distrain.PipelineStrategy(stages=2),
    "fsdp": lambda: "fsdp",
    "single": lambda: "single",
}


def _resume_run(tmp, layout: str, resume: bool):
    devices = 1 if layout == "single" else 2
    batch = 2 if layout == "fsdp" else 4  # fsdp: 2 replicas; the others see the whole batch of 4
    recorder = Recorder()
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy=LAYOUTS[layout](),
        devices=devices,
        max_steps=TOTAL,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        seed=7,
        log_every_n_steps=1,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=str(tmp),
        callbacks=[recorder, distrain.ModelCheckpoint(every_n_train_steps=CUT, save_top_k=-1)],
    )
    distrain.seed_everything(0)
    module = SmallGPT(n_layer=2)
    trainer.fit(
        module, DataLoader(IndexedTokens(48), batch_size=batch, shuffle=True), ckpt_path="last" if resume else None
    )
    state = distrain.checkpoint_state_of(module, trainer.optimizers[0])  # this rank's model and optimizer, whole
    return [r[0] for r in recorder.rows], state, trainer.progress.samples_in_epoch


def _resume_session(rank, tmp, jobs):
    return {name: _resume_run(tmp / name, layout, source is not None) for name, layout, source in jobs}


def _copy_cut(tmp, source: str, name: str) -> None:
    """``name`` starts from ``source``'s checkpoint at step CUT (``source`` ran on past it)."""
    checkpoints = tmp / name / "checkpoints"
    shutil.copytree(tmp / source / "checkpoints" / f"epoch=0-step={CUT}", checkpoints / f"epoch=0-step={CUT}")
    (checkpoints / "last").symlink_to(f"epoch=0-step={CUT}")


@pytest.mark.slow
def test_checkpoints_resume_across_layouts(tmp_path):
    single = _resume_run(tmp_path / "single", "single", False)
    # 2 ranks: TP and PP uninterrupted; their step-CUT checkpoints (and the single process's) are resumed below
    first = run_ranks(_resume_session, 2, tmp_path, [("tp", "tp", None), ("pp", "pp", None)])
    jobs = [
        ("tp<tp", "tp", "tp"),
        ("pp<pp", "pp", "pp"),
        ("pp<tp", "pp", "tp"),
        ("fsdp<tp", "fsdp", "tp"),
        ("tp<pp", "tp", "pp"),
        ("fsdp<pp", "fsdp", "pp"),
        ("tp<single", "tp", "single"),
        ("pp<single", "pp", "single"),
    ]
    for name, _, source in jobs:
        _copy_cut(tmp_path, source, name)
    resumed = run_ranks(_resume_session, 2, tmp_path, jobs)
    in_parent = {}
    for source in ("tp", "pp"):
        _copy_cut(tmp_path, source, f"single<{source}")
        in_parent[f"single<{source}"] = _resume_run(tmp_path / f"single<{source}", "single", True)

    ref_losses, _, ref_position = single
    for rank in range(2):
        runs = {**first[rank], **resumed[rank], **in_parent}
        for name, (losses, state, position) in runs.items():
            layout, _, source = name.partition("<")
            # the resumed steps continue the one-process curve: data position and optimizer state came along
            expected = ref_losses if not source else ref_losses[CUT:]
            assert len(losses) == len(expected), name
            for a, b in zip(expected, losses):
                assert math.isclose(a, b, rel_tol=1e-5), (name, expected, losses)
            assert position == ref_position, name
            if source == layout:  # the same layout: bit-identical to its uninterrupted run
                uninterrupted = runs[layout]
                assert losses == uninterrupted[0][CUT:], name
                assert state.keys() == uninterrupted[1].keys()
                for key in state:
                    assert torch.equal(state[key], uninterrupted[1][key]), (name, key)

    # `distrain convert` from every layout gives exactly the weights that run trained (pipeline: both stages')
    from safetensors.torch import load_file

    from distrain import cli

    for name in ("tp", "pp", "fsdp<tp", "tp<single"):
        trained = {}
        for rank in range(2):
            state = {**first[rank], **resumed[rank]}[name][1]
            trained.update({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
        out = tmp_path / f"{name.replace('<', '-')}.safetensors"
        assert cli.convert(str(tmp_path / name / "checkpoints" / f"epoch=0-step={TOTAL}"), str(out), "safetensors") == 0
        weights = load_file(out)
        assert weights.keys() == trained.keys(), name
        for key in trained:
            assert torch.equal(weights[key], trained[key]), (name, key)


# ---- a loop of your own, through the Runtime (Fabric-style) -------------------------------------------------
def _runtime_loop(rank, strategy_name):
    """Three AdamW steps of the built-in GPT in a hand-written loop; returns the losses and the samples seen."""
    from distrain.models.gpt import GPT, GPTConfig

    if strategy_name == "single":
        rt = distrain.Runtime(strategy="single", devices=1, accelerator="cpu")
    else:
        rt = distrain.Runtime(
            strategy=distrain.ModelParallelStrategy(tensor_parallel_size=2), devices=2, accelerator="cpu"
        )
    rt.setup_environment()
    rt.seed_everything(3)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_dataloaders(DataLoader(IndexedTokens(24), batch_size=4, shuffle=False))
    losses, seen = [], []
    for x, y, idx in loader:
        loss = model(x, y)
        rt.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        seen.append(idx.tolist())
        if len(losses) == STEPS:
            break
    return losses, seen


def _pipeline_loader(rank):
    rt = distrain.Runtime(strategy="pipeline", devices=2, accelerator="cpu")
    loader = rt.setup_dataloaders(DataLoader(IndexedTokens(24), batch_size=4, shuffle=False))
    try:
        rt.setup(torch.nn.Linear(2, 2))
    except ValueError as e:
        refusal = str(e)
    return [idx.tolist() for _, _, idx in loader], refusal


def test_runtime_api_under_tensor_parallelism_matches_one_process(tmp_path):
    """The Runtime sharded data by global rank: tensor-parallel peers got different batches while the plan
    declares its inputs replicated — wrong gradients and no error. Peers now share their batches."""
    (ref_losses, ref_seen) = run_ranks(_runtime_loop, 1, "single")[0]
    results = run_ranks(_runtime_loop, 2, "model_parallel")
    for losses, seen in results:
        assert seen == ref_seen  # both tensor-parallel ranks saw the one-process batches
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    per_stage = run_ranks(_pipeline_loader, 2)
    assert per_stage[0][0] == per_stage[1][0] and len(per_stage[0][0]) == 6  # stages share the batches
    assert "use Trainer.fit" in per_stage[0][1]
