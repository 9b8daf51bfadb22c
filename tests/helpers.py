"""Run a function in N real processes (gloo, free port) and collect each rank's result."""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset

import distrain
from distrain.cluster import find_free_port


def env_without_rank() -> dict[str, str]:
    """This process's environment without the rank variables: a launcher started from a test (torchrun,
    ``distrain train``) must not think it is a rank of the test's own group."""
    rank_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in rank_keys}


#: Ranks are forked from a server that imported torch and distrain once (tests/conftest.py preloads
#: them): a fresh interpreter per rank cost ~3 s of imports per test on 2 cores, ~0.1 s forked. Each rank
#: is still a new process with nothing left from the tests before it.
START_METHOD = "forkserver"


def run_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, *args)`` in ``world_size`` new processes; returns results by rank."""
    port = find_free_port()
    # the fork server started with the environment and folder of the first test that used it: a rank
    # gets this test's own (monkeypatch.setenv/chdir), as a spawned one would
    here = (dict(os.environ), os.getcwd())
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _entry, args=(fn, world_size, port, out, args, here), nprocs=world_size, start_method=START_METHOD
        )
        return [pickle.loads((Path(out) / f"{r}.pkl").read_bytes()) for r in range(world_size)]


def run_harness(harness: str | os.PathLike, env: dict[str, str], cwd: str | os.PathLike) -> subprocess.CompletedProcess:
    """``python HARNESS`` in ``cwd`` with ``env`` (a script on one process, no launcher: its own ``__main__``, its
    own environment and folder), in a process forked from the server that has imported torch and distrain: what a new
    interpreter spends importing them (seconds on 2 cores) is not spent again. Its output and exit status as a
    subprocess's. Not for a script that starts its other ranks by running itself again (``sys.argv`` is the
    server's)."""
    return run_ranks(_harness_in_rank, 1, str(harness), dict(env), str(cwd))[0]


def _harness_in_rank(rank: int, harness: str, env: dict[str, str], cwd: str) -> subprocess.CompletedProcess:
    import runpy
    import traceback

    os.environ.clear()
    os.environ.update(env)  # no rank variables: a script on a machine with no launcher
    os.chdir(cwd)
    streams = (sys.stdout, sys.stderr)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        try:
            runpy.run_path(harness, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 — the script's failure is its exit status and its traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([harness], code, out.read(), err.read())


def _entry(rank, fn, world_size, port, out, args, here=None):
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native abort in a rank still shows its Python stack
    # what the rank inherited from the fork server (torch, distrain: millions of objects) is never garbage: frozen,
    # the collector skips it (a full collection walked all of it, ~0.5 s each, and wrote to every page it shares
    # with the server); what the rank makes itself is collected as before
    gc.freeze()
    if here is not None:
        environ, cwd = here
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    result = fn(rank, *args)
    (Path(out) / f"{rank}.pkl").write_bytes(pickle.dumps(result))
    from distrain.distributed import shutdown

    shutdown()


def _cpu_info_once() -> None:
    """py-cpuinfo's ``get_cpu_info()`` answers from a new Python process each call (1 to 2.5 s on 2 busy cores), and
    DeepSpeed asks it three times for each CPU Adam (offloaded optimizer) and again for each NVMe swapper: half of an
    NVMe-offload cell's time went there. The answer, the same on this machine for the whole session, is kept after its
    first call: in this process, and in the session's shared folder (tests/conftest.py) for the ranks forked from the
    server that imported this module."""
    try:
        import cpuinfo
    except ImportError:
        return
    ask = cpuinfo.get_cpu_info
    if getattr(ask, "kept_for_the_session", False):
        return
    known: list[dict] = []

    def get_cpu_info() -> dict:
        if known:
            return known[0]
        shared = os.environ.get("DISTRAIN_TEST_SHARED")
        kept = Path(shared) / "cpuinfo.json" if shared else None
        try:
            info = json.loads(kept.read_text()) if kept else ask()
        except (OSError, ValueError):
            info = ask()
            fresh = kept.with_name(f"{kept.name}.{os.getpid()}")
            try:
                fresh.write_text(json.dumps(info))
                os.replace(fresh, kept)
            except OSError:
                pass
        known.append(info)
        return info

    get_cpu_info.kept_for_the_session = True
    cpuinfo.get_cpu_info = get_cpu_info


_cpu_info_once()


class IndexedTokens(Dataset):
    """Learnable byte sequences (arithmetic progressions); item i also carries i, to see who got what."""

    def __init__(self, n: int = 96, seq_len: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 256, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(seq_len + 1)) % 256

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:], torch.tensor(i)


