"""Out of memory, explained: a rank that runs out (a CUDA out-of-memory error, or the kernel's OOM killer) becomes one
line on the console naming the rank, its step and phase, the memory plan's predicted peak per rank against the
budget, and the nearest option of the plan that fits. Real ranks under distrain's own launcher; the error is raised
from the user's code, as a user meets it (no GPU here: torch's own OutOfMemoryError, raised on the CPU)."""

import re
import time

import pytest
import torch

import distrain
from distrain.planner.oom import memory_plan
from helpers import TinyGPT, console_of_a_faulty_rank, loader, run_ranks

COLLECTIVE_TIMEOUT = 30.0  # rank 0 waits for rank 1 while it plans (a few seconds): not a hang
PLAN = r"memory plan: ddp needs [\d.]+ MiB per rank of [\d.]+ GiB usable"


@pytest.mark.slow
def test_a_cuda_oom_is_one_line_naming_the_rank_the_step_the_plan_and_an_option(tmp_path):
    oom = 'raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")'
    console, _ = console_of_a_faulty_rank(tmp_path, oom, COLLECTIVE_TIMEOUT)
    first = console.splitlines()[0]
    assert first.startswith("[distrain] rank 1 failed first at step 3 (in forward/backward): OutOfMemoryError: ")
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in first, console
    # a tiny model in the host's memory: the plan expected it to fit, and names an option that needs less
    assert re.search(PLAN + r" \(predicted to fit", first), first
    assert re.search(r"nearest option that fits with less: .+, [\d.]+ MiB \(strategy \w+", first), first
    assert "rank 0 failed first" not in console, console


@pytest.mark.slow
def test_a_rank_the_oom_killer_ended_is_named_with_its_step_and_the_plan(tmp_path):
    """Rank 1 dies as an OOM-killed process would (exit code 137, no traceback): the console names rank 1, its exit
    and where it was (its last progress mark), and what the memory plan says; rank 0 is called what it was: a rank
    that waited for it."""
    console, _ = console_of_a_faulty_rank(tmp_path, "os._exit(137)", 3.0)
    first = console.splitlines()[0]
    assert first.startswith("[distrain] rank 1 failed first at step 3 (in forward/backward): exited with code 137"), (
        console
    )
    assert "SIGKILL" in first and "out of memory" in first, console
    assert re.search(PLAN, first) and "nearest option that fits with less: " in first, first
    assert "rank 0 failed first" not in console and "(it waited for the ranks above)" in console, console


def _runtime(strategy=None) -> distrain.Runtime:
    """2 DDP ranks on this CPU (``strategy``: another), as a Trainer's fit would run them; no rank is started."""
    runtime = distrain.Runtime(accelerator="cpu", strategy="ddp", devices=2)
    if strategy is not None:
        runtime.use_strategy(strategy)
    return runtime


class Plain(TinyGPT):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return self.gpt(x, y)


class Slow(torch.utils.data.Dataset):
    """A sample that takes longer than the plan may: the planner never gets to trace."""

    def __len__(self):
        return 1

    def __getitem__(self, i):
        time.sleep(1.0)
        raise RuntimeError("too late")


def _plans(rank):
    """The memory plan of each case below, made in a process of its own (a rank of one that joins no group): the
    test process has run other tests' DTensor operations, whose per-thread caches hold their process groups, and
    the plan forks its simulations from a thread of its own, where those caches die with the fork and take the
    groups' threads down with them (a wait that never ends). A failing rank runs none of those operations first:
    a sharded strategy's OOM is not planned."""
    import os

    import distrain.planner.plan as plan

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)  # a process no launcher started, as the test process is
    plan.host_memory = lambda: int(2 * 8.6 * 2**20)  # 7.7 MiB usable per rank
    # time enough for the whole search on a slow machine (the limit is the last case's)
    fits = memory_plan(_runtime(), Plain(), loader(64), micro_batch=64, accumulate=1, clip=None, seconds=300)
    # TinyGPT keeps the ids it trained on (.tolist()): data-dependent, which the planner's fake tensors cannot trace
    untraceable = memory_plan(_runtime(), TinyGPT(), loader(4), micro_batch=4, accumulate=1, clip=None)
    no_model = memory_plan(_runtime(distrain.Strategy()), Plain(), loader(4), micro_batch=4, accumulate=1, clip=None)
    sharded = memory_plan(_runtime(distrain.FSDPStrategy()), Plain(), loader(4), micro_batch=4, accumulate=1, clip=None)
    slow = torch.utils.data.DataLoader(Slow(), batch_size=4)
    late = memory_plan(_runtime(), Plain(), slow, micro_batch=4, accumulate=1, clip=None, seconds=0.2)
    return fits, untraceable, no_model, sharded, late


def test_the_plan_names_what_fits_and_says_when_it_cannot_plan():
    """Without ranks: a budget the run does not fit in (the nearest option that fits, a smaller micro-batch that
    keeps the global batch); a module the planner cannot trace, a strategy it has no model of, one that has sharded
    the model, and a plan slower than its time: each is said to be unavailable, never raised."""
    fits, untraceable, no_model, sharded, late = run_ranks(_plans, 1)[0]
    assert re.match(r"memory plan: ddp needs [\d.]+ MiB per rank of 7\.7 MiB usable; nearest option that fits: ", fits)
    assert re.search(r"; or micro-batch \d+ × accumulation \d+ with ddp$", fits), fits
    assert untraceable.startswith("memory plan: unavailable (the planner could not plan TinyGPT: "), untraceable
    assert no_model == "memory plan: unavailable (the planner has no model of Strategy)"
    assert sharded.startswith("memory plan: unavailable (FSDPStrategy has sharded the model the planner would trace; ")
    assert late == "memory plan: unavailable (not made within 0.2 s)"
