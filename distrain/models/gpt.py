"""A small GPT decoder: pre-norm blocks, SDPA attention, tied input/output embeddings.

Sizes go from ~1M parameters (tests) to the usual 124M/350M/1.3B/7B shapes. The block class is
exported so activation-checkpointing and wrapping policies can name it. ``n_experts`` makes each block's
MLP a mixture of experts (``distrain.models.moe``): ``top_k`` of them per token, and the router's
load-balancing loss added to the loss × ``aux_loss_coef``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.models.moe import MoE
from distrain.parallel.context_parallel import IGNORE


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte level
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    n_experts: int = 0
    """A mixture of this many experts in place of each block's MLP (0: the MLP)."""
    top_k: int = 2
    """Experts per token."""
    aux_loss_coef: float = 0.01
    """The router's load-balancing loss (the mean over the blocks) is added to the loss times this."""


GPT_SIZES: dict[str, dict] = {
    "gpt-tiny": dict(n_layer=4, n_head=4, n_embd=128),  # ~0.8M
    "gpt-mini": dict(n_layer=6, n_head=6, n_embd=384),  # ~11M
    "gpt-small": dict(n_layer=8, n_head=8, n_embd=512),  # ~25M
    "gpt-124m": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt-350m": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt-1.3b": dict(n_layer=24, n_head=32, n_embd=2048),
    "gpt-7b": dict(n_layer=32, n_head=32, n_embd=4096),
    "gpt-70b": dict(n_layer=80, n_head=64, n_embd=8192),  # 64B: for planning (`distrain plan`)
}


def check_experts_key(training) -> None:
    """``training.n_experts`` (a config's ``TrainingConfig``) makes the built-in GPT a mixture of experts: one line
    naming the key for any other model (config.py cannot tell a built-in name: it imports no model)."""
    from distrain.config import ConfigError

    if training.n_experts and training.model_name not in GPT_SIZES:
        raise ConfigError(
            f"training.n_experts makes the built-in GPT a mixture of experts; {training.model_name!r} is not one "
            "(a Hugging Face model's experts are its config's: training.model_config)"
        )


