"""A mixture-of-experts feed-forward layer: top-k routing over experts whose weights are stacked in one tensor each,
as transformers 5 keeps a layer's experts (``[experts, out, in]``), so that expert parallelism splits them along
the first dimension (``distrain.parallel.expert_parallel``) without rebuilding the model.

Routing is Mixtral's: a softmax over the experts, the ``top_k`` largest kept and renormalized. No token is dropped
(no capacity factor): every token reaches its ``top_k`` experts however unevenly they are chosen. Each forward keeps
the router's load-balancing loss and the tokens each expert received, for the loss and the metrics.

The load-balancing loss is Switch Transformer's (experts × Σ fraction of assignments × mean probability; 1.0 when
the load is even) taken per sequence and averaged, as DeepSeek-V3's sequence-wise balance loss is. Taken over a
micro-batch instead, it would depend on which sequences share one: two ranks and one process accumulating the same
global batch group its sequences differently, and their losses drifted apart by 1e-4 within four steps. Per
sequence, the loss of a global batch is the same however it is split. Under context parallelism a sequence is split
over the group's ranks: each counts its slice's real tokens (not the padding) and the group sums the counts and the
probabilities, so the loss is the whole sequence's, as one process computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor


class Experts(nn.Module):
    """``count`` GELU MLPs of ``width`` → ``hidden`` → ``width``, stacked: ``fc`` is ``[count, hidden, width]`` and
    ``proj`` ``[count, width, hidden]`` (each expert's weight as ``nn.Linear`` holds it)."""

    def __init__(self, count: int, width: int, hidden: int):
        super().__init__()
        self.fc = nn.Parameter(torch.empty(count, hidden, width))
        self.proj = nn.Parameter(torch.empty(count, width, hidden))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` grouped by expert, ``counts[e]`` of them for expert ``e``: each group through its expert."""
        fc, proj = (w.to_local() if isinstance(w, DTensor) else w for w in (self.fc, self.proj))  # this rank's units
        return grouped_linear(F.gelu(grouped_linear(tokens, fc, counts)), proj, counts)


def grouped_linear(tokens: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``tokens`` grouped by expert (``counts[e]`` rows for expert ``e``), each group times its expert's
    ``weight[e]`` (``[experts, out, in]``, as ``nn.Linear`` holds a weight). One grouped matmul where torch has one
    for the device and dtype (``F.grouped_mm``: CUDA, compute capability 8.0+, bf16, widths a multiple of 8, as
    its kernel needs 16-byte strides), else one matmul per expert (CPU, fp32; the same products)."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else tokens.dtype
    if _grouped_mm_applies(tokens, weight, dtype):
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(tokens.device, non_blocking=True)
        return F.grouped_mm(tokens.to(dtype), weight.to(dtype).transpose(-2, -1), offs=offsets)
    # unbind, not weight[e]: the backward of one ``select`` per expert makes a zero tensor of the whole stacked
    # weight for each expert's gradient, and adds them up (64 fills and sums of the full weights per step in a
    # 4-layer, 8-expert GPT); unbind's stacks the experts' gradients once. The same products and sums, bit for bit
    groups = tokens.split(counts)
    return torch.cat([group @ w.t() for group, w in zip(groups, weight.unbind(0))])


def _grouped_mm_applies(tokens: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        tokens.is_cuda
        and dtype == torch.bfloat16
        and hasattr(F, "grouped_mm")
        and not isinstance(tokens, FakeTensor)  # the planner's trace: its fake kernel is what it is, the loop counts
        and weight.shape[1] % 8 == 0
        and weight.shape[2] % 8 == 0
        and torch.cuda.get_device_capability(tokens.device) >= (8, 0)
    )


class MoE(nn.Module):
    """Top-``top_k`` of ``n_experts`` experts per token, in place of a block's MLP."""

    def __init__(self, width: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be between 1 and n_experts ({n_experts}), got {top_k}")
        self.top_k = top_k
        self.router = nn.Linear(width, n_experts, bias=False)
        self.experts = Experts(n_experts, width, hidden)
        #: the last forward's load-balancing loss and tokens per expert (every expert of the layer)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        #: context parallelism's ``SequenceShard`` (``distrain.parallel.context_parallel``): this rank computes a slice
        #: of each sequence
        self.sequence_shard = None
        #: tensor parallelism's split of every expert's hidden units (``distrain.parallel.tensor_parallel.
        #: ExpertTensorParallel``): the experts compute this rank's partial sums, which ``leave`` adds up
        self.hidden_split = None

    @property
    def n_experts(self) -> int:
        return self.router.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = self.router(h).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        slots = chosen.reshape(-1)  # token i's k-th choice at i·k + k
        counts = expert_counts(slots, self.n_experts)
        self.tokens_per_expert = counts.detach()
        self.aux_loss = self.balance_loss(chosen, probs, shape[-2] if x.dim() > 2 else len(h))
        order = slots.argsort(stable=True)  # the slots grouped by expert, in token order within each
        token = order // self.top_k
        weights = weights.reshape(-1)[order]
        split, inputs = self.hidden_split, h
        if split is not None:  # the experts' shares of these gradients are this rank's partial sums: summed back
            inputs, weights = split.enter(h), split.enter(weights)
        out = self.compute(inputs[token], counts)
        out = out * weights.unsqueeze(-1).to(out.dtype)
        mixed = torch.zeros_like(h).index_add_(0, token, out.to(h.dtype)).view(shape)
        return mixed if split is None else split.leave(mixed)

    def balance_loss(self, chosen: torch.Tensor, probs: torch.Tensor, length: int) -> torch.Tensor:
        """Switch Transformer's load-balancing loss of each sequence of ``length`` tokens, averaged over them."""
        if self.sequence_shard is not None:
            return self._balance_loss_of_slices(chosen, probs, length)
        sequences = probs.shape[0] // length
        slots = chosen.reshape(sequences, -1)  # each sequence's length · top_k assignments
        counts = torch.zeros(sequences, self.n_experts, device=probs.device).scatter_add_(
            1, slots, torch.ones(slots.shape, device=probs.device)
        )
        fraction = counts / slots.shape[1]  # [sequence, expert]: its share of the sequence's assignments
        mean_prob = probs.reshape(sequences, length, -1).mean(1)
        return self.n_experts * (fraction * mean_prob).sum(-1).mean()

    def _balance_loss_of_slices(self, chosen: torch.Tensor, probs: torch.Tensor, length: int) -> torch.Tensor:
        """The loss of each whole sequence, this rank holding a ``length``-token slice of each: the group sums each
        sequence's assignments and probabilities over its real tokens. The loss is linear in this rank's
        probabilities (the assignments carry no gradient), so, as the next-token loss (``loss_sum``), its value is
        the whole sequence's on every rank and its gradient ``N ×`` this rank's share: the data-parallel reduction
        averages over the group's N ranks too."""
        shard = self.sequence_shard
        sequences, n = probs.shape[0] // length, self.n_experts
        real = (shard.positions(length, probs.device) < shard.length).to(probs.dtype)  # not the padding
        slots = chosen.reshape(sequences, length * self.top_k)
        counts = torch.zeros(sequences, n, device=probs.device, dtype=probs.dtype).scatter_add_(
            1, slots, real.repeat_interleave(self.top_k).expand(sequences, -1).contiguous()
        )
        summed = (probs.reshape(sequences, length, n) * real[None, :, None]).sum(1)
        totals = torch.cat([counts, summed.detach()])
        torch.distributed.all_reduce(totals, group=shard.group)
        counts, whole = totals.split(sequences)
        self.tokens_per_expert = counts.sum(0).round().long()  # the group's, as one process counts them
        fraction = counts / (shard.length * self.top_k)
        share = shard.size * n * (fraction * summed).sum(-1).mean() / shard.length
        return share + (n * (fraction * whole).sum(-1).mean() / shard.length - share).detach()

    def compute(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert's tokens through it: ``tokens`` grouped by expert, ``counts`` per expert. Expert parallelism
        replaces this with a dispatch to the ranks that hold the experts."""
        return self.experts(tokens, group_sizes(counts, len(tokens)))


def expert_counts(slots: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of ``slots`` (expert indices) chose each expert: ``bincount``'s values in a shape known before they
    are (the planner traces the step under fake tensors, where ``bincount``'s length depends on the data)."""
    return torch.zeros(n_experts, dtype=torch.long, device=slots.device).scatter_add_(0, slots, torch.ones_like(slots))


def group_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """``counts`` as Python ints, to split the tokens by expert. Under fake tensors (the planner tracing a step)
    they cannot be read: the routing is taken as even, what the balance loss aims at (the same FLOPs as any other
    routing; an uneven one holds more tokens on some ranks under expert parallelism)."""
    if isinstance(counts, FakeTensor):
        n = counts.shape[0]
        return [total // n + (e < total % n) for e in range(n)]
    return counts.tolist()
