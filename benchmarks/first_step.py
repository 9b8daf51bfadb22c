"""Time to the first step: ``distrain train --max-steps 1`` against a bare torchrun script, same model, same run.

    python benchmarks/first_step.py [--rounds 3] [--devices 2]

The bare script (written below, run by ``torchrun --standalone``) does what a hand-written DDP job does before its
first step: import torch, join the gloo process group, build the built-in gpt-tiny, wrap it in
DistributedDataParallel, take one AdamW step on a batch of 8 × 128 bytes per rank. ``distrain train`` runs the
same model and global batch (16 × 128) with ``strategy: auto``: once as a first start on a new machine (no rates,
no plan kept), once as every later start (the plan kept), and once with ``--strategy ddp``. The clock runs from
the command's start to the line rank 0 prints after step 1; rounds alternate the commands so drift in machine load
hits each, and the table shows the median, the parts of distrain's time (read from the run's own lines), and the
ratio to the bare script.

A script of your own that calls ``Trainer(strategy="auto").fit`` (written below: the same model and global batch) is
timed the same ways: a first start, a later start (the decision kept, ``planner/cache.py``), a later start with
``DISTRAIN_PLAN_CACHE=off`` (what every start paid before the Trainer kept its decision: the plan made again, the
machine's rates kept), and ``strategy="ddp"``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = r"""
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from distrain.models.gpt import GPT, gpt_config
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(GPT(gpt_config("gpt-tiny", block_size=128)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, 256, (8, 129))
loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
loss.backward()
opt.step()
if dist.get_rank() == 0:
    print(f"step 1 loss {loss.item():.3f}", flush=True)
dist.destroy_process_group()
"""

TRAINER = r"""
import sys, torch, distrain
from torch.utils.data import DataLoader, TensorDataset
from distrain.models.lm import GPTLanguageModel


class FirstStep(distrain.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            print("trainer step 1 done", flush=True)


if __name__ == "__main__":
    tokens = torch.randint(0, 256, (64, 129), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = distrain.Trainer(
        strategy=sys.argv[1], devices=int(sys.argv[3]), accelerator="cpu", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=sys.argv[2], callbacks=[FirstStep()],
    )
    trainer.fit(GPTLanguageModel("gpt-tiny", block_size=128), data)
"""


def first_step_seconds(command: list[str], marker: str, env: dict, cwd: str) -> tuple[float, dict[str, float]]:
    """Seconds from the start to the first output line containing ``marker``, and when other lines came."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    seen: dict[str, float] = {}
    found = None
    for line in proc.stdout:
        now = time.perf_counter() - start
        for name, text in (("planned", "strategy auto"), ("launched", " process(es), strategy ")):
            if text in line and name not in seen:
                seen[name] = now
        if marker in line and found is None:
            found = now
    proc.wait()
    if found is None:
        raise RuntimeError(f"{' '.join(command)}: no line with {marker!r} (exit {proc.returncode})")
    return found, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    (work / "bare.py").write_text(BARE)
    (work / "trainer.py").write_text(TRAINER)
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "DISTRAIN_PLAN_CACHE": str(work / "plans")}
    env.pop("DISTRAIN_PLANNED", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.devices}"]
    train = ["distrain", "train", "--max-steps", "1", "--devices", str(args.devices), "--accelerator", "cpu"]
    train += ["--batch-size", "8", "--seq-len", "128", "logging.progress_bar=false", "logging.use_tensorboard=false"]
    not_kept = {**env, "DISTRAIN_PLAN_CACHE": "off"}  # the machine's rates kept, the decision made every time
    runs: dict[str, list[tuple[float, dict]]] = {}

    def script(strategy: str, out: str) -> list[str]:
        return [sys.executable, "trainer.py", strategy, out, str(args.devices)]

    for r in range(args.rounds):
        cold = {**env, "XDG_CACHE_HOME": str(work / f"cold{r}"), "DISTRAIN_PLAN_CACHE": str(work / f"cold{r}")}
        cold_too = {**env, "XDG_CACHE_HOME": str(work / f"cold-t{r}"), "DISTRAIN_PLAN_CACHE": str(work / f"cold-t{r}")}
        cases = {
            "bare torchrun script": (torchrun + ["bare.py"], "step 1 loss", env),
            "distrain, auto, first start on this machine": (train + ["--output-dir", f"a{r}"], "step 1/1", cold),
            "distrain, auto, later starts (plan kept)": (train + ["--output-dir", f"b{r}"], "step 1/1", env),
            "distrain, --strategy ddp": (train + ["--strategy", "ddp", "--output-dir", f"c{r}"], "step 1/1", env),
            "Trainer, auto, first start on this machine": (script("auto", f"d{r}"), "trainer step 1", cold_too),
            "Trainer, auto, later starts (plan kept)": (script("auto", f"e{r}"), "trainer step 1", env),
            "Trainer, auto, plan made at every start": (script("auto", f"f{r}"), "trainer step 1", not_kept),
            "Trainer, strategy='ddp'": (script("ddp", f"g{r}"), "trainer step 1", env),
        }
        if r == 0:  # the plans the later starts keep: made once, not timed
            first_step_seconds(train + ["--output-dir", "warm"], "step 1/1", env, str(work))
            first_step_seconds(script("auto", "warm-trainer"), "trainer step 1", env, str(work))
        for name, (command, marker, case_env) in cases.items():
            runs.setdefault(name, []).append(first_step_seconds(command, marker, case_env, str(work)))
    bare = statistics.median(t for t, _ in runs["bare torchrun script"])
    print(
        f"time to the first step, {args.devices} CPU ranks (gloo), gpt-tiny, 16 × 128 per step; "
        f"median of {args.rounds} rounds"
    )
    print(f"{'command':46s} {'first step':>10s} {'× bare':>7s}   parts (median)")
    for name, results in runs.items():
        seconds = statistics.median(t for t, _ in results)
        parts = ""
        if name.startswith("distrain"):
            launched = statistics.median(s.get("launched", 0.0) for _, s in results)
            parts = f"to the launch {launched:.1f} s (plan included), ranks to step 1 {seconds - launched:.1f} s"
        print(f"{name:46s} {seconds:8.1f} s {seconds / bare:6.2f}x   {parts}")


if __name__ == "__main__":
    main()
