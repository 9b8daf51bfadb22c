"""Every strategy docs/strategies.md names × every kind of model users bring × both routes (the Python API and
`distrain train`): each cell trains on 2 CPU ranks and matches the one-process run of the same global
batch, or is refused before any rank starts with one line.

Tolerances (relative, on losses and gradient norms, fp32): the first step 1e-5 everywhere (the same
weights and data: the initialization contract). Later steps 1e-5, except: 1e-4 with DeepSpeed's CPU
Adam (optimizer offload: another Adam implementation, same math), and 1e-3 under ZeRO-3, whose
bucketed reduce-scatter sums gradients in another order than DDP's all-reduce; Adam's first updates
divide by a tiny second moment and so magnify that fp32 rounding (measured: 1e-5 to 1.3e-4 by step 3).
Each cell of the printed table shows the largest relative difference it saw. The CLI route runs each
strategy once in CI (the model kinds rotate): `python -m distrain.cli train` in a new process for one cell per
way the CLI starts ranks (SUBPROCESS_CELLS), ``distrain.cli.main`` in forked ranks for the others;
`DISTRAIN_FULL_MATRIX=1 python -m pytest tests/test_matrix.py` runs every cell, each in a new process. The
table is printed at the end of the test session.
"""

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import matrix_models
import pytest
from conftest import report
from torch.utils.data import DataLoader

import distrain
from helpers import LossRecorder, env_without_rank, run_cli, run_ranks

KINDS = ("mlp", "gpt", "hf-causal", "hf-classifier")
SHARED = (
    "ddp",
    "fsdp",
    "fsdp_cpu_offload",
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
    "deepspeed_stage_3_offload_nvme",
)
#: model parallelism on 2 ranks is one model replica: it accumulates 2 micro-batches as the one process does
#: (the pipeline's micro-batches are the accumulation micro-batches); TP splits each sequence over 2 ranks
MODEL_PARALLEL = {
    "model_parallel": ["distributed.tensor_parallel_size=2"],
    "pipeline": ["distributed.pipeline_stages=2"],
}
#: expert parallelism (each mixture-of-experts layer's 4 experts over the 2 ranks), a row each: its GPT and Hugging
#: Face cells train the mixture-of-experts variant of their kind (the GPT with 4 experts per block; a tiny Mixtral,
#: Llama's layers with MoE MLPs), against one process training that variant; a model with no mixture of experts is
#: refused in one line
EXPERT_PARALLEL = {"ddp+ep": "ddp", "fsdp+ep": "fsdp"}
MIXTURE_KINDS = ("gpt", "hf-causal")
NO_EXPERTS = {(s, k) for s in EXPERT_PARALLEL for k in KINDS if k not in MIXTURE_KINDS}
#: models neither built-in plan knows (a user's own MLP, BERT): refused in one line, naming what to add
NO_PLAN = {(s, k) for s in MODEL_PARALLEL for k in ("mlp", "hf-classifier")}
NO_PLAN_MESSAGES = ("no built-in tensor-parallel plan", "the pipeline strategy has a built-in plan for")
LAUNCHING = ("ddp_fork", "ddp_notebook", "ddp_spawn")  # they start their own workers (CLI route in CI:
# spawn gets the MLP from a file, whose class its fresh workers must import by name)
LOOSER = {
    "deepspeed_stage_2_offload": 1e-4,
    "deepspeed_stage_3": 1e-3,
    "deepspeed_stage_3_offload": 1e-3,
    "deepspeed_stage_3_offload_nvme": 1e-3,
}  # after the first step; see the module docstring
STEPS, BATCH = 3, 4  # per-rank batch 4 on 2 ranks = one process accumulating 2 batches of 4


def _has_libaio() -> bool:
    """DeepSpeed's async I/O op (NVMe offload) builds only where libaio is installed (CI installs it). Asked once, by
    the test process: its ranks (which import this module too) and their children read the answer from the
    environment they inherit, instead of importing DeepSpeed for it (seconds per rank on 2 cores)."""
    known = os.environ.get("DISTRAIN_TEST_LIBAIO")
    if known is None:
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder
        except ImportError:
            known = "0"
        else:
            known = "1" if AsyncIOBuilder().is_compatible(verbose=False) else "0"
        os.environ["DISTRAIN_TEST_LIBAIO"] = known
    return known == "1"


