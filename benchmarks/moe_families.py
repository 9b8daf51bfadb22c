"""Expert parallelism over every mixture-of-experts family of the installed transformers: which ones distrain splits,
and whether the split trains as one process.

    python benchmarks/moe_families.py [--families mixtral olmoe ...] [--write docs/strategies.md]

The families are read from transformers itself, not listed by hand: every configuration class whose constructor
takes an expert count (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ...) and whose model type has a
causal language model. Each is built tiny from its own configuration class, with the shape keywords below where
the class takes them (everything else its defaults), 4 experts, top-2. Then, on 2 CPU ranks over gloo:

- ``check``: ``expert_parallel.check_module`` (what the Trainer asks before any rank starts): the mixture blocks it
  finds, or its one-line refusal;
- one step of a batch of 4 sequences: one process takes the two halves (its gradients summed, then halved); each
  rank takes its half with each layer's stacked experts split over the 2 ranks (``split_model``: rank r keeps
  experts 2r and 2r+1), the other gradients averaged over the ranks. ``max rel diff``: the largest difference of any
  gradient (a rank's experts' rows against the same rows of one process's) relative to that gradient's largest
  value (at least a millionth of the model's largest gradient), over both ranks; ``loss diff`` likewise for each
  rank's loss against its half's.

A family passes when the split holds every layer's experts and both differences are within fp32 rounding (1e-4).
This is one step of gradients through the model's own forward, the check ``tests/test_expert_parallel.py`` makes
for the families it names. ``--trainer`` adds, for each family that passes it, the Trainer's own runs: 8 AdamW steps
of a global batch of 4 sequences with ``expert_parallel_size=2`` under DDP and FSDP on 2 ranks, and EP 2 × FSDP 2 on
4, each step's loss (the mean over the ranks) against one process's on the same global batch (``fit``; one
set of ranks for each world size, started once, runs every family in turn). A run passes within 1e-5 of one process
at every step. A router's jitter (Phi-3.5-MoE's) is off in these runs: it draws otherwise on each rank. DDP runs with
``find_unused_parameters=True``: a family whose attention computes an index without gradient (DeepSeek-V3.2's sparse
attention) leaves parameters without one, which plain DDP refuses (in one line naming them) with or without experts.
``--write`` replaces the table between the markers in the file given.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
#: the tiny shape, by the keyword names the configuration classes use; a class gets those its constructor takes
SHAPE = {
    "vocab_size": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 12,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "top_k_experts": 2,
    "moe_k": 2,  # ERNIE 4.5's
    "enable_moe_block": True,  # families whose mixture is off by default (Gemma 4, Doge)
    "is_moe": True,
    "expert_ffn_hidden_size": 12,
    "zero_expert_num": 0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,  # DeepSeek's dense first layers: one, then mixtures
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 4,
    "full_attention_interval": 2,  # hybrids of linear and full attention: one of each in every two layers
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 1,
    "expert_layer_offset": 0,
    "n_shared_experts": 1,  # Dots1 multiplies by it, and has no default
    "mamba_n_heads": 4,  # hybrids with Mamba layers: heads × head size = expand (2) × hidden size
    "mamba_d_head": 8,
}
#: a second shape, where a family refuses the first or cannot run it: two layers, one key-value head, no MLA query
#: rank, the family's own token ids and layer pattern
SMALLER = {
    **{k: v for k, v in SHAPE.items() if not k.endswith(("_token_id", "_interval", "_period", "_offset"))},
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "q_lora_rank": None,
}
del SMALLER["first_k_dense_replace"]
#: a third, where a family takes one expert per token only (ZAYA)
ONE_CHOICE = {**SMALLER, **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "top_k_experts", "moe_k"), 1)}
MARK = ("<!-- moe-families: start (benchmarks/moe_families.py --write) -->", "<!-- moe-families: end -->")


def families() -> list[tuple[str, str]]:
    """(model type, configuration class name) of every mixture-of-experts family with a causal language model."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type, name in CONFIG_MAPPING_NAMES.items():
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            parameters = inspect.signature(getattr(transformers, name).__init__).parameters
        except (AttributeError, ImportError, ValueError, TypeError):
            continue
        if any(key in parameters for key in EXPERT_COUNTS):
            found.append((model_type, name))
    return sorted(found)


