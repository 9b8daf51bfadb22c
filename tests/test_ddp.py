"""DDP behaviour on real gloo ranks: data sharding, collectives, comm hooks, launchers."""

import os
import socket
import subprocess
import sys

import pytest
import torch

import distrain
from helpers import TinyGPT, env_without_rank, loader, make_trainer, params_of, run_ranks


def _seen_per_epoch(rank, tmp):
    trainer, _ = make_trainer(tmp, strategy="ddp", devices=2, max_epochs=2, enable_checkpointing=False, logger=False)
    module = TinyGPT()
    epochs = []

    class PerEpoch(distrain.Callback):
        def on_train_epoch_end(self, trainer, m):
            epochs.append(list(m.seen))
            m.seen.clear()

    trainer.callbacks.append(PerEpoch())
    trainer.fit(module, loader(8, n=64))
    return epochs


@pytest.mark.slow
def test_ranks_see_disjoint_samples_and_reshuffle_each_epoch(tmp_path):
    r0, r1 = run_ranks(_seen_per_epoch, 2, tmp_path)
    for epoch in range(2):
        assert len(r0[epoch]) == len(r1[epoch]) == 32
        assert set(r0[epoch]).isdisjoint(r1[epoch])
        assert set(r0[epoch]) | set(r1[epoch]) == set(range(64))
    assert r0[0] != r0[1]  # set_epoch was called: a new order


