"""Running a model as a pipeline on ``torch.distributed.pipelining`` (``PipelineStage`` + schedules).

Set-up (``PipelineBuild``): the PipelineSplit's blocks are divided into stages; this rank's stages become
``StageModule``s (the same layer objects as the user's model, so names, checkpoints and the
optimizer see one model); layers of other stages are dropped from the model once it is
initialized. A parameter two stages share (an output layer tied to the embedding) is held by both,
its gradients summed across them after each step, so both copies stay equal.

A step (``PipelineRunner.train``): the Trainer's micro-batches of one optimizer step are the
schedule's micro-batches (GPipe, 1F1B, Interleaved1F1B), so the global batch means what it means
under DDP. The last stage runs the user's ``training_step`` on each micro-batch with the model's
call answered from the pipeline's output (``PipelineSplit.answer``): the loss is the step's own,
divided by the number of micro-batches as the Trainer does. The step's loss reaches every stage by
one broadcast. Evaluation runs each batch through the pipeline forward only; the last stage runs
``validation_step``/``test_step``/``predict_step`` (predictions are broadcast to every stage).

torch's stages learn the shapes of what they send from the first micro-batch (one extra forward
and backward per new shape; our loss function recognizes that run and calls no user code), so a
step's micro-batches must share one shape (``PipelineSplit.pad_window`` pads token batches).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrain import compat
from distrain.config import Refusal
from distrain.module import loss_of, run_step
from distrain.parallel import pipeline_memory
from distrain.parallel.gradients import match_gradient_layouts
from distrain.parallel.layout import PP, ParallelLayout
from distrain.parallel.pipeline_split import PipelineSplit, split_blocks
from distrain.parallel.tensor_parallel import shared_parameters


class StageModule(nn.Module):
    """One pipeline stage: ``embed`` (first stage), a run of blocks, ``head`` (last stage). Its
    children are the user's own layers, so a stage holds no copy of anything."""

    def __init__(self, split: PipelineSplit, index: int, num_stages: int, blocks: range, runner: PipelineRunner | None):
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == num_stages - 1
        self.first_layers = nn.ModuleList(split.first if self.is_first else [])
        self.blocks = nn.ModuleList(split.blocks[i] for i in blocks)
        self.last_layers = nn.ModuleList(split.last if self.is_last else [])
        self.shared_layers = nn.ModuleList(split.every_stage)
        object.__setattr__(self, "split", split)  # not submodules: the split's functions reach the layers above
        object.__setattr__(self, "runner", runner)

    def forward(self, *received: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        return self.run(self.runner.batch(int(mb.reshape(-1)[0])), *received)

    def run(self, batch: Any, *received: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This stage on a micro-batch (the planner traces stages through this too); with the split's ``aux_loss``,
        its output and the auxiliary losses' sum so far."""
        x = self.split.embed(batch) if self.is_first else received[0]
        context = self.split.context(batch, x)
        for block in self.blocks:
            x = block(x, **context)
        out = self.split.head(x) if self.is_last else x
        if self.split.aux_loss is None:
            return out
        return out, self.split.stage_aux(self.blocks, None if self.is_first else received[1])


@dataclass
class PipelineBuild:
    """Which blocks each stage holds, which stages this rank runs, what it keeps of the model."""

    split: PipelineSplit
    ranges: list[range]
    local: list[int]  # this rank's stage indices (several for interleaved schedules)
    keep: list[nn.Module]  # the split's layers this rank holds (its stages', and holders of tied weights)
    ties: list[tuple[str, list[int]]]  # tied parameters held by several stages: (name, the stages holding it)

    @classmethod
    def create(cls, module: nn.Module, split: PipelineSplit, layout: ParallelLayout, pp_rank: int, split_points=None):
        num_stages = layout.num_stages
        ranges = split_blocks(split, num_stages, split_points, root=module)
        local = [s for s in range(num_stages) if s % layout.pipeline == pp_rank]  # torch's loop-style placement
        check_split_covers(module, split)
        owned = {s: _stage_layers(split, ranges, s) for s in range(num_stages)}
        groups = shared_parameters(module)
        names = {id(p): n for n, p in module.named_parameters()}  # the first name of each (tied) parameter
        ties: list[tuple[str, list[int]]] = []
        keep = [m for s in local for m in owned[s]]
        for group in groups:
            holders = [m for m, _ in group]
            stages = [s for s in range(num_stages) if any(_inside(h, owned[s]) for h in holders)]
            if len(stages) > 1:
                name = names[id(getattr(group[0][0], group[0][1]))]
                ties.append((name, stages))
            if any(s in local for s in stages):  # keep every holder: the parameter keeps all its names
                keep.extend(h for h in holders if h not in keep)
        return cls(split, ranges, local, keep, ties)

    def stage_modules(self, runner: PipelineRunner | None) -> list[StageModule]:
        n = len(self.ranges)
        return [StageModule(self.split, s, n, self.ranges[s], runner) for s in self.local]

    def prune(self, module: nn.Module) -> None:
        """Drop the split's layers this rank does not hold from ``module`` (after initialization, which
        runs on the whole model so every rank draws the same random numbers)."""
        kept = {id(m) for root in self.keep for m in root.modules()}
        parts = [*self.split.first, *self.split.last, *self.split.every_stage, *self.split.blocks]
        where = {id(child): (parent, name) for parent in module.modules() for name, child in parent.named_children()}
        for part in parts:
            if id(part) not in kept and id(part) in where:
                parent, name = where[id(part)]
                parent._modules[name] = None


def _stage_layers(split: PipelineSplit, ranges: list[range], stage: int) -> list[nn.Module]:
    layers = [split.blocks[i] for i in ranges[stage]] + list(split.every_stage)
    if stage == 0:
        layers += list(split.first)
    if stage == len(ranges) - 1:
        layers += list(split.last)
    return layers


def _inside(module: nn.Module, roots: list[nn.Module]) -> bool:
    return any(module is m for root in roots for m in root.modules())


def check_split_covers(module: nn.Module, split: PipelineSplit) -> None:
    """Every parameter must belong to some stage, or it would never be trained."""
    parts = [*split.first, *split.last, *split.every_stage, *split.blocks]
    covered = {id(p) for part in parts for p in part.parameters()}
    stray = [n for n, p in module.named_parameters() if id(p) not in covered]
    if stray:
        raise Refusal(
            f"the pipeline split of {type(module).__name__} places {', '.join(stray[:4])}"
            f"{' …' if len(stray) > 4 else ''} on no stage; add their layers to the split's first/last/every_stage"
        )


class PipelineRunner:
    """The schedule around this rank's stages, for one training step or one evaluation batch."""

    def __init__(
        self, module: nn.Module, build: PipelineBuild, layout: ParallelLayout, mesh, schedule: str, device, precision
    ):
        self.module, self.split, self.build, self.layout, self.mesh = module, build.split, build, layout, mesh
        self.schedule_name = schedule
        self.device, self.precision = device, precision
        self.group = mesh.get_group(PP)
        self.last_rank = dist.get_global_rank(self.group, layout.pipeline - 1)  # the rank of the last stage
        self.stage_modules = build.stage_modules(self)
        stage = pipeline_memory.pipeline_stage
        self.stages = [stage(m, m.index, layout.num_stages, device, self.group) for m in self.stage_modules]
        self.holds_last = any(m.is_last for m in self.stage_modules)
        self.tie_groups: list = []
        self._schedule = None
        self._schedule_key = None
        self._window: list[tuple[int, Any]] = []
        self._targets: list[torch.Tensor] = []
        #: a step of fewer micro-batches than the stages was said on the console (by the strategy's set-up, or here)
        self.warned_short = False

    def finish(self) -> None:
        """Once the model holds its final (sharded, initialized, pruned) parameters."""
        self.tie_groups = self._tie_groups(self.mesh)

    # ---- what the stages read while a step runs --------------------------------------------------------------
    def batch(self, index: int) -> Any:
        return self._window[index][1]

    # ---- training ------------------------------------------------------------------------------------------------
    def train(self, micro_batches: list[tuple[int, Any]], before_each, loss_parallel) -> tuple[torch.Tensor, Any]:
        """One optimizer step's forward and backward; returns (the step's mean loss on every stage, the
        last ``training_step`` output on the last stage, else that loss)."""
        window = self._prepare(micro_batches)
        n = len(window)
        self._losses: list[torch.Tensor | None] = [None] * n
        self._output = None
        self._scale = 1.0 / n
        self._before_each = before_each  # the loop's own bookkeeping, before each training_step
        schedule = self._schedule_for(n, training=True)
        with loss_parallel, self.precision.autocast():
            compat.run_pipeline_schedule(schedule, self.stages, *self._micro_batch_args(n), backward=True)
        if self.holds_last:
            step_loss = torch.stack(self._losses).mean()
        else:
            step_loss = torch.zeros((), device=self.device)
        step_loss = step_loss.detach().float().to(self.device)
        dist.broadcast(step_loss, src=self.last_rank, group=self.group)  # every stage reports the step's loss
        match_gradient_layouts(self.module.parameters())
        self._sum_tied_gradients()
        return step_loss, (self._output if self.holds_last else step_loss)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        index = self._index_of(target)
        if index is None:  # torch's shape inference on a copy of the first micro-batch: no user code runs
            return _surrogate_loss(output)
        batch_idx, batch = self._window[index]
        if self._before_each is not None:
            self._before_each(batch)
        with self._answering(output, batch):
            step_output = run_step(self.module, "training_step", batch, batch_idx)
        loss = whole_tensor(loss_of(step_output))
        self._losses[index] = loss.detach().float()
        self._output = step_output
        return self.precision.scale_loss(loss * self._scale)

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self, step_name: str, batch: Any, batch_idx: int, loss_parallel) -> Any:
        """``step_name`` on one batch: its output on the last stage (for ``predict_step``: on every
        stage), None elsewhere."""
        self._prepare([(batch_idx, batch)])
        self._eval_step, self._eval_result = step_name, None
        schedule = self._schedule_for(1, training=False)
        with loss_parallel:
            compat.run_pipeline_schedule(schedule, self.stages, *self._micro_batch_args(1), backward=False)
        result = self._eval_result
        if step_name == "predict_step":
            box = [result if self.holds_last else None]
            dist.broadcast_object_list(box, src=self.last_rank, group=self.group, device=self._object_device())
            result = box[0]
        return result

    def _eval_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        index = self._index_of(target)
        if index is not None:
            batch_idx, batch = self._window[index]
            with self._answering(output, batch):
                self._eval_result = whole_tensors(getattr(self.module, self._eval_step)(batch, batch_idx))
        return torch.zeros((), device=self.device)

    # ---- the schedule -------------------------------------------------------------------------------------------
    def _prepare(self, micro_batches: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        batches = [b for _, b in micro_batches]
        if self.split.pad_window is not None and len({_shapes(b) for b in batches}) > 1:
            batches = self.split.pad_window(batches)
        self._window = [(i, b) for (i, _), b in zip(micro_batches, batches)]
        return self._window

    def _micro_batch_args(self, n: int):
        # the first stage's input and every stage's keyword: the micro-batch's index (stages read the
        # batch itself from the runner); the target: the same index, as an object of our own, so the
        # loss function can tell torch's shape inference from a real micro-batch
        self._targets = [torch.tensor(i) for i in range(n)]
        args = [(torch.tensor([i]),) for i in range(n)]
        kwargs = [{"mb": torch.tensor([i])} for i in range(n)]
        return args, kwargs, self._targets

    def _index_of(self, target: torch.Tensor) -> int | None:
        return next((i for i, t in enumerate(self._targets) if t is target), None)

    def _schedule_for(self, n: int, training: bool):
        shapes = tuple(_shapes(b) for _, b in self._window)
        key = (training, n, shapes)
        if key != self._schedule_key:  # a fresh schedule re-learns the shapes it sends (once per new shape)
            self._schedule = self._make_schedule(n, training)
            pipeline_memory.release_sent_gradients(self._schedule, self.stages)
            self._schedule_key = key
        return self._schedule

    def _make_schedule(self, n: int, training: bool):
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        loss_fn = self._loss if training else self._eval_loss
        multi = len(self.stages) > 1
        name = self.schedule_name if training else ("LoopedBFS" if multi else "GPipe")
        if name == "1F1B" and n < self.layout.pipeline:  # 1F1B needs a micro-batch per stage in flight
            self._warn_short(n)
            name = "GPipe"
        classes = {
            "GPipe": ScheduleGPipe,
            "1F1B": Schedule1F1B,
            "Interleaved1F1B": ScheduleInterleaved1F1B,
            "LoopedBFS": ScheduleLoopedBFS,
        }
        target = self.stages if multi else self.stages[0]
        try:
            return classes[name](target, n, loss_fn=loss_fn, scale_grads=False)
        except ValueError:  # e.g. Interleaved1F1B with a micro-batch count its rounds do not divide
            if not multi:
                raise
            self._warn_short(n)
            return ScheduleLoopedBFS(target, n, loss_fn=loss_fn, scale_grads=False)

    def _warn_short(self, n: int) -> None:
        if not self.warned_short and dist.get_rank() == 0:
            warnings.warn(
                f"distrain: a pipeline step of {n} micro-batch(es) on {self.layout.pipeline} stages cannot run "
                f"{self.schedule_name}; it runs breadth-first instead (same result, more idle stages). Use a multiple "
                "of the stages for accumulate_grad_batches (training.gradient_accumulation_steps)",
                stacklevel=2,
            )
            self.warned_short = True

    # ---- the model call the user's step makes on the last stage ------------------------------------------------
    @contextlib.contextmanager
    def _answering(self, output: Any, batch: Any):
        split, calls = self.split, []
        name = type(split.model).__name__

        def forward(*args, **kwargs):
            if calls:
                raise RuntimeError(
                    f"under the pipeline strategy a step calls {name} once per micro-batch (its output comes from the "
                    "last stage); this step called it twice"
                )
            calls.append(True)
            given, expected = split.call_inputs(*args, **kwargs), split.batch_inputs(batch)
            if given is not expected and not (given.shape == expected.shape and torch.equal(given, expected)):
                raise RuntimeError(
                    f"under the pipeline strategy the step must call {name} on its micro-batch's own inputs (the "
                    "pipeline's first stage embedded those); it passed other inputs"
                )
            return split.answer_call(output, *args, **kwargs)

        split.model.forward = forward  # an instance attribute shadows the class's forward for this call only
        try:
            yield
        finally:
            del split.model.forward
        if not calls:
            raise RuntimeError(
                f"under the pipeline strategy the step's result must come from calling {name} (the pipeline's "
                "output answers that call); the step did not call it"
            )

    # ---- tied parameters held by several stages ---------------------------------------------------------------------
    def _tie_groups(self, mesh) -> list[tuple[torch.nn.Parameter, Any]]:
        """For each parameter several pipeline ranks hold: this rank's copy and the group of those ranks
        (with the same data- and tensor-parallel position). Every rank creates every group, in one order."""
        params = dict(self.module.named_parameters())
        out = []
        coords = mesh.mesh  # (pipeline, data, tensor) → global rank
        me = dist.get_rank()
        for name, stages in self.build.ties:
            pp_ranks = sorted({s % self.layout.pipeline for s in stages})
            if len(pp_ranks) < 2:
                continue  # both holders on this rank: one parameter, its gradients add up by themselves
            mine = None
            if pp_ranks == list(range(self.layout.pipeline)):
                mine = self.group
            else:
                for d in range(coords.shape[1]):
                    for t in range(coords.shape[2]):
                        ranks = [int(coords[p, d, t]) for p in pp_ranks]
                        group = dist.new_group(ranks)
                        if me in ranks:
                            mine = group
            if name in params and mine is not None:
                out.append((params[name], mine))
        return out

    def _sum_tied_gradients(self) -> None:
        for param, group in self.tie_groups:
            if param.grad is not None:
                local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                dist.all_reduce(local, group=group)

    def counted_once(self) -> set[int]:
        """Parameters this rank holds whose gradient another stage counts in the global norm (a tied copy)."""
        params = dict(self.module.named_parameters())
        skip = set()
        for name, stages in self.build.ties:
            first_rank = min(s % self.layout.pipeline for s in stages)
            if name in params and dist.get_rank(self.group) != first_rank:
                skip.add(id(params[name]))
        return skip

    def _object_device(self):
        return self.device if self.device.type == "cuda" else None


def _shapes(batch: Any) -> tuple:
    from torch.utils._pytree import tree_leaves

    return tuple(tuple(t.shape) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))


def _surrogate_loss(output: Any) -> torch.Tensor:
    """A loss of the right kind for torch's shape inference: gradients of the right shapes (zeros)."""
    from torch.utils._pytree import tree_leaves

    tensors = [whole_tensor(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum((t.float().sum() * 0.0 for t in tensors), torch.zeros(()))


def whole_tensor(x: Any) -> Any:
    """A DTensor as the whole tensor it stands for (differentiably); anything else as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def whole_tensors(x: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: whole_tensor(t).detach() if isinstance(t, torch.Tensor) else t, x)