#: cells this machine cannot run, and why (shown in the table, not counted as failures)
UNAVAILABLE = (
    {}
    if _has_libaio()
    else {"deepspeed_stage_3_offload_nvme": "skipped: no libaio here (apt-get install libaio-dev; CI has it)"}
)
FULL = os.environ.get("DISTRAIN_FULL_MATRIX") == "1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    from distrain.hf import tiny as hf_tiny

    root = tmp_path_factory.mktemp("tiny")
    texts = root / "counting.txt"
    texts.write_text("\n".join(hf_tiny.counting_texts(120)) + "\n")
    return {
        "hf-causal": hf_tiny.make_tiny_llama(root / "llama"),
        "hf-causal-moe": hf_tiny.make_tiny_llama(root / "mixtral", experts=4),
        "hf-classifier": hf_tiny.make_tiny_bert(root / "bert", dropout=0.0),
        "counting": str(texts),
        "reviews": hf_tiny.write_jsonl(root / "reviews.jsonl", hf_tiny.reviews(120)),
    }


def _job(kind: str, tiny: dict, multiple_of: int = 1, mixture: bool = False):
    """``mixture``: the mixture-of-experts variant of the kind (the GPT and the causal LM have one)."""
    distrain.seed_everything(0)  # as a user's script does before building its model
    if kind == "mlp":
        module = matrix_models.MLP(batch_size=BATCH)
        return module, module.train_dataloader()
    if kind == "gpt":
        module = matrix_models.gpt(n_experts=4 if mixture else 0)
        return module, DataLoader(matrix_models.ByteSequences(), batch_size=BATCH, shuffle=True)
    task = "causal_lm" if kind == "hf-causal" else "sequence_classification"
    path = tiny["hf-causal-moe"] if mixture and kind == "hf-causal" else tiny[kind]
    module = matrix_models.hf_causal(path) if kind == "hf-causal" else matrix_models.hf_classifier(path)
    samples = matrix_models.hf_samples(path, task)
    collate = matrix_models.hf_collate(path, multiple_of)
    return module, DataLoader(samples, batch_size=BATCH, shuffle=True, collate_fn=collate)


def _fit(strategy: str, devices: int, kind: str, tiny: dict, tmp: Path, mixture: bool = False, **options):
    recorder = LossRecorder()
    if strategy in EXPERT_PARALLEL:
        strategy, mixture = EXPERT_PARALLEL[strategy], True
        options["expert_parallel_size"] = devices
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_steps=STEPS,
        accumulate_grad_batches=2 if devices == 1 or strategy in MODEL_PARALLEL else 1,
        gradient_clip_val=1.0,
        seed=7,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=str(tmp),
        callbacks=[recorder],
        **options,
    )
    module, loader = _job(kind, tiny, multiple_of=2 if strategy == "model_parallel" else 1, mixture=mixture)
    try:
        trainer.fit(module, loader)
    except ValueError as e:
        if (strategy, kind) in NO_PLAN and any(m in str(e) for m in NO_PLAN_MESSAGES) and "\n" not in str(e):
            return "refused"
        if mixture and kind not in MIXTURE_KINDS and "has no mixture-of-experts layer" in str(e) and "\n" not in str(e):
            return "refused"
        raise
    if strategy in LAUNCHING:  # the workers' recorder stays in the workers: the parent gets the final step
        return [trainer.callback_metrics["loss"]], [trainer.callback_metrics["grad_norm"]]
    return recorder.losses, recorder.grad_norms


def _options(strategy: str, tmp: Path) -> dict:
    if strategy == "deepspeed_stage_3_offload_nvme":
        (tmp / "nvme").mkdir(parents=True, exist_ok=True)
        return {"nvme_path": str(tmp / "nvme")}
    return {}