def _count_allreduce(rank, tmp, accumulate):
    calls = []

    def counting_hook(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    strategy = distrain.DDPStrategy(ddp_comm_hook=counting_hook)
    trainer, _ = make_trainer(
        tmp,
        strategy=strategy,
        devices=2,
        max_steps=3,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(TinyGPT(), loader(4))
    return len(calls), trainer.global_step


@pytest.mark.slow
def test_no_allreduce_on_accumulation_micro_steps(tmp_path):
    (plain, steps), _ = run_ranks(_count_allreduce, 2, tmp_path / "a", 1)
    (accumulated, steps_acc), _ = run_ranks(_count_allreduce, 2, tmp_path / "b", 4)
    assert steps == steps_acc == 3
    buckets_per_step = plain // 3
    assert buckets_per_step >= 1 and plain == 3 * buckets_per_step
    # 12 micro-steps, but buckets are all-reduced only on the 3 optimizer steps
    assert accumulated == plain


def _hooks(rank, tmp):
    results = {}
    for hook in ["fp16_compress", "bf16_compress", "powersgd", "post_localsgd"]:
        strategy = distrain.DDPStrategy(ddp_comm_hook=hook)
        if hook == "powersgd":  # start compressing after 2 steps so the short run uses it
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            strategy = distrain.DDPStrategy(
                ddp_comm_hook=powerSGD_hook.powerSGD_hook,
                ddp_comm_state=powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2),
            )
        if hook == "post_localsgd":
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

            strategy = distrain.DDPStrategy(
                ddp_comm_hook=post_localSGD_hook.post_localSGD_hook,
                ddp_comm_state=post_localSGD_hook.PostLocalSGDState(None, None, start_localSGD_iter=2),
                model_averaging_period=2,
            )
        trainer, rec = make_trainer(
            tmp, strategy=strategy, devices=2, max_steps=12, enable_checkpointing=False, logger=False
        )
        distrain.seed_everything(0)
        module = TinyGPT(lr=1e-2, schedule=False)
        trainer.fit(module, loader(8))
        results[hook] = (rec.losses, params_of(module))
    # a parameter the loss never uses: DDP's reduction never finishes, and its error names none of them
    trainer, _ = make_trainer(tmp / "unused", devices=2, max_steps=3, enable_checkpointing=False, logger=False)
    module = TinyGPT(lr=1e-2, schedule=False)
    module.idle = torch.nn.Linear(2, 2)
    try:
        trainer.fit(module, loader(8))
    except RuntimeError as error:
        return results, str(error)
    return results, None


@pytest.mark.slow
def test_comm_hooks_train_and_keep_replicas_in_sync(tmp_path):
    """Each comm hook trains and keeps the replicas alike. A parameter no step uses fails DDP at the next step's
    forward in one line naming it and the option that trains such a model (DDP's own names none)."""
    (r0, unused), (r1, _) = run_ranks(_hooks, 2, tmp_path)
    assert unused is not None and unused.startswith(
        "DDP: 2 parameters of the model got no gradient in a step (idle.weight, idle.bias), so DDP's gradient "
        "reduction never finished"
    ), unused
    assert "find_unused_parameters=True" in unused and "\n" not in unused
    for hook, (losses, params) in r0.items():
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, (hook, losses)
        if hook != "post_localsgd":  # local SGD lets replicas drift between averagings
            for k in params:
                assert torch.equal(params[k], r1[hook][1][k]), (hook, k)


def test_ddp_spawn_returns_trained_weights_to_parent(tmp_path):
    trainer, _ = make_trainer(tmp_path, strategy="ddp_spawn", devices=2, max_steps=3, logger=False)
    distrain.seed_everything(0)
    module = TinyGPT()
    before = params_of(module)
    trainer.fit(module, loader(4))
    after = params_of(module)
    assert trainer.global_step == 3
    assert any(not torch.equal(before[k], after[k]) for k in before)
    saved = TinyGPT.load_from_checkpoint(str(tmp_path / "checkpoints" / "last"))
    assert all(torch.equal(after[k], v) for k, v in params_of(saved).items())


SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import distrain
from helpers import TinyGPT, loader
trainer = distrain.Trainer(accelerator="cpu", strategy={strategy!r}, devices=2, max_steps=2,
                           enable_progress_bar=False, logger=False, default_root_dir={out!r})
distrain.seed_everything(0)
module = TinyGPT()
before = float(module.gpt.head.weight.detach().sum())
trainer.fit(module, loader(4))
who = os.environ.get("RANK", "parent")
with open(os.path.join({out!r}, "result-" + who), "w") as f:
    print(who, trainer.world_size, trainer.global_step, float(module.gpt.head.weight.detach().sum()) != before, file=f)
"""


#: an earlier cell of the same session left a process group of one (a one-process run, DeepSpeed's
#: init_distributed, or the user's own)
EARLIER_GROUP = """import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""

#: an earlier cell left garbage in a reference cycle that holds a live gloo group (two members, formed by two
#: threads of this process, as the planner measures gloo); Python's collector has not reached it yet (held off here,
#: so that it is still waiting when the ranks fork)
EARLIER_GROUP_IN_GARBAGE = """import gc, threading, torch.distributed as dist
from datetime import timedelta
gc.disable()
class Cell: pass
cell, store = Cell(), dist.HashStore()
cell.cell, cell.groups = cell, []
def member(rank):
    cell.groups.append(dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30)))
members = [threading.Thread(target=member, args=(r,)) for r in range(2)]
[m.start() for m in members]
[m.join() for m in members]
del cell
"""


#: an earlier cell computed on every core, as notebooks do (GNU OpenMP's threads, which a fork leaves behind)
EARLIER_PARALLEL_WORK = """torch.set_num_threads(2)
torch.randn(512, 512) @ torch.randn(512, 512)
torch.randn(2**20).exp()
"""


def _run_script(tmp_path, strategy, launcher=(), inline=False, earlier="", env=None):
    code = SCRIPT.format(tests=os.path.dirname(__file__), strategy=strategy, out=str(tmp_path))
    code = code.replace("trainer = ", earlier + "trainer = ", 1)
    env = {**env_without_rank(), **(env or {})}
    if inline:  # like a notebook: no script file to re-run
        cmd = [sys.executable, "-c", code]
    else:
        script = tmp_path / "train.py"
        script.write_text(code)
        cmd = [*launcher, str(script)] if launcher else [sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(f.read_text().split() for f in tmp_path.glob("result-*"))


@pytest.mark.slow
def test_ddp_relaunches_the_script_per_rank(tmp_path):
    assert _run_script(tmp_path, "ddp") == [["0", "2", "2", "True"], ["1", "2", "2", "True"]]


@pytest.mark.slow
def test_same_script_runs_unchanged_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert _run_script(tmp_path, "ddp", launcher=torchrun) == [["0", "2", "2", "True"], ["1", "2", "2", "True"]]


@pytest.mark.slow
def test_ddp_fork_from_an_interactive_session(tmp_path):
    # code passed with -c (no file, like a notebook cell): the parent gets the trained weights
    assert _run_script(tmp_path, "ddp_fork", inline=True) == [["parent", "2", "2", "True"]]


@pytest.mark.slow
def test_ddp_fork_from_a_session_that_holds_a_group_of_one(tmp_path):
    """The group of one must not reach the forked ranks: its gloo threads do not survive the fork, and
    the ranks' first collective waited forever (it hung the whole test session in CI)."""
    assert _run_script(tmp_path, "ddp_fork", inline=True, earlier=EARLIER_GROUP) == [["parent", "2", "2", "True"]]


@pytest.mark.slow
def test_ddp_fork_from_a_session_whose_garbage_holds_an_ended_group(tmp_path):
    """The ranks inherit that garbage but not the group's threads: had a rank collected it, the group's
    destructor would have joined threads that do not exist there, and the rank waited forever at its end (it
    hung the strategy matrix in CI for the 30 minutes of its timeout)."""
    results = _run_script(tmp_path, "ddp_fork", inline=True, earlier=EARLIER_GROUP_IN_GARBAGE)
    assert results == [["parent", "2", "2", "True"]]


@pytest.mark.slow
def test_ddp_fork_from_a_session_that_computed_on_every_core(tmp_path):
    """Each forked rank computes on one thread: with two (a user's OMP_NUM_THREADS, or a machine with more cores than
    ranks) the ranks' first parallel region waited forever for threads that stayed in the parent."""
    results = _run_script(
        tmp_path, "ddp_fork", inline=True, earlier=EARLIER_PARALLEL_WORK, env={"OMP_NUM_THREADS": "2"}
    )
    assert results == [["parent", "2", "2", "True"]]


def test_ddp_refuses_to_relaunch_without_a_script(tmp_path):
    code = SCRIPT.format(tests=os.path.dirname(__file__), strategy="ddp", out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "ddp_fork" in proc.stderr


def _two_ranks_by_hand(script, code: str, env_of_rank) -> list[str]:
    """``code`` written to ``script`` and run as two ranks started by hand, as a cluster's launcher would (each
    with ``env_of_rank(rank, port)`` added); each must end with success. Their outputs."""
    from distrain.cluster import find_free_port

    script.write_text(code)
    port = str(find_free_port())
    procs = []
    for rank in range(2):
        env = {**env_without_rank(), **env_of_rank(rank, port)}
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True, **pipes))
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outputs]
    return [out for out, _ in outputs]


