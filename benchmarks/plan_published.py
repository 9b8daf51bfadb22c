"""``distrain plan`` against training runs others measured and published (issue 57): each run's model rebuilt from
its published shape, planned on its GPU type, cluster and layout, and the plan's tokens/s per GPU set beside the
published one. The runs, with their sources, are gathered in ``benchmarks/published/runs.md``.

    python benchmarks/plan_published.py [--rows TA1 LH6 ...] [--json out.json]

Fake-tensor tracing only: nothing is allocated, no GPU is needed. A deep model is traced at two shallow depths and
extrapolated, as every plan is (``planner/estimate.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

LLAMA = "llama"
GPT2 = "gpt2"  # GPT-2 style: learned positions, LayerNorm and biases, exact GELU MLP, tied embeddings, no dropout (MPT)

#: name: (family, layers, hidden, heads, kv heads, ffn, vocab); runs.md §1
SHAPES = {
    "L3-8B": (LLAMA, 32, 4096, 32, 8, 14336, 128256),
    "L3-70B": (LLAMA, 80, 8192, 64, 8, 28672, 128256),
    "L2-13B": (LLAMA, 40, 5120, 40, 40, 13824, 32000),
    "L2-70B": (LLAMA, 80, 8192, 64, 8, 28672, 32000),
    "MPT-1B": (GPT2, 24, 2048, 16, 16, 8192, 50368),
    "MPT-3B": (GPT2, 32, 2560, 20, 20, 10240, 50368),
    "MPT-7B": (GPT2, 32, 4096, 32, 32, 16384, 50368),
    "MPT-13B": (GPT2, 40, 5120, 40, 40, 20480, 50368),
    "MPT-30B": (GPT2, 48, 7168, 56, 56, 28672, 50368),
    "MPT-70B": (GPT2, 80, 8192, 64, 64, 32768, 50368),
    # Megatron's GPT (GELU MLP of 4 × hidden) as a Llama-style model whose SwiGLU has the same parameters and FLOPs
    # (three matrices of hidden × 8/3 hidden): the planner's tensor parallelism splits Llama-style layers
    "GPT-22B": (LLAMA, 48, 6144, 64, 64, 16384, 51200),
    "GPT-175B": (LLAMA, 96, 12288, 96, 96, 32768, 51200),
}


@dataclass(frozen=True)
class Run:
    id: str
    source: str
    model: str
    gpu: str
    gpu_memory: str
    nodes: int
    devices: int
    seq: int
    micro_batch: int
    accumulate: int
    checkpoint_every: int | None  # recompute every N-th block (1: every block); None: no recomputation
    measured: float  # tokens/s per GPU, as published
    strategy: str = "fsdp"
    tensor: int = 1  # tensor-parallel ranks (model_parallel), FSDP over the rest
    #: norms that keep their input in bf16 for the backward (``training.low_precision_norms``), as each source ran:
    #: torchtitan's ``norm_type = "fused_rmsnorm"`` (its 8B and 13B configs), llm-foundry's MPT default
    #: ``low_precision_layernorm``, Megatron-LM's fused LayerNorm (apex). False: torchtitan's 70B configs'
    #: ``norm_type = "rmsnorm"``, fp32 by hand as Hugging Face's Llama computes it (runs.md §2a)
    low_precision_norms: bool = True
    compile: bool = False  # torch.compile (torchtitan's per-block compile)
    precision: str = "bf16-mixed"  # fp8: torchao's float8 linear layers (torchtitan's float8 rows)
    #: recomputation per operation (torchtitan's ``selective_ac_option = "op"``, ``training.activation_checkpointing_
    #: mode: selective``) in the blocks ``checkpoint_every`` selects
    selective: bool = False
    pipeline: int = 1  # pipeline ranks (``model_parallel``'s ``pipeline_stages``), tensor parallel within each
    stages_per_rank: int = 1  # >1: torch's Interleaved1F1B with that many model chunks per pipeline rank
    sequence_parallel: bool = True  # under tensor parallelism (distrain's default)


#: torchtitan's H100 runs (runs.md §2b): their norms in fp32 by hand, their recomputation per operation
TORCHTITAN_H100 = {"low_precision_norms": False, "selective": True}

#: the runs planned (runs.md's IDs): layouts the planner models (FSDP, tensor parallel), bf16 or float8
RUNS = [
    Run("TA1", "torchtitan A100", "L3-8B", "A100", "80GB", 8, 8, 8192, 1, 1, 2, 2904),
    Run("TA3", "torchtitan A100", "L3-70B", "A100", "80GB", 8, 8, 8192, 1, 1, 1, 331, low_precision_norms=False),
    Run("TA4", "torchtitan A100", "L2-13B", "A100", "80GB", 8, 8, 4096, 2, 1, None, 2162),
    Run("TA5", "torchtitan A100", "L2-13B", "A100", "80GB", 8, 8, 4096, 2, 1, 2, 1914),
    Run("TA8", "torchtitan A100", "L2-70B", "A100", "80GB", 8, 8, 4096, 2, 1, 1, 353, low_precision_norms=False),
    # torchtitan on H100 96GB at a 500 W power limit (runs.md §2b, commit 9dec370): Llama 3.1 8B, FSDP, 2 × 8192
    # tokens, eager, compiled, and compiled with torchao's float8 linears (TH3, TH6: planned with the weights
    # gathered in float8, as distrain's FSDP runs fp8; the 8B config at 9dec370 leaves torchtitan's float8 all-gather
    # off, and with bf16 gathers TH6 plans 1% slower), norm_type = "rmsnorm" (fp32 by hand), and recomputation per
    # operation in every block (selective_ac_option = "op")
    *(
        Run(
            id, "torchtitan H100", "L3-8B", "H100", "96GB", nodes, 8, 8192, 2, 1, 1, measured, **TORCHTITAN_H100, **more
        )
        for id, nodes, measured, more in (
            ("TH1", 1, 5762, {}),
            ("TH2", 1, 6667, {"compile": True}),
            ("TH3", 1, 8532, {"compile": True, "precision": "fp8"}),
            ("TH4", 16, 5605, {}),
            ("TH5", 16, 6514, {"compile": True}),
            ("TH6", 16, 8380, {"compile": True, "precision": "fp8"}),
        )
    ),
    # torchtitan's community benchmark on H200s (runs.md §2d, Trainy on WhiteFiber): Llama 3.1 8B, FSDP over 32 and
    # 64 GPUs, 2 × 8192 tokens, compiled, float8 linears with float8 all-gather, recomputation per operation
    *(
        Run(id, "torchtitan H200", "L3-8B", "H200", "141GB", nodes, 8, 8192, 2, 1, 1, measured, compile=True,
            precision="fp8", **TORCHTITAN_H100)
        for id, nodes, measured in (("TR1", 4, 10938), ("TR2", 8, 10753))
    ),  # fmt: skip
    # distrain's own runs on one H200 (runs.md §2j; docs/benchmarks.md, 2026-11-26): ``distrain bench --strategies
    # single``, sequence 2048, bf16 autocast, the built-in GPT's LayerNorms as they run (fp32 under autocast)
    *(
        Run(id, "distrain H200", model, "H200", "141GB", 1, 1, 2048, batch, 1, None, measured, "single",
            low_precision_norms=False, **settings)
        for id, model, batch, measured, settings in (
            ("DH1", "gpt-1.3b", 8, 62126, {}),
            ("DH2", "gpt-1.3b", 8, 66542, {"compile": True}),
            ("DH3", "gpt-1.3b", 8, 77209, {"compile": True, "precision": "fp8"}),
            ("DH4", "gpt-350m", 16, 190348, {}),
            ("DH5", "gpt-124m", 16, 642326, {"compile": True}),
        )
    ),  # fmt: skip
    Run("LH1", "llm-foundry H100", "MPT-1B", "H100", "80GB", 1, 8, 2048, 14, 1, None, 45455),
    Run("LH6", "llm-foundry H100", "MPT-7B", "H100", "80GB", 1, 8, 2048, 6, 1, None, 10643),
    Run("LH9", "llm-foundry H100", "MPT-7B", "H100", "80GB", 16, 8, 2048, 6, 1, None, 10475),
    Run("LH7", "llm-foundry H100", "MPT-7B", "H100", "80GB", 1, 8, 8192, 8, 2, 1, 6935),
    Run("LH11", "llm-foundry H100", "MPT-13B", "H100", "80GB", 1, 8, 4096, 10, 3, 1, 4717),
    Run("LH14", "llm-foundry H100", "MPT-30B", "H100", "80GB", 1, 8, 2048, 3, 21, 1, 2002),
    Run("LH16", "llm-foundry H100", "MPT-70B", "H100", "80GB", 8, 8, 2048, 8, 4, 1, 1039),
    Run("LH8", "llm-foundry H100", "MPT-7B", "H100", "80GB", 1, 8, 32768, 2, 2, 1, 3318),
    Run("LH13", "llm-foundry H100", "MPT-13B", "H100", "80GB", 1, 8, 32768, 1, 3, 1, 1976),
    Run("LA1", "llm-foundry A100", "MPT-1B", "A100", "80GB", 1, 8, 2048, 14, 4, None, 20513),
    Run("LA2", "llm-foundry A100", "MPT-1B", "A100", "80GB", 1, 8, 32768, 1, 4, None, 6275),
    Run("LA3", "llm-foundry A100", "MPT-3B", "A100", "80GB", 1, 8, 8192, 3, 6, None, 7695),
    Run("LA4", "llm-foundry A100", "MPT-7B", "A100", "80GB", 1, 8, 2048, 6, 2, None, 4641),
    Run("LA5", "llm-foundry A100", "MPT-7B", "A100", "80GB", 1, 8, 8192, 8, 2, 1, 3206),
    Run("LA6", "llm-foundry A100", "MPT-7B", "A100", "80GB", 1, 8, 32768, 2, 2, 1, 1672),
    Run("LA7", "llm-foundry A100", "MPT-13B", "A100", "80GB", 1, 8, 2048, 2, 3, None, 2262),
    Run("LA8", "llm-foundry A100", "MPT-13B", "A100", "80GB", 1, 8, 8192, 5, 3, 1, 1795),
    Run("LA9", "llm-foundry A100", "MPT-13B", "A100", "80GB", 1, 8, 32768, 1, 3, 1, 1016),
    Run("LA10", "llm-foundry A100", "MPT-30B", "A100", "80GB", 1, 8, 2048, 3, 21, 1, 916),
    # Korthikanti et al. 2022, Table 5: 22B, tensor parallel 8 on 8 A100s, iterations of 4 × 2048 tokens (a
    # transcription of the paper's table, runs.md K1, K2). K1: full recomputation, no sequence parallelism, 1.42 s.
    # K2: sequence parallelism and selective recomputation, 1.10 s, planned as K4 below
    *(
        Run(id, "Megatron-LM A100", "GPT-22B", "A100", "80GB", 1, 8, 2048, 4, 1, every, 4 * 2048 / seconds / 8,
            "model_parallel", 8, sequence_parallel=sp)
        for id, every, seconds, sp in (("K1", 1, 1.42, False), ("K2", None, 1.10, True))
    ),
    # Korthikanti et al. 2022, Table 5: GPT-3 175B, tensor parallel 8 × pipeline 8 on 64 A100s (DP 1), the interleaved
    # schedule with 3 model chunks per rank, 64 micro-batches of 1 × 2048 tokens per iteration (runs.md K3, K4). K3:
    # full recomputation, no sequence parallelism, 18.13 s. K4: sequence parallelism and Megatron's selective
    # recomputation (the attention's scores and softmax only), 13.75 s: planned with no recomputation, as flash
    # attention keeps no scores and its backward recomputes them (what Megatron's selective recomputation does)
    *(
        Run(id, "Megatron-LM A100", "GPT-175B", "A100", "80GB", 8, 8, 2048, 1, 64, every, 64 * 2048 / seconds / 64,
            "model_parallel", 8, pipeline=8, stages_per_rank=3, sequence_parallel=sp)
        for id, every, seconds, sp in (("K3", 1, 18.13, False), ("K4", None, 13.75, True))
    ),
    Run("TS1", "torchtitan H100 TP", "L3-70B", "H100", "96GB", 32, 8, 8192, 16, 1, 1, 597.3, "model_parallel", 8,
        compile=True, low_precision_norms=False),
    Run("TS4", "torchtitan H100 TP", "L3-8B", "H100", "96GB", 8, 8, 8192, 12, 1, 1, 4378, "model_parallel", 8,
        compile=True, **TORCHTITAN_H100),
]  # fmt: skip


def model_dir(name: str, seq: int, root: Path) -> Path | str:
    """A Hugging Face config of ``name``'s published shape (no weights), saved under ``root``; a built-in model's
    name (``gpt-1.3b``) as it is."""
    if name not in SHAPES:
        return name
    family, layers, hidden, heads, kv, ffn, vocab = SHAPES[name]
    path = root / f"{name}-{seq}"
    if (path / "config.json").is_file():
        return path
    if family == LLAMA:
        from transformers import LlamaConfig

        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=vocab,
            max_position_embeddings=seq,
            architectures=["LlamaForCausalLM"],
        )
    else:
        from transformers import GPT2Config

        config = GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, vocab_size=vocab, n_positions=seq,
            activation_function="gelu", architectures=["GPT2LMHeadModel"],
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,  # MPT trains without dropout
        )  # fmt: skip
    config.save_pretrained(path)
    return path


def planner_for(run: Run, root: Path):
    """(planner, option, hardware) of ``run``: the job as ``distrain plan`` builds it from the same flags."""
    from distrain.cli import _flag_values, build_config, plan_parser
    from distrain.planner.cli import TimingArgs
    from distrain.planner.from_config import budget_from_config, job_from_config
    from distrain.planner.plan import Planner, option_for_run

    argv = [
        "--model-name", str(model_dir(run.model, run.seq, root)), "--gpu-type", run.gpu,
        "--gpu-memory", run.gpu_memory, "--num-nodes", str(run.nodes), "--devices", str(run.devices),
        "--strategy", run.strategy, "--batch-size", str(run.micro_batch), "--seq-len", str(run.seq),
        "--precision", run.precision, "training.pretrained=false", "training.task=causal_lm",
        f"training.gradient_accumulation_steps={run.accumulate}",
        # as torchtitan and llm-foundry (FSDP1) run: gradients reduce-scattered after every micro-batch
        "fsdp.sync_each_micro_batch=true",
        f"training.low_precision_norms={str(run.low_precision_norms).lower()}",
        f"training.compile={str(run.compile).lower()}",
        f"training.activation_checkpointing_mode={'selective' if run.selective else 'full'}",
        *([f"distributed.tensor_parallel_size={run.tensor}"] if run.tensor > 1 else []),
        *([f"distributed.pipeline_stages={run.pipeline}"] if run.pipeline > 1 else []),
        *(["distributed.pipeline_schedule=Interleaved1F1B",
           f"distributed.pipeline_stages_per_rank={run.stages_per_rank}"] if run.stages_per_rank > 1 else []),
        *([] if run.sequence_parallel else ["distributed.sequence_parallel=false"]),
    ]  # fmt: skip
    args = plan_parser().parse_intermixed_args(argv)
    config = build_config(args.config, _flag_values(args), args.overrides)
    job = job_from_config(config, gpu=True)
    budget = budget_from_config(config, True, job.per_node)
    hardware = TimingArgs.from_args(args).hardware(job)
    every = run.checkpoint_every  # the option's count of recomputed blocks: 0 none, None all
    checkpoint = 0 if every is None else None if every == 1 else SHAPES[run.model][1] // every
    option = replace(option_for_run(run.strategy, job), checkpoint=checkpoint)
    return Planner(job, budget, hardware), option, hardware


def plan_row(run: Run, root: Path) -> dict:
    planner, option, hardware = planner_for(run, root)
    row = planner.row(option, max_batch=False)
    step = planner.estimator.step_time(option, hardware)
    # a rank's micro-batch is its data-parallel group's: tensor-parallel ranks share theirs
    tokens = run.micro_batch * run.accumulate * run.seq / option.sharing_a_sample
    planned = tokens / step.seconds
    return {
        "id": run.id,
        "source": run.source,
        "model": run.model,
        "gpus": run.nodes * run.devices,
        "measured": run.measured,
        "planned": planned,
        "ratio": planned / run.measured,
        "peak_gib": row.peak / 2**30,
        "buffers_gib": row.buffers / 2**30,
        "usable_gib": planner.budget.usable / 2**30,
        "fits": row.peak <= planner.budget.usable,
        "compute_s": step.compute,
        "optimizer_s": step.optimizer,
        "communication_s": step.communication,
        "step_s": step.seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", help="runs.md IDs (default: every run above)")
    p.add_argument("--json")
    args = p.parse_args()
    runs = [r for r in RUNS if not args.rows or r.id in args.rows]
    root = Path(os.environ.get("DISTRAIN_PUBLISHED_MODELS", Path(tempfile.gettempdir()) / "distrain-published"))
    rows = []
    print("| run | source | model | GPUs | published tok/s/GPU | planned | plan / published | peak GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        r = plan_row(run, root)
        rows.append(r)
        print(
            f"| {r['id']} | {r['source']} | {r['model']} | {r['gpus']} | {r['measured']:,.0f} | {r['planned']:,.0f} "
            f"| {r['ratio']:.2f} | {r['peak_gib']:.1f} | {'yes' if r['fits'] else 'NO'} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
