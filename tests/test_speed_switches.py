"""Speed switches keep the numbers: torch.compile (whole model under DDP, per block under FSDP with
activation checkpointing outside the compiled region) and fused AdamW agree with eager / for-each
runs; fp8 converts the model's linears through torchao and is refused without an fp8 GPU."""

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