#: strategies that share one pair of rank processes (fewer process starts; DeepSpeed's offload engines
#: hold pinned and swap buffers, so they get processes of their own)
SESSIONS = (
    ("ddp", "fsdp", "fsdp_cpu_offload"),
    ("deepspeed", "deepspeed_stage_1", "deepspeed_stage_2"),
    ("deepspeed_stage_2_offload", "deepspeed_stage_3"),
    ("deepspeed_stage_3_offload",),
    ("deepspeed_stage_3_offload_nvme",),
    tuple(MODEL_PARALLEL),
)


def _shared_session(rank, tiny, tmp, strategies):
    import gc

    out = {}
    for strategy, kind in itertools.product(strategies, KINDS):
        out[strategy, kind] = _fit(strategy, 2, kind, tiny, tmp / f"{strategy}-{kind}", **_options(strategy, tmp))
        gc.collect()  # the trainer, its engine and the module refer to each other
        gc.freeze()  # what is left (the modules the cell imported) is not walked again by the next cells' collections
    return out


def _compare(reference, result, strategy) -> tuple[str, float]:
    """(what differs beyond the tolerance, or "") and the largest relative difference seen. The first
    step's loss and gradient norm must agree within 1e-5 under every strategy (the same weights, the
    same data: the initialization contract); later steps within the strategy's tolerance."""
    ref_losses, ref_norms = reference
    losses, norms = result
    offset = len(ref_losses) - len(losses)  # spawn/fork report the last step only
    if offset < 0 or len(norms) != len(losses):
        return f"{len(losses)} steps", math.inf
    worst = 0.0
    for name, ref_values, values in (("loss", ref_losses, losses), ("grad norm", ref_norms, norms)):
        for i, b in enumerate(values):
            step = offset + i + 1
            a = ref_values[offset + i]
            difference = abs(a - b) / max(abs(a), 1e-12)
            worst = max(worst, difference)
            tolerance = 1e-5 if step == 1 else (LOOSER.get(strategy, 1e-5))
            if difference > tolerance:
                return f"{name} {b:.6g} ≠ {a:.6g} at step {step}", worst
    return "", worst


def _cell(strategy: str, kind: str, reference, result) -> tuple[str, str]:
    """The table's cell and what failed ("" when nothing did). A run is (losses, gradient norms); a string
    says why it did not run ("refused": one line naming the missing plan)."""
    if (strategy, kind) in NO_PLAN:
        problem = "" if result == "refused" else f"expected a one-line refusal (no plan), got {str(result)[:120]}"
        return ("refused: no plan" if not problem else f"✗ {problem}"), problem
    if (strategy, kind) in NO_EXPERTS:
        problem = "" if result == "refused" else f"expected a one-line refusal (no experts), got {str(result)[:120]}"
        return ("refused: no experts" if not problem else f"✗ {problem}"), problem
    worst = 0.0
    if isinstance(result, str) or isinstance(reference, str):
        problem = result if isinstance(result, str) else reference
    else:
        problem, worst = _compare(reference, result, strategy)
    return (f"✗ {problem}" if problem else f"✓ {worst:.0e}"), problem


