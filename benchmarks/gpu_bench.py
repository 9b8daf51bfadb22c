"""The GPU numbers of docs/benchmarks.md, measured: ``python benchmarks/gpu_bench.py`` on a GPU machine runs exactly
what fills that page's GPU table and writes it (``runs/gpu_bench/results.md``, again after every row, so that a run
cut short keeps what it measured); ``--dry-run`` prints the commands instead (any machine, no GPU needed).

1. Throughput: ``distrain bench`` for gpt-124m, gpt-350m and gpt-1.3b in bf16-mixed, bf16 + ``--compile`` and
   fp8 + ``--compile`` (fp8 where the GPU has float8 tensor cores: compute capability 8.9+), sequence 2048.
   Each row is one ``distrain bench`` process (fresh process group, the real Trainer). The table sets each row's
   MFU beside torchtitan's published H100 figures for Llama 3 8B under FSDP on 8 GPUs (5,762 tokens/s/GPU in
   bf16, 6,667 with compile, 8,532 with compile + float8), turned into MFU with torchtitan's own FLOP count —
   a comparison per FLOP, since the models differ. Target: at least 45% MFU for gpt-1.3b, bf16 + compile, on one
   H100.
2. The largest model one GPU and its host can train with ZeRO-3 offload (``deepspeed_stage_3_offload``) and
   with FSDP's CPU offload (``fsdp_cpu_offload``): Llama-2-7B-wide models (hidden 4096) of 8 to 64 layers
   (1.9B to 13B parameters), activation checkpointing on, micro-batch 1 × 2048 tokens. ``distrain plan``
   predicts each size first (device peak and host memory); then the largest size the plan says fits is trained
   for 3 steps, and the next sizes up until one fails (or down until one trains). The table shows the plan
   beside what was measured (peak CUDA memory, host RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SIZES = ("gpt-124m", "gpt-350m", "gpt-1.3b")
#: micro-batch per GPU at sequence 2048 (bf16, AdamW in fp32): about 50 GiB of an 80 GiB H100 at 1.3B
BATCH = {"gpt-124m": 16, "gpt-350m": 16, "gpt-1.3b": 8}
SETTINGS = {  # name → distrain bench flags
    "bf16": ["--precision", "bf16-mixed"],
    "bf16 + compile": ["--precision", "bf16-mixed", "--compile"],
    "fp8 + compile": ["--precision", "fp8", "--compile"],
}
#: torchtitan's published H100 throughput (Llama 3 8B, FSDP, 8 × H100, sequence 8192), tokens/s per GPU
TORCHTITAN = {"bf16": 5762, "bf16 + compile": 6667, "fp8 + compile": 8532}
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s; torchtitan's MFU (and distrain's) is against it, fp8 included
TARGET = ("gpt-1.3b", "bf16 + compile", 0.45)

#: offload ladder: Llama-2-7B's width and heads, the depth varies (202M parameters per layer, 262M embeddings)
LADDER_LAYERS = (8, 16, 24, 32, 40, 48, 64)
LLAMA_WIDTH = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008)
OFFLOAD = ("deepspeed_stage_3_offload", "fsdp_cpu_offload")


def torchtitan_flops_per_token() -> float:
    """torchtitan's count for Llama 3 8B at sequence 8192: 6 × (parameters − embedding) + 12 × layers × dim × seq."""
    layers, dim, vocab, ffn, seq = 32, 4096, 128256, 14336, 8192
    kv = 8 * 128  # 8 key/value heads of 128
    per_layer = dim * dim * 2 + dim * kv * 2 + 3 * dim * ffn + 2 * dim  # q, o; k, v; the MLP; two norms
    params = layers * per_layer + 2 * vocab * dim + dim  # + embeddings, output, final norm
    return 6 * (params - vocab * dim) + 12 * layers * dim * seq


def torchtitan_mfu(setting: str) -> float:
    return TORCHTITAN[setting] * torchtitan_flops_per_token() / H100_BF16_PEAK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the commands; run nothing (works without a GPU)")
    p.add_argument("--out", default="runs/gpu_bench", help="results.md, rows.json and each command's output")
    p.add_argument("--gpus", type=int, help="GPUs for the throughput rows (default: every local GPU)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES))
    p.add_argument("--strategies", nargs="+", help="default: single and fsdp on one GPU; ddp, fsdp, ZeRO-3 on more")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator)")
    p.add_argument("--batch-size", type=int, help="micro-batch per GPU for every size (default: per size)")
    p.add_argument("--skip-bench", action="store_true", help="only the offload part")
    p.add_argument("--skip-offload", action="store_true", help="only the throughput part")
    p.add_argument("--layers", nargs="+", type=int, default=list(LADDER_LAYERS), help="offload ladder depths")
    p.add_argument("--gpu-memory", help="plan for this GPU memory instead of the machine's (e.g. 80GB)")
    p.add_argument("--cpu-memory", help="plan for this host memory instead of the machine's (e.g. 128GB)")
    p.add_argument("--plan-row", nargs=2, metavar=("MODEL", "STRATEGY"), help=argparse.SUPPRESS)
    return p


