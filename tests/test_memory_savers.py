"""What a step keeps for its backward, where a hand-written loop keeps less: norms in the compute dtype
(``training.low_precision_norms``, ``distrain.models.norms``), the next-token loss in pieces
(``distrain.models.loss``), and blocks that recompute per operation (``training.activation_checkpointing_mode:
selective``). Also how the planner counts both on a GPU, where CUDA's kernels keep other tensors than
the CPU's it traces with (``planner.fake.norms_as_on_cuda``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from distrain.models import loss as loss_pieces
from distrain.models.norms import LowPrecisionNorm, low_precision_norms
from distrain.planner import ModelSpec, fake
from distrain.planner.model_stats import trace_step

H, LAYERS, VOCAB = 64, 2, 128


def _llama(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, **extra,
    )  # fmt: skip


def _models():
    """Norms as four families write them: Llama's and Qwen3's RMSNorm by hand (Qwen3's also over each head's
    queries and keys), GPT-2's nn.LayerNorm, the built-in GPT's LayerNorm without bias; and Gemma's, which
    scales by 1 + weight and is no RMSNorm of its weight."""
    from transformers import (
        GemmaConfig,
        GemmaForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from distrain.models.gpt import GPT, gpt_config

    torch.manual_seed(0)
    small = dict(hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, head_dim=16)  # fmt: skip
    return {
        "llama": (LlamaForCausalLM(_llama()), 2 * LAYERS + 1),
        "qwen3": (Qwen3ForCausalLM(Qwen3Config(**small)), 4 * LAYERS + 1),
        "gpt2": (GPT2LMHeadModel(GPT2Config(n_embd=H, n_layer=LAYERS, n_head=4, vocab_size=VOCAB)), 2 * LAYERS + 1),
        "gpt": (GPT(gpt_config("gpt-tiny", block_size=32)), None),
        "gemma": (GemmaForCausalLM(GemmaConfig(**small)), 0),
    }


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "gpt", "gemma"])
def test_norms_are_replaced_by_what_they_compute_and_give_the_same_fp32_results(family):
    model, expected = _models()[family]
    model.eval()
    norms = [n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()]
    ids = torch.randint(0, VOCAB, (2, 12))
    before = model(ids)
    before = before if isinstance(before, torch.Tensor) else before.logits
    state = model.state_dict(keep_vars=True)
    replaced = low_precision_norms(model)
    assert len(replaced) == (len(norms) if expected is None else expected)
    assert replaced == (norms if family != "gemma" else [])  # Gemma's 1 + weight keeps its own code
    after = model(ids)
    after = after if isinstance(after, torch.Tensor) else after.logits
    assert torch.equal(before, after)  # fp32: the model's own operations, bit for bit
    # the model's own parameters under the same names: checkpoints, ties and shards see no difference
    new_state = model.state_dict(keep_vars=True)
    assert list(new_state) == list(state) and all(new_state[k] is state[k] for k in state)
    assert low_precision_norms(model) == []  # twice is once


def test_a_bf16_norm_computes_in_the_compute_dtype_and_keeps_only_bf16_tensors_of_the_input_size():
    """Under autocast the replacement runs in autocast's dtype, outside autocast's fp32 policy for norms; what it
    keeps for the backward is its bf16 input (and fp32 per-row statistics), where Hugging Face's RMSNorm keeps an
    fp32 copy of the input. (LayerNorm here; torch's CPU ``rms_norm`` is composed of fp32 operations, its CUDA kernel
    is not, which the next test's planner accounts for.)"""
    norm = LowPrecisionNorm("layer", (H,), 1e-5, torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.zeros(H)))
    x = torch.randn(4, 8, H, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = norm(x)
    assert out.dtype == torch.bfloat16
    large = [t for t in kept if t.numel() >= x.numel()]
    assert large and all(t.dtype == torch.bfloat16 for t in large)
    reference = F.layer_norm(x.bfloat16(), (H,), norm.weight.bfloat16(), norm.bias.bfloat16(), 1e-5)
    assert torch.equal(out, reference)
    out.float().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_the_planner_counts_what_cudas_norms_keep(tmp_path):
    """A GPU plan traced on the CPU: Hugging Face's RMSNorm keeps an fp32 copy of its input (4 bytes per token and
    hidden unit) that torch's fused CUDA kernel in the compute dtype does not. The difference in a bf16 trace is
    exactly that, for every norm (two per layer and the final one); a CPU plan traces the CPU's kernels."""
    _llama(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    b, t = 2, 32
    spec = ModelSpec.huggingface(str(tmp_path), t, "causal_lm")
    bf16 = dict(param_dtype=torch.bfloat16, autocast=torch.bfloat16)
    own = trace_step(spec, b, foreach=True, **bf16)
    low = trace_step(spec.with_low_precision_norms(), b, foreach=True, **bf16)
    assert own.activations - low.activations == 4 * b * t * H * (2 * LAYERS + 1)
    # a CPU plan traces the CPU's kernels: torch's composite rms_norm keeps fp32 copies as HF's does, and its
    # normalized input before the weight's product in fp32 too (HF's rounds it to bf16 first): 2 bytes more a norm
    cpu_own, cpu_low = (trace_step(s, b, **bf16).activations for s in (spec, spec.with_low_precision_norms()))
    assert cpu_low - cpu_own == 2 * b * t * H * (2 * LAYERS + 1)


def test_the_planner_counts_cuda_autocasts_fp32_layer_norm():
    """CUDA's autocast runs ``layer_norm`` in fp32 (an fp32 copy of the input kept); the CPU's does not. A GPU plan
    of the built-in GPT (LayerNorms) keeps more per token and width per norm than the CPU's, and the low-precision
    norms give it back."""
    b, t, width, blocks = 2, 32, 128, 4  # gpt-tiny
    spec = ModelSpec.builtin_gpt("gpt-tiny", t)
    bf16 = dict(param_dtype=torch.bfloat16, autocast=torch.bfloat16)
    cpu = trace_step(spec, b, **bf16).activations
    gpu = trace_step(spec, b, foreach=True, **bf16).activations
    # the fp32 copy (4 bytes) in place of the bf16 input the CPU's kernel keeps (2, where nothing else holds it)
    per_norm = b * t * width * (2 * blocks + 1)
    assert 1 * per_norm <= gpu - cpu <= 4 * per_norm
    assert trace_step(spec.with_low_precision_norms(), b, foreach=True, **bf16).activations == cpu


def test_the_cuda_rms_norm_stand_in_computes_torchs_rms_norm_and_its_gradients():
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 5, 16, dtype=torch.float64)
    for weight in (w, None):
        inputs = (x,) if weight is None else (x, w)
        expected = torch.autograd.grad(F.rms_norm(x, (16,), weight, 1e-6), inputs, grad)
        with fake.norms_as_on_cuda():
            out = F.rms_norm(x, (16,), weight, 1e-6)
        assert torch.allclose(out, F.rms_norm(x, (16,), weight, 1e-6), atol=1e-6)  # its statistics in fp32
        for got, want in zip(torch.autograd.grad(out, inputs, grad), expected):
            assert torch.allclose(got, want, atol=1e-6)
    assert F.rms_norm.__module__ == "torch.nn.functional"  # put back


def test_the_loss_in_pieces_is_the_whole_loss_and_keeps_only_the_logits(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(3, 50, 97, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 97, (3, 50))
    targets[0, :7] = loss_pieces.IGNORE
    whole = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    (whole_grad,) = torch.autograd.grad(whole, logits)
    monkeypatch.setattr(loss_pieces, "PIECE_ELEMENTS", 97 * 16)  # 10 pieces of 16 rows (the last of 6)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        pieces = loss_pieces.token_loss_sum(logits, targets)
    assert torch.allclose(pieces, whole, rtol=1e-6)
    (grad,) = torch.autograd.grad(pieces, logits)
    assert torch.equal(grad, whole_grad)
    # kept for the backward: the bf16 logits' pieces and the targets, never an fp32 copy of the logits
    assert sum(t.numel() for t in kept if t.is_floating_point()) == logits.numel()
    assert all(t.dtype == torch.bfloat16 for t in kept if t.is_floating_point())
    with torch.no_grad():
        assert torch.allclose(loss_pieces.token_loss_sum(logits, targets), whole, rtol=1e-6)


def test_distrain_plan_shows_the_norms_saving_on_a_gpu_and_the_key_is_documented(capsys):
    """What a user sees: ``distrain plan`` for GPUs with ``training.low_precision_norms=true`` plans less activation
    memory for every layout, and ``distrain config training`` lists the key with its meaning."""
    from distrain import cli

    base = ["plan", "--devices", "2", "--gpu-type", "H100", "--gpu-memory", "80GB", "--model-name", "gpt-tiny"]
    base += ["--precision", "bf16-mixed", "--strategy", "ddp", "--no-time", "--json"]
    plans = {}
    for value in ("false", "true"):
        assert cli.main([*base, f"training.low_precision_norms={value}"]) == 0
        plans[value] = {r["label"]: r["activations_bytes"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert plans["true"].keys() == plans["false"].keys() and plans["true"]
    assert all(plans["true"][label] < plans["false"][label] for label in plans["true"])
    assert cli.main(["config", "training"]) == 0
    listed = capsys.readouterr().out
    assert "low_precision_norms" in listed and "compute dtype" in listed


def test_selective_checkpointing_recomputes_every_second_matmul_and_gives_the_same_gradients():
    """A selectively checkpointed block keeps its attention's output and every other matmul's, and recomputes the
    rest in backward (torchtitan's per-operation policy): half of its matmuls run again where full checkpointing
    runs all four, for memory between none and full. The gradients are bit-identical to no checkpointing's, with
    dropout too (the recomputation replays its random numbers)."""
    import copy

    from torch.utils._python_dispatch import TorchDispatchMode

    from distrain.models.gpt import Block
    from distrain.models.lm import GPTLanguageModel
    from distrain.module import loss_of, run_step
    from distrain.strategies.layers import apply_activation_checkpointing

    class Matmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Matmuls.count += func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    base = GPTLanguageModel("gpt-tiny", block_size=128, dropout=0.1)
    base.configure_model()
    x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(1))
    blocks = base.gpt.cfg.n_layer
    runs = {}
    for name, policy in (("none", None), ("full", {Block}), ("selective", {"classes": {Block}, "selective": True})):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, policy)
        torch.manual_seed(2)
        tracker = fake.peak_memory_tracker()
        with tracker:
            loss = loss_of(run_step(model, "training_step", (x[:, :-1], x[:, 1:]), 0))
            Matmuls.count = 0
            with Matmuls():
                loss.backward()
        runs[name] = (Matmuls.count, tracker.peak_bytes(), [p.grad for p in model.parameters()])
    assert runs["full"][0] - runs["none"][0] == 4 * blocks  # qkv, proj, fc, proj: all again
    assert runs["selective"][0] - runs["none"][0] == 2 * blocks  # every second one
    assert runs["full"][1] < runs["selective"][1] < runs["none"][1]
    for name in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(runs[name][2], runs["none"][2])), name


def test_selective_checkpointing_is_a_mode_of_the_config_refused_by_deepspeed(capsys):
    """``training.activation_checkpointing_mode``: full or selective, anything else named in one line; DeepSpeed,
    whose checkpointing recomputes whole layers, refuses selective before any rank starts; ``distrain plan`` says
    the mode it plans."""
    from distrain import cli
    from distrain.strategies.deepspeed import DeepSpeedStrategy

    base = ["plan", "--devices", "2", "--accelerator", "cpu", "--cpu-memory", "16GB", "--model-name", "gpt-tiny"]
    assert cli.main([*base, "training.activation_checkpointing_mode=partial"]) == 2
    assert "training.activation_checkpointing_mode must be full or selective, got 'partial'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="selective activation checkpointing .* is not supported with DeepSpeed"):
        DeepSpeedStrategy(stage=2, activation_checkpointing_policy={"classes": {torch.nn.Linear}, "selective": True})
    ac = ["training.activation_checkpointing=true", "--strategy", "fsdp", "--no-time"]
    assert cli.main([*base, *ac, "training.activation_checkpointing_mode=selective"]) == 0
    assert "AC per operation (selective)" in capsys.readouterr().out
