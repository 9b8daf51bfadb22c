"""Speed switches keep the numbers: torch.compile (whole model under DDP, per block under FSDP with
activation checkpointing outside the compiled region, and under tensor, pipeline and context parallelism)
and fused AdamW agree with eager / for-each runs; fp8 converts the model's linears through torchao and is
refused without an fp8 GPU."""

import pytest
import torch

import distrain
from distrain.models.gpt import Block
from helpers import TinyGPT, loader, make_trainer, run_ranks

STEPS = 3


class BlockGPT(TinyGPT):
    block_class = Block  # the repeated layer: FSDP's unit, compiled one at a time


def _losses(rank, strategy, compile, fused=None, checkpointing=False):
    trainer, rec = make_trainer(
        "/tmp/unused", strategy=strategy, devices=2, max_steps=STEPS, enable_checkpointing=False, logger=False,
        gradient_clip_val=1.0, compile=compile, activation_checkpointing_policy={Block} if checkpointing else None,
    )  # fmt: skip
    torch.manual_seed(0)
    module = BlockGPT(schedule=False)
    if fused is not None:  # the module's optimizer, fused or not
        from distrain.optim import adamw

        module.configure_optimizers = lambda: adamw(module.gpt, 3e-3, 0.1, fused=fused)
    trainer.fit(module, loader(4))
    compiled = [name for name, m in module.named_modules() if hasattr(m.forward, "__wrapped__")]
    fused_used = trainer.optimizers[0].defaults.get("fused")
    return rec.losses, rec.grad_norms, compiled, fused_used


def _close(a, b, tol=1e-5):
    return torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), rtol=tol, atol=0)


@pytest.mark.slow
def test_compile_matches_eager_under_ddp_and_fsdp():
    eager, eager_norms, none, _ = run_ranks(_losses, 2, "ddp", False)[0]
    assert none == [] and len(eager) == STEPS
    ddp, ddp_norms, ddp_compiled, _ = run_ranks(_losses, 2, "ddp", True)[0]
    assert ddp_compiled == ["gpt"]  # the whole network, not the Module's training_step
    fsdp, fsdp_norms, fsdp_compiled, _ = run_ranks(_losses, 2, "fsdp", True, None, True)[0]
    assert fsdp_compiled == ["gpt.blocks.0._checkpoint_wrapped_module", "gpt.blocks.1._checkpoint_wrapped_module"]
    assert _close(ddp, eager) and _close(ddp_norms, eager_norms), (ddp, eager)
    assert _close(fsdp, eager) and _close(fsdp_norms, eager_norms), (fsdp, eager)


def _model_parallel_runs(rank):
    """Each layout eager and compiled, in one pair of rank processes: losses, gradient norms, what was compiled."""
    layouts = {
        "tp": lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2),
        "pp": lambda: "pipeline",
        "cp-ring": lambda: distrain.ModelParallelStrategy(context_parallel_size=2),  # one head: the ring engine
    }
    out = {}
    for name, strategy in layouts.items():
        for compile in (False, True):
            trainer, rec = make_trainer(
                "/tmp/unused", strategy=strategy(), devices=2, max_steps=STEPS, enable_checkpointing=False,
                logger=False, gradient_clip_val=1.0, compile=compile,
            )  # fmt: skip
            torch.manual_seed(0)
            module = BlockGPT(schedule=False, n_head=1 if name == "cp-ring" else 2)
            trainer.fit(module, loader(4))
            compiled = [n for n, m in module.named_modules() if hasattr(m.forward, "__wrapped__")]
            out[name, compile] = rec.losses, rec.grad_norms, compiled, trainer.strategy.context_engine
    return out


@pytest.mark.slow
def test_compile_under_tensor_pipeline_and_context_parallelism_compiles_each_block_and_matches_eager():
    first, last = run_ranks(_model_parallel_runs, 2)
    assert first["cp-ring", True][3] == "ring"
    for name in ("tp", "pp", "cp-ring"):
        results = last if name == "pp" else first  # a pipeline's losses live on its last stage
        eager, eager_norms, none, _ = results[name, False]
        losses, norms, compiled, _ = results[name, True]
        assert none == [] and len(losses) == STEPS, name
        assert _close(losses, eager) and _close(norms, eager_norms), (name, losses, eager)
        if name == "pp":  # each stage compiled the block it runs
            assert (first[name, True][2], compiled) == (["gpt.blocks.0"], ["gpt.blocks.1"])
        else:
            assert compiled == ["gpt.blocks.0", "gpt.blocks.1"], name


