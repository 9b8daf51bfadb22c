"""What the planner knows about a model, learned without allocating it.

A ``ModelSpec`` says how to build the training module with its layers on the meta device and how
to make a micro-batch. From it come the parameter statistics (``ParamStats``, from the meta model)
and a traced training micro-step (``trace_step``): the module's own ``training_step``, backward and
optimizer step run under fake tensors (shapes and dtypes, no storage) inside torch's
``MemTracker``, which records how many bytes of activations, temporaries, gradients and optimizer
state are alive after every operation. A 7B model traces in seconds and a few hundred MB.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from distrain.module import Module, loss_of, run_step
from distrain.parallel import expert_parallel
from distrain.planner import fake
from distrain.planner.work import StepWork, WorkCounter
from distrain.strategies import layers
from distrain.strategies.layers import apply_activation_checkpointing
from distrain.strategies.sharded_init import to_empty_keeping_ties


@dataclass
class ModelSpec:
    """How to build a training module without memory, and how to make its micro-batches."""

    name: str
    build: Callable[[], Module]
    """The ``distrain.Module`` with every layer built on the meta device (``configure_model`` done)."""
    make_batch: Callable[[int], Any]
    """A micro-batch of ``b`` samples, as the train loader gives it (small real CPU tensors)."""
    seq_len: int
    block_classes: tuple[type, ...] = ()
    """The repeated layer (transformer block): FSDP's unit and what activation checkpointing wraps."""
    hidden_size: int | None = None
    with_depth: Callable[[int], ModelSpec] | None = None
    """The same model with ``n`` blocks: deep models are traced at two small depths and extrapolated."""
    num_blocks: int = 0
    experts: int = 0
    """Experts per mixture-of-experts layer that expert parallelism can split (``expert_parallel.splittable_experts``);
    0: none."""
    selective_checkpointing: bool = False
    """Its checkpointed blocks recompute per operation (``training.activation_checkpointing_mode: selective``)."""
    key: tuple | None = None
    """What the model is, by content (the built-in GPT's arguments, a Hugging Face config's every field): two specs
    with one key trace alike, so a process traces each once (``trace_step``). None: not known by content (a module
    of your own, which may change between two plans), traced every time."""

    # ---- the built-in GPT, Hugging Face configs, any module -------------------------------------
    @classmethod
    def builtin_gpt(
        cls, model_name: str, seq_len: int, n_layer: int | None = None, n_experts: int = 0, top_k: int = 2
    ) -> ModelSpec:
        """The built-in GPT (``n_experts``: each block a mixture of that many experts, ``top_k`` per token)."""
        from distrain.models.gpt import Block, gpt_config
        from distrain.models.lm import GPTLanguageModel

        moe = {"n_experts": n_experts, "top_k": top_k} if n_experts else {}
        cfg = gpt_config(model_name, block_size=seq_len, **({"n_layer": n_layer} if n_layer else {}), **moe)

        def build() -> Module:
            module = GPTLanguageModel(model_name, block_size=seq_len, **moe)
            with _on_meta():
                from distrain.models.gpt import GPT

                module.gpt = GPT(cfg)
            return module

        def make_batch(b: int):
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, cfg.vocab_size, (b, seq_len + 1), generator=g)
            return x[:, :-1], x[:, 1:]

        return cls(
            name=model_name,
            build=build,
            make_batch=make_batch,
            seq_len=seq_len,
            block_classes=(Block,),
            hidden_size=cfg.n_embd,
            with_depth=lambda n: cls.builtin_gpt(model_name, seq_len, n_layer=n, n_experts=n_experts, top_k=top_k),
            num_blocks=cfg.n_layer,
            experts=cfg.n_experts,
            key=("builtin_gpt", model_name, seq_len, n_layer, n_experts, top_k),
        )

    @classmethod
    def huggingface(
        cls, name: str, seq_len: int, task: str | None = None, num_labels: int | None = None, hf_config=None
    ) -> ModelSpec:
        """A Hugging Face model from its config alone (a local directory with ``config.json``, or a
        hub name): the structure is built on the meta device, no weights are read."""
        from distrain.hf import models
        from distrain.hf.tasks import TASK_MODULES, config_dict

        config = hf_config if hf_config is not None else models.load_config(name)
        task = models.infer_task(config, task, name)
        if task == "sequence_classification" and num_labels:
            config.num_labels = num_labels
        limit = getattr(config, "max_position_embeddings", None)
        seq_len = min(seq_len, limit) if limit else seq_len
        skeleton = models.build_skeleton(task, config)
        blocks = tuple(layers.block_classes(skeleton))
        depth_key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(config, k)), None)

        def build() -> Module:
            module = TASK_MODULES[task](model_name=name, hf_config=config_dict(config), pretrained=False)
            module.model = models.build_skeleton(task, config)
            return module

        vocab = getattr(config, "vocab_size", 2)

        def make_batch(b: int):
            # full-length samples, no padding: the longest batch. No attention mask, which is what an
            # all-ones mask amounts to (transformers then skips the mask and SDPA runs causal/unmasked;
            # a fake mask's values cannot be read, so it would take the explicit-mask path instead)
            g = torch.Generator().manual_seed(0)
            batch = {"input_ids": torch.randint(0, vocab, (b, seq_len), generator=g)}
            if task == "sequence_classification":
                batch["labels"] = torch.zeros(b, dtype=torch.long)
            return batch

        def with_depth(n: int) -> ModelSpec:
            shallow = copy.deepcopy(config)
            setattr(shallow, depth_key, n)
            return cls.huggingface(name, seq_len, task, num_labels, hf_config=shallow)

        return cls(
            name=name,
            build=build,
            make_batch=make_batch,
            seq_len=seq_len,
            block_classes=blocks,
            hidden_size=getattr(config, "hidden_size", None),
            with_depth=with_depth if depth_key else None,
            num_blocks=getattr(config, depth_key) if depth_key else 0,
            experts=expert_parallel.splittable_experts(skeleton),
            key=_content_key_of_config(name, task, seq_len, config),
        )

    @classmethod
    def from_module(cls, module: Module, loader, block_classes=None) -> ModelSpec:
        """Any ``distrain.Module`` and its train loader (the ``Trainer(strategy="auto")`` path). The
        module is copied onto the meta device (its tensors are not copied) and configured there;
        batches are collated from the loader's first samples."""

        def build() -> Module:
            meta = _meta_copy(module)
            if not getattr(module, "_distrain_configured", False):
                with _on_meta():
                    meta.configure_model()
            return meta

        def make_batch(b: int):
            dataset, collate = loader.dataset, loader.collate_fn
            return collate([dataset[i % len(dataset)] for i in range(b)])

        probe = build()
        blocks = tuple(block_classes or layers.block_classes(probe))
        first = make_batch(1)
        lengths = [t.shape[-1] for t in tree_flatten(first)[0] if isinstance(t, torch.Tensor) and t.dim() >= 2]
        return cls(
            name=type(module).__name__,
            build=build,
            make_batch=make_batch,
            seq_len=max(lengths, default=1),
            block_classes=blocks,
            hidden_size=layers.hidden_size_of(probe),
            num_blocks=sum(isinstance(m, blocks) for m in probe.modules()) if blocks else 0,
            experts=expert_parallel.splittable_experts(probe),
        )

    def with_low_precision_norms(self) -> ModelSpec:
        """This model with its norms computed in the compute dtype (``training.low_precision_norms``), at every
        depth the planner traces."""
        from distrain.models.norms import low_precision_norms

        def build() -> Module:
            module = self.build()
            low_precision_norms(module)
            return module

        deeper = self.with_depth
        return replace(
            self,
            build=build,
            with_depth=None if deeper is None else (lambda n: deeper(n).with_low_precision_norms()),
            key=None if self.key is None else (*self.key, "low_precision_norms"),
        )

    def with_selective_checkpointing(self) -> ModelSpec:
        """This model with its checkpointed blocks recomputed per operation, at every depth the planner traces."""
        deeper = self.with_depth
        return replace(
            self,
            selective_checkpointing=True,
            with_depth=None if deeper is None else (lambda n: deeper(n).with_selective_checkpointing()),
        )

    def portable(self, micro_batch: int) -> ModelSpec:
        """This spec for a process that did not fork from this one (``simulate.Started``): ``build`` and
        ``make_batch`` are closures over this process's objects (a user's module, a loader), so the module is built
        here, on the meta device, and travels pickled with the one micro-batch a simulation reads."""
        import functools

        template = self.build()
        return ModelSpec(
            name=self.name,
            build=functools.partial(copy.deepcopy, template),
            make_batch=_PortableBatch(micro_batch, self.make_batch(micro_batch)),
            seq_len=self.seq_len,
            block_classes=self.block_classes,
            hidden_size=self.hidden_size,
            num_blocks=self.num_blocks,
            experts=self.experts,
            selective_checkpointing=self.selective_checkpointing,
            key=self.key,
        )