class TinyGPT(distrain.Module):
    """A 2-layer byte GPT that records the sample ids it trained on."""

    def __init__(
        self, dropout: float = 0.0, lr: float = 3e-3, schedule: bool = True, n_head: int = 2, n_experts: int = 0
    ):
        super().__init__()
        self.save_hyperparameters()
        from distrain.models.gpt import GPT, GPTConfig

        cfg = GPTConfig(n_layer=2, n_head=n_head, n_embd=32, block_size=16, dropout=dropout, n_experts=n_experts)
        self.gpt = GPT(cfg)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.extend(idx.tolist())
        return self.gpt(x, y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", self.gpt(x, y))

    def predict_step(self, batch, batch_idx):
        return self.gpt(batch[0]).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.1)
        if not self.hparams["schedule"]:
            return opt
        from distrain.optim import warmup_decay

        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup_decay(opt, 2, 20), "interval": "step"}}


class LossRecorder(distrain.Callback):
    def __init__(self):
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["loss"])
        if "grad_norm" in trainer.callback_metrics:
            self.grad_norms.append(trainer.callback_metrics["grad_norm"])


def make_trainer(tmp, **kw) -> tuple[distrain.Trainer, LossRecorder]:
    rec = LossRecorder()
    kw.setdefault("callbacks", [])
    kw["callbacks"] = [rec, *kw["callbacks"]]
    defaults = dict(
        accelerator="cpu",
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_plots=False,  # drawing summary.png costs ~1 s a run; tests/test_monitoring.py checks it
        default_root_dir=str(tmp),
        seed=7,
    )
    return distrain.Trainer(**{**defaults, **kw}), rec


def loader(batch_size: int, n: int = 96, shuffle: bool = True) -> DataLoader:
    return DataLoader(IndexedTokens(n), batch_size=batch_size, shuffle=shuffle)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}


FAULTY_RANK_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
import torch
import distrain
from helpers import TinyGPT, loader

class Faulty(TinyGPT):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 2:
            {fault}
        x, y, _ = batch  # no .tolist() of the ids, and no self.trainer: the memory planner can trace this step
        return self.gpt(x, y)

def stuck_in_user_code():
    while True:  # busy in Python: a loop that never ends
        time.sleep(0.01)

trainer = distrain.Trainer(accelerator="cpu", strategy={strategy}, devices=2, max_steps=6, {timeout_option}
                           enable_progress_bar=False, logger=False, enable_checkpointing=False,
                           default_root_dir={root!r})
trainer.fit(Faulty(**{module_kwargs}), loader(4))
"""


def console_of_a_faulty_rank(
    tmp_path, fault: str, collective_timeout: float, strategy: str = '"ddp"', module_kwargs: str = "{}"
) -> tuple[str, float]:
    """A user's script, run as a user runs it (distrain's own launcher starts rank 1 from it), training 2 ranks (DDP;
    ``strategy``: the Trainer's argument as Python source, a name or a constructor call; ``module_kwargs``:
    TinyGPT's, the same) of which rank 1 runs ``fault`` (a line of Python) at the start of its third step: the
    console's ``[distrain]`` lines, and the seconds the script took. ``collective_timeout`` goes to the Trainer with a
    strategy's name, and into the call that makes an instance."""
    script = tmp_path / "train.py"
    root = str(tmp_path / "run")
    instance = strategy.endswith(")")
    tests = os.path.dirname(__file__)
    script.write_text(
        FAULTY_RANK_SCRIPT.format(
            tests=tests,
            timeout_option="" if instance else f"collective_timeout={collective_timeout},",
            fault=fault,
            root=root,
            strategy=f"{strategy[:-1]}, collective_timeout={collective_timeout})"
            if strategy.endswith(")")
            else strategy,
            module_kwargs=module_kwargs,
        )
    )
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(script)], env=env_without_rank(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    return "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[distrain]")), time.time() - start


