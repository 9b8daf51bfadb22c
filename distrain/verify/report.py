"""The verdict of ``distrain verify``: the run under test beside the one-process reference, step by step, and
the checks that need no reference (data, replicas, the optimizer's coverage, the checkpoint, the precision)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from distrain.precision import TRUE_DTYPES, compute_dtype

#: relative difference (of whole tensors, by norm) a precision's rounding explains, per optimizer step. bf16 keeps 8
#: bits: a norm's gradient computed from bf16 weights (FSDP's mixed precision gathers every parameter in bf16) and
#: from fp32 ones under autocast differ by several percent (measured: up to 6e-2, gpt-tiny, 3 steps)
TOLERANCE = {"32-true": 1e-4, "bf16-mixed": 1e-1, "16-mixed": 5e-2, "16-true": 1.5e-1, "bf16-true": 1.5e-1, "fp8": 2e-1}
#: strategies whose reductions or optimizer round differently in fp32 (ZeRO-3's buckets, CPU Adam): a factor on
#: fp32's tolerance only (on bf16's it made 1.0, a bound no run can cross)
LOOSER_IN_FP32 = {"DeepSpeedStrategy": 10.0}
#: strategies whose mixed precision keeps the model's weights in low precision (DeepSpeed's bf16 and fp16 engines,
#: with an fp32 master copy in the optimizer), held to bf16-true's tolerance. Measured on an H200 (gpt-tiny, ZeRO-3,
#: bf16-mixed, 3 steps): gradients up to 3e-2 from one fp32 process under autocast, weights 2e-3
LOW_PRECISION_WEIGHTS = {"DeepSpeedStrategy"}
#: the least tolerance once an optimizer step has run (its weights, and every later step): Adam divides each gradient
#: element by its own magnitude, so an element whose gradient is rounding-sized (an inactive unit's) moves by up to a
#: learning rate in a direction the rounding picks, and the weights and later gradients carry that. Measured in fp32
#: under tensor parallelism (gradients equal to 7e-7 at step 1): up to 9e-5 on the weights after step 1 and 2e-4 on
#: step 2's gradients (gpt-tiny and a tiny Llama, 4 steps); a layout bug moves whole tensors by 1e-2 and more
AFTER_A_STEP = 1e-3


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    header: str
    tolerance: float
    """for the initial weights, step 1's loss and gradients; ``tolerance_after_a_step`` for what follows"""
    tolerance_after_a_step: float
    steps: list[dict] = field(default_factory=list)
    modules: list[dict] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def first_divergence(self) -> str | None:
        return next((c.detail for c in self.checks if c.name == "losses, gradients, weights" and not c.ok), None)

    def table(self, modules: int = 8) -> str:
        lines = [self.header, ""]
        lines.append(f"{'step':>4}  {'loss (run)':>12}  {'loss (1 process)':>16}  {'diff':>8}  worst gradient / weight")
        for s in self.steps:
            run = "-" if s["loss_run"] is None else f"{s['loss_run']:.6g}"
            ref = "-" if s["loss_reference"] is None else f"{s['loss_reference']:.6g}"
            diff = "-" if s["loss_diff"] is None else f"{s['loss_diff']:.0e}"
            worst = "; ".join(f"{what} {name} {d:.0e}" for what, (name, d) in s["worst"].items() if name)
            lines.append(f"{s['step']:>4}  {run:>12}  {ref:>16}  {diff:>8}  {worst}")
        if self.modules:
            lines += ["", f"{'module (largest differences over the steps)':<48} {'gradient':>9} {'weight':>9}"]
            for m in self.modules[:modules]:
                lines.append(f"{m['module']:<48} {m['gradient']:>9.0e} {m['weight']:>9.0e}")
        lines += ["", "checks"]
        lines += [f"  {'ok  ' if c.ok else 'FAIL'}  {c.name:<28} {c.detail}" for c in self.checks]
        lines.append(f"result: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "header": self.header,
            "ok": self.ok,
            "tolerance": self.tolerance,
            "tolerance_after_a_step": self.tolerance_after_a_step,
            "first_divergence": self.first_divergence,
            "steps": self.steps,
            "modules": self.modules,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }


