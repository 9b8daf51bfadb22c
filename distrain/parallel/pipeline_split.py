"""How a model splits into pipeline stages: a ``PipelineSplit``.

A pipeline runs a model as a chain of stages on different ranks: the first stage embeds the
micro-batch, each stage runs a contiguous run of the model's blocks and hands its activations to
the next, the last stage runs the head. What a plan says:

- ``blocks``: the repeated layers, split at block boundaries (balanced by parameter count, or at
  the split points you give);
- ``embed`` (first stage): a micro-batch → the first block's input;
- ``head`` (last stage): the last block's output → the model's raw output (the logits);
- ``context`` (every stage): what each block needs besides its input (a mask, rotary embeddings);
- ``aux_loss`` (a mixture of experts): a stage's blocks' load-balancing losses, summed along the stages;
- ``model`` and ``answer``: your ``training_step`` (and ``validation_step``, ...) runs unchanged on
  the last stage; its call of ``model(...)`` is answered from the pipeline's output
  (``answer(head output, *the call's arguments)``), so the loss, the logged metrics and the loss
  normalization are your step's own.

Built in: distrain's GPT (batches ``(x, y, ...)``) and Hugging Face Llama-style causal LMs (batches
with ``input_ids`` and ``attention_mask``). A Module of your own returns a plan from
``pipeline_split()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distrain.config import Refusal


@dataclass
class PipelineSplit:
    """How a model splits into pipeline stages (the module's docstring says more): the first stage embeds each
    micro-batch, the stages run contiguous runs of ``blocks``, the last runs ``head``, and your step's call of
    ``model(...)`` is answered from it. A Module of your own returns one from ``pipeline_split()``."""

    model: nn.Module
    """The module your steps call (``self.gpt(x, y)``); on the last stage that call is answered."""
    blocks: nn.ModuleList
    """The repeated layers: each stage runs a contiguous run of them."""
    embed: Callable[[Any], torch.Tensor]
    """A micro-batch → the first block's input (runs on the first stage)."""
    head: Callable[[torch.Tensor], Any]
    """The last block's output → the model's raw output, e.g. the logits (runs on the last stage)."""
    answer: Callable[..., Any]
    """``answer(head output, *args, **kwargs)`` → what ``model(*args, **kwargs)`` returns (logits, a loss)."""
    batch_inputs: Callable[[Any], torch.Tensor]
    """The tensor of a micro-batch that ``embed`` reads (its token ids)."""
    call_inputs: Callable[..., torch.Tensor]
    """The same tensor, from the arguments of your step's ``model(...)`` call: they must agree."""
    first: Sequence[nn.Module] = ()
    """Modules ``embed`` uses: held by the first stage only."""
    last: Sequence[nn.Module] = ()
    """Modules ``head`` uses: held by the last stage only."""
    every_stage: Sequence[nn.Module] = ()
    """Modules every stage holds (rotary embeddings: buffers, no weights)."""
    context: Callable[[Any, torch.Tensor], dict] = field(default=lambda batch, x: {})
    """``context(micro-batch, stage input)`` → keyword arguments of every block call on a stage."""
    pad_window: Callable[[list], list] | None = None
    """Micro-batches of one step → the same, padded to one shape (a pipeline's buffers have one shape
    per step); None: they must already agree."""
    aux_loss: Callable[[nn.Module], torch.Tensor] | None = None
    """A stage's blocks → the sum of their auxiliary losses of the last forward (a mixture of experts' load
    balance). Each stage adds its own to the sum it received and sends it on beside its output, so the last stage's
    ``answer`` gets the whole model's (``aux_loss=``) and the backward reaches every stage's routers, as one process
    computes them. None: the model has none."""

    load_ratio: Callable[[nn.Module], torch.Tensor] | None = None
    """With ``aux_loss``: a stage's blocks → the busiest expert's tokens over the mean in their least balanced layer,
    of the last forward. It travels with the losses' sum, each stage keeping the larger, so that ``answer`` gets the
    whole model's (``aux_loss=`` then holds both: the sum, then the ratio) for the metrics your step logs."""

    def answer_call(self, output: Any, *args, **kwargs) -> Any:
        """``answer`` from what the last stage computed: the head's output, and with ``aux_loss`` the model's sum."""
        if self.aux_loss is None:
            return self.answer(output, *args, **kwargs)
        head_output, aux_loss = output
        return self.answer(head_output, *args, aux_loss=aux_loss, **kwargs)

    def stage_aux(self, blocks: nn.Module, received: torch.Tensor | None) -> torch.Tensor:
        """What a stage sends on beside its output: the auxiliary losses' sum so far (``received``: the stages' before
        it), and with ``load_ratio`` the largest ratio so far after it."""
        aux = self.aux_loss(blocks)
        if self.load_ratio is None:
            return aux if received is None else received + aux
        ratio = self.load_ratio(blocks).detach().to(aux.dtype)
        if received is not None:
            aux, ratio = received[0] + aux, torch.maximum(received[1], ratio)
        return torch.stack([aux, ratio])


# ---- built-in plans ---------------------------------------------------------------------------------------------
def gpt_split(gpt: nn.Module) -> PipelineSplit:
    """distrain's GPT; micro-batches are ``(x, y, ...)`` (the built-in job's and the tests')."""
    from distrain.models.gpt import GPT

    cfg = gpt.cfg

    def answer(logits, idx, targets=None, aux_loss=None):
        loss = GPT.output(logits, targets)  # with a mixture: the balance loss's mean over every block's, as forward's
        if targets is None or aux_loss is None:
            return loss
        aux, ratio = aux_loss[0] / cfg.n_layer, aux_loss[1]
        gpt.balance_of_every_stage = {"moe_aux_loss": aux.detach(), "moe_load_max_over_mean": ratio}
        return gpt.with_aux_loss(loss, aux)

    return PipelineSplit(
        model=gpt,
        blocks=gpt.blocks,
        embed=lambda batch: gpt.embed(_first_tensor(batch)),
        head=gpt.logits,
        answer=answer,
        aux_loss=GPT.aux_loss_sum if cfg.n_experts and cfg.aux_loss_coef else None,
        load_ratio=GPT.load_ratio if cfg.n_experts and cfg.aux_loss_coef else None,
        batch_inputs=_first_tensor,
        call_inputs=lambda idx, targets=None: idx,
        first=[gpt.tok_emb, gpt.pos_emb, gpt.drop],
        last=[gpt.ln_f, gpt.head],
    )


def llama_split(lm: nn.Module) -> PipelineSplit:
    """A Hugging Face Llama-style causal LM (``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``); micro-batches are dicts with ``input_ids`` (and ``attention_mask``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from distrain import compat

    inner = lm.model
    supported = {"input_ids", "attention_mask", "labels", "use_cache", "token_type_ids"}

    def context(batch: dict, x: torch.Tensor) -> dict:
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        shape_like = x.new_empty((ids.shape[0], ids.shape[1], 1))  # the mask needs the batch, length and dtype
        mask = compat.hf_causal_mask(lm.config, shape_like, batch.get("attention_mask"), positions)
        return {
            "attention_mask": mask,
            "position_embeddings": inner.rotary_emb(shape_like, positions),
            "position_ids": positions,
        }

    def answer(logits, *args, labels=None, **kwargs):
        unknown = set(kwargs) - supported
        if unknown or kwargs.get("use_cache"):
            raise ValueError(
                f"under the pipeline strategy {type(lm).__name__} is called with input_ids, attention_mask and labels "
                f"only (no cache); the step passed {', '.join(sorted(unknown)) or 'use_cache=True'}"
            )
        loss = None
        if labels is not None:
            loss = lm.loss_function(logits=logits, labels=labels, vocab_size=lm.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def call_inputs(*args, **kwargs):
        return kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    return PipelineSplit(
        model=lm,
        blocks=inner.layers,
        embed=lambda batch: inner.embed_tokens(batch["input_ids"]),
        head=lambda x: lm.lm_head(inner.norm(x)),
        answer=answer,
        batch_inputs=lambda batch: batch["input_ids"],
        call_inputs=call_inputs,
        first=[inner.embed_tokens],
        last=[inner.norm, lm.lm_head],
        every_stage=[inner.rotary_emb],
        context=context,
        pad_window=_pad_token_batches,
    )


def split_for(module: nn.Module) -> PipelineSplit:
    """The module's own ``pipeline_split()``, or the built-in plan of the one model it holds."""
    own = getattr(module, "pipeline_split", None)
    if callable(own):
        plan = own()
        if not isinstance(plan, PipelineSplit):
            raise TypeError(f"{type(module).__name__}.pipeline_split() must return a distrain.PipelineSplit")
        return plan
    from distrain.models.gpt import GPT
    from distrain.parallel.tensor_parallel import is_llama_style

    found = [(m, gpt_split) for m in module.modules() if isinstance(m, GPT)]
    found += [(m, llama_split) for m in module.modules() if is_llama_style(m)]
    if len(found) != 1:
        what = "no model" if not found else f"{len(found)} models"
        raise Refusal(
            f"{type(module).__name__} holds {what} the pipeline strategy has a built-in plan for (distrain's GPT, "
            "Hugging Face Llama-style causal LMs); give it a pipeline_split() method returning a distrain.PipelineSplit"
        )
    model, make = found[0]
    return make(model)


# ---- splitting the blocks -------------------------------------------------------------------------------------------
def split_blocks(
    plan: PipelineSplit, num_stages: int, split_points: Sequence[int | str] | None = None, root: nn.Module | None = None
) -> list[range]:
    """The blocks of each stage: at ``split_points`` (block indices or block names such as
    ``"gpt.blocks.2"``, where a new stage begins), else balanced by parameter count (the first stage
    also holds the embeddings, the last the head)."""
    n = len(plan.blocks)
    if num_stages > n:
        raise Refusal(
            f"{num_stages} pipeline stages but the model has {n} blocks: each stage needs at least one "
            "(distributed.pipeline_stages, or fewer stages per rank)"
        )
    if split_points:
        starts = sorted(_block_index(p, plan, root) for p in split_points)
        if len(starts) != num_stages - 1 or len(set(starts)) != len(starts) or starts[0] <= 0:
            raise Refusal(
                f"split_points {list(split_points)} must name {num_stages - 1} distinct blocks after the first "
                f"(where stages 2..{num_stages} begin; the model has blocks 0..{n - 1})"
            )
        bounds = [0, *starts, n]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    sizes = [_numel(b) for b in plan.blocks]
    extra_first = sum(_numel(m) for m in plan.first)
    extra_last = sum(_numel(m) for m in plan.last)
    return _balanced(sizes, num_stages, extra_first, extra_last)


def _balanced(sizes: list[int], k: int, extra_first: int, extra_last: int) -> list[range]:
    """Contiguous runs minimizing the largest stage (embedding on the first, head on the last)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (extra_first if stage == 0 else 0) + (extra_last if stage == k - 1 else 0)

    inf = float("inf")
    # best[s][i]: the smallest possible largest stage when stages 0..s-1 hold blocks 0..i-1
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for s in range(1, k + 1):
        for i in range(s, n - (k - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds = [n]
    for s in range(k, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _block_index(point: int | str, plan: PipelineSplit, root: nn.Module | None) -> int:
    if isinstance(point, int) and not isinstance(point, bool):
        if 0 <= point < len(plan.blocks):
            return point
        raise Refusal(f"split point {point} is not a block index (0..{len(plan.blocks) - 1})")
    target = None
    for candidate in (root, plan.model):
        if candidate is None:
            continue
        try:
            target = candidate.get_submodule(str(point))
            break
        except AttributeError:
            continue
    for i, block in enumerate(plan.blocks):
        if target is block or getattr(block, "_checkpoint_wrapped_module", None) is target:
            return i
    raise Refusal(f"split point {point!r} names no block of the model (blocks are e.g. {_block_names(plan, root)})")


def _block_names(plan: PipelineSplit, root: nn.Module | None) -> str:
    names = {id(m): n for n, m in (root or plan.model).named_modules()}
    return ", ".join(names.get(id(b), "?") for b in list(plan.blocks)[:3])


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _first_tensor(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0]
    if isinstance(batch, dict):
        for key in ("input_ids", "idx", "x"):
            if key in batch:
                return batch[key]
    raise TypeError(f"the built-in GPT pipeline plan reads batches (x, y, ...); got {type(batch).__name__}")


def _pad_token_batches(batches: list) -> list:
    """Token batches of one step padded to the longest (right padding, masked out)."""
    longest = max(b["input_ids"].shape[1] for b in batches)
    out = []
    for b in batches:
        short = longest - b["input_ids"].shape[1]
        if not short:
            out.append(b)
            continue
        if b.get("attention_mask") is None:
            raise ValueError(
                "the micro-batches of one pipeline step have different lengths and no attention_mask to pad them "
                "with; pad every batch to one length (data.padding=max_length)"
            )
        padded = dict(b)
        for key, value in (("input_ids", 0), ("attention_mask", 0), ("labels", -100), ("token_type_ids", 0)):
            if key in b and isinstance(b[key], torch.Tensor):
                padded[key] = torch.nn.functional.pad(b[key], (0, short), value=value)
        out.append(type(b)(padded) if not isinstance(b, dict) or type(b) is dict else _rebuild(b, padded))
    return out


def _rebuild(original, values: dict):
    try:
        return type(original)(values)
    except Exception:  # noqa: BLE001 — a mapping type that cannot be rebuilt from a dict: a plain dict
        return values