@pytest.mark.slow
def test_ranks_started_by_srun_form_one_group(tmp_path):
    """Under srun only SLURM_* variables exist: the two tasks must still join one group of 2."""
    code = SCRIPT.format(tests=os.path.dirname(__file__), strategy="ddp", out=str(tmp_path))

    def slurm(rank: int, port: str) -> dict[str, str]:
        return dict(
            SLURM_NTASKS="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_NODELIST="localhost",
            SLURM_JOB_NAME="train",
            SLURM_JOB_ID="77",
            SLURM_NTASKS_PER_NODE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )

    _two_ranks_by_hand(tmp_path / "train.py", code, slurm)
    results = sorted(f.read_text().split() for f in tmp_path.glob("result-*"))
    assert results == [["0", "2", "2", "True"], ["1", "2", "2", "True"]]


def test_custom_sampler_is_not_silently_replaced():
    from torch.utils.data import DataLoader, WeightedRandomSampler

    from distrain.data import with_distributed_sampler
    from helpers import IndexedTokens

    data = IndexedTokens(16)
    weighted = DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 16, 16))
    with pytest.raises(ValueError, match="WeightedRandomSampler.*use_distributed_sampler=False"):
        with_distributed_sampler(weighted, 2, 0, seed=0)
    assert with_distributed_sampler(weighted, 1, 0, seed=0) is weighted


ELASTIC = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
import distrain
from helpers import TinyGPT, loader

out, crash = sys.argv[1], sys.argv[2] == "crash"
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

class KillRank1(distrain.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if crash and restart == 0 and trainer.global_step == 5 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

trainer = distrain.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=9, enable_progress_bar=False,
                           logger=False, default_root_dir=out, seed=7,
                           callbacks=[distrain.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1), KillRank1()])
distrain.seed_everything(0)
module = TinyGPT(dropout=0.1)
trainer.fit(module, loader(4))  # no ckpt_path: after a restart, "last" is the default
if trainer.global_rank == 0:
    torch.save({{k: v.detach() for k, v in module.state_dict().items()}}, os.path.join(out, "final.pt"))
    open(os.path.join(out, "attempts"), "w").write(str(restart))