def test_compile_is_refused_where_unsupported():
    with pytest.raises(ValueError, match="compile=True is not supported with DeepSpeedStrategy"):
        distrain.Trainer(accelerator="cpu", strategy="deepspeed", devices=1, compile=True)


def test_fused_adamw_matches_for_each():
    from distrain.optim import adamw, fused_adamw_default

    torch.manual_seed(0)
    model = TinyGPT().gpt
    twin = TinyGPT().gpt
    twin.load_state_dict(model.state_dict())
    fused, foreach = adamw(model, 1e-2, 0.1), adamw(twin, 1e-2, 0.1, fused=False)
    assert fused_adamw_default(list(model.parameters())) and fused.defaults["fused"] and not foreach.defaults["fused"]
    for step in range(5):
        for m in (model, twin):
            torch.manual_seed(step)  # the same gradients for both
            for p in m.parameters():
                p.grad = torch.randn_like(p)
        fused.step()
        foreach.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert not fused_adamw_default([torch.zeros(2, dtype=torch.float64)])  # no fused kernel for float64


@pytest.mark.slow
def test_fused_adamw_on_fsdp_shards_matches_ddp_for_each():
    ddp, ddp_norms, _, ddp_fused = run_ranks(_losses, 2, "ddp", False, False)[0]
    fsdp, fsdp_norms, _, fsdp_fused = run_ranks(_losses, 2, "fsdp", False, True)[0]
    assert fsdp_fused and not ddp_fused  # fused AdamW on DTensor shards, for-each on DDP's replicas
    assert _close(fsdp, ddp) and _close(fsdp_norms, ddp_norms), (fsdp, ddp)


# ---- fp8 ----------------------------------------------------------------------------------------


def test_fp8_is_refused_without_an_fp8_gpu_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has an fp8 GPU")
    with pytest.raises(ValueError, match=r"^precision='fp8' needs an NVIDIA GPU with float8 tensor cores") as e:
        distrain.Trainer(accelerator="cpu", devices=1, precision="fp8")
    assert "\n" not in str(e.value)
    # distrain train: the same line alone, before the plan (which no layout could make) and before any rank starts
    from distrain import cli

    for strategy in ("ddp", "auto"):
        out = tmp_path / strategy
        argv = ["train", "--accelerator", "cpu", "--devices", "2", "--precision", "fp8", "--strategy", strategy]
        assert cli.main([*argv, f"output_dir={out}", "training.max_steps=1"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("distrain: error: precision='fp8' needs an NVIDIA GPU"), lines
        assert not out.exists()
    from distrain.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="training.precision=fp8 is not supported"):
        build_config(overrides={"training.precision": "fp8", "distributed.strategy": "deepspeed"})


def test_fp8_converts_the_linears_and_trains_on_cpu():
    pytest.importorskip("torchao", reason="the test extra installs torchao")
    from torchao.float8.float8_linear import Float8Linear

    from distrain.precision import convert_to_float8

    torch.manual_seed(0)
    reference = TinyGPT().gpt
    model = TinyGPT().gpt
    model.load_state_dict(reference.state_dict())
    converted = convert_to_float8(model)
    assert converted == [
        f"blocks.{i}.{layer}" for i in range(2) for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]
    assert type(model.head) is torch.nn.Linear and model.head.weight is model.tok_emb.weight  # head kept, tied
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in converted)
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    loss, ref = model(x, y), reference(x, y)
    loss.backward()
    ref.backward()
    # float8 matmuls (emulated on CPU by torchao) are close to fp32, not equal
    assert loss.item() != ref.item() and abs(loss.item() - ref.item()) / ref.item() < 2e-2
    g, g_ref = model.blocks[0].mlp.fc.weight.grad, reference.blocks[0].mlp.fc.weight.grad
    assert torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0) > 0.99


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="fp8 training needs an NVIDIA GPU with compute capability 8.9+ (none here)",
)
def test_fp8_training_on_a_gpu(tmp_path):
    trainer, rec = make_trainer(tmp_path, accelerator="gpu", devices=1, strategy="single", precision="fp8",
                                max_steps=20, enable_checkpointing=False, logger=False)  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(TinyGPT(), loader(8))
    assert rec.losses[-1] < rec.losses[0]