# ---- what runs ---------------------------------------------------------------------------------------------------
def machine(args) -> dict:
    """GPUs and fp8 support here; a dry run on a machine without a GPU assumes one GPU."""
    import importlib.util

    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.dry_run:
        raise SystemExit("gpu_bench: no CUDA GPU here; `--dry-run` prints what it would run")
    gpus = args.gpus or (torch.cuda.device_count() if gpu else 1)
    from distrain.precision import FP8_MIN_CAPABILITY

    fp8 = gpu and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY
    fp8 = fp8 and importlib.util.find_spec("torchao") is not None
    return {
        "gpu": gpu,
        "gpus": gpus,
        "name": torch.cuda.get_device_name() if gpu else "no GPU (dry run)",
        "fp8": fp8 if gpu else None,  # None: unknown here
    }


def bench_commands(args, here: dict, out: Path) -> list[tuple[dict, list[str]]]:
    strategies = args.strategies or (["single", "fsdp"] if here["gpus"] == 1 else ["ddp", "fsdp", "deepspeed_stage_3"])
    rows = []
    for size in args.sizes:
        for strategy in strategies:
            for setting, flags in SETTINGS.items():
                if strategy.startswith("deepspeed") and setting != "bf16":
                    continue  # DeepSpeed: neither torch.compile nor torchao's fp8 is wired in (refused)
                if setting.startswith("fp8") and here["fp8"] is False:
                    continue
                slug = f"{size}-{strategy}-{setting.replace(' + ', '-')}"
                command = ["distrain", "bench", "--sizes", size, "--strategies", strategy,
                           "--devices", str(here["gpus"]), "--batch-size", str(args.batch_size or BATCH.get(size, 8)),
                           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
                           *flags, "--json", str(out / "bench" / f"{slug}.json")]  # fmt: skip
                rows.append(({"size": size, "strategy": strategy, "setting": setting, "slug": slug}, command))
    return rows


def ladder(out: Path, depths=LADDER_LAYERS) -> list[dict]:
    return [
        {"name": f"llama-4096x{layers}", "layers": layers, "dir": out / "models" / f"llama-4096x{layers}"}
        for layers in sorted(depths)
    ]


def llama_params(layers: int) -> int:
    h, ffn, vocab = LLAMA_WIDTH["hidden_size"], LLAMA_WIDTH["intermediate_size"], 32000
    return layers * (4 * h * h + 3 * h * ffn + 2 * h) + 2 * vocab * h + h


def plan_command(args, model: Path, strategy: str) -> list[str]:
    command = ["distrain", "plan", "--model-name", str(model), "--devices", "1", "--precision", "bf16-mixed",
               "--batch-size", "1", "--seq-len", str(args.seq_len), "--strategy", strategy, "--json"]  # fmt: skip
    for flag, value in (("--gpu-memory", args.gpu_memory), ("--cpu-memory", args.cpu_memory)):
        if value:
            command += [flag, value]
    return [*command, "training.activation_checkpointing=true", "training.pretrained=false"]


def train_command(args, model: Path, strategy: str, corpus: Path, run_dir: Path) -> list[str]:
    return [
        "distrain", "train", "--model-name", str(model), "--strategy", strategy, "--devices", "1",
        "--precision", "bf16-mixed", "--batch-size", "1", "--max-steps", "3", "--output-dir", str(run_dir),
        "--overwrite",  # the bench's own folder: the bench run again replaces the run it measured there before
        "training.pretrained=false", "training.activation_checkpointing=true", "training.limit_val_batches=1",
        f"data.dataset={corpus}", f"data.max_length={args.seq_len}", "data.packing=true",
        "logging.log_every_n_steps=1", "logging.progress_bar=false", "logging.use_tensorboard=false",
        "logging.plot_summary=false", "checkpointing.save_every_n_steps=null", "checkpointing.export_hf=false",
    ]  # fmt: skip


