"""Tensor parallelism on DTensor (``torch.distributed.tensor.parallel``): the built-in plans.

A plan maps a model's layers to PyTorch's parallel styles, Megatron's recipe as torchtitan applies
it: in each block the attention's query/key/value and the MLP's first layers are split by output
columns (each rank computes its own heads, its own slice of the hidden layer), the projections back
by input rows (one reduction per block half); with ``sequence_parallel`` the norms and the residual
stream between them are split along the sequence, so activations there are not replicated either;
the output layer leaves the logits split by vocabulary, and the loss is computed on them where they
are (``loss_parallel``: no rank ever holds the whole logits).

Plans are selected from the model: the built-in GPT (``distrain.models.gpt.GPT``) and Hugging Face
Llama-style causal LMs (``model.layers[i].self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``:
Llama, Mistral, Qwen2, ...). A model of your own brings its plan in ``configure_model``
(``parallelize_module(..., self.device_mesh["tensor_parallel"], ...)``); distrain then applies none.

The built-in GPT computes query, key and value with one fused layer whose weight holds ``[q; k; v]``.
Split by rows, a rank would get all of q and half of k, so that weight is split by its input
features instead (``Shard(1)``: the checkpoint keeps the ``[q; k; v]`` layout) and its output is
reduce-scattered by heads — each rank ends up with q, k and v of the same heads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import distribute_module

from distrain.config import Refusal


class FusedQKVParallel(ParallelStyle):
    """A ``Linear`` whose output is ``[q; k; v]`` (each ``n_embd`` wide): weight split by input features,
    output reduce-scattered so each rank holds ``[q_r; k_r; v_r]`` of its heads (a plain tensor)."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(1) if pname == "weight" else Replicate()
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def prepare_input(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):  # the block's replicated input
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x.redistribute(mesh, [Shard(x.ndim - 1)]), *inputs[1:])

        def prepare_output(mod, output, mesh):
            *lead, width = output.shape  # a partial sum over the input features: reduce-scatter by heads
            heads = output.view(*lead, 3, width // 3).redistribute(mesh, [Shard(len(lead) + 1)])
            return heads.to_local().reshape(*lead, -1)

        return distribute_module(module, mesh, partition, prepare_input, prepare_output)


class SequenceShardedInput(ParallelStyle):
    """The first block's input, replicated after the embeddings, split along the sequence (a local
    slice, no communication). Sequence parallelism needs the length to divide by the group's size."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        size = mesh.size()

        def shard(mod, inputs):
            x = inputs[0]
            if x.shape[1] % size:
                raise ValueError(
                    f"sequence parallelism splits each sequence over the {size} tensor-parallel ranks, but a batch "
                    f"has sequences of {x.shape[1]} tokens; pad batches to a multiple of {size} (e.g. "
                    "data.padding=max_length) or turn it off: ModelParallelStrategy(sequence_parallel=False) "
                    "(distributed.sequence_parallel=false)"
                )
            local = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
            return (local.to_local(), *inputs[1:])

        module.register_forward_pre_hook(shard)
        return module


class ExpertTensorParallel(ParallelStyle):
    """A mixture of experts (``distrain.models.moe.MoE``) in place of a block's MLP: every expert's hidden units
    split over the ranks as the dense MLP's are (``fc`` ``[experts, hidden, width]`` by its hidden rows, ``proj`` by
    its hidden columns), Megatron's expert tensor parallelism. Each rank routes every token (the router replicated,
    the input gathered whole under sequence parallelism), computes its units of each token's experts, and the
    block's output is the ranks' sum (reduced to ``output_layout``: the residual's): the MLP's one reduction, and each
    rank's work the same however the tokens are routed. The experts' inputs and routing weights enter with an
    all-reduce of their gradients, the partial sums of each rank's units (Megatron's ``f``)."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        experts = module.experts
        for pname, dim in (("fc", 1), ("proj", 2)):
            param = experts.get_parameter(pname)
            experts.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)])))
        module.hidden_split = _HiddenSplit(mesh, self.output_layout)
        # the router replicated as a DTensor (each rank computes its whole gradient), as sequence parallelism's norms
        # are: an optimizer's foreach and fused kernels take a list of parameters that are all DTensors or none
        distribute_module(
            module.router,
            mesh,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
            ),
            output_fn=lambda mod, output, mesh: output.to_local(),
        )

        def whole_input(mod, inputs):  # sequence parallelism's slice, gathered (its gradient: this rank's slice)
            x = inputs[0]
            return (x.redistribute(mesh, [Replicate()]).to_local(), *inputs[1:]) if isinstance(x, DTensor) else None

        module.register_forward_pre_hook(whole_input)
        return module


