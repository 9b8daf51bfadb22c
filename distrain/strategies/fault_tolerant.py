"""DDP over replica groups that go on when one is lost, and take a restarted one back (torchft).

Each replica group is a job of its own: its ranks, its process group, its restarts (one torchrun each). The
groups average their gradients through torchft's ``Manager``, and torchft's lighthouse (a small server) forms, at
every step, a quorum of the groups that are alive. A group that dies mid-step makes that step's cross-group
all-reduce fail: every surviving group drops the step (``commit_step`` is False: nothing applied, the step does not
count) and goes on without it, each step then averaging fewer groups' gradients (a smaller global batch). torchrun
restarts the dead group; it joins the next quorum, takes the live state of a group that kept running — weights,
optimizer, LR schedulers, the loop's progress and data position — over HTTP (read weights-only), and trains on from
there. No job restart, no checkpoint read.

Why the quorum is synchronous (``use_async_quorum=False``): a group that rejoins must take the peer's state before
it reads its step's batches, so the loop asks for the quorum first (``start_step``) and re-reads its data position
when the state was replaced. Why no DDP wrapper: the bucket layout must be the same in every group, also in one that
just restarted (DDP rebuilds its buckets after the first step), so the gradients are averaged after the backward
in fixed buckets: first within the group, then across groups.

What a group opens to others: torchft's manager server (gRPC, on the group's rank 0), the HTTP server a running
group hands its live state from, and gloo's sockets; distrain's launcher adds torchft's lighthouse. torchft's
lighthouse and manager have no authentication (anyone who reaches them can join the quorum, or stop a group), so
when the lighthouse is on this machine's loopback — the job runs on this machine, as distrain's launcher starts it —
all of them listen on 127.0.0.1 only. The live state is served only to a request that carries the job's secret
(``DISTRAIN_JOB_SECRET``, made by the launcher; see ``checkpoint/peer_state.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ReduceOp

from distrain import distributed
from distrain.cluster import JOB_SECRET, ReplicaGroup, is_loopback_address, job_secret, replica_group
from distrain.config import ConfigError
from distrain.strategies.base import LoopFacts, SetUp, Strategy, Traits, as_timedelta
from distrain.strategies.registry import register

#: gradients are averaged in buckets of about this many bytes (one all-reduce each, within and across groups)
BUCKET_BYTES = 25 * 2**20


class TorchFTStrategy(Strategy):
    """``replica_groups`` groups of ``devices`` ranks each. ``min_replicas``: the fewest groups a step may commit
    with. ``lighthouse``: the address of a running ``torchft_lighthouse`` (None: distrain's launcher starts one).
    ``max_restarts``: how often torchrun restarts one group. ``ft_timeout``: how long a cross-group all-reduce, a
    quorum or a state transfer may take before the step is dropped. ``semi_sync``: ``local_sgd`` or ``diloco``
    (``semi_sync.py``): the groups meet every ``sync_every`` steps instead of every step; DiLoCo's outer optimizer
    is SGD with ``outer_lr`` and Nesterov ``outer_momentum``."""

    start_method = "replica_groups"

    def __init__(
        self,
        replica_groups: int = 2,
        min_replicas: int = 1,
        lighthouse: str | None = None,
        max_restarts: int = 3,
        ft_timeout: timedelta | float = timedelta(seconds=60),
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        activation_checkpointing_policy: Any = None,
        collective_timeout: timedelta | float | None = timedelta(minutes=5),
        semi_sync: str | None = None,
        sync_every: int = 8,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
    ):
        super().__init__(process_group_backend, timeout, activation_checkpointing_policy, collective_timeout)
        _check_options(replica_groups, min_replicas, lighthouse, max_restarts, "")
        _check_semi_sync(semi_sync, sync_every, outer_lr, outer_momentum, "")
        self.semi_sync, self.sync_every = semi_sync, sync_every
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self._semi = None  # torchft's LocalSGD or DiLoCo (semi_sync.py), made with the optimizer
        self._met = False  # semi_sync: this process met the others once (its first step); then only every sync_every
        self._stepping = False  # inside the optimizer's step, where torchft's semi-synchronous meeting runs
        self.cross_group_bytes = 0  # what this rank handed to torchft's cross-group all-reduce
        self._peer_in_meeting = False  # the state taken last came from a peer inside a semi-synchronous meeting
        self.replica_groups, self.min_replicas, self.max_restarts = replica_groups, min_replicas, max_restarts
        self.lighthouse = lighthouse
        self.ft_timeout = as_timedelta(ft_timeout)
        self.manager = None  # torchft's Manager, made in setup_environment
        self.group: ReplicaGroup | None = None
        self._rejoined = False  # the last quorum replaced this group's state with a peer's
        self._groups_in_quorum = 0  # how many groups the last quorum had (a change is announced)
        self._hands_over_state = False  # the loop's live state is registered with this manager (fit may run again)
        self._in_step = False  # a quorum was formed for the step under way
        self._step = 0  # the step under way (start_step), which commit_step settles
        self._formed_a_quorum = False  # this process has: its first one waits for every group (a start or a resume)
        # torchrun restarted this group (its rank died): it must meet another group before it trains again
        self._restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        self._take_over = None  # loads a peer's state into the loop (set with the loop's live state)
        self._run_dir: str | None = None
        self._ended_at: int | None = None  # the step of the finished group's final state it took
        self._stop_vote = 0.0  # this rank's stop vote, sent with the next step's gradients to every group
        self._stop_votes: torch.Tensor | None = None  # the step's votes, averaged over the quorum's ranks
        self._stop_agreed = 0.0  # the job's agreed stop, from the last committed step

    def launcher(self, nprocs: int, cluster, num_nodes: int):
        """Every group is a torchrun of its own, also of one rank: distrain starts the groups of one machine."""
        if cluster.launched_externally:
            return None
        if num_nodes > 1:
            raise ValueError(
                "ddp_torchft on several nodes: start one torchrun per replica group yourself (REPLICA_GROUP_ID, "
                "NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE set; torchft_lighthouse on one host); distrain starts the "
                "groups of one machine"
            )
        from distrain.launch import ReplicaGroupLauncher

        if self.lighthouse is not None:  # a lighthouse of the user's: said here, before any group starts
            _check_lighthouse(self.lighthouse, self.ft_timeout)
        return ReplicaGroupLauncher(nprocs, self.replica_groups, self.min_replicas, self.lighthouse, self.max_restarts)

    traits = Traits(reruns_steps=False)  # each replica group would decide alone whether to re-run or roll back

    # ---- which data this rank reads: its group's share, then its own within the group --------------------------
    @property
    def _replica_group(self) -> ReplicaGroup | None:
        """This process's group (None in the launching process, which starts the groups and trains nothing)."""
        return self.group or replica_group()

    @property
    def data_parallel_size(self) -> int:
        group = self._replica_group
        return (group.count if group else self.replica_groups) * self.world_size

    @property
    def data_parallel_rank(self) -> int:
        group = self._replica_group
        return (group.id if group else 0) * self.world_size + self.global_rank

    @property
    def layout_note(self) -> str:
        group = self._replica_group
        return f" (replica group {group.id} of {group.count})" if group else ""

    def all_gather_job_object(self, obj: Any) -> list:
        """This group's objects, then every group's through torchft's cross-group all-reduce: each group writes its
        JSON (not a pickle: peers' bytes are read here) into its own row of a zeroed buffer, and the sum is every
        row. A group outside the quorum leaves its row empty, and is missing from the list."""
        mine = self.all_gather_object(obj)
        if self.manager is None or self.group is None:
            return mine
        payload = json.dumps(mine).encode()
        sizes = torch.zeros(self.group.count, dtype=torch.int64)
        sizes[self.group.id] = len(payload)
        self.manager.allreduce(sizes, reduce_op=ReduceOp.SUM).wait()
        rows = torch.zeros(self.group.count, int(sizes.max()), dtype=torch.uint8)
        rows[self.group.id, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.manager.allreduce(rows, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored():
            return mine
        return [item for g, size in enumerate(sizes.tolist()) if size for item in json.loads(bytes(rows[g, :size]))]

    # ---- set-up -------------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        self.group = replica_group()
        if self.group is None:
            raise RuntimeError(
                "strategy ddp_torchft runs in replica groups: let distrain start them (no outside launcher), or start "
                "one torchrun per group with REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE and "
                f"{JOB_SECRET} set"
            )
        try:
            secret = job_secret()
        except ValueError as e:
            raise RuntimeError(f"strategy ddp_torchft, replica group {self.group.id}: {e}") from None
        super().setup_environment()  # this group's own process group
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at INFO
        torchft = _torchft()
        from distrain.checkpoint import peer_state  # torchft's transport: imported with torchft

        logging.getLogger("torchft").setLevel(logging.ERROR)  # its warnings are about NCCL's flight recorder
        _check_lighthouse(self.group.lighthouse, self.ft_timeout)
        pg_class = torchft.ProcessGroupNCCL if "nccl" in self.backend else torchft.ProcessGroupGloo
        self._forget_previous_manager()
        # a lighthouse on loopback is reachable from this machine only: every group is here, and so is every peer
        local = is_loopback_address(self.group.lighthouse)
        advertised = {"hostname": "127.0.0.1"} if local else {}  # the address the manager gives the lighthouse
        with _manager_server_on_loopback() if local else contextlib.nullcontext():
            self.manager = torchft.Manager(
                pg=pg_class(timeout=self.ft_timeout),
                load_state_dict=None,
                state_dict=None,
                min_replica_size=self.min_replicas,
                use_async_quorum=False,
                timeout=self.ft_timeout,
                quorum_timeout=self.ft_timeout,
                connect_timeout=self.ft_timeout,
                rank=self.global_rank,
                world_size=self.world_size,
                store_addr=os.environ["MASTER_ADDR"],
                store_port=int(os.environ["MASTER_PORT"]),
                lighthouse_addr=self.group.lighthouse,
                replica_id=f"distrain_replica_{self.group.id}",
                checkpoint_transport=peer_state.peer_state_transport(self.ft_timeout, secret, loopback=local),
                init_sync=True,  # step 0: every group starts from the first group's weights, whatever built them
                **advertised,
            )
        self._count_cross_group_bytes()
        self._hands_over_state = False  # a new manager (after a teardown) knows no state yet

    def _count_cross_group_bytes(self) -> None:
        """What this rank hands to the other groups, counted where it leaves (torchft's all-reduce, which
        ``semi_sync``'s LocalSGD and DiLoCo call too): ``cross_group_mb`` in the logged metrics."""
        allreduce = self.manager.allreduce

        def counted(tensor, *args, **kwargs):
            self.cross_group_bytes += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted

    def metrics(self) -> dict[str, float]:
        return {"cross_group_mb": round(self.cross_group_bytes / 2**20, 6)} if self.manager is not None else {}

    def _forget_previous_manager(self) -> None:
        """torchft's Manager finds its group's manager server through keys in torchrun's store (rank 0 of the group
        writes them, the others wait for them). That store outlives a restart of the group, so after one, a rank
        other than 0 would read the dead server's address and wait on it until ft_timeout, then fail again, each
        restart alike. Rank 0 deletes them first, and the group passes a barrier before any rank reads them."""
        if self.world_size == 1:
            return
        if self.global_rank == 0:
            from torch.distributed import TCPStore
            from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

            store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
            for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
                store.delete_key(key)
        self.barrier("torchft manager keys cleared")

    def _setup_training(self, model: nn.Module, optimizers: list, schedulers: list, loop: LoopFacts) -> SetUp:
        self._run_dir = loop.run_dir
        self._stop_vote, self._stop_agreed = 0.0, 0.0  # a new fit: no stop asked for yet
        if loop.live_state is not None and not self._hands_over_state:
            save, load = loop.live_state

            def take_over(state: dict) -> None:  # a peer's state, received in the quorum (before this step's data)
                in_meeting = state.pop("semi_sync_meeting", False) is True  # a peer's bytes: only a real True
                progress = state.get("progress")
                if in_meeting and not self._stepping and isinstance(progress, dict):
                    # taken before this group's step, from a peer inside its own: the peer counts that step once its
                    # meeting ends, and so does this group (a count that is not one is refused by the loader)
                    step = progress.get("global_step")
                    state["progress"] = {**progress, "global_step": step + 1 if type(step) is int else step}
                load(state)
                self._peer_in_meeting = in_meeting
                self._rejoined = True
                if self.is_global_zero:
                    print(
                        f"distrain: replica group {self.group.id} took over the live state of a running group at step "
                        f"{state['progress']['global_step']}",
                        flush=True,
                    )

            def served() -> dict:  # a peer in a semi-synchronous meeting is inside its optimizer's step
                return {**save(), "semi_sync_meeting": self._stepping} if self.semi_sync else save()

            self.manager.register_state_dict_fn("distrain", take_over, served)
            self._take_over = load
            self._hands_over_state = True
        if self.semi_sync:
            self._start_semi_sync(model, optimizers)
        return SetUp(model, optimizers, schedulers)

    def _start_semi_sync(self, model: nn.Module, optimizers: list) -> None:
        from distrain.strategies.semi_sync import SemiSync

        if len(optimizers) != 1:
            raise ValueError(f"ddp_torchft with semi_sync needs one optimizer (the inner one), got {len(optimizers)}")
        if self._semi is not None:
            self._semi.close()
        self._semi = SemiSync(
            self.semi_sync, self.manager, model, optimizers[0], self.sync_every, self.outer_lr, self.outer_momentum
        )
        self._met = False
        # registered after torchft's: the meeting (its post-hook) runs while _stepping is True
        optimizer = optimizers[0]
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "_stepping", True))
        optimizer.register_step_post_hook(lambda *_: setattr(self, "_stepping", False))

    def state_dict(self) -> dict:
        if self._semi is None:
            return {}
        return {**self._semi.state_dict(), "meetings": self.manager.current_step()}

    def load_state_dict(self, state: dict, source: str) -> None:
        if self._semi is None:
            return
        if state:
            meetings = state.get("meetings")
            if type(meetings) is not int or meetings < 0:
                raise ValueError(f"{source}: its semi-synchronous meetings count is {meetings!r}, not a count")
            self._semi.load_state_dict(state, source)
            # every group resumes at the same count: the first quorum then heals none of them (at step 0 torchft's
            # init_sync would give each the first group's state, and mid-round the groups' weights differ)
            self.manager.load_state_dict({"step": meetings, "batches_committed": self.manager.batches_committed()})
        else:  # a checkpoint of synchronous training: its weights are where the groups last met
            if self.semi_sync == "diloco":
                self._semi.engine._save_parameters()
            self._semi.engine._local_step = 0

    def teardown(self) -> None:
        """Close the semi-synchronous engine and shut torchft's manager down, then end the process group
        (``Strategy.teardown``)."""
        if self._semi is not None:
            self._semi.close()
            self._semi = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        super().teardown()

    # ---- the step -----------------------------------------------------------------------------------------------
    def start_step(self, step: int) -> bool:
        self._step = step + 1
        if self._semi is not None:
            return self._start_semi_step(step)
        manager = self.manager
        if self._rejoined:  # the loop re-read its position after taking a peer's state: this step's quorum is done
            self._rejoined = False
            return False
        if manager.current_step() != step:  # resumed from a checkpoint: the quorum compares the groups' steps
            manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})
        manager.start_quorum()  # synchronous: a group that fell behind has taken a peer's state when it returns
        self._in_step = True
        first, restarted, self._formed_a_quorum = not self._formed_a_quorum, self._restarted, True
        if self._ended_at is not None:  # it took a finished group's final state, and the loop still asks for steps
            raise RuntimeError(
                f"ddp_torchft: replica group {self.group.id} took the final state of the groups that had ended at step "
                f"{self._ended_at}; it ends there too rather than train on alone"
            )
        if self._restarted and self._meet_another_group(step):
            return True  # it took a finished group's final state: the loop reads its position (the end) from there
        if manager.current_step() == 0:  # every group in the quorum is starting (a later one took a peer's step)
            self._wait_for_every_group(step)
        elif first and not restarted and manager.current_step() == step:  # every group in it resumed at this step
            self._wait_for_every_group(step)
        groups = manager.num_participants()
        if groups != self._groups_in_quorum and self.is_global_zero:
            print(
                f"distrain: replica group {self.group.id} at step {manager.current_step() + 1}: {groups} of "
                f"{self.group.count} replica groups in the quorum",
                flush=True,
            )
        self._groups_in_quorum = groups
        return self._rejoined

    def _start_semi_step(self, step: int) -> bool:
        """Semi-synchronous: the groups meet in torchft's optimizer hook every ``sync_every`` steps, not here. Here
        only the first step of this process forms a quorum (a fresh start: every group takes the first group's
        weights; a restarted group: it meets the running ones at their next meeting, takes their state and takes
        part in that meeting). True when the loop must re-read its data position."""
        if self._met:
            rejoined, self._rejoined = self._rejoined, False  # taken in a meeting, inside the last step
            return rejoined
        self._met, self._peer_in_meeting = True, False
        manager, restarted = self.manager, self._restarted
        manager.start_quorum()
        if restarted and self._meet_another_group(step):
            return True
        if not restarted and not self._rejoined:  # a start or a resume: every group of the quorum is at its start
            self._wait_for_every_group(step)
        if self._rejoined and self._peer_in_meeting:
            self._semi.meet_after_healing()  # the running groups' all-reduce waits for this group too
        else:
            # every group of this quorum is here, at its start: an all-reduce of one number holds a group that
            # serves its state until the groups that take it have it (it trains on only after), then the quorum is
            # committed, as torchft's every step is; so the first meeting finds them all at step 1, and torchft's
            # init_sync (which at step 0 gives every group the first group's state) does not throw away the other
            # groups' first round
            manager.allreduce(torch.zeros(1)).wait()
            manager.should_commit()
        rejoined, self._rejoined = self._rejoined, False
        return rejoined

    #: how long a restarted group waits for another group in its quorum before it takes the others for ended
    PEER_WAIT_S = 15.0

    def _meet_another_group(self, step: int) -> bool:
        """A restarted group never trains alone from its own state: alone, its weights would part from the job's
        for good (and with min_replicas=1 torchft lets it). Its first quorum with another group heals it as usual.
        When none comes within ``PEER_WAIT_S`` (the others finished while it restarted), it takes the final state of
        a group that finished — its last checkpoint — and so ends as that group did; with none to take, it stops,
        naming why, and the job's exit status says so. True when it took a finished group's state."""
        manager, deadline = self.manager, time.monotonic() + self.PEER_WAIT_S
        while manager.num_participants() < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            manager.start_quorum()
        if manager.num_participants() >= 2:
            self._restarted = False  # in the job again: the quorum healed it if it was behind
            return False
        finished = self._finished_peer_checkpoint()
        if finished is None:
            raise RuntimeError(
                f"ddp_torchft: replica group {self.group.id} restarted, but no other replica group joined it within "
                f"{self.PEER_WAIT_S:.0f} s and none left a final checkpoint beside its run directory: it stops here "
                f"rather than train alone from step {step} (its weights would part from the job's)"
            )
        path, state = finished
        self._take_over(state)
        self._restarted, self._ended_at = False, state["progress"]["global_step"]
        if self.is_global_zero:
            print(
                f"distrain: replica group {self.group.id} restarted after the other groups had finished: it takes the "
                f"final state at step {self._ended_at} from {path}, and ends there",
                flush=True,
            )
        return True

    def _finished_peer_checkpoint(self) -> tuple[str, dict] | None:
        """The newest ``last`` checkpoint among the other groups' run directories (``<run>/replica_<id>/checkpoints``,
        the layout distrain's groups write): this job's own files."""
        from pathlib import Path

        from distrain.checkpoint import io as ckpt_io

        if self._run_dir is None:
            return None
        newest = None
        for last in sorted(Path(self._run_dir).parent.glob("replica_*/checkpoints/last")):
            if last.parent.parent.name == f"replica_{self.group.id}" or ckpt_io.find_damage(last.resolve()):
                continue
            state = ckpt_io.read_state_file(last)
            if newest is None or state["progress"]["global_step"] > newest[1]["progress"]["global_step"]:
                newest = (str(last.resolve()), state)
        return newest

    def _wait_for_every_group(self, step: int) -> None:
        """The first step of a start, or of a resume from a checkpoint (``step``: the one it resumed at), waits up to
        ``ft_timeout`` until every group is in the quorum: groups start at different speeds, and a step (or, under
        ``semi_sync``, a meeting) without one is a smaller batch than the run asked for: a resume would then part
        from the run that was never stopped. Every group in a quorum sees the same count, so they ask again
        together; a run without failures is then the same as DDP on all the ranks, and a resume exact."""
        manager, deadline = self.manager, time.monotonic() + self.ft_timeout.total_seconds()
        while manager.num_participants() < self.group.count and time.monotonic() < deadline:
            time.sleep(0.1)
            manager.start_quorum()
        if manager.num_participants() < self.group.count and self.is_global_zero:
            late = "training starts without the others (they join as they come)"
            if step > 0:
                late = (
                    f"training resumes at step {step} without the others (they join as they come, taking the live "
                    "state): from here the run is not the one that was never stopped"
                )
            print(
                f"distrain: {manager.num_participants()} of {self.group.count} replica groups joined within "
                f"{self.ft_timeout.total_seconds():.0f} s; {late}",
                flush=True,
            )

    def agree_to_stop(self, vote: float) -> float | Callable[[], float]:
        """The groups agree on a stop with the gradients, not with a collective of their own (a group's process group
        holds only its ranks): the vote travels in the next step's all-reduce, over this group's ranks and then over
        every group in that step's quorum, and is read after that step, as on DDP's ranks. A group that dropped the
        step sends it again with the next one. Under ``semi_sync`` there is no per-step quorum: the group's ranks
        agree, and each group stops at the step its own signal lands."""
        if self._semi is not None:
            return super().agree_to_stop(vote)
        self._stop_vote = vote
        return lambda: self._stop_agreed

    def run_step(self, model: nn.Module, micro_batches: list, before_each=None) -> tuple[torch.Tensor, Any]:
        loss, output = super().run_step(model, micro_batches, before_each)  # no wrapper: gradients stay local
        self._average_gradients(model)
        return loss, output

    def _average_gradients(self, model: nn.Module) -> None:
        """The mean over this group's ranks, then over the groups in the quorum. A parameter without a gradient
        contributes zeros, so every group (also one that just restarted) all-reduces the same buckets. Under
        ``semi_sync`` the groups meet in the optimizer's hook instead: the mean over this group only."""
        across_groups = self._semi is None
        if across_groups and not self._in_step:  # torchft would fail an assertion in its all-reduce
            raise RuntimeError(
                "ddp_torchft: no quorum for this step; a loop of your own calls strategy.start_step(step) before "
                "reading a step's batches and strategy.commit_step() before the optimizer step (the Trainer does)"
            )
        if not across_groups and self.world_size == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if across_groups:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        buckets = _buckets([p.grad for p in params if p.grad is not None])
        for i, bucket in enumerate(buckets):
            flat = _flatten_dense_tensors(bucket)
            votes = across_groups and i == len(buckets) - 1  # the stop votes ride on the last bucket
            if votes:
                flat = torch.cat([flat, _stop_ballot(self._stop_vote).to(flat)])
            if self.world_size > 1:
                flat = distributed.all_reduce(flat, "mean")
            if across_groups:
                self.manager.allreduce(flat).wait()  # a failure is recorded: commit_step is then False
            if votes:
                flat, self._stop_votes = flat[: -len(STOP_VOTES)], flat[-len(STOP_VOTES) :]
            for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(averaged)

    def commit_step(self) -> bool:
        self._in_step = False
        if self._semi is not None:  # torchft commits at the meetings (a failed one goes back to the last)
            return True
        committed = self.manager.should_commit()
        if committed and self._stop_votes is not None:  # a failed step's all-reduce may hold anything
            self._stop_agreed = max(self._stop_agreed, _stop_outcome(self._stop_votes))
        self._stop_votes = None
        if not committed and self.is_global_zero:
            print(
                f"distrain: step {self._step} dropped (a replica group was lost during it); training goes on with the "
                "groups that remain",
                flush=True,
            )
        return committed


