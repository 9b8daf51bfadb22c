"""What a pipeline rank holds of the micro-batches in flight: torch's ``PipelineStage`` holding a micro-batch's
receive buffers and sends only while they are needed (``InFlightStage``), and the analysis of when a gradient sent
back is provably received (``release_sent_gradients``, which the planner's pipeline model shares). Private torch
APIs relied on are named where they are used, checked against torch 2.13.0."""

from __future__ import annotations

import copy

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _make_tensor_from_meta


def pipeline_stage(module, stage_index: int, num_stages: int, device, group) -> InFlightStage:
    """A ``PipelineStage`` (public) whose shapes are learned from the first micro-batch at run time, and which holds
    what it receives and sends only while its micro-batch needs it (``InFlightStage``)."""
    return InFlightStage(module, stage_index, num_stages, device, group=group)


class InFlightStage(PipelineStage):
    """A stage that holds a micro-batch's receive buffers and sends only while they are needed. torch 2.13 holds
    far more, which is what a rank runs out of memory on at many micro-batches:

    - ``PipelineStage`` allocates, once, a receive buffer for every micro-batch of a step, the activation from the
      stage before and the gradient from the stage after, for each of a rank's stages, for the life of the
      schedule. Here a micro-batch's buffers are allocated when its receive is posted and dropped once its
      backward is done.
    - GPipe and the looped schedules (``_PipelineScheduleRuntime``: Interleaved1F1B, LoopedBFS) keep each send's
      work, and through it the tensor sent, to the step's end. Here an activation sent forward is let go at its
      micro-batch's backward (the stage after has sent its gradient back, so it received the activation long
      ago), and, under a looped schedule, a gradient sent back once a later message from that rank proves it was
      received (``release_sent_gradients``). What is let go is the tensor the send holds (a detached alias, or
      the gradient itself), set to nothing: storage anything else holds stays.
    - The schedule keeps each micro-batch's loss to the step's end, and through its graph the last stage's received
      input and that input's gradient; a loss is detached once its backward is done.

    GPT-3 175B over 8 × 8 ranks at 64 micro-batches (docs/plan.md, ``K3``) held 36 GiB of buffers alone, where
    Megatron-LM holds only the micro-batches in flight.

    Relied on, checked on torch 2.13.0 (``stage.py``, ``schedules.py``): ``_setup_forward_recv_info(num_microbatches,
    has_backward)`` fills ``args_recv_info[chunk]`` with ``_RecvInfo``s, each chunk's alike but for its buffer;
    ``_create_grad_recv_info`` makes one chunk's ``grad_recv_info``; ``get_fwd_recv_ops`` / ``get_bwd_recv_ops``
    post a chunk's receives into ``info.buffer``, a buffer of None with a ``tensor_meta`` being a receive not yet
    posted; ``get_fwd_send_ops`` / ``get_bwd_send_ops`` return ``P2POp``s of the tensors sent; a looped schedule
    calls ``forward_one_chunk`` / ``backward_one_chunk`` once it has waited for the chunk's receives;
    ``_make_tensor_from_meta`` (``_utils.py``) is how torch makes a buffer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sent_forward: dict[int, list[torch.Tensor]] = {}
        self.sent_gradients: _SentGradients | None = None  # a looped schedule's (release_sent_gradients)

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # one chunk's infos (and one buffer, dropped here)
        first = self.args_recv_info[0]
        _release(first)
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = _unallocated(first)

    def _create_grad_recv_info(self, act_send_info):
        infos = _unallocated(super()._create_grad_recv_info(act_send_info))
        _release(infos)
        return infos

    def _allocate(self, infos):
        for info in _received(infos):
            if info.buffer is None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self._sent_forward[fwd_chunk_id] = [op.tensor for op in ops]
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if self.sent_gradients is not None:
            self.sent_gradients.sent[(self.stage_index, bwd_chunk_id)] = [op.tensor for op in ops]
        return ops

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if self.sent_gradients is not None:
            _let_go(self.sent_gradients.reached("F", self.stage_index, fwd_chunk_id))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        if self.sent_gradients is not None:
            _let_go(self.sent_gradients.reached("B", self.stage_index, bwd_chunk_id))
        result = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward:  # else the weights' backward, to come, may still need the input
            _let_go(self._sent_forward.pop(bwd_chunk_id, ()))
            _release(self.args_recv_info[bwd_chunk_id])
            _release(self.grad_recv_info.get(bwd_chunk_id, ()))
            if loss is not None and loss.grad_fn is not None and not loss._is_view():
                loss.detach_()
        return result

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        # an evaluation's forwards, which no backward releases; the step before's sends, waited for at its end
        self._sent_forward.clear()
        if self.sent_gradients is not None:
            self.sent_gradients.sent.clear()
        for infos in (*self.args_recv_info.values(), *self.grad_recv_info.values()):
            _release(infos)


def _received(infos):
    return [i for i in infos if not i.is_root_arg and i.tensor_meta is not None]


def _unallocated(infos):
    # a copy of each: the chunks' infos must not share one buffer
    return tuple(copy.copy(i) for i in infos)


def _release(infos):
    for info in _received(infos):
        info.buffer = None


def _let_go(tensors):
    with torch.no_grad():
        for tensor in tensors:
            tensor.set_()


class _SentGradients:
    """A looped schedule's gradients sent back, on one rank: each is let go when this rank's compute that first
    waits for a message its receiver sent after consuming it begins (``release_sent_gradients``)."""

    def __init__(self, releases: dict[tuple[str, int, int], list[tuple[int, int]]]):
        self.releases = releases
        self.sent: dict[tuple[int, int], list[torch.Tensor]] = {}

    def reached(self, kind: str, stage: int, chunk: int) -> list[torch.Tensor]:
        """The tensors sent that this compute's received messages prove were received."""
        return [t for sent in self.releases.get((kind, stage, chunk), ()) for t in self.sent.pop(sent, ())]