class _HiddenSplit:
    """``enter``: the same tensor, its gradient summed over the ranks; ``leave``: the ranks' partial sums added up,
    in ``output_layout``, their gradient each rank's whole."""

    def __init__(self, mesh, output_layout: Placement):
        self.mesh, self.output_layout = mesh, output_layout

    def enter(self, t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, self.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    def leave(self, t: torch.Tensor) -> torch.Tensor:
        partial = DTensor.from_local(t, self.mesh, [Partial()], run_check=False)
        return partial.redistribute(self.mesh, [self.output_layout]).to_local()


def gpt_plan(gpt: nn.Module, tp: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The built-in GPT (``distrain.models.gpt.GPT``); names relative to it."""
    cfg = gpt.cfg
    _divides(tp, {"n_head": cfg.n_head, "n_embd": cfg.n_embd})
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["blocks.0"] = SequenceShardedInput()
        plan["ln_f"] = SequenceParallel(use_local_output=True)
    for i in range(len(gpt.blocks)):
        b = f"blocks.{i}."
        plan[b + "attn.qkv"] = FusedQKVParallel()
        plan[b + "attn.proj"] = RowwiseParallel(output_layouts=residual)
        if cfg.n_experts:
            plan[b + "mlp"] = ExpertTensorParallel(output_layout=residual)
        else:
            plan[b + "mlp.fc"] = ColwiseParallel()
            plan[b + "mlp.proj"] = RowwiseParallel(output_layouts=residual)
        if sequence_parallel:
            for norm in ("ln1", "ln2"):
                plan[b + norm] = SequenceParallel()
            for sub in ("attn",) if cfg.n_experts else ("attn", "mlp"):
                plan[b + sub] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def llama_split(lm: nn.Module, tp: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A Hugging Face Llama-style causal LM (``XForCausalLM`` with ``model.layers``); names relative to it."""
    config = lm.config
    _divides(
        tp,
        {
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
            "intermediate_size": config.intermediate_size,
        },
    )
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        # replicated: the model builds its causal mask and rotary embeddings from the whole sequence
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["model.layers.0"] = SequenceShardedInput()
        plan["model.norm"] = SequenceParallel(use_local_output=True)
    for i in range(len(lm.model.layers)):
        b = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{b}self_attn.{name}"] = ColwiseParallel()
        plan[b + "self_attn.o_proj"] = RowwiseParallel(output_layouts=residual)
        plan[b + "mlp.gate_proj"] = ColwiseParallel()
        plan[b + "mlp.up_proj"] = ColwiseParallel()
        plan[b + "mlp.down_proj"] = RowwiseParallel(output_layouts=residual)
        if sequence_parallel:
            plan[b + "input_layernorm"] = SequenceParallel()
            plan[b + "post_attention_layernorm"] = SequenceParallel()
            plan[b + "self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            plan[b + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def _divides(tp: int, sizes: dict[str, int]) -> None:
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise Refusal(
            f"tensor_parallel_size={tp} must divide the model's {', '.join(f'{k}={v}' for k, v in bad.items())} "
            "(each rank computes an equal share of the heads and hidden units)"
        )


def is_llama_style(module: nn.Module) -> bool:
    inner = getattr(module, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not hasattr(module, "lm_head"):
        return False
    layer = layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and all(
        hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
    )


def built_in_targets(module: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """The models inside ``module`` a built-in plan knows, each with its plan function."""
    from distrain.models.gpt import GPT

    found = []
    for m in module.modules():
        if isinstance(m, GPT):
            found.append((m, gpt_plan))
        elif is_llama_style(m):
            found.append((m, llama_split))
    return found


def planned_targets(module: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """``built_in_targets``, or the run's error when no built-in plan knows any model in ``module``."""
    targets = built_in_targets(module)
    if not targets:
        raise Refusal(no_plan_message(module))
    return targets


def check_plan(module: nn.Module, tp: int, sequence_parallel: bool) -> None:
    """What ``apply_tensor_parallel`` would refuse, checked on a model not yet split (the planner's layouts, the
    strategy's check before launch): the run's own error when no built-in plan knows the model or ``tp`` does not
    divide its heads or hidden units."""
    for model, plan in planned_targets(module):
        plan(model, tp, sequence_parallel)


def split_parameters(module: nn.Module, tp: int, sequence_parallel: bool) -> set[int]:
    """The ids of the parameters the built-in plans split over the ``tp`` ranks (each rank holds 1/tp of each):
    every weight a column-, row- or fused-QKV-parallel layer holds, and column-parallel biases. The rest (norms,
    row-parallel biases, a mixture's router) every rank holds whole."""
    split: set[int] = set()
    for model, plan in built_in_targets(module):
        for name, style in plan(model, tp, sequence_parallel).items():
            if isinstance(style, ExpertTensorParallel):  # every expert's weights
                split.update(id(p) for p in model.get_submodule(name).experts.parameters())
                continue
            if not isinstance(style, ColwiseParallel | RowwiseParallel | FusedQKVParallel):
                continue
            for pname, param in model.get_submodule(name).named_parameters(recurse=False):
                if pname == "weight" or isinstance(style, ColwiseParallel):
                    split.add(id(param))
    return split


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``configure_model`` applied a tensor-parallel plan of its own (DTensor parameters)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def no_plan_message(module: nn.Module) -> str:
    return (
        f"{type(module).__name__} has no built-in tensor-parallel plan (built in: distrain's GPT and Hugging Face "
        "Llama-style causal LMs); apply your own in configure_model: "
        'parallelize_module(layer, self.device_mesh["tensor_parallel"], {...}) with ColwiseParallel/RowwiseParallel'
    )


def apply_tensor_parallel(module: nn.Module, tp_mesh, sequence_parallel: bool = True) -> str:
    """Apply the built-in plan to every model in ``module`` it knows; returns what was done."""
    if is_parallelized(module):
        return "the module's own plan (configure_model)"
    targets = planned_targets(module)
    ties = shared_parameters(module)
    for model, plan in targets:
        parallelize_module(model, tp_mesh, plan(model, tp_mesh.size(), sequence_parallel))
        model.register_forward_hook(_whole_outputs_without_gradients)
    retie(ties)
    return ", ".join(type(m).__name__ for m, _ in targets)


def _whole_outputs_without_gradients(module: nn.Module, args, output):
    """Evaluation and predict (no gradients): the model's outputs come back as whole tensors, so a step's own
    code (``logits.argmax(-1)``, metrics) runs on plain tensors as it does on one process (DTensor's argmax of a
    one-sample batch fails in torch 2.13). While training, the logits stay split by vocabulary: the loss is
    computed where they are (``loss_parallel``) and no rank holds them whole."""
    if torch.is_grad_enabled():
        return output
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, output)


# ---- parameters that several modules share (tied embeddings) ---------------------------------------------------
def shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of ``(module, attribute)`` that hold the same parameter (e.g. a head tied to the embedding)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((m, name))
    return [group for group in holders.values() if len(group) > 1]


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every holder of each group at one parameter again, after sharding replaced them one by
    one: the first holder's (DTensor, then materialized) parameter wins."""
    for group in groups:
        params = [getattr(m, name) for m, name in group]
        winner = next((p for p in params if isinstance(p, DTensor)), None)
        winner = winner if winner is not None else next((p for p in params if not p.is_meta), params[0])
        for m, name in group:
            if getattr(m, name) is not winner:
                if isinstance(winner, DTensor) and isinstance(getattr(m, name), DTensor):
                    _check_same_layout(getattr(m, name), winner, name)
                m._parameters[name] = winner


def _check_same_layout(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.placements != b.placements or a.device_mesh != b.device_mesh:
        raise ValueError(
            f"tied parameter {name!r} is split two ways by the tensor-parallel plan ({a.placements} and "
            f"{b.placements}); give the layers that share it the same split"
        )