def _content_key_of_config(name: str, task: str, seq_len: int, config) -> tuple | None:
    """A Hugging Face model's ``ModelSpec.key``: every field of its config (None where one does not serialize)."""
    try:
        return ("huggingface", name, task, seq_len, config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return None


class _PortableBatch:
    """A portable spec's one micro-batch (``ModelSpec.portable``). It pickles as ``torch.save`` writes it, and is
    loaded when unpickled (not later, under fake tensors): tensors that share storage (``x[:, :-1]`` and
    ``x[:, 1:]``) still share it, so a simulation counts the batch's bytes as a forked one does."""

    def __init__(self, micro_batch: int, batch):
        self.micro_batch, self.batch = micro_batch, batch

    def __call__(self, b: int):
        if b != self.micro_batch:
            raise ValueError(f"this spec carries a micro-batch of {self.micro_batch} samples, not {b}")
        return self.batch

    def __getstate__(self):
        import io

        buffer = io.BytesIO()
        torch.save(self.batch, buffer)
        return self.micro_batch, buffer.getvalue()

    def __setstate__(self, state):
        import io

        self.micro_batch, saved = state
        self.batch = torch.load(io.BytesIO(saved), weights_only=True)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors: nothing is allocated, ties stay tied."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _on_meta():
    """Build on the meta device without running the initializers: they write no values there, and on meta tensors
    ``normal_`` and the like go through torch's reference implementations, whose first use imports torch._dynamo
    (0.85 s, paid by every ``Trainer(strategy="auto")`` start whose plan was kept)."""
    return layers.device_init_context(torch.device("meta"), dtype=None, empty_init=True)


# ---- parameters ----------------------------------------------------------------------------------------
@dataclass
class ParamStats:
    """Counts from the meta model: what model-state formulas need."""

    numel: int
    """Unique parameters (tied weights once)."""
    trainable: int
    shapes: list[tuple[int, ...]]
    """Each unique trainable parameter's shape, in registration order."""
    largest_param: int
    largest_layer: int
    """The module with the most parameters of its own (DeepSpeed's ``largest_layer_params``)."""
    buffer_bytes: int

    @classmethod
    def of(cls, module: nn.Module) -> ParamStats:
        unique = {id(p): p for p in module.parameters()}.values()
        trainable = [p for p in unique if p.requires_grad]
        return cls(
            numel=sum(p.numel() for p in unique),
            trainable=sum(p.numel() for p in trainable),
            shapes=[tuple(p.shape) for p in trainable],
            largest_param=max((p.numel() for p in trainable), default=0),
            largest_layer=max(
                (sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0
            ),
            buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        )


# ---- activation checkpointing: which blocks --------------------------------------------------------------
def checkpoint_policy(block_classes: tuple[type, ...], blocks: int | None, selective: bool = False) -> dict | None:
    """The policy that checkpoints the first ``blocks`` blocks (``None``: every block; 0: none), each whole or, where
    ``selective``, per operation (``layers.selective_recomputation``).

    The first ones, because their recomputation comes last in backward, when the other blocks'
    activations are already freed: the same count saves the most peak memory there."""
    if not block_classes or blocks == 0:
        return None
    policy: dict[str, Any] = {"classes": set(block_classes)}
    if blocks is not None:
        policy["count"] = blocks
    if selective:
        policy["selective"] = True
    return policy


# ---- the traced micro-step -----------------------------------------------------------------------------
@dataclass
class StepTrace:
    """Bytes alive during one training step of the bare (unwrapped, one-process) model."""

    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    """All gradients, as the optimizer step sees them."""
    optimizer_bytes: int
    """Optimizer state (Adam: two moments and a step count per parameter)."""
    input_bytes: int
    activations: int
    """The most activation memory alive at once in forward and backward: saved tensors, their
    recomputation under checkpointing, gradients of activations and each new parameter gradient
    before it is stored (what every strategy holds on top of its model states)."""
    activations_and_grads: int
    """The same with the parameter gradients stored so far (one process, or any strategy that keeps
    every full gradient as it is produced)."""
    step_extra: int
    """The optimizer step's (and clipping's) temporaries on the full parameter set."""
    timeline: list[tuple[int, int]] = field(default_factory=list, repr=False)
    """(activation bytes, parameter-gradient bytes stored so far) after each forward/backward operation."""
    grad_events: list[tuple[int, int, int]] = field(default_factory=list, repr=False)
    """(timeline index, optimizer group, position in the group) as each parameter's gradient is stored."""
    groups: list[list[int]] = field(default_factory=list, repr=False)
    """The optimizer's parameter groups: each trainable parameter's element count, in order."""
    work: StepWork = field(default_factory=StepWork, repr=False)
    """FLOPs, bytes moved and operations of forward, backward and the optimizer step (for time)."""
    expert_bytes: int = 0
    """The parameters of the experts expert parallelism can split (``expert_parallel.splittable_experts``)."""
    expert_tensors: int = 0
    """How many tensors hold them (each layer's stacked weights)."""
    moe_layers: int = 0
    """Mixture-of-experts layers (an all-to-all each, each way)."""
    dispatched: int = 0
    """Numbers one micro-batch's forward sends to its experts, over every mixture-of-experts layer: each token's
    ``top_k`` copies of its width (under expert parallelism they travel by all-to-all, and back, in forward and in
    backward)."""
    float8_bytes: int = 0
    float8_elements: int = 0
    """Bytes (as traced) and elements of the float8 linear layers' weights (``precision: fp8``): FSDP gathers them in
    float8, a byte each (torchao's float8 all-gather, which ``FSDPStrategy`` turns on)."""

    @property
    def elements(self) -> int:
        """Trainable parameters' elements: what an fp32 copy of them (a DiLoCo meeting, FSDP's fp32 reduction) holds."""
        return sum(sum(group) for group in self.groups)

    def activations_from(self, index: int) -> int:
        """The most activation memory alive at or after timeline ``index`` (0 past the end): what
        coexists with a buffer a strategy allocates only at that point of backward."""
        return max((act for act, _ in self.timeline[index:]), default=0)


class Phases:
    """Running maxima of MemTracker's current snapshot after every operation."""

    ACTIVATION_KINDS = ("Activation", "Temp", "Other")

    def __init__(self):
        self.phase = "forward"
        self.act = 0
        self.act_grad = 0
        self.step_base: int | None = None
        self.step_extra = 0
        self.timeline: list[tuple[int, int]] = []

    def sample(self, snapshot: dict) -> None:
        totals: dict[str, int] = {}
        for device, per_device in snapshot.items():
            if device.type == "meta":  # skeletons take no memory
                continue
            for kind, nbytes in per_device.items():
                name = getattr(kind, "value", kind)
                totals[name] = totals.get(name, 0) + nbytes
        act = sum(totals.get(k, 0) for k in self.ACTIVATION_KINDS)
        if self.phase in ("forward", "backward"):
            grads = totals.get("Gradient", 0)
            self.act = max(self.act, act)
            self.act_grad = max(self.act_grad, act + grads)
            self.timeline.append((act, grads))
        else:
            total = totals.get("Total", 0)
            if self.step_base is None:
                self.step_base = total
            self.step_extra = max(self.step_extra, total - self.step_base)


def first_optimizer(conf: Any) -> torch.optim.Optimizer:
    """The optimizer of ``configure_optimizers``' answer (any of its accepted shapes)."""
    if isinstance(conf, torch.optim.Optimizer):
        return conf
    if isinstance(conf, dict):
        return conf["optimizer"]
    if isinstance(conf, (list, tuple)) and conf:
        return first_optimizer(conf[0])
    raise TypeError(f"configure_optimizers returned {type(conf).__name__}; expected an optimizer or a dict")


def use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Run the optimizer as torch does on a GPU (multi-tensor ``foreach`` kernels, whose
    temporaries span a whole parameter group); a CPU run picks the per-tensor loop."""
    for group in optimizer.param_groups:
        if group.get("foreach", False) is None and not group.get("fused"):
            group["foreach"] = True


def create_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's lazily-created state (Adam's moments) as a first step would."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def set_up_module(
    spec: ModelSpec,
    param_dtype: torch.dtype,
    checkpoint: int | None,
    *,
    float8: bool = False,
    reentrant: bool = False,
) -> tuple[Module, list[str]]:
    """The spec's module on the meta device as a strategy without sharding sets it up, and the names of its float8
    linear layers: torchao's where ``float8`` (``precision.convert_to_float8``, the conversion a run makes), its
    parameters in ``param_dtype``, activation checkpointing on its first ``checkpoint`` blocks
    (``checkpoint_policy``)."""
    module = spec.build()
    float8_layers: list[str] = []
    if float8:
        from distrain.precision import convert_to_float8

        float8_layers = convert_to_float8(module)
    if param_dtype != torch.float32:
        module.to(param_dtype)
    policy = checkpoint_policy(spec.block_classes, checkpoint, spec.selective_checkpointing)
    apply_activation_checkpointing(module, policy, reentrant)
    return module, float8_layers


def trace_step(
    spec: ModelSpec,
    micro_batch: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    autocast: torch.dtype | None = None,
    checkpoint: int | None = 0,
    foreach: bool = False,
    clip: float | None = None,
    reentrant: bool = False,
    float8: bool = False,
    routed_over: int = 1,
) -> StepTrace:
    """One training step of the bare model under fake tensors: forward (``training_step``, under
    autocast when given), backward, gradient clipping, the module's own optimizer step.
    ``checkpoint``: blocks whose activations are recomputed (``None``: all), with torch's
    reentrant checkpoint if ``reentrant`` (DeepSpeed's activation checkpointing is reentrant).
    ``float8``: the linear layers are torchao's float8 ones (``precision: fp8``). ``routed_over``: the experts split
    over that many ranks, and the routing at its worst for this rank (``worst_routing``); 1: even routing.

    A spec known by its content (``ModelSpec.key``) is traced once per process for the same arguments: a plan
    traces the same model at the same shapes for several options, and ``auto`` then an out-of-memory plan again."""
    arguments = (micro_batch, param_dtype, autocast, checkpoint, foreach, clip, reentrant, float8, routed_over)
    if spec.key is None:
        return _trace_step(spec, *arguments)
    memo_key = (spec.key, spec.selective_checkpointing, *arguments)
    trace = _TRACES.get(memo_key)
    if trace is None:
        if len(_TRACES) >= _TRACES_KEPT:
            _TRACES.pop(next(iter(_TRACES)))  # the oldest
        trace = _TRACES[memo_key] = _trace_step(spec, *arguments)
    return trace


#: the traces of specs known by content, by their arguments (``trace_step``); a trace is read, never changed
_TRACES: dict[tuple, StepTrace] = {}
#: at most this many kept: a trace holds its timeline (a pair of numbers per operation), ~1 MB for a deep model
_TRACES_KEPT = 256


def _trace_step(
    spec: ModelSpec,
    micro_batch: int,
    param_dtype: torch.dtype,
    autocast: torch.dtype | None,
    checkpoint: int | None,
    foreach: bool,
    clip: float | None,
    reentrant: bool,
    float8: bool,
    routed_over: int,
) -> StepTrace:
    module, float8_layers = set_up_module(spec, param_dtype, checkpoint, float8=float8, reentrant=reentrant)
    float8_weights = [module.get_submodule(name).weight for name in float8_layers]
    # non-fake inputs: the meta parameters that ``to_empty`` turns into fake ones
    # a GPU's run (``foreach``): its norms keep what CUDA's kernels keep
    with (
        fake.fake_tensor_mode(allow_non_fake_inputs=True) as mode,
        fake.transformers_as_in_eager(),
        fake.norms_as_on_cuda(foreach),
    ):
        to_empty_keeping_ties(module)
        optimizer = first_optimizer(module.configure_optimizers())
        if foreach:
            use_foreach(optimizer)
        create_optimizer_state(module, optimizer)
        batch = tree_map_only(torch.Tensor, mode.from_tensor, spec.make_batch(micro_batch))
        inputs = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        phases = Phases()
        grad_events: list[tuple[int, int, int]] = []
        groups = []
        for g, group in enumerate(optimizer.param_groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            groups.append([p.numel() for p in trainable])
            for i, p in enumerate(trainable):
                p.register_post_accumulate_grad_hook(
                    lambda _p, g=g, i=i: grad_events.append((len(phases.timeline), g, i))
                )
        moe = _experts_of(module, counter_phase := {"phase": "forward"}, routed_over)
        tracker = fake.timeline_memory_tracker(phases.sample)
        tracker.track_external(module, optimizer, *inputs)
        counter = WorkCounter()
        with tracker, counter:
            with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                loss = loss_of(run_step(module, "training_step", batch, 0))
            phases.phase = counter.phase = counter_phase["phase"] = "backward"
            loss.backward()
            del loss
            phases.phase = counter.phase = "step"
            params = [p for p in module.parameters() if p.grad is not None]
            grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=foreach or None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        unique = {id(p): p for p in module.parameters()}.values()
        opt_bytes = sum(
            v.numel() * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
    return StepTrace(
        param_bytes=sum(p.numel() * p.element_size() for p in unique),
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        grad_bytes=grad_bytes,
        optimizer_bytes=opt_bytes,
        input_bytes=sum(t.numel() * t.element_size() for t in inputs),
        activations=phases.act,
        activations_and_grads=phases.act_grad,
        step_extra=phases.step_extra,
        timeline=phases.timeline,
        grad_events=grad_events,
        groups=groups,
        work=counter.work,
        expert_bytes=moe["bytes"],
        expert_tensors=moe["tensors"],
        moe_layers=moe["layers"],
        dispatched=moe["dispatched"][0],
        float8_bytes=sum(w.numel() * w.element_size() for w in float8_weights),
        float8_elements=sum(w.numel() for w in float8_weights),
    )


def _experts_of(module: nn.Module, phase: dict, routed_over: int = 1) -> dict[str, Any]:
    """The experts expert parallelism can split: their ``bytes``, ``tensors`` and ``layers``, and ``dispatched``,
    the numbers the forward sends to them, filled as the traced forward runs each layer (not the recomputation in
    backward). ``routed_over`` > 1: each layer's experts take the tokens of the worst routing over that many ranks
    (``worst_routing``)."""
    sent = [0]
    layers = expert_parallel.moe_layers(module) if expert_parallel.splittable_experts(module) else []

    def count(layer, args, output) -> None:
        if phase["phase"] == "forward":
            top_k, width = expert_parallel.dispatched_per_token(layer)
            sent[0] += args[0].numel() // width * top_k * width

    for layer in layers:
        layer.register_forward_hook(count)
        if routed_over > 1:
            top_k, _ = expert_parallel.dispatched_per_token(layer)
            _take_more_tokens(layer.experts, worst_routing(routed_over, expert_parallel.expert_count(layer), top_k))
    experts = [p for layer in layers for p in layer.experts.parameters()]
    return {
        "bytes": sum(p.numel() * p.element_size() for p in experts),
        "tensors": len(experts),
        "layers": len(layers),
        "dispatched": sent,
    }


def worst_routing(ranks: int, experts: int, top_k: int) -> int:
    """How many times its even share of the token copies one rank's experts can receive with ``experts`` over
    ``ranks`` ranks: every token of every rank sends it as many of its ``top_k`` copies as the rank has experts
    (rounded up). Expert parallelism keeps every token (no capacity), so a router that collapses onto one rank's
    experts holds that many times their activations there."""
    return math.ceil(ranks * min(top_k, experts // ranks) / top_k)


def _take_more_tokens(experts: nn.Module, times: int) -> None:
    """``experts`` computing ``times`` as many token copies as they are given (each tensor argument repeated along
    its first dimension, each count scaled), handing back the first share: under fake tensors, what the experts of
    a rank that receives ``times`` its share hold. distrain's ``Experts(tokens, counts)`` and transformers' experts
    ``(hidden, top_k_index, top_k_weights)`` alike."""

    def more(module, args):
        return tuple(
            a.repeat(times, *[1] * (a.dim() - 1))
            if isinstance(a, torch.Tensor)
            else [n * times for n in a]
            if isinstance(a, list)
            else a
            for a in args
        )

    experts.register_forward_pre_hook(more)
    experts.register_forward_hook(lambda module, args, out: out[: len(out) // times])


# ---- deep models: estimate two shallow copies, extrapolate by depth ---------------------------------------
#: models with more blocks than this are estimated at SHALLOW_DEPTHS blocks and extrapolated
EXTRAPOLATE_ABOVE = 8
SHALLOW_DEPTHS = (4, 8)


def affine(values: dict[int, float], depth: int) -> int:
    """The value at ``depth`` of the line through two (depth, value) points."""
    (d1, v1), (d2, v2) = sorted(values.items())
    return max(0, int(math.ceil(v1 + (v2 - v1) * (depth - d1) / (d2 - d1))))


def is_deep(spec: ModelSpec) -> bool:
    return spec.with_depth is not None and spec.num_blocks > EXTRAPOLATE_ABOVE