def gpt_config(name: str, **overrides) -> GPTConfig:
    if name not in GPT_SIZES:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {', '.join(GPT_SIZES)}")
    return GPTConfig(**{**GPT_SIZES[name], **overrides})


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        # [batch, sequence, heads, head_dim] q, k, v → the same of y; context parallelism puts an engine around it
        self.attend = self.causal_attention

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return y.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # [q; k; v] of the heads this rank computes: all of them, or under tensor parallelism its share
        # (distrain.parallel.tensor_parallel hands each rank q, k and v of the same heads)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        return self.proj(self.attend(q, k, v).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoE(cfg.n_embd, 4 * cfg.n_embd, cfg.n_experts, cfg.top_k) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.reset_parameters()
        self.sequence_shard = None  # context parallelism: this rank's slice of every sequence (enable_context_parallel)
        #: a pipeline's last stage: the whole model's balance of the micro-batch it answered (``pipeline_balance``)
        self.balance_of_every_stage: dict[str, torch.Tensor] | None = None
        # counted now: a pipeline stage later holds only some of the layers
        numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731  (ZeRO-3 keeps only a partition)
        self._param_counts = (sum(numel(p) for p in self.parameters()), numel(self.pos_emb.weight))

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # GPT-2 init; residual projections scaled down by depth
                residual = name.endswith(("proj.weight", "experts.proj"))
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def num_params(self, non_embedding: bool = True) -> int:
        total, positions = self._param_counts
        return total - positions if non_embedding else total

    def active_params(self) -> int:
        """The parameters one token computes with: all but the experts it is not routed to."""
        cfg = self.cfg
        idle = max(0, cfg.n_experts - cfg.top_k) * 2 * 4 * cfg.n_embd * cfg.n_embd * cfg.n_layer
        return self.num_params() - idle

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N for the matmuls (N: the active parameters) plus attention (PaLM appendix B)."""
        T = seq_len or self.cfg.block_size
        return 6 * self.active_params() + 12 * self.cfg.n_layer * self.cfg.n_embd * T

    def load_balance(self) -> dict[str, torch.Tensor]:
        """The last forward's balance over the experts, for the metrics (empty without MoE): the load-balancing
        loss (``moe_aux_loss``, 1.0 when even) and the busiest expert's tokens over the mean, in the least balanced
        layer (``moe_load_max_over_mean``: 1.0 when even, the expert count when every token went to one)."""
        if self.balance_of_every_stage is not None:  # a pipeline stage holds some blocks: the stages' together
            return self.balance_of_every_stage
        ratio = self.load_ratio(self.blocks)
        return {} if ratio is None else {"moe_aux_loss": self.aux_loss().detach(), "moe_load_max_over_mean": ratio}

    @staticmethod
    def load_ratio(blocks: nn.Module) -> torch.Tensor | None:
        """The busiest expert's tokens over the mean in the least balanced mixture of ``blocks`` (None: no MoE)."""
        counts = [
            m.tokens_per_expert.float() for m in blocks.modules() if getattr(m, "tokens_per_expert", None) is not None
        ]
        return torch.stack([c.max() / c.mean().clamp(min=1e-9) for c in counts]).max() if counts else None

    def aux_loss(self) -> torch.Tensor | None:
        """The last forward's load-balancing loss, the mean over the blocks' mixtures of experts (None: no MoE)."""
        losses = [layer.aux_loss for layer in self._mixtures() if layer.aux_loss is not None]
        return torch.stack(losses).mean() if losses else None

    def _mixtures(self) -> list[MoE]:
        """The blocks' mixtures of experts (a pipeline stage holds only some blocks: the others are None)."""
        return [b.mlp for b in self.blocks if b is not None and isinstance(b.mlp, MoE)]

    def context_parallel_heads(self) -> list[int]:
        """The heads context parallelism splits (``distrain.parallel.context_parallel.attention_heads``)."""
        return [self.cfg.n_head]

    def enable_context_parallel(self, shard) -> None:
        """Split every sequence over a context-parallel group (``distrain.parallel.context_parallel``): the forward
        takes whole sequences and computes on this rank's slice; attention runs through the group's engine."""
        if shard.engine == "ring" and self.cfg.dropout:
            from distrain.parallel.context_parallel import RING_REFUSES

            raise ValueError(RING_REFUSES.format(what=f"attention dropout (dropout={self.cfg.dropout})"))
        self.sequence_shard = shard
        for block in self.blocks:
            block.attn.attend = shard.attention(block.attn.causal_attention)
        for mixture in self._mixtures():  # each balances whole sequences, of which this rank holds a slice
            mixture.sequence_shard = shard

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        shard, length = self.sequence_shard, idx.shape[1]
        if shard is not None:
            if length > self.cfg.block_size:
                raise ValueError(f"sequence length {length} exceeds the model's block_size {self.cfg.block_size}")
            idx = shard.split(idx, 0)  # a pad's token is never attended to by a real one (causal)
            targets = None if targets is None else shard.split(targets, IGNORE)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.logits(x)
        if shard is not None:  # the loss over the group's tokens, or the logits of the whole sequence
            out = shard.mean_loss(logits, targets) if targets is not None else shard.gather(logits, length)
        else:
            out = self.output(logits, targets)
        aux = self.aux_loss() if targets is not None and self.cfg.aux_loss_coef else None
        return out if aux is None else self.with_aux_loss(out, aux)

    def with_aux_loss(self, loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """``loss`` and the load-balancing loss ``aux`` (the mean over the mixtures) × ``aux_loss_coef``."""
        if isinstance(loss, DTensor):  # tensor parallelism's loss (loss_parallel): every rank's, as the aux loss is
            aux = DTensor.from_local(aux, loss.device_mesh, loss.placements, run_check=False)
        return loss + self.cfg.aux_loss_coef * aux

    @staticmethod
    def aux_loss_sum(blocks: nn.Module) -> torch.Tensor:
        """The sum of the last forward's load-balancing losses of the mixtures in ``blocks`` (a pipeline stage's)."""
        return torch.stack([m.aux_loss for m in blocks.modules() if isinstance(m, MoE)]).sum()

    # the forward's three parts: a pipeline runs them on its first stage, every stage and its last stage
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size {self.cfg.block_size}")
        shard = self.sequence_shard
        if shard is not None:  # a pad past block_size takes the last position: what it computes counts for nothing
            pos = shard.positions(T, idx.device).clamp(max=self.cfg.block_size - 1)
        else:
            pos = torch.arange(T, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))

    @staticmethod
    def output(logits: torch.Tensor, targets: torch.Tensor | None = None):
        """What ``forward`` returns: the logits, or with ``targets`` the mean next-token loss."""
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
