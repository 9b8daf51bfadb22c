"""Every refusal a run could meet inside its ranks (``config.Refusal``: a model's forward under a layout, a strategy's
set-up of the model) fires before any rank starts, in one line. The test walks the code for each ``raise Refusal``
and holds a case for each: ``distrain train`` refused by its plan (exit code 2, one line, no run directory), or a
Trainer refused by its strategy's ``check_module`` (the refusal raised in this process, no rank's log written). A new
refusal without a case here fails ``test_every_refusal_in_the_code_has_a_case``."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

import distrain
from distrain import cli
from distrain.config import Refusal

ROOT = Path(distrain.__file__).parent


def refusal_sites() -> set[tuple[str, str, int]]:
    """(file, function, n): the n-th ``raise Refusal(...)`` of each function of distrain (the innermost function
    that holds it)."""
    sites = set()
    for path in sorted(ROOT.rglob("*.py")):
        finder = _RefusalsByFunction()
        finder.visit(ast.parse(path.read_text()))
        for function, count in finder.counts.items():
            sites.update((str(path.relative_to(ROOT)), function, n) for n in range(count))
    return sites


class _RefusalsByFunction(ast.NodeVisitor):
    def __init__(self):
        self.functions: list[str] = []
        self.counts: dict[str, int] = {}

    def visit_FunctionDef(self, node):
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Raise(self, node):
        call = node.exc
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "Refusal":
            where = self.functions[-1] if self.functions else "<module>"
            self.counts[where] = self.counts.get(where, 0) + 1
        self.generic_visit(node)


# ---- the models the cases refuse -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Tiny Hugging Face models, each with something a layout cannot run, and a corpus."""
    pytest.importorskip("transformers")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from distrain.hf import tiny

    root = tmp_path_factory.mktemp("refused")
    models = {
        "mistral-window-4": tiny.make_tiny_llama(root / "mistral", sliding_window=4),
        "llama-3-heads": tiny.make_tiny_llama(root / "llama-dropout", heads=3, kv_heads=1),
    }
    config = Path(models["llama-3-heads"]) / "config.json"  # attention dropout, which the ring cannot draw
    config.write_text(json.dumps({**json.loads(config.read_text()), "attention_dropout": 0.1}))
    tokenizer = tiny.make_tokenizer({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    gemma = Gemma2Config(  # logit soft-capping, which neither engine applies
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, max_position_embeddings=128, attn_logit_softcapping=50.0,
    )  # fmt: skip
    Gemma2ForCausalLM(gemma).save_pretrained(root / "gemma2")
    tokenizer.save_pretrained(root / "gemma2")
    models["gemma2-softcap"] = str(root / "gemma2")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"one two three four five six seven eight nine {i}\n" for i in range(40)))
    return models, str(corpus)


def _train(argv: list[str], out: Path, capsys) -> str:
    """``distrain train`` refused before any rank starts: exit code 2, one line, nothing written. Its line."""
    code = cli.main(["train", "--accelerator", "cpu", *argv, f"output_dir={out}", "training.max_steps=1"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, captured.err[-2000:], captured.out[-2000:])
    assert lines[0].startswith("distrain: error: "), lines
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))  # no rank started: no run directory, no logs
    return lines[0]


def _cp(model: str, corpus: str, length: int = 16) -> list[str]:
    return [
        "--model_name", model, "--strategy", "model_parallel", "--devices", "2", "distributed.tensor_parallel_size=1",
        "distributed.context_parallel_size=2", f"data.dataset={corpus}", f"data.max_length={length}",
    ]  # fmt: skip


def _fit(strategy, module, out: Path, devices: int = 2) -> str:
    """``Trainer.fit`` refused in this process: its strategy's ``check_module``, before any rank starts."""
    import helpers

    trainer = distrain.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, default_root_dir=str(out)
    )
    with pytest.raises(Refusal) as info:
        trainer.fit(module, helpers.loader(4))  # never read
    assert not (out / "logs").exists(), sorted((out / "logs").iterdir())  # no rank wrote its log
    assert "\n" not in str(info.value)
    return str(info.value)


def _built(strategy, out: Path, devices: int = 2) -> str:
    """A Trainer refused as it is built: its strategy's layout (``connect``), before any rank starts."""
    with pytest.raises(Refusal) as info:
        distrain.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, default_root_dir=str(out))
    assert not (out / "logs").exists()
    assert "\n" not in str(info.value)
    return str(info.value)


def _gpt():
    import helpers

    return helpers.TinyGPT(n_head=2)


def _gpt_and_a_stray_layer():
    import helpers

    class GPTAndAStrayLayer(helpers.TinyGPT):
        """The built-in GPT's plan splits the GPT: a layer beside it would be on no stage, never trained."""

        def __init__(self):
            super().__init__()
            self.stray = torch.nn.Linear(2, 2)

    return GPTAndAStrayLayer()


def _mlp():
    import matrix_models

    return matrix_models.MLP()


def _built_in_gpt():
    """The built-in GPT job's module: its layers are built in ``configure_model``, its depth known now."""
    import matrix_models

    return matrix_models.gpt()


def _mp(**sizes):
    from distrain.strategies.model_parallel import ModelParallelStrategy

    return ModelParallelStrategy(**sizes)