def release_sent_gradients(schedule, stages) -> None:
    """Under a looped schedule (``_PipelineScheduleRuntime``), let each of this rank's stages go of a gradient it
    sent back once the rank it went to has provably received it: that rank waited for it before its backward of
    that micro-batch, and any message it sends this rank after that backward is waited for here before a forward
    (an activation) or a backward (a gradient, with 2 ranks). The schedule is torch's own lowered order of every
    rank's actions, ``pipeline_order_with_comms`` (``stage_index_to_group_rank``, ``rank``: checked on torch 2.13.0);
    a gradient no later message vouches for (the last backwards of a step) stays to the step's end, as torch keeps
    it. Other schedules: nothing (1F1B waits for each send; GPipe sends nothing back to this rank)."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    registry = (
        _SentGradients(_gradient_releases(order, schedule.stage_index_to_group_rank)[schedule.rank]) if order else None
    )
    for stage in stages:
        stage.sent_gradients = registry


def sent_gradient_releases(orders: dict[int, list[tuple[bool, int, int]]], pipeline: int):
    """What ``release_sent_gradients`` lets each rank go of, and where, for the planner: ``orders`` each rank's
    (forward?, stage, micro-batch) computes in order, stage s on rank s % pipeline, lowered to sends and receives as
    torch lowers a looped schedule's (``schedules._add_send_recv``, checked on torch 2.13.0)."""
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    compute = {
        r: [_Action(stage, Kind.FORWARD if forward else Kind.FULL_BACKWARD, chunk) for forward, stage, chunk in order]
        for r, order in orders.items()
    }
    stages = 1 + max(stage for order in orders.values() for _, stage, _ in order)
    lowered = _add_send_recv(compute, stage_to_rank=lambda s: s % pipeline, num_stages=stages)
    return _gradient_releases(lowered, {s: s % pipeline for s in range(stages)})


def _gradient_releases(order, to_rank) -> dict[int, dict[tuple[str, int, int], list[tuple[int, int]]]]:
    """{rank: {(kind, stage, chunk) of a compute of that rank: the (stage, chunk) gradients it sent that the
    compute's received messages prove received}}. The ranks run ``order`` (each rank's lowered actions) to the end, each
    compute that waits for a message waiting for its send; each rank keeps a vector clock, the last action of
    every rank known to have happened, which a message carries from its send to the compute that waits for it. A
    gradient sent back to rank q is proven received at the sender's first compute whose clock has reached q's
    backward of that stage and chunk (which waited for it): directly or through other ranks' messages."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    backwards = (Kind.FULL_BACKWARD, Kind.BACKWARD_INPUT)

    def awaited(rank, a):
        """The message a compute waits for: ("F", stage, chunk) an activation, ("B", stage, chunk) a gradient."""
        s = a.stage_index
        if a.computation_type == Kind.FORWARD and s > 0 and to_rank[s - 1] != rank:
            return ("F", s, a.microbatch_index)
        if a.computation_type in backwards and s + 1 in to_rank and to_rank[s + 1] != rank:
            return ("B", s, a.microbatch_index)
        return None

    position = {r: 0 for r in order}
    clock = {r: dict.fromkeys(order, -1) for r in order}
    messages: dict[tuple[str, int, int], dict[int, int]] = {}
    # each rank's computes that waited for a message, with what they knew then
    waited: dict[int, list[tuple[tuple[str, int, int], dict[int, int]]]] = {r: [] for r in order}
    moved = True
    while moved:
        moved = False
        for r, actions in order.items():
            while position[r] < len(actions):
                a, i = actions[position[r]], position[r]
                message = awaited(r, a)
                if message is not None and message not in messages:
                    break  # blocked on a send not yet made
                clock[r][r] = i
                if message is not None:
                    for q, known in messages[message].items():
                        clock[r][q] = max(clock[r][q], known)
                    waited[r].append((message, dict(clock[r])))
                if a.computation_type == Kind.SEND_F:
                    messages[("F", a.stage_index + 1, a.microbatch_index)] = dict(clock[r])
                elif a.computation_type == Kind.SEND_B:
                    messages[("B", a.stage_index - 1, a.microbatch_index)] = dict(clock[r])
                position[r] += 1
                moved = True
    consumed = {
        (r, b.stage_index, b.microbatch_index): i
        for r, actions in order.items()
        for i, b in enumerate(actions)
        if b.computation_type in backwards
    }
    releases: dict[int, dict[tuple[str, int, int], list[tuple[int, int]]]] = {r: {} for r in order}
    for r, actions in order.items():
        for a in actions:
            if a.computation_type != Kind.SEND_B:
                continue
            stage, chunk = a.stage_index, a.microbatch_index
            receiver = to_rank[stage - 1]
            at = consumed.get((receiver, stage - 1, chunk))
            proof = next((message for message, known in waited[r] if at is not None and known[receiver] >= at), None)
            if proof is not None:
                releases[r].setdefault(proof, []).append((stage, chunk))
    return releases