"""


@pytest.mark.slow
def test_kill_9_under_torchrun_restarts_and_resumes_exactly(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ELASTIC.format(tests=os.path.dirname(__file__)))
    env = env_without_rank()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ref = subprocess.run(
        [*torchrun, str(script), str(tmp_path / "ref"), "ok"], env=env, capture_output=True, text=True, timeout=180
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    # one restart allowed: the restarted group must rendezvous at the first try
    cut = subprocess.run(
        [*torchrun, "--max-restarts", "1", str(script), str(tmp_path / "cut"), "crash"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert (tmp_path / "cut" / "attempts").read_text() == "1"
    a = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


TWO_GROUPS_IN_ONE_JOB = """
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
from distrain import distributed

rank = int(os.environ["RANK"])
sums = []
for group in range(3):
    distributed.init_process_group("gloo", timedelta(seconds=20), None)
    total = torch.tensor([float(rank + 1 + 10 * group)])
    dist.all_reduce(total)
    sums.append(int(total.item()))
    if rank == 0:
        time.sleep(1.5)  # rank 1 starts the next group while this one is still up, and its store with it
    distributed.shutdown(barrier=False)
print(*sums, flush=True)
"""


def test_one_job_starts_one_group_after_another_while_a_rank_still_ends_the_last(tmp_path):
    """``verify`` then ``fit`` in one script: each starts a group on the job's port, and no barrier ends a group.
    A rank quick to start the next one joined its peer's store of the last group, which the peer then closed and
    opened again on the same port: the peer waited for that rank until the timeout (a verify-then-fit script hung 2
    runs in 3). Each group of the job now meets in keys of its own, on the one store of the job."""

    def torch_env(rank: int, port: str) -> dict[str, str]:
        return dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

    outputs = _two_ranks_by_hand(tmp_path / "groups.py", TWO_GROUPS_IN_ONE_JOB, torch_env)
    assert [out.split() for out in outputs] == [["3", "23", "43"]] * 2


LISTENING = """
import json, os, sys, psutil
sys.path.insert(0, {tests!r})
import distrain
from helpers import TinyGPT, loader

class Listening(distrain.Callback):  # every socket this rank listens on, mid-run
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            found = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
            with open(os.path.join({out!r}, f"listening-{{trainer.global_rank}}.json"), "w") as f:
                json.dump(found, f)

trainer = distrain.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=2, enable_progress_bar=False,
                           logger=False, enable_checkpointing=False, default_root_dir={out!r}, callbacks=[Listening()])
trainer.fit(TinyGPT(), loader(4))
"""


def test_a_job_on_one_machine_listens_on_loopback_only(tmp_path):
    """The rendezvous store (torch's TCPStore answers whoever connects) and gloo's sockets of a job whose ranks are all
    on this machine listen on loopback, not on every network the machine is on (the store did: '::')."""
    import ipaddress
    import json

    script = tmp_path / "train.py"
    script.write_text(LISTENING.format(tests=os.path.dirname(__file__), out=str(tmp_path)))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env_without_rank(), timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    listening = {rank: json.loads((tmp_path / f"listening-{rank}.json").read_text()) for rank in range(2)}
    assert listening[0], listening  # rank 0 hosts the store, and each rank listens for gloo's peers
    for rank, addresses in listening.items():
        assert all(ipaddress.ip_address(a).is_loopback for a in addresses), (rank, addresses)


def _address_of_this_machine() -> str | None:
    """An IPv4 address of this machine's that is not loopback (where a peer on another machine would reach it)."""
    import ipaddress

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


def test_a_job_across_machines_listens_on_the_address_its_peers_use(tmp_path):
    """Ranks started by a cluster's launcher with a ``MASTER_ADDR`` that is this machine's network address (as rank
    0's node is given to the others): rank 0's store listens on that address, not on every interface (it did:
    '::'); gloo's sockets stay where the host name resolves."""
    import json

    address = _address_of_this_machine()
    if address is None:
        pytest.skip("this machine has no network address besides loopback")

    def torch_env(rank: int, port: str) -> dict[str, str]:
        return dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR=address, MASTER_PORT=port)

    _two_ranks_by_hand(tmp_path / "train.py", LISTENING.format(tests=os.path.dirname(__file__), out=str(tmp_path)),
                       torch_env)  # fmt: skip
    listening = {rank: json.loads((tmp_path / f"listening-{rank}.json").read_text()) for rank in range(2)}
    assert address in listening[0], listening  # the store, where the other ranks were told it is
    wildcard = {rank: [a for a in found if a in ("0.0.0.0", "::")] for rank, found in listening.items()}
    assert not any(wildcard.values()), listening