# ---- the cases: (file, function, n-th raise of it) → the run that meets it, and its line ------------------------
CASES = {
    ("parallel/context_parallel.py", "check_window", 0): (
        lambda hf, out, capsys: _train(_cp(hf[0]["mistral-window-4"], hf[1]), out, capsys),
        r"context parallelism cannot run a sliding window of 4 tokens over sequences of 16 ",
    ),
    ("parallel/context_parallel.py", "check_no_extras", 0): (
        lambda hf, out, capsys: _train(_cp(hf[0]["gemma2-softcap"], hf[1]), out, capsys),
        r"cannot run this model's attention: it asks for logit soft-capping \(softcap\)",
    ),
    ("parallel/context_parallel.py", "_ring_attention", 0): (
        lambda hf, out, capsys: _train(_cp(hf[0]["llama-3-heads"], hf[1]), out, capsys),
        r"ring engine .* cannot run attention dropout \(0.1\)",
    ),
    ("parallel/context_parallel.py", "engine_for", 0): (
        lambda hf, out, capsys: _train(
            ["--strategy", "model_parallel", "--devices", "6"]
            + ["distributed.tensor_parallel_size=3", "distributed.context_parallel_size=2"],
            out,
            capsys,
        ),
        r"gpt-tiny has 4 attention heads, which tensor_parallel_size=3 does not divide",
    ),
    ("parallel/tensor_parallel.py", "_divides", 0): (
        lambda hf, out, capsys: (
            _train(
                ["--strategy", "model_parallel", "--devices", "3", "distributed.tensor_parallel_size=3"], out, capsys
            )
            + _fit(_mp(tensor_parallel_size=3), _gpt(), out / "trainer", devices=3)
        ),
        r"tensor_parallel_size=3 must divide the model's n_head=4, n_embd=128 .*tensor_parallel_size=3 must divide "
        r"the model's n_head=2",
    ),
    ("parallel/pipeline_split.py", "split_blocks", 0): (
        lambda hf, out, capsys: (
            _train(
                ["--strategy", "pipeline", "--devices", "2", "distributed.pipeline_stages=2"]
                + ["distributed.pipeline_stages_per_rank=4", "distributed.pipeline_schedule=Interleaved1F1B"],
                out,
                capsys,
            )
            + _fit(_mp(pipeline_stages=2, schedule="Interleaved1F1B", stages_per_rank=2), _gpt(), out / "trainer")
        ),
        r"8 pipeline stages but the model has 4 blocks.*4 pipeline stages but the model has 2 blocks",
    ),
    ("parallel/pipeline_split.py", "split_blocks", 1): (
        lambda hf, out, capsys: _fit(_mp(pipeline_stages=2, split_points=[0]), _gpt(), out),
        r"split_points \[0\] must name 1 distinct blocks after the first",
    ),
    ("parallel/pipeline_split.py", "_block_index", 0): (
        lambda hf, out, capsys: _fit(_mp(pipeline_stages=2, split_points=[7]), _gpt(), out),
        r"split point 7 is not a block index \(0..1\)",
    ),
    ("parallel/pipeline_split.py", "_block_index", 1): (
        lambda hf, out, capsys: _fit(_mp(pipeline_stages=2, split_points=["gpt.head"]), _gpt(), out),
        r"split point 'gpt.head' names no block of the model",
    ),
    ("parallel/pipeline_stages.py", "check_split_covers", 0): (
        lambda hf, out, capsys: _fit(_mp(pipeline_stages=2), _gpt_and_a_stray_layer(), out),
        r"the pipeline split of GPTAndAStrayLayer places stray.weight, stray.bias on no stage",
    ),
    ("parallel/pipeline_split.py", "split_for", 0): (
        lambda hf, out, capsys: _fit(_mp(pipeline_stages=2), _mlp(), out),
        r"MLP holds no model the pipeline strategy has a built-in plan for",
    ),
    ("strategies/layers.py", "apply_activation_checkpointing", 0): (
        lambda hf, out, capsys: _train(
            ["--strategy", "deepspeed_stage_2", "--devices", "2", "training.activation_checkpointing=true"]
            + ["training.activation_checkpointing_mode=selective"],
            out,
            capsys,
        ),
        r"selective activation checkpointing .* is not supported with DeepSpeed",
    ),
    ("strategies/model_parallel.py", "check_module", 0): (
        lambda hf, out, capsys: _fit(_mp(pipeline_stages=8), _built_in_gpt(), out, devices=8),
        r"8 pipeline stages \(distributed.pipeline_stages\) but gpt-tiny has 4 blocks",
    ),
    ("strategies/model_parallel.py", "_check_experts_layout", 0): (
        lambda hf, out, capsys: _built(_mp(tensor_parallel_size=2, expert_parallel_size=2), out),
        r"expert_parallel_size=2 \(distributed.expert_parallel_size\) under model_parallel splits the experts among "
        r"the data and context-parallel ranks, and not yet with tensor parallelism or a pipeline",
    ),
    ("parallel/tensor_parallel.py", "planned_targets", 0): (
        lambda hf, out, capsys: _fit(_mp(tensor_parallel_size=2), _mlp(), out),
        r"MLP has no built-in tensor-parallel plan",
    ),
}


def test_every_refusal_in_the_code_has_a_case():
    assert refusal_sites() == set(CASES), (
        f"without a case: {sorted(refusal_sites() - set(CASES))}; stale: {sorted(set(CASES) - refusal_sites())}"
    )


@pytest.mark.parametrize("site", sorted(CASES), ids=lambda site: f"{site[1]}-{site[2]}")
def test_each_refusal_fires_before_any_rank_starts_in_one_line(site, hf, tmp_path, capsys):
    run, says = CASES[site]
    line = run(hf, tmp_path / "run", capsys)
    assert re.search(says, line), line