#: every stop vote there is (``training/preemption.py``: a stop asked for by the code, then the signal numbers). The
#: gradients' all-reduce averages, so a vote travels as a one-hot row, and the largest slot any rank filled wins.
STOP_VOTES = (0.5, *range(1, 65))


def _stop_ballot(vote: float) -> torch.Tensor:
    if vote and vote not in STOP_VOTES:
        raise ValueError(f"ddp_torchft: a stop vote must be one of 0, 0.5 or a signal number, not {vote}")
    return torch.tensor([float(v == vote) for v in STOP_VOTES])


def _stop_outcome(averaged: torch.Tensor) -> float:
    filled = [v for v, share in zip(STOP_VOTES, averaged.tolist()) if share > 0]
    return max(filled, default=0.0)


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][0].dtype != g.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    return buckets


@contextlib.contextmanager
def _manager_server_on_loopback():
    """torchft 0.2's Manager starts its gRPC server (rank 0 of a group) with ``bind=f"[::]:{port}"``, every interface,
    and has no argument for it (``hostname`` is only the address it advertises). While a Manager is made here, the
    ``ManagerServer`` it calls binds to 127.0.0.1 instead, same port; torchft's module is restored right after."""
    from torchft import manager as module

    original = module.ManagerServer

    def on_loopback(*args, bind: str, **kwargs):
        return original(*args, bind=f"127.0.0.1:{bind.rsplit(':', 1)[1]}", **kwargs)

    module.ManagerServer = on_loopback
    try:
        yield
    finally:
        module.ManagerServer = original