#: what a family needs beyond the shape and has no default for, by configuration class, from the shape
OWN_KEYWORDS = {
    "Lfm2MoeConfig": lambda shape: {"layer_types": ["conv", "full_attention"] * (shape["num_hidden_layers"] // 2)},
}


def tiny_model(name: str, shape: dict):
    import transformers

    cls = getattr(transformers, name)
    taken = inspect.signature(cls.__init__).parameters
    shape = {**shape, **OWN_KEYWORDS.get(name, lambda shape: {})(shape)}
    keywords = {key: value for key, value in shape.items() if key in taken}
    keywords.update({key: 4 for key in EXPERT_COUNTS if key in taken})
    config = cls(**keywords)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))


def step(model, ids, half: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward of a half of the batch, from a generator state of that half's own: a router that
    draws in training (Phi-3.5-MoE's jitter) draws alike in one process and in the rank that takes the half."""
    torch.manual_seed(100 + half)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as distrain's causal-LM task trains
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def one_process(name: str) -> dict:
    """The family's build, distrain's check, and one process's two halves: in the first shape the family builds
    and runs one process in (its transformers code, before distrain splits anything)."""
    from distrain.parallel.expert_parallel import check_module

    failure = {}
    for shape in (SHAPE, SMALLER, ONE_CHOICE):
        try:
            model = tiny_model(name, shape)
        except Exception as error:  # noqa: BLE001 - the table says why
            failure = failure or {"error": f"build: {type(error).__name__}: {_short(error)}"}
            continue
        try:
            check_module(model, 2)
        except Exception as error:  # noqa: BLE001
            return {"refused": _short(error)}
        halves = []
        try:
            for i in (0, 2):
                halves.append(step(model, batch()[i : i + 2], i // 2))
        except Exception as error:  # noqa: BLE001
            failure = failure or {"error": f"forward: {type(error).__name__}: {_short(error)}"}
            continue
        (loss0, _), (loss1, grads) = halves  # grads: summed over both halves
        return {"shape": shape, "losses": (loss0, loss1), "grads": {n: g / 2 for n, g in grads.items()}}
    return failure


def in_rank(rank: int, port: int, names: list[tuple[str, dict]], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from distrain.parallel.expert_parallel import split_model

    results = {}
    for name, shape in names:
        try:
            model = tiny_model(name, shape)
            split = split_model(model, 2, "cpu")
            loss, grads = step(model, batch()[2 * rank : 2 * rank + 2], rank)
            for key, grad in grads.items():
                if key in split.owners:
                    grad.div_(2)  # the mean over both ranks' tokens, as the strategies take it
                else:
                    dist.all_reduce(grad, op=dist.ReduceOp.AVG)
            held = {key: tuple(split.parameter(key).shape) for key in split.owners}
            results[name] = {"loss": loss, "grads": grads, "held": held}
        except Exception as error:  # noqa: BLE001 - every rank fails alike (the same model, the same split)
            results[name] = {"error": f"{type(error).__name__}: {_short(error)}"}
    torch.save(results, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 140 else text[:137] + "..."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(reference: dict, ranks: list[dict]) -> tuple[str, str, str, str]:
    """(experts held, loss diff, max rel diff, result) of one family."""
    if any("error" in r for r in ranks):
        return "", "", "", "fails in the ranks: " + next(r["error"] for r in ranks if "error" in r)
    held = ranks[0]["held"]
    if not held:
        return "none", "", "", "nothing split"
    layers = len({key.rsplit(".", 1)[0] for key in held})
    loss_diff = max(
        abs(r["loss"] - reference["losses"][i]) / max(1e-12, abs(reference["losses"][i])) for i, r in enumerate(ranks)
    )
    worst = 0.0
    # a gradient that is rounding noise (a router whose weights normalize to constants: DeepSeek-V4's hash layers
    # with their table unset) is held to a millionth of the model's largest gradient, not to its own noise
    floor = 1e-6 * max(float(g.abs().max()) for g in reference["grads"].values())
    for rank, r in enumerate(ranks):
        for key, grad in r["grads"].items():
            whole = reference["grads"][key]
            if key in held:
                whole = whole[2 * rank : 2 * rank + 2]
            worst = max(worst, float((grad - whole).abs().max()) / max(float(whole.abs().max()), floor, 1e-30))
    ok = loss_diff <= 1e-4 and worst <= 1e-4 and all(shape[0] == 2 for shape in held.values())
    return f"{layers} layers", f"{loss_diff:.1e}", f"{worst:.1e}", "exact" if ok else "differs"


#: the Trainer's runs of a family (``--trainer``): name → (strategy, ranks)
RUNS = {"DDP, EP 2": ("ddp_find_unused_parameters_true", 2), "FSDP, EP 2": ("fsdp", 2), "EP 2 × FSDP 2": ("fsdp", 4)}
STEPS = 8


def fit(model_type: str, strategy: str, devices: int) -> list[float] | None:
    """One Trainer run of a family's tiny model, by this process alone (``devices=1``) or as a rank of a job of
    ``devices`` (its variables set): each step's loss, the mean over the ranks (on rank 0; None elsewhere). A router's
    jitter is off (it draws otherwise on each rank)."""
    import distrain

    name = dict(families())[model_type]
    shape = next(s for s in (SHAPE, SMALLER, ONE_CHOICE) if _builds(name, s))
    shape = {**shape, "router_jitter_noise": 0.0, "input_jitter_noise": 0.0}

    class CausalLM(distrain.Module):
        def __init__(self):
            super().__init__()
            self.model = tiny_model(name, shape)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0], use_cache=False).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    losses: list[float] = []

    class Losses(distrain.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    ids = torch.randint(0, 64, (4 * STEPS, 12), generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4 // devices)
    options = {"expert_parallel_size": 2} if devices > 1 else {}
    trainer = distrain.Trainer(
        accelerator="cpu", strategy=strategy, devices=devices, max_steps=STEPS, seed=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()],
        default_root_dir=os.path.join(tempfile.gettempdir(), "moe_families"), **options,
    )  # fmt: skip
    trainer.fit(CausalLM(), loader)
    every_rank = trainer.strategy.all_gather_object(losses) if devices > 1 else [losses]
    return [sum(step) / devices for step in zip(*every_rank)] if trainer.is_global_zero else None


def _builds(name: str, shape: dict) -> bool:
    try:
        tiny_model(name, shape)
    except Exception:  # noqa: BLE001 - the next shape
        return False
    return True


def _pool_rank(rank: int, world: int, port: int, jobs: list[tuple[str, str]], out: str) -> None:
    """A rank of a job that runs each (family, strategy) in turn; each result (or this rank's error) a file."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    torch.set_num_threads(1)
    for model_type, strategy in jobs:
        result = Path(out) / f"{model_type}.{strategy}.{world}.json"
        try:
            losses = fit(model_type, strategy, world)
        except Exception as error:  # noqa: BLE001 - the table says why; the pool starts again after it
            result.write_text(json.dumps(f"fails: {type(error).__name__}: {_short(error)}"))
            return
        if losses is not None:
            result.write_text(json.dumps(losses))


def run_pool(world: int, jobs: list[tuple[str, str]], out: str, patience: float = 240) -> None:
    """``jobs`` on one set of ``world`` ranks started once (a failure or a hang: the ranks are stopped, that job
    recorded, and a new set goes on with the next ones)."""

    def result(job: tuple[str, str]) -> Path:
        return Path(out) / f"{job[0]}.{job[1]}.{world}.json"

    remaining = list(jobs)
    while remaining:
        context = mp.start_processes(
            _pool_rank, args=(world, _free_port(), remaining, out), nprocs=world, join=False, start_method="spawn"
        )
        last, seen, ended = time.monotonic(), 0, False
        while not ended:
            try:
                ended = context.join(timeout=1)
            except Exception:  # noqa: BLE001 - a rank died; its error file says why
                ended = True
            finished = [job for job in remaining if result(job).exists()]
            if len(finished) > seen:
                last, seen = time.monotonic(), len(finished)
            ended = ended or any("fails" in result(job).read_text() for job in finished)
            ended = ended or time.monotonic() - last > patience
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        done = 0
        while done < len(remaining) and result(remaining[done]).exists():
            done += 1
        if done < len(remaining) and not any("fails" in result(job).read_text() for job in remaining[:done]):
            result(remaining[done]).write_text(json.dumps("timed out"))  # it hung: the next set goes on after it
            done += 1
        remaining = remaining[done:]


def trainer_runs(model_types: list[str], out: str, world_sizes: set[int]) -> dict[str, list[str]]:
    """Each family's ``RUNS`` against one process: the largest relative difference of a step's loss, or why not.
    Each result is a file in ``out``, kept: a run stopped half-way goes on from there, and only ``world_sizes``' runs
    are started (the others' cells stay empty until a run makes them)."""

    def result(model_type: str, strategy: str, devices: int) -> Path:
        return Path(out) / f"{model_type}.{strategy}.{devices}.json"

    for model_type in model_types:
        if not result(model_type, "single", 1).exists():
            try:
                one = fit(model_type, "single", 1)
            except Exception as error:  # noqa: BLE001
                one = f"one process fails: {type(error).__name__}: {_short(error)}"
            result(model_type, "single", 1).write_text(json.dumps(one))
    for world in sorted(world_sizes):
        strategies = [strategy for strategy, devices in RUNS.values() if devices == world]
        jobs = [(m, s) for m in model_types for s in strategies if not result(m, s, world).exists()]
        if jobs:
            run_pool(world, jobs, out)
    cells = {}
    for model_type in model_types:
        reference = json.loads(result(model_type, "single", 1).read_text())
        row = []
        for strategy, devices in RUNS.values():
            if not result(model_type, strategy, devices).exists():
                row.append("not run yet")
                continue
            split = json.loads(result(model_type, strategy, devices).read_text())
            if isinstance(reference, str) or isinstance(split, str):
                row.append(reference if isinstance(reference, str) else split)
                continue
            worst = max(abs(a - b) / abs(b) for a, b in zip(split, reference))
            row.append(f"{worst:.0e}" + ("" if worst <= 1e-5 and len(split) == len(reference) else " (differs)"))
        cells[model_type] = row
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", help="model types (default: every mixture family found)")
    parser.add_argument("--write", help="a Markdown file whose table between the markers is replaced")
    parser.add_argument("--trainer", action="store_true", help="add the Trainer's runs (DDP, FSDP, EP × FSDP)")
    parser.add_argument(
        "--results",
        default=str(Path.home() / ".cache" / "distrain" / "moe_trainer"),
        help="where the Trainer's runs keep their results (a run stopped half-way goes on from them)",
    )
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4], help="the world sizes to run now")
    args = parser.parse_args()
    import transformers

    found = families()
    if args.families:
        found = [(t, n) for t, n in found if t in args.families]
    started = time.perf_counter()
    references = {name: one_process(name) for _, name in found}
    runnable = [name for _, name in found if "grads" in references[name]]
    ranks: list[dict] = [{}, {}]
    if runnable:
        with tempfile.TemporaryDirectory() as out:
            shaped = [(name, references[name]["shape"]) for name in runnable]
            mp.start_processes(in_rank, args=(_free_port(), shaped, out), nprocs=2, start_method="spawn")
            ranks = [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(2)]
    passed = [
        t for t, n in found if "grads" in references[n] and compare(references[n], [r[n] for r in ranks])[3] == "exact"
    ]
    results = Path(args.results) / f"transformers-{transformers.__version__}-torch-{torch.__version__}"
    if args.trainer:
        results.mkdir(parents=True, exist_ok=True)
    trained_runs = trainer_runs(passed, str(results), set(args.ranks)) if args.trainer else {}
    rows, exact, trained = [], 0, 0
    for model_type, name in found:
        ref = references[name]
        if "grads" in ref:
            held, loss_diff, grad_diff, result = compare(ref, [ranks[0][name], ranks[1][name]])
        else:
            held, loss_diff, grad_diff = "", "", ""
            result = f"refused: {ref['refused']}" if "refused" in ref else ref["error"]
        exact += result == "exact"
        cells = [held, loss_diff, grad_diff]
        if args.trainer:
            runs = trained_runs.get(model_type, [""] * len(RUNS))
            made = [c for c in runs if c != "not run yet"]
            trained += result == "exact" and bool(made) and all(c[:1].isdigit() and "differs" not in c for c in made)
            cells += runs
        cells.append(result.replace("|", "/"))
        rows.append(f"| `{model_type}` | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    runs = (
        f"; {trained} of them train under the Trainer as one process in every run made (8 AdamW steps of each)"
        if args.trainer
        else ""
    )
    columns = ["family", "experts split", "loss diff", "max rel diff", *(RUNS if args.trainer else ()), "result"]
    header = [
        f"transformers {transformers.__version__}, torch {torch.__version__}: {exact} of {len(rows)} mixture "
        f"families split over 2 ranks as one process{runs} ({time.perf_counter() - started:.0f} s on 2 CPU cores).",
        "",
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    table = "\n".join(header + rows)
    print(table)
    if args.write:
        path = Path(args.write)
        text = path.read_text()
        start, end = text.index(MARK[0]) + len(MARK[0]), text.index(MARK[1])
        path.write_text(text[:start] + "\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    sys.exit(main())