def difference(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """How far ``a`` is from ``b``: the norm of the difference relative to ``b``'s (inf for another shape). A tensor
    whose values are rounding noise around zero (an attention key's bias gradient, which softmax makes 0) is
    measured against ``floor`` instead: a small fraction of the whole set's norm."""
    if a.shape != b.shape:
        return math.inf
    scale = max(b.norm().item(), floor)
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


def _floor(tensors: dict) -> float:
    """1e-3 of the norm of all of a step's tensors together, per tensor."""
    total = math.sqrt(sum(t.float().norm().item() ** 2 for t in tensors.values()))
    return 1e-3 * total / math.sqrt(max(1, len(tensors)))


def tolerance(precision: str, strategy: str) -> float:
    """The relative difference from one process that ``precision``'s rounding explains under ``strategy`` (its
    class name), for the initial weights and step 1."""
    tol = TOLERANCE.get(precision, 1e-4)
    if precision == "32-true":
        return tol * LOOSER_IN_FP32.get(strategy, 1.0)
    if strategy in LOW_PRECISION_WEIGHTS:
        return max(tol, TOLERANCE["bf16-true"])
    return tol


def compare(run: dict, reference: dict, checkpoint_weights: dict | None, label: str) -> Report:
    precision = run["precision"]
    tol = tolerance(precision, run["strategy"])
    after = max(tol, AFTER_A_STEP)
    dp = run["data_parallel_size"]
    header = (
        f"distrain verify: {label} on {run['world_size']} ranks ({dp} with their own data) against one process on the "
        f"same global batch; {len(run['steps'])} step{'s' * (len(run['steps']) != 1)}, {precision}: "
        f"tolerance {_tolerances(tol, after)} (relative, per tensor)"
    )
    report = Report(header, tol, after)
    report.checks.append(_initial(run, reference, tol))
    report.checks.append(_steps(run, reference, tol, after, report))
    report.checks.append(_data(run, reference))
    report.checks.append(_replicas(run))
    if any(r.get("experts") for r in run["ranks"]):
        report.checks.append(_experts(run))
    # read in the reference: it steps a plain torch optimizer over the module's own parameters (engines step flat
    # partitions), and what configure_optimizers leaves out is the same code in both
    missing = reference["missing_from_optimizer"]
    report.checks.append(
        Check(
            "optimizer covers the model",
            not missing,
            f"no optimizer steps {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}"
            if missing
            else "every trainable parameter is stepped",
        )
    )
    if checkpoint_weights is not None:
        report.checks.append(_checkpoint(run, checkpoint_weights))
    report.checks.append(_precision(run))
    return report


def _tolerances(first: float, after: float) -> str:
    return f"{first:.0e}" if after == first else f"{first:.0e} at step 1's gradients, {after:.0e} after a step"


def _initial(run: dict, reference: dict, tol: float) -> Check:
    exact = run["precision"] == "32-true"
    worst = _worst(run["initial"], reference["initial"])
    name, diff = worst
    if name is None:
        return Check("initial weights (step 0)", True, "identical")
    ok = diff == 0 if exact else diff <= tol
    what = "identical" if diff == 0 else f"largest difference {diff:.0e} in {name}"
    return Check("initial weights (step 0)", ok, what if ok else f"{what}: the ranks did not start from one build")


def _worst(a: dict, b: dict) -> tuple[str | None, float]:
    """The tensor of ``b`` that ``a`` differs most from (a name missing from either: infinitely)."""
    worst: tuple[str | None, float] = (None, 0.0)
    floor = _floor(b)
    for name in sorted(b):
        if name not in a or name not in b:
            return name, math.inf
        d = difference(a[name], b[name], floor)
        if d > worst[1] or worst[0] is None:
            worst = (name, d)
    return worst


def _steps(run: dict, reference: dict, first_tol: float, after: float, report: Report) -> Check:
    first = None
    per_module: dict[str, dict[str, float]] = {}
    # a parameter whose gradient is rounding noise (softmax makes an attention key's bias gradient 0): Adam turns
    # noise into lr-sized steps of random sign, so its weights are not compared once that happened
    noise: set[str] = set()
    for i, (r, f) in enumerate(zip(run["steps"], reference["steps"]), start=1):
        loss_diff = abs(r["loss"] - f["loss"]) / max(abs(f["loss"]), 1e-12)
        grad_floor = _floor(f["grads"])
        noise |= {name for name, g in f["grads"].items() if g.norm().item() < grad_floor}
        worst = {}
        for what, key in (("gradient", "grads"), ("weight", "weights")):
            ref = f[key] if what == "gradient" else {k: v for k, v in f[key].items() if k not in noise}
            worst[what] = _worst(r[key], ref)
            floor = _floor(f[key])
            for name in set(r[key]) & set(ref):
                module = name.rsplit(".", 1)[0] if "." in name else name
                entry = per_module.setdefault(module, {"gradient": 0.0, "weight": 0.0})
                entry[what] = max(entry[what], difference(r[key][name], f[key][name], floor))
        report.steps.append(
            {"step": i, "loss_run": r["loss"], "loss_reference": f["loss"], "loss_diff": loss_diff, "worst": worst}
        )
        # step i's loss and gradients come from the weights after i - 1 optimizer steps; its weights after i
        tol = {"gradient": first_tol if i == 1 else after, "weight": after}
        failing = [f"{what} of {name} by {d:.0e}" for what, (name, d) in worst.items() if name and d > tol[what]]
        loss_off = loss_diff > tol["gradient"]
        if first is None and (loss_off or failing):
            loss = f"loss {r['loss']:.6g} against {f['loss']:.6g} ({loss_diff:.0e})"
            first = f"step {i}: " + "; ".join(([loss] if loss_off else []) + failing)
    report.modules = sorted(
        ({"module": m, **v} for m, v in per_module.items()), key=lambda m: -max(m["gradient"], m["weight"])
    )
    if len(run["steps"]) != len(reference["steps"]):
        first = first or f"the run took {len(run['steps'])} steps, the reference {len(reference['steps'])}"
    within = f"within {_tolerances(first_tol, after)} at every one of {len(run['steps'])} steps"
    return Check("losses, gradients, weights", first is None, first or within)


def _data(run: dict, reference: dict) -> Check:
    ranks = run["ranks"]
    problems = []
    for i, ref_ids in enumerate(reference["ranks"][0]["samples"], start=1):
        groups: dict[int, list[tuple[int, list[str]]]] = {}
        for rank, r in enumerate(ranks):
            if i <= len(r["samples"]):
                groups.setdefault(r["data_parallel_rank"], []).append((rank, r["samples"][i - 1]))
        for members in groups.values():  # tensor-parallel peers and pipeline stages share their batches
            (first_rank, ids), *rest = members
            for rank, other in rest:
                if other != ids:
                    problems.append(
                        f"step {i}: ranks {first_rank} and {rank} share a data-parallel group but saw different samples"
                    )
        seen: dict[str, int] = {}
        for members in groups.values():
            rank, ids = members[0]
            for sample in ids:
                if sample in seen and seen[sample] != rank:
                    problems.append(f"step {i}: ranks {seen[sample]} and {rank} both trained on one sample")
                    break
                seen[sample] = rank
        union = Counter(s for members in groups.values() for s in members[0][1])
        if union != Counter(ref_ids):
            problems.append(f"step {i}: the ranks' samples together are not the one-process global batch")
        if problems:
            break
    problems += _sequence_split(ranks)
    steps = len(reference["ranks"][0]["samples"])
    replicas = len({r["data_parallel_rank"] for r in ranks})
    detail = f"{len(ranks)} ranks × {steps} steps: disjoint, together the global batch"
    if replicas < len(ranks):
        detail = (
            f"{replicas} replica(s) × {steps} steps: disjoint, together the global batch; the "
            f"{len(ranks) // replicas} ranks of each replica share its samples"
        )
    if any(r.get("sequence_slice") for r in ranks):
        parts = len({tuple(map(tuple, r["sequence_slice"])) for r in ranks if r.get("sequence_slice")})
        detail += f", each sequence split into {parts} slices that tile it"
    return Check("data", not problems, problems[0] if problems else detail)


def _sequence_split(ranks: list[dict]) -> list[str]:
    """Context parallelism: within each replica, the pieces of a sequence its ranks computed tile it — no token
    computed twice, none left out (tensor-parallel peers compute the same pieces)."""
    replicas: dict[int, set] = {}
    for r in ranks:
        if r.get("sequence_slice"):
            replicas.setdefault(r["data_parallel_rank"], set()).update(tuple(p) for p in r["sequence_slice"])
    for replica, slices in sorted(replicas.items()):
        end = 0
        for start, stop, padded in sorted(slices):
            if start != end or padded != max(s[2] for s in slices):
                return [f"replica {replica}: its ranks' slices of a sequence {sorted(slices)} do not tile it"]
            end = stop
        if end != padded:
            return [f"replica {replica}: its ranks' slices of a sequence {sorted(slices)} stop at {end} of {padded}"]
    return []


def _replicas(run: dict) -> Check:
    """Parameters held whole on several ranks (DDP replicas, tensor-parallel replicated ones) must stay equal."""
    ranks = run["ranks"]
    for step in range(max((len(r["replicas"]) for r in ranks), default=0)):
        holders: dict[str, dict[str, list[int]]] = {}
        for rank, r in enumerate(ranks):
            for name, digest in (r["replicas"][step] if step < len(r["replicas"]) else {}).items():
                holders.setdefault(name, {}).setdefault(digest, []).append(rank)
        for name, copies in holders.items():
            if len(copies) > 1:
                groups = " vs ".join(f"rank{'s' * (len(v) > 1)} {', '.join(map(str, v))}" for v in copies.values())
                return Check("replicated parameters agree", False, f"after step {step + 1}: {name} differs ({groups})")
    return Check("replicated parameters agree", True, "every copy of each whole parameter is equal on every rank")


def _experts(run: dict) -> Check:
    """Expert parallelism: every expert of every layer is held by as many ranks as every other (its expert-data-
    parallel ranks), and no rank holds one twice. (That each expert's gradient arrives once, not summed twice nor
    missed, the gradients beside one process's show.)"""
    ranks, size = run["ranks"], run["experts_count"]
    holders: dict[str, Counter] = {}
    for r in ranks:
        for name, (first, stop) in (r.get("experts") or {}).items():
            holders.setdefault(name, Counter()).update(range(first, stop))
    replicas = len(ranks) // size
    for name, held in holders.items():
        count = max(held) + 1 if held else 0
        wrong = [e for e in range(count) if held[e] != replicas]
        if wrong:
            return Check(
                "experts held once per replica",
                False,
                f"{name}: expert {wrong[0]} is held by {held[wrong[0]]} ranks"
                f", each expert by {replicas} expected ({len(ranks)} ranks, experts over {size})",
            )
    first = ranks[0].get("experts") or {}
    name, (start, stop) = next(iter(first.items()))
    return Check(
        "experts held once per replica",
        True,
        f"each layer's {max(max(h) for h in holders.values()) + 1} experts over {size} ranks, each held by {replicas} "
        f"rank{'s' * (replicas > 1)} (rank 0: experts {start}-{stop - 1} of {name})",
    )


def _checkpoint(run: dict, weights: dict) -> Check:
    final = run["steps"][-1]["weights"] if run["steps"] else {}
    held = {k: weights[k] for k in final if k in weights}  # tied parameters are in the file under both names
    name, diff = _worst(held, final)
    ok = diff == 0
    detail = (
        f"the step-{len(run['steps'])} checkpoint read by one process holds the run's weights exactly"
        if ok
        else f"the checkpoint's {name} differs from the run's by {diff:.0e}"
    )
    return Check("checkpoint round trip", ok, detail)


def _precision(run: dict) -> Check:
    precision, seen = run["precision"], run["dtypes"]
    # a "true" precision holds its weights in its own dtype; every other keeps fp32 masters
    want_master = _dtype_name(TRUE_DTYPES.get(precision, torch.float32))
    want_compute = _dtype_name(compute_dtype(precision))
    problems = []
    for stage in ("master weights", "optimizer state"):
        found = set(seen.get(stage, []))
        if found and found != {want_master}:
            problems.append(f"{stage} {'/'.join(sorted(found))}, where {precision} asks {want_master}")
    compute = set(seen.get("compute", []))
    if compute and (want_compute not in compute or (precision == "32-true" and compute != {"float32"})):
        problems.append(f"compute {'/'.join(sorted(compute))}, where {precision} asks {want_compute}")
    reduction = set(seen.get("reduction", []))
    if precision == "32-true" and reduction - {"float32"}:
        problems.append(f"gradients reduced in {'/'.join(sorted(reduction))} under 32-true")
    summary = " · ".join(f"{stage} {'/'.join(v)}" for stage, v in seen.items())
    return Check("precision", not problems, "; ".join(problems) + f" (seen: {summary})" if problems else summary)


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``bfloat16``, as the run's dtypes are recorded."""
    return str(dtype).removeprefix("torch.")