def run(command: list[str], log: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``command`` as printed (``distrain ...``), run with this interpreter; its output kept in ``log``."""
    argv = [sys.executable, "-m", "distrain.cli", *command[1:]] if command[0] == "distrain" else command
    print(f"$ {shlex.join(command)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        done = subprocess.CompletedProcess(argv, 124, e.stdout or "", f"timed out after {timeout} s")
    log.write_text(f"$ {shlex.join(command)}\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    return done


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (done.stderr or done.stdout or "").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else f"exit {done.returncode}"


# ---- 1. throughput ------------------------------------------------------------------------------------------
def run_bench(args, here: dict, out: Path, keep=lambda bench: None) -> list[dict]:
    """``keep(rows)`` after every row: a run cut short (a lent GPU's time runs out) keeps what it measured."""
    rows = []
    for meta, command in bench_commands(args, here, out):
        done = run(command, out / "logs" / f"bench-{meta['slug']}.log")
        result = Path(command[command.index("--json") + 1])
        if done.returncode == 0 and result.is_file():
            (row,) = json.loads(result.read_text())
            rows.append({**meta, **row})
        else:
            rows.append({**meta, "error": last_line(done)})
        print(f"  → {format_bench_row(rows[-1])}", flush=True)
        keep(rows)
    return rows


def format_bench_row(row: dict) -> str:
    if "error" in row:
        return f"{row['size']} {row['strategy']} {row['setting']}: failed: {row['error']}"
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") else "-"
    return f"{row['size']} {row['strategy']} {row['setting']}: {row['tokens_per_sec']:,.0f} tokens/s, MFU {mfu}"


# ---- 2. the largest model with offload ------------------------------------------------------------------------------
def plan_row(model: str, strategy: str, seq_len: int, gpu_memory: str | None, cpu_memory: str | None) -> dict:
    """The planner's row for one rank of ``strategy`` with every block checkpointed, asked directly:
    ``distrain plan`` plans only the single-process option at ``--devices 1``."""
    from dataclasses import replace

    from distrain.config import build_config
    from distrain.planner.from_config import budget_from_config, job_from_config
    from distrain.planner.plan import Planner, option_for_run

    overrides = {
        "training.model_name": model,
        "training.pretrained": False,
        "training.precision": "bf16-mixed",
        "training.batch_size_per_gpu": 1,
        "training.activation_checkpointing": True,
        "data.seq_len": seq_len,
        "distributed.strategy": strategy,
        "distributed.devices": 1,
        "distributed.gpu_memory": gpu_memory,
        "distributed.cpu_memory": cpu_memory,
    }
    config = build_config(overrides={k: v for k, v in overrides.items() if v is not None})
    job = job_from_config(config, gpu=True)
    budget = budget_from_config(config, True, 1)
    option = replace(option_for_run(strategy, job), checkpoint=None)  # None: every block recomputed
    row = Planner(job, budget).row(option, max_batch=False)
    return {**row.to_json(), "usable_bytes": budget.usable, "host_budget_bytes": budget.host}


def planned(args, model: Path, strategy: str, out: Path) -> dict:
    """``distrain plan``'s row for this strategy (activation checkpointing on); where the CLI does not plan it
    at one rank, the same planner asked directly (``--plan-row``)."""
    command = plan_command(args, model, strategy)
    done = run(command, out / "logs" / f"plan-{strategy}-{model.name}.log")
    if done.returncode == 0:
        try:
            rows = [r for r in json.loads(done.stdout)["rows"] if r["strategy"] == strategy]
        except (json.JSONDecodeError, KeyError) as e:
            return {"error": f"unreadable plan: {e}"}
        if rows:
            return {**rows[-1], "planned_by": "distrain plan"}
    if "is not planned" not in done.stderr and done.returncode != 0:
        return {"error": last_line(done)}
    print("  (distrain plan does not plan offload at --devices 1: asking the planner directly)", flush=True)
    fallback = [sys.executable, str(Path(__file__).resolve()), "--plan-row", str(model), strategy,
                "--seq-len", str(args.seq_len)]  # fmt: skip
    for flag, value in (("--gpu-memory", args.gpu_memory), ("--cpu-memory", args.cpu_memory)):
        if value:
            fallback += [flag, value]
    done = run(fallback, out / "logs" / f"plan-row-{strategy}-{model.name}.log")
    if done.returncode != 0:
        return {"error": last_line(done)}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "planned_by": "distrain.planner (one rank)"}


def write_models(out: Path, depths) -> Path:
    """The ladder's model directories (config and tokenizer, no weights: pretrained=false) and a corpus."""
    from transformers import LlamaConfig

    from distrain.hf import tiny

    tokenizer = tiny.make_tokenizer({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    for model in ladder(out, depths):
        if not (model["dir"] / "config.json").is_file():
            config = LlamaConfig(
                **LLAMA_WIDTH, num_hidden_layers=model["layers"], vocab_size=32000, max_position_embeddings=4096,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
            )  # fmt: skip
            config.save_pretrained(model["dir"])
            tokenizer.save_pretrained(model["dir"])
    corpus = out / "models" / "counting.txt"
    corpus.write_text("\n".join(tiny.counting_texts(40_000)) + "\n")
    return corpus


def measured(run_dir: Path, done: subprocess.CompletedProcess) -> dict:
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [r for r in records if "loss" in r]
    if done.returncode != 0 or not steps:
        return {"trained": False, "error": last_line(done)}
    peak = max(r.get("mem_max_allocated_mb", 0) for r in steps)
    host = max(r.get("host_rss_mb", 0) for r in steps)
    return {"trained": True, "gpu_peak_mb": peak, "host_rss_mb": host, "step_time": steps[-1].get("step_time")}


def run_offload(args, out: Path, keep=lambda offload: None) -> list[dict]:
    corpus = write_models(out, args.layers)
    sizes = ladder(out, args.layers)
    rows = []
    for strategy in OFFLOAD:
        plans = {m["name"]: planned(args, m["dir"], strategy, out) for m in sizes}
        fitting = [i for i, m in enumerate(sizes) if plans[m["name"]].get("fits")]
        tried = search(args, strategy, sizes, fitting[-1] if fitting else 0, corpus, out)
        for i, model in enumerate(sizes):
            rows.append({"strategy": strategy, "model": model["name"], "params": llama_params(model["layers"]),
                         "plan": plans[model["name"]], "measured": tried.get(i)})  # fmt: skip
        keep(rows)
    return rows


def search(args, strategy: str, sizes: list[dict], start: int, corpus: Path, out: Path) -> dict[int, dict]:
    """Train from the largest size the plan says fits: up until one fails, or down until one trains."""
    tried: dict[int, dict] = {}

    def attempt(i: int) -> bool:
        model = sizes[i]
        run_dir = out / "offload" / strategy / model["name"]
        command = train_command(args, model["dir"], strategy, corpus, run_dir)
        tried[i] = measured(run_dir, run(command, out / "logs" / f"train-{strategy}-{model['name']}.log"))
        print(f"  → {model['name']} with {strategy}: {'trained' if tried[i]['trained'] else 'failed'}", flush=True)
        return tried[i]["trained"]

    if attempt(start):
        i = start + 1
        while i < len(sizes) and attempt(i):
            i += 1
    else:
        i = start - 1
        while i >= 0 and not attempt(i):
            i -= 1
    return tried


# ---- the table ------------------------------------------------------------------------------------------
def render(here: dict, bench: list[dict], offload: list[dict], args) -> str:
    lines = [f"GPU: {here['name']} × {here['gpus']}; sequence {args.seq_len}; {args.steps} timed steps after "
             f"{args.warmup}; {time.strftime('%Y-%m-%d')}", ""]  # fmt: skip
    if bench:
        lines += [
            "| model | strategy | setting | GPUs | tokens/s | tokens/s per GPU | step ms | MFU "
            "| torchtitan (Llama 3 8B, 8 × H100, FSDP) | MFU ÷ torchtitan's |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in bench:
            theirs = torchtitan_mfu(r["setting"])
            ref = f"{TORCHTITAN[r['setting']]:,} tok/s/GPU = {100 * theirs:.1f}% MFU"
            if "error" in r:
                lines.append(f"| {r['size']} | {r['strategy']} | {r['setting']} | {here['gpus']} | failed: "
                             f"{r['error']} | | | | {ref} | |")  # fmt: skip
                continue
            mfu = r.get("mfu")
            lines.append(
                f"| {r['size']} | {r['strategy']} | {r['setting']} | {r['ranks']} | {r['tokens_per_sec']:,.0f} | "
                f"{r['tokens_per_sec'] / r['ranks']:,.0f} | {1000 * r['step_time']:.1f} | "
                f"{f'{100 * mfu:.1f}%' if mfu else '-'} | {ref} | {f'{mfu / theirs:.2f}' if mfu else '-'} |"
            )
        size, setting, target = TARGET
        hits = [r for r in bench if r["size"] == size and r["setting"] == setting and r.get("mfu")]
        if hits:
            best = max(r["mfu"] for r in hits)
            verdict = "met" if best >= target else "not met"
            lines += ["", f"Target ≥{100 * target:.0f}% MFU ({size}, {setting}): {100 * best:.1f}% — {verdict}."]
        lines.append("")
    if offload:
        lines += [
            "| strategy | model | parameters | planned GPU peak | planned host | plan: fits | measured GPU peak | "
            "measured host RSS | trained |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in offload:
            plan, got = r["plan"], r["measured"]
            fits = "error: " + plan["error"] if "error" in plan else ("yes" if plan.get("fits") else "no")
            if got is None:
                tail = "| not run | | |"
            elif got["trained"]:
                tail = f"| {got['gpu_peak_mb'] / 1024:.1f} GiB | {got['host_rss_mb'] / 1024:.1f} GiB | yes |"
            else:
                tail = f"| | | no: {got['error']} |"
            lines.append(
                f"| {r['strategy']} | {r['model']} | {r['params'] / 1e9:.1f}B | {_gib(plan.get('peak_bytes'))} | "
                f"{_gib(plan.get('host_bytes'))} | {fits} {tail}"
            )
        for strategy in OFFLOAD:
            trained = [r for r in offload if r["strategy"] == strategy and (r["measured"] or {}).get("trained")]
            largest = max(trained, key=lambda r: r["params"]) if trained else None
            name = f"{largest['model']} ({largest['params'] / 1e9:.1f}B)" if largest else "none"
            lines.append(f"\nLargest trained with {strategy}: {name}")
    return "\n".join(lines) + "\n"


def _gib(n) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, (int, float)) else "-"


def dry_run(args, here: dict, out: Path) -> None:
    gpus = f"{here['gpus']} GPU{'s' if here['gpus'] > 1 else ''}"
    print(f"# gpu_bench dry run on {here['name']}: the commands for {gpus}; results would go to {out}/results.md")
    if not args.skip_bench:
        print("# 1. throughput (the GPU table of docs/benchmarks.md): one distrain bench process per row")
        if not here["fp8"]:
            fp8 = "here" if here["fp8"] is False else "where the GPU has compute capability 8.9+ and torchao"
            print(f"#    (fp8 rows: {'none ' + fp8 if here['fp8'] is False else 'only ' + fp8})")
        for _, command in bench_commands(args, here, out):
            print(shlex.join(command))
    if not args.skip_offload:
        print("# 2. the largest model one GPU and its host train with offload: first the plan of every size ...")
        print(f"#    (models written to {out}/models: Llama-2-7B width, {min(args.layers)}-{max(args.layers)} layers)")
        sizes = ladder(out, args.layers)
        for strategy in OFFLOAD:
            for model in sizes:
                print(shlex.join(plan_command(args, model["dir"], strategy)))
        print("#    where `distrain plan` does not plan offload at --devices 1, the planner is asked directly:")
        print(f"#    python {Path(__file__).relative_to(ROOT)} --plan-row MODEL STRATEGY --seq-len {args.seq_len}")
        print("# ... then training from the largest size the plan says fits: up until one fails, down until one trains")
        corpus = out / "models" / "counting.txt"
        for strategy in OFFLOAD:
            for model in sizes:
                run_dir = out / "offload" / strategy / model["name"]
                print(shlex.join(train_command(args, model["dir"], strategy, corpus, run_dir)))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plan_row:
        row = plan_row(*args.plan_row, args.seq_len, args.gpu_memory, args.cpu_memory)
        print(json.dumps(row))
        return 0
    out = Path(args.out)
    here = machine(args)
    if args.dry_run:
        dry_run(args, here, out)
        return 0
    out.mkdir(parents=True, exist_ok=True)

    def keep(bench: list[dict], offload: list[dict]) -> str:
        (out / "rows.json").write_text(
            json.dumps({"machine": here, "bench": bench, "offload": offload}, indent=1, default=str)
        )
        table = render(here, bench, offload, args)
        (out / "results.md").write_text(table)
        return table

    bench = [] if args.skip_bench else run_bench(args, here, out, lambda rows: keep(rows, []))
    offload = [] if args.skip_offload else run_offload(args, out, lambda rows: keep(bench, rows))
    print(keep(bench, offload))
    return 0 if all("error" not in r for r in bench) else 1


if __name__ == "__main__":
    sys.exit(main())