def _table(title: str, cells: dict) -> list[str]:
    strategies = sorted({s for s, _ in cells}, key=lambda s: (s != "single", s))
    lines = [title, "| strategy | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    for s in strategies:
        lines.append(f"| {s} | " + " | ".join(cells.get((s, k), "–") for k in KINDS) + " |")
    return lines


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold ~/.cache/torch_extensions builds DeepSpeed's ops inside it
def test_api_matrix(tiny, tmp_path):
    references = {kind: _fit("single", 1, kind, tiny, tmp_path / f"single-{kind}") for kind in KINDS}
    assert sorted(s for session in SESSIONS for s in session) == sorted((*SHARED, *MODEL_PARALLEL))
    results = {}
    for session in SESSIONS:
        runnable = tuple(s for s in session if s not in UNAVAILABLE)
        if runnable:
            results.update(run_ranks(_shared_session, 2, tiny, tmp_path, runnable)[0])
    # expert parallelism: against one process training the same mixture of experts
    mixtures = {kind: _fit("single", 1, kind, tiny, tmp_path / f"single-moe-{kind}", True) for kind in MIXTURE_KINDS}
    results.update(run_ranks(_shared_session, 2, tiny, tmp_path, tuple(EXPERT_PARALLEL))[0])
    for strategy, kind in itertools.product(LAUNCHING, KINDS):
        if FULL or (strategy, kind) in (
            ("ddp_spawn", "mlp"),
            ("ddp_spawn", "hf-causal"),
            ("ddp_fork", "gpt"),
            ("ddp_fork", "hf-classifier"),
        ):
            results[strategy, kind] = _fit(strategy, 2, kind, tiny, tmp_path / f"{strategy}-{kind}")
    cells, failures = {("single", k): "reference" for k in KINDS}, []
    cells.update({(s, k): why for s, why in UNAVAILABLE.items() for k in KINDS})
    for (strategy, kind), result in results.items():
        reference = mixtures.get(kind) if strategy in EXPERT_PARALLEL else references[kind]
        cells[strategy, kind], problem = _cell(strategy, kind, reference, result)
        if problem:
            failures.append(f"{strategy} × {kind}: {problem}")
    report(_table("Python API: 2 CPU ranks vs one process (losses and gradient norms, 3 steps)", cells))
    assert not failures, failures


# ---- the CLI route: `distrain train` with a config's keys as overrides ------------------------------------------
ROUTE_ALL = ("single", *SHARED, *LAUNCHING, *MODEL_PARALLEL)
#: the cells run as a user runs them, `python -m distrain.cli train` in a new process: one for each way the CLI
#: starts its ranks (popen: it re-runs its own command line per rank; spawn: fresh workers import the user's
#: module file by name; fork). Every other cell calls the same ``distrain.cli.main`` in ranks an outside
#: launcher started (tests/helpers.run_ranks: the torchrun route), and ddp_notebook starts its workers from such
#: a call: the CLI's config keys, planning and Trainer are the same, without a fresh interpreter's seconds of
#: imports per rank.
SUBPROCESS_CELLS = (("ddp", "mlp"), ("ddp_spawn", "mlp"), ("ddp_fork", "hf-causal"))
RANK_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cli_cells() -> list[tuple[str, str]]:
    """Every cell with DISTRAIN_FULL_MATRIX=1; else every strategy once, the model kinds taking turns."""
    strategies = [s for s in ROUTE_ALL if s != "single"]
    if FULL:
        return list(itertools.product(strategies, KINDS)) + list(itertools.product(EXPERT_PARALLEL, MIXTURE_KINDS))
    cells = [(s, KINDS[i % len(KINDS)]) for i, s in enumerate(strategies)]
    # model parallelism: both built-in plans under TP (Llama: batches padded to a multiple of the TP size for
    # sequence parallelism) and a model without a plan; expert parallelism: the built-in GPT made a mixture of
    # experts by its config keys, and a tiny Mixtral
    extra = [("model_parallel", "hf-causal"), ("model_parallel", "mlp"), ("fsdp+ep", "gpt"), ("ddp+ep", "hf-causal")]
    return cells + [c for c in extra if c not in cells]


#: the one-process reference of an expert-parallel cell: the same mixture of experts
MIXTURE_REFERENCE = "single+moe"


def _reference(strategy: str) -> str:
    return MIXTURE_REFERENCE if strategy in EXPERT_PARALLEL else "single"


def _cli_args(kind: str, tiny: dict, mixture: bool = False) -> list[str]:
    if kind == "mlp":
        return [
            f"training.module={Path(__file__).parent / 'matrix_models.py'}:MLP",
            "training.module_args={batch_size: 4}",
        ]
    if kind == "gpt":
        return ["--model-name", "gpt-tiny", "data.seq_len=16", "data.max_bytes=20000"] + (
            ["training.n_experts=4", "training.top_k=2"] if mixture else []
        )
    data = tiny["counting"] if kind == "hf-causal" else tiny["reviews"]
    model = tiny["hf-causal-moe"] if mixture and kind == "hf-causal" else tiny[kind]
    return ["--model-name", model, f"data.dataset={data}", "data.max_length=16"]


def _cli_argv(strategy: str, kind: str, tiny: dict, out: Path) -> list[str]:
    """The arguments of `distrain train` for a cell (the same on both routes)."""
    mixture = strategy in EXPERT_PARALLEL or strategy == MIXTURE_REFERENCE
    experts = ["distributed.expert_parallel_size=2"] if strategy in EXPERT_PARALLEL else []
    strategy = EXPERT_PARALLEL.get(strategy, "single" if strategy == MIXTURE_REFERENCE else strategy)
    devices = 1 if strategy == "single" else 2
    argv = [
        "train",
        "--strategy",
        strategy,
        "--devices",
        str(devices),
        "--max-steps",
        str(STEPS),
        "--output-dir",
        str(out),
        "--seed",
        "7",
        "training.batch_size_per_gpu=4",
        f"training.gradient_accumulation_steps={2 if devices == 1 or strategy in MODEL_PARALLEL else 1}",
        "training.max_grad_norm=1.0",
        "training.lr_schedule=constant",
        "training.warmup_ratio=0",
        "training.limit_val_batches=1",
        "logging.log_every_n_steps=1",
        "logging.progress_bar=false",
        "logging.use_tensorboard=false",
        "checkpointing.save_every_n_steps=null",
        "checkpointing.export_hf=false",
        *_cli_args(kind, tiny, mixture),
        *experts,
    ]
    if strategy == "deepspeed_stage_3_offload_nvme":
        (out / "nvme").mkdir(parents=True, exist_ok=True)
        argv.append(f"deepspeed.nvme_path={out / 'nvme'}")
    return argv + MODEL_PARALLEL.get(strategy, [])


def _cli_result(code: int, stderr: str, out: Path) -> tuple[list, list] | str:
    """A run's (losses, gradient norms) from its metrics.jsonl; "refused" for a one-line no-plan refusal; else
    what went wrong."""
    import json

    if code != 0:
        errors = [line for line in stderr.splitlines() if line.startswith("distrain") or "Error" in line]
        if any(m in line for line in errors for m in NO_PLAN_MESSAGES):
            return "refused"
        return f"exit {code}: {stderr.strip().splitlines()[-1:]}"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss" in s and "grad_norm" in s]
    return [s["loss"] for s in steps], [s["grad_norm"] for s in steps]


def _train_cli(strategy: str, kind: str, tiny: dict, out: Path) -> tuple[list, list] | str:
    """`python -m distrain.cli train ...` in a new process, as a user runs it."""
    command = [sys.executable, "-m", "distrain.cli", *_cli_argv(strategy, kind, tiny, out)]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=400, env=env_without_rank(), cwd=Path(__file__).parent.parent
    )
    return _cli_result(proc.returncode, proc.stderr, out)