def run_cli(argv: list[str], cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``distrain ARGV`` as ``distrain.cli.main`` (what the console script runs) in this process, its stdout and
    stderr caught at the file descriptors as a subprocess's are (C libraries' output included; sys.stdout and
    sys.stderr stay real streams, whose fileno DeepSpeed's op checks use). For a test where the CLI's own process
    start is not what is tested: a new interpreter costs seconds of imports per process on 2 cores. In the ranks of
    ``run_ranks`` it is the CLI under an outside launcher (torchrun's route); ``os.environ`` without the rank
    variables, the CLI on a machine with no launcher."""
    from distrain.cli import main

    here, streams = os.getcwd(), (sys.stdout, sys.stderr)
    os.environ.pop("DISTRAIN_PLANNED", None)  # each run plans for itself, as a new process would
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        for stream in streams:
            stream.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        # Python's own streams write to those descriptors too (pytest's capture writes past them)
        sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        try:
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's refusals
                code = e.code
        finally:
            os.chdir(here)
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams  # also undoes the run's copy of its output into its rank log
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())


def cli_rank(rank: int, argv: list[str], cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``run_cli`` in a rank of ``run_ranks``: ``run_ranks(cli_rank, 2, argv, cwd)``."""
    return run_cli(argv, cwd)


def deepspeed_model_state_estimates(
    total_params: int, largest_layer_params: int, gpus_per_node: int, num_nodes: int
) -> dict[str, tuple[int, int]]:
    """DeepSpeed's own estimators of ZeRO-2/3 model-state memory (fp16/bf16 params + Adam), as
    ``{option: (host bytes, device bytes)}``, for cross-checking the planner. The functions live
    in ``deepspeed.runtime.zero.stage_1_and_2`` / ``stage3`` (deepspeed 0.19.8); their
    ``additional_buffer_factor`` pads the host figure only, and is left at 1 here."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    out = {}
    for offload in (False, True):
        host, device = estimate_zero2_model_states_mem_needs(
            total_params, gpus_per_node, num_nodes, cpu_offload=offload, additional_buffer_factor=1
        )
        out[f"zero2{'_offload' if offload else ''}"] = (host, device)
    for offload, offload_params in ((False, False), (True, False), (True, True)):
        host, device, _ = estimate_zero3_model_states_mem_needs(
            total_params,
            largest_layer_params,
            gpus_per_node,
            num_nodes,
            cpu_offload=offload,
            cpu_offload_params=offload_params,
            zero_init=True,
            additional_buffer_factor=1,
        )
        name = "zero3" + ("_offload_params" if offload_params else "_offload" if offload else "")
        out[name] = (host, device)
    return out


def torchs_interleaved_operations(pipeline: int, per_rank: int, micro: int) -> dict[int, list]:
    """Each rank's compute actions in torch's own ScheduleInterleaved1F1B (its order-making method, called on the
    numbers it reads, without stages or a process group)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    torchs = object.__new__(ScheduleInterleaved1F1B)
    rounds = max(1, micro // pipeline)
    torchs.__dict__.update(
        n_local_stages=per_rank,
        pp_group_size=pipeline,
        _n_microbatches=micro,
        number_of_rounds=rounds,
        microbatches_per_round=micro // rounds,
    )
    return {r: [a for a in torchs._calculate_single_rank_operations(r) if a is not None] for r in range(pipeline)}