def _torchft():
    try:
        import torchft
    except ImportError:
        raise RuntimeError(
            "strategy ddp_torchft needs torchft: ./install.sh ft (pip install 'torchft>=0.2,<0.3')"
        ) from None
    return torchft


def _check_lighthouse(address: str, timeout: timedelta) -> None:
    """One line naming the address when no lighthouse answers there (torchft's own error comes after a minute). A
    port where nothing listens is said at once (torchft's client retries it until its timeout)."""
    from urllib.parse import urlsplit

    from torchft.coordination import LighthouseClient

    wait = min(timeout, timedelta(seconds=10))
    try:
        where = urlsplit(address)
        socket.create_connection((where.hostname, where.port or 80), timeout=wait.total_seconds()).close()
        LighthouseClient(address, connect_timeout=wait)
    except (OSError, ValueError, RuntimeError) as e:
        raise RuntimeError(
            f"ddp_torchft: no torchft lighthouse answers at {address} (TORCHFT_LIGHTHOUSE / distributed.lighthouse): "
            f"{(str(e).splitlines() or [type(e).__name__])[0][:200]}"
        ) from None


def _check_options(replica_groups, min_replicas, lighthouse, max_restarts, prefix: str) -> None:
    error = ConfigError if prefix else ValueError
    if not isinstance(replica_groups, int) or replica_groups < 1:
        raise error(f"{prefix}replica_groups must be a positive integer, got {replica_groups!r}")
    if not isinstance(min_replicas, int) or not 1 <= min_replicas <= replica_groups:
        raise error(f"{prefix}min_replicas must be in 1..replica_groups ({replica_groups}), got {min_replicas!r}")
    if lighthouse is not None and not (isinstance(lighthouse, str) and lighthouse.startswith(("http://", "https://"))):
        raise error(f"{prefix}lighthouse must be an address like http://host:29510, got {lighthouse!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise error(f"{prefix}max_restarts must be a non-negative integer, got {max_restarts!r}")


def _check_semi_sync(semi_sync, sync_every, outer_lr, outer_momentum, prefix: str) -> None:
    from distrain.strategies.semi_sync import MODES

    error = ConfigError if prefix else ValueError
    if semi_sync is not None and semi_sync not in MODES:
        raise error(f"{prefix}semi_sync must be local_sgd, diloco or null, got {semi_sync!r}")
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise error(f"{prefix}sync_every must be a positive integer, got {sync_every!r}")
    if not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < float("inf"):
        raise error(f"{prefix}outer_lr must be a positive number, got {outer_lr!r}")
    if not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise error(f"{prefix}outer_momentum must be in [0, 1), got {outer_momentum!r}")


def options_from_config(config, block_classes) -> dict:
    d = config.distributed
    return dict(
        replica_groups=d.replica_groups,
        min_replicas=d.min_replicas,
        lighthouse=d.lighthouse,
        max_restarts=d.max_restarts,
        semi_sync=d.semi_sync,
        sync_every=d.sync_every,
        outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum,
    )


def check(config) -> None:
    o = options_from_config(config, set())
    _check_options(o["replica_groups"], o["min_replicas"], o["lighthouse"], o["max_restarts"], "distributed.")
    _check_semi_sync(o["semi_sync"], o["sync_every"], o["outer_lr"], o["outer_momentum"], "distributed.")
    d = config.distributed
    if d.semi_sync is not None and d.strategy != "ddp_torchft":
        raise ConfigError(
            f"distributed.semi_sync={d.semi_sync} is for replica groups (strategy ddp_torchft), not {d.strategy}"
        )
    if d.strategy == "ddp_torchft" and d.num_nodes > 1 and replica_group() is None:
        raise ConfigError(
            f"distributed.num_nodes={d.num_nodes} with strategy ddp_torchft: distrain starts the replica groups of "
            "one machine; on several nodes start one torchrun per replica group yourself (REPLICA_GROUP_ID, "
            f"NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE and the same {JOB_SECRET} set; torchft_lighthouse on one host)"
        )


register(
    "ddp_torchft",
    TorchFTStrategy,
    "DDP over replica groups that go on when one dies and take it back when torchrun restarts it (torchft)",
    options_from_config,
    "distributed",
    check,
    cost_model="distrain.planner.models.replicated",
)