def _main_here(strategy: str, kind: str, tiny: dict, out: Path) -> tuple[list, list] | str | None:
    """``distrain.cli.main`` (what the console script runs) in this process; rank 0's result, None on the others."""
    proc = run_cli(_cli_argv(strategy, kind, tiny, out))
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return _cli_result(proc.returncode, proc.stderr, out)


def _cli_ranks(rank, tiny, tmp, cells):
    """Cells in 2 ranks started as torchrun starts them (the CLI starts no ranks of its own there)."""
    import gc

    out = {}
    for strategy, kind in cells:
        out[strategy, kind] = _main_here(strategy, kind, tiny, tmp / f"{strategy}-{kind}")
        gc.collect()
        gc.freeze()
    return out


def _cli_local(rank, tiny, tmp, cells):
    """Cells in one process on a machine with no launcher: the single-process references, and strategies whose
    workers the CLI forks itself."""
    for key in RANK_KEYS:
        os.environ.pop(key, None)
    return {(s, k): _main_here(s, k, tiny, tmp / f"{s}-{k}") for s, k in cells}


def _cli_runs(cells: list[tuple[str, str]], tiny: dict, tmp: Path) -> dict:
    """Each cell's result: in a new process where the route says so, else in forked processes (the references
    and the launching strategies in one; the others in the rank pairs of SESSIONS)."""
    results = {}
    here = [c for c in cells if FULL or c in SUBPROCESS_CELLS]
    local = [c for c in cells if c not in here and (c[0] in ("single", MIXTURE_REFERENCE) or c[0] in LAUNCHING)]
    results.update(run_ranks(_cli_local, 1, tiny, tmp, local)[0])
    for session in (*SESSIONS, tuple(EXPERT_PARALLEL)):
        ranked = [c for c in cells if c not in here and c[0] in session]
        if ranked:
            results.update(run_ranks(_cli_ranks, 2, tiny, tmp, ranked)[0])
    for strategy, kind in here:
        results[strategy, kind] = _train_cli(strategy, kind, tiny, tmp / f"{strategy}-{kind}")
    return results


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold ~/.cache/torch_extensions builds DeepSpeed's ops inside it
def test_cli_matrix(tiny, tmp_path):
    cells = [c for c in _cli_cells() if c[0] not in UNAVAILABLE]
    references = sorted({(_reference(s), k) for s, k in cells}, key=lambda c: (c[0], KINDS.index(c[1])))
    assert set(SUBPROCESS_CELLS) <= set(cells)  # each launcher path keeps a cell of its own
    results = _cli_runs(references + cells, tiny, tmp_path)
    table, failures = dict.fromkeys(references, "reference"), []
    table.update({(s, k): UNAVAILABLE[s] for s, k in _cli_cells() if s in UNAVAILABLE})
    for strategy, kind in cells:
        reference = results[_reference(strategy), kind]
        table[strategy, kind], problem = _cell(strategy, kind, reference, results[strategy, kind])
        if problem:
            failures.append(f"{strategy} × {kind}: {problem}")
    report(_table("`distrain train` (config keys as overrides): 2 CPU ranks vs one process", table))
    assert not failures, failures


# ---- refused before any rank starts, in one line ---------------------------------------------------------------
@pytest.mark.parametrize(
    "options,expected",
    [
        ({"strategy": "deepspeed_stage_3_offload_nvme"}, "nvme_path '/local_nvme'"),
        ({"strategy": "ddp", "process_group_backend": "nccl"}, "needs CUDA GPUs"),
        ({"strategy": "horovod"}, "Horovod"),
    ],
)
def test_refused_in_one_line(options, expected):
    with pytest.raises(ValueError) as info:
        distrain.Trainer(accelerator="cpu", devices=2, logger=False, **options)
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "strategy,backend,ranks,refused",
    [
        ("fsdp", "gloo", 2, True),
        ("model_parallel", "gloo", 2, True),
        ("deepspeed_stage_3", "gloo", 2, True),
        ("ddp", "gloo", 2, False),  # DDP's all-reduce over gloo works on CUDA tensors
        ("fsdp", "cpu:gloo,cuda:nccl", 2, False),  # NCCL carries the CUDA tensors
        ("fsdp", "gloo", 1, False),  # one rank: FSDP2 skips its collectives
    ],
)
def test_sharded_strategies_on_cuda_refuse_gloo_in_one_line(strategy, backend, ranks, refused):
    """Seen on an H200 (torch 2.11): FSDP2 and tensor parallelism over gloo with CUDA tensors end every rank in
    SIGSEGV. The refusal is decided by the strategy's traits and the backend, before any rank starts, so it is
    checked here without a GPU (the accelerator is only named)."""
    from distrain.accelerators import CUDAAccelerator
    from distrain.cluster import ClusterEnv
    from distrain.precision import Precision
    from distrain.strategies.registry import make_strategy

    strategy_object = make_strategy(strategy, ranks, process_group_backend=backend)
    connect = lambda: strategy_object.connect(  # noqa: E731
        CUDAAccelerator(), Precision("32-true", "cuda"), ClusterEnv("local", world_size=ranks), ranks, 1
    )
    if not refused:
        connect()
        return
    with pytest.raises(ValueError) as info:
        connect()
    message = str(info.value)
    assert "needs NCCL" in message and repr(backend) in message and "\n" not in message, message


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel", "deepspeed_stage_3"])
def test_sharded_strategies_on_cpu_keep_gloo(strategy):
    """The refusal above is CUDA's alone: on a CPU gloo is the backend every sharded strategy runs on."""
    from distrain.accelerators import Accelerator
    from distrain.cluster import ClusterEnv
    from distrain.precision import Precision
    from distrain.strategies.registry import make_strategy

    make_strategy(strategy, 2, process_group_backend="gloo").connect(
        Accelerator(), Precision("32-true", "cpu"), ClusterEnv("local", world_size=2), 2, 1
    )
