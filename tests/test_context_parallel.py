"""Context parallelism (``distributed.context_parallel_size``) on real gloo ranks: each sequence split over the ranks of
a group, attention through DeepSpeed-Ulysses (heads the group divides) or torch's ring. A run matches one process on
the same global batch (losses, gradient norms and every trained weight, within fp32 rounding), with sequences whose
length is not a multiple of the group and targets that are padding; position ids and the loss mean are the whole
sequence's, not a slice's."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import distrain
from distrain.config import ConfigError
from distrain.parallel.context_parallel import IGNORE, SequenceShard, right_padded
from distrain.parallel.expert_parallel import experts_of
from distrain.parallel.layout import ParallelLayout, layout_for
from helpers import console_of_a_faulty_rank, run_ranks

STEPS = 3
SEQ = 15  # not a multiple of 2 or 4: the last rank's slice is padded


class Sequences(Dataset):
    """Learnable byte sequences of SEQ tokens; some targets are padding (IGNORE), as a collator's would be."""

    def __init__(self, n: int, seed: int = 0, length: int = SEQ, padding: bool = True):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 256, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        data = (start + stride * torch.arange(length + 1)) % 256
        self.x, self.y = data[:, :-1].clone(), data[:, 1:].clone()
        padded = torch.randint(0, length // 2 if padding else 1, (n,), generator=g)  # a tail of each may be padding
        for i, keep in enumerate(length - padded):
            self.y[i, keep:] = IGNORE

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class LongGPT(distrain.Module):
    """The built-in GPT (4 heads unless told, 8 wide each), built in configure_model; ``experts``: each block a
    mixture of that many, top-2, its balance loss in the loss."""

    def __init__(self, heads: int = 4, experts: int = 0):
        super().__init__()
        self.gpt, self.heads, self.experts = None, heads, experts

    def configure_model(self):
        if self.gpt is None:
            from distrain.models.gpt import GPT, GPTConfig

            moe = {"n_experts": self.experts, "top_k": 2, "aux_loss_coef": 0.1} if self.experts else {}
            self.gpt = GPT(GPTConfig(n_layer=2, n_head=self.heads, n_embd=8 * self.heads, block_size=16, **moe))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.gpt(x, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.gpt(x, y))

    def predict_step(self, batch, batch_idx):
        return self.gpt(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class Rows(distrain.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append((m["loss"], m["grad_norm"], m.get("train_loss")))


def _fit(
    tmp,
    strategy,
    devices: int,
    batch: int,
    steps: int = STEPS,
    resume: str | None = None,
    padding=True,
    llama=None,
    heads: int = 4,
    experts: int = 0,
):
    """``steps`` steps (from ``resume``'s checkpoint if given, a checkpoint kept at the end); the per-step rows,
    the validation loss, the predictions, the whole trained weights and the engine that split the sequences."""
    from distrain.checkpoint import state as ckpt_state

    rows = Rows()
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        gradient_clip_val=1.0,
        seed=7,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=True,
        logger=False,
        default_root_dir=str(tmp),
        callbacks=[rows],
    )
    if llama is None:
        module = LongGPT(heads, experts)
        train = DataLoader(Sequences(24, padding=padding), batch_size=batch, shuffle=True)
        val = DataLoader(Sequences(6, seed=1, padding=padding), batch_size=3)
    else:  # a tiny Hugging Face Llama on right-padded samples of uneven lengths
        import matrix_models

        from distrain.hf.data import PadCollator
        from distrain.hf.models import load_tokenizer

        samples = matrix_models.hf_samples(llama, "causal_lm", n=24)
        collate = PadCollator(load_tokenizer(llama).pad_token_id)
        module = matrix_models.hf_causal(llama)
        train = DataLoader(samples, batch_size=batch, shuffle=True, collate_fn=collate)
        val = DataLoader(samples[:6], batch_size=3, collate_fn=collate)
    trainer.fit(module, train, val, ckpt_path=resume)
    predictions = [p if p.dtype == torch.long else p.argmax(-1) for p in trainer.predict(module, val)]
    if llama is not None and trainer.strategy.data_parallel_size == 1:  # (replicas: each predicts its share)
        # a pad's prediction depends on how its mask is made: only real tokens' are compared
        predictions = [p.masked_fill(b["attention_mask"] == 0, -1) for p, b in zip(predictions, val)]
    predictions = [p.tolist() for p in predictions]
    model = module.gpt if llama is None else module.model
    weights = ckpt_state.get_model_state_dict(model, options=ckpt_state.FULL_EVERY_RANK)
    experts = experts_of(model)
    if experts is not None:  # each layer's experts whole, as a checkpoint holds them
        weights = experts.global_state(weights, ckpt_state.get_model_state_dict(model, options=ckpt_state.SHARDED))
    weights = {k: v.detach().clone() for k, v in weights.items()}
    engine = getattr(trainer.strategy, "context_engine", None)
    return rows.rows, trainer.callback_metrics["val_loss"], predictions, weights, engine


def _cp(size: int, tensor: int = 1, **options):
    return distrain.ModelParallelStrategy(tensor_parallel_size=tensor, context_parallel_size=size, **options)


def _every_block():
    from distrain.models.gpt import Block

    return {Block}


def _two_ranks(rank, tmp, llama, llama_gqa, mistrals):
    """Ulysses (4 heads, 2 ranks) and the ring (3 heads; a Llama with 3 query heads sharing 1 key/value head),
    each trained and verified; Mistral's sliding window, wider than the sequences (exact) and narrower (refused)."""
    runs = {
        "gpt": _fit(tmp / "cp2", _cp(2), 2, 4),
        "llama": _fit(tmp / "cp2-llama", _cp(2), 2, 4, llama=llama),
        "gpt-ring": _fit(tmp / "cp2-ring", _cp(2), 2, 4, heads=3),
        # a mixture of experts: each rank routes its slice; the balance loss is each whole sequence's
        "gpt-moe": _fit(tmp / "cp2-moe", _cp(2), 2, 4, experts=4),
        "gpt-moe-ring": _fit(tmp / "cp2-moe-ring", _cp(2), 2, 4, heads=3, experts=4),
        # tensor parallelism, no context parallelism: each rank every token, its half of each expert's hidden units
        "gpt-moe-tp2": _fit(tmp / "tp2-moe", _cp(1, tensor=2, sequence_parallel=False), 2, 4, experts=4),
        # and the experts split between the context-parallel ranks, which hold different tokens (all-to-all)
        "gpt-moe-ep2": _fit(tmp / "cp2-moe-ep2", _cp(2, expert_parallel_size=2), 2, 4, experts=4),
        "llama-ring": _fit(tmp / "cp2-llama-ring", _cp(2), 2, 4, llama=llama_gqa),
        "mistral": _fit(tmp / "cp2-mistral", _cp(2), 2, 4, llama=mistrals["wide"]),
    }
    try:
        _fit(tmp / "cp2-mistral-narrow", _cp(2), 2, 4, llama=mistrals["narrow"])
        runs["refused"] = None
    except ValueError as error:
        runs["refused"] = str(error)
    reports = {}
    for heads in (4, 3):  # each verify starts a process group of its own, and ends it
        trainer = distrain.Trainer(
            accelerator="cpu", strategy=_cp(2), devices=2, seed=7, logger=False, default_root_dir=str(tmp / "verify")
        )
        report = trainer.verify(LongGPT(heads), DataLoader(Sequences(24), batch_size=4, shuffle=True), steps=2)
        reports[heads] = None if report is None else report.to_json()
    return runs, reports


def _close(reference, result, what: str, first_step: int = 1, atol: float = 5e-5) -> None:
    rows, val_loss, predictions, weights, _ = result
    assert len(rows) == len(reference[0]), what
    for step, (a, b) in enumerate(zip(reference[0], rows), start=first_step):
        for name, x, y in zip(("loss", "grad_norm", "train_loss"), a, b):
            if x is None and y is None:  # not logged by this job
                continue
            assert math.isclose(x, y, rel_tol=1e-5), f"{what}: step {step} {name}: {x} vs {y}"
    assert math.isclose(val_loss, reference[1], rel_tol=1e-5), what
    assert predictions == reference[2], what  # the whole sequence's logits, gathered from the slices
    assert weights.keys() == reference[3].keys(), what
    # Adam divides a gradient by its own scale: fp32 rounding in a near-zero gradient moves a weight by up to ~lr
    # × rounding; a wrong gradient moves it by ~lr (3e-3, 1e-2)
    for key, value in reference[3].items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=atol, msg=lambda m, k=key: f"{what}: {k}: {m}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from distrain.hf import tiny

    return tiny.make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def mistrals(tmp_path_factory):
    """Sliding windows of 64 tokens (wider than the samples: the window changes nothing) and of 4 (narrower)."""
    pytest.importorskip("transformers")
    from distrain.hf import tiny

    root = tmp_path_factory.mktemp("tiny")
    return {
        "wide": tiny.make_tiny_llama(root / "mistral-64", sliding_window=64),
        "narrow": tiny.make_tiny_llama(root / "mistral-4", sliding_window=4),
    }


@pytest.fixture(scope="module")
def llama_gqa(tmp_path_factory):
    """3 query heads, 1 key/value head: no group of 2 splits them, so the ring runs it."""
    pytest.importorskip("transformers")
    from distrain.hf import tiny

    return tiny.make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama-gqa", heads=3, kv_heads=1)


def test_context_parallel_on_two_ranks_matches_one_process_and_resumes_on_one(tmp_path, llama, llama_gqa, mistrals):
    results = run_ranks(_two_ranks, 2, tmp_path, llama, llama_gqa, mistrals)
    references = {
        "gpt": _fit(tmp_path / "single", "single", 1, 4),
        "llama": _fit(tmp_path / "single-llama", "single", 1, 4, llama=llama),
        "gpt-ring": _fit(tmp_path / "single-ring", "single", 1, 4, heads=3),
        "gpt-moe": _fit(tmp_path / "single-moe", "single", 1, 4, experts=4),
        "gpt-moe-ring": _fit(tmp_path / "single-moe-ring", "single", 1, 4, heads=3, experts=4),
        "llama-ring": _fit(tmp_path / "single-llama-ring", "single", 1, 4, llama=llama_gqa),
        "mistral": _fit(tmp_path / "single-mistral", "single", 1, 4, llama=mistrals["wide"]),
    }
    for heads, verified in results[0][1].items():
        assert verified["ok"], (heads, [c for c in verified["checks"] if not c["ok"]])
        data = next(c["detail"] for c in verified["checks"] if c["name"] == "data")
        assert "the 2 ranks of each replica share its samples, each sequence split into 2 slices that tile it" in data
    for rank in range(2):
        runs = results[rank][0]
        # a window narrower than the sequences: refused, where the engine would attend past it
        assert re.match(
            r"context parallelism cannot run a sliding window of 4 tokens over sequences of \d+ ", runs["refused"] or ""
        ), runs["refused"]
        moe = references["gpt-moe"]
        for name, reference in {**references, "gpt-moe-tp2": moe, "gpt-moe-ep2": moe}.items():
            assert runs[name][4] == ("ring" if "ring" in name else None if "tp2" in name else "ulysses"), name
            # a mixture's router adds gradients of its own to the attention's: one near-zero coordinate in 3072
            # moved 1e-4 (a wrong gradient moves weights by ~lr, 3e-3)
            _close(reference, runs[name], f"CP=2 {name}, rank {rank}", atol=2e-4 if "moe" in name else 5e-5)
    # its checkpoint resumes on one process (no context parallelism) where one process's own run goes on
    longer = _fit(tmp_path / "single-longer", "single", 1, 4, steps=STEPS + 2)
    last = next((tmp_path / "cp2").rglob(f"*step={STEPS}*"))
    resumed = _fit(tmp_path / "single<cp2", "single", 1, 4, steps=STEPS + 2, resume=str(last))
    _close((longer[0][STEPS:], *longer[1:]), resumed, "one process resumed from CP=2", STEPS + 1)


# data parallelism averages the replicas' mean losses, which is one process's mean over tokens when every
# replica has as many real tokens: these runs have no padded targets (the 2-rank one has)
FOUR_RANKS = {  # name: (strategy, per-rank batch, replicas); the GPT has 4 heads unless its name says
    "cp2xfsdp2": (lambda: _cp(2), 2, 2),
    "cp2xtp2": (lambda: _cp(2, tensor=2), 4, 1),
    "cp2xtp2-6heads": (lambda: _cp(2, tensor=2), 4, 1),  # 3 heads per tensor-parallel rank: the ring
    "cp4+ac": (lambda: _cp(4, activation_checkpointing_policy=_every_block()), 4, 1),  # recomputed: the same
    "cp2xfsdp2-llama": (lambda: _cp(2), 2, 2),  # its loss is the mean over the step's tokens: padding is exact
    "cp4-llama": (lambda: _cp(4), 4, 1),  # 2 heads on 4 ranks: the ring, its sequences cut into 8 pieces
    # a mixture of experts, each expert's hidden units split over the tensor-parallel ranks and sharded over the
    # replicas (FSDP2 on the 2-D mesh); and under sequence parallelism, each sequence split over the context ranks
    "tp2xfsdp2-moe": (lambda: _cp(1, tensor=2, sequence_parallel=False), 2, 2),
    "cp2xtp2-moe": (lambda: _cp(2, tensor=2), 4, 1),
    # the experts split among 2 and among all 4 of the data × context ranks, each layer's sharded over the others
    "cp2xfsdp2-moe-ep2": (lambda: _cp(2, expert_parallel_size=2), 2, 2),
    "cp2xfsdp2-moe-ep4": (lambda: _cp(2, expert_parallel_size=4), 2, 2),
}


def _four_ranks(rank, tmp, llama):
    out = {
        name: _fit(
            tmp / name,
            make(),
            4,
            batch,
            padding=False,
            llama=llama if "llama" in name else None,
            heads=_heads(name),
            experts=4 if "moe" in name else 0,
        )
        for name, (make, batch, _) in FOUR_RANKS.items()
    }
    # CP2 × FSDP2's checkpoint resumes under CP=4 (another context size, no replicas)
    last = next((tmp / "cp2xfsdp2").rglob(f"*step={STEPS}*"))
    out["cp4<cp2xfsdp2"] = _fit(tmp / "cp4<cp2xfsdp2", _cp(4), 4, 4, STEPS + 2, str(last), padding=False)
    # the mixture's, its experts split among 4 ranks by rows, resumes with each expert's hidden units split 4 ways
    last = next((tmp / "cp2xfsdp2-moe-ep4").rglob(f"*step={STEPS}*"))
    tp4 = _cp(1, tensor=4, sequence_parallel=False)
    out["tp4<ep4"] = _fit(tmp / "tp4<ep4", tp4, 4, 4, STEPS + 2, str(last), padding=False, experts=4)
    return out


def _heads(name: str) -> int:
    return 6 if "6heads" in name else 4


@pytest.mark.slow
def test_context_parallel_with_fsdp_and_with_tensor_parallel_on_four_ranks_matches_one_process(tmp_path, llama):
    results = run_ranks(_four_ranks, 4, tmp_path, llama)
    references = {
        "gpt": _fit(tmp_path / "single", "single", 1, 4, padding=False),
        "llama": _fit(tmp_path / "single-llama", "single", 1, 4, llama=llama),
        "gpt-6heads": _fit(tmp_path / "single-6heads", "single", 1, 4, padding=False, heads=6),
        "gpt-moe": _fit(tmp_path / "single-moe", "single", 1, 4, padding=False, experts=4),
    }
    for name, (_, batch, replicas) in FOUR_RANKS.items():
        assert batch * replicas == 4  # the global batch of the reference
        kind = "llama" if "llama" in name else "gpt-6heads" if _heads(name) == 6 else "gpt"
        reference = references["gpt-moe" if "moe" in name else kind]
        for rank in range(4):
            result = results[rank][name]
            engine = "ring" if name in ("cp2xtp2-6heads", "cp4-llama") else None if name.startswith("tp") else "ulysses"
            assert result[4] == engine, name
            if replicas > 1:  # a value logged without sync_dist is this replica's; it predicts its share
                rows = [(loss, norm, ref[2]) for (loss, norm, _), ref in zip(result[0], reference[0])]
                result = (rows, result[1], reference[2], *result[3:])
            _close(reference, result, f"{name}, rank {rank}", atol=2e-4 if "moe" in name else 5e-5)
    longer = _fit(tmp_path / "single-longer", "single", 1, 4, steps=STEPS + 2, padding=False)
    longer_moe = _fit(tmp_path / "single-longer-moe", "single", 1, 4, steps=STEPS + 2, padding=False, experts=4)
    for rank in range(4):
        _close((longer[0][STEPS:], *longer[1:]), results[rank]["cp4<cp2xfsdp2"], f"CP=4 from CP2×FSDP2, rank {rank}")
        resumed = results[rank]["tp4<ep4"]
        _close(
            (longer_moe[0][STEPS:], *longer_moe[1:]), resumed, f"TP=4 from CP2×FSDP2×EP4, rank {rank}", STEPS + 1, 2e-4
        )


# ---- in one process: the slice, the layout, and what is refused before any rank starts ------------------------------
@pytest.mark.slow
@pytest.mark.alone  # the console within a collective timeout of seconds
@pytest.mark.parametrize("heads", [2, 1], ids=["ulysses", "ring"])
def test_the_console_names_a_context_parallel_rank_that_dies_while_its_peer_waits_in_the_engine(tmp_path, heads):
    """Rank 1 of a CP=2 group dies (exit 137, as the OOM killer ends a process) at the start of its third step;
    rank 0 is inside attention's collective (Ulysses's all-to-all; the ring's all-gather for the 1 head that 2 ranks
    cannot split), waiting for the slice rank 1 never sends. The console's first line names rank 1, its exit and
    step; rank 0 is the one that waited, never the culprit."""
    strategy = "distrain.ModelParallelStrategy(context_parallel_size=2)"
    console, elapsed = console_of_a_faulty_rank(tmp_path, "os._exit(137)", 3.0, strategy, f"{{'n_head': {heads}}}")
    first = console.splitlines()[0]
    assert first.startswith("[distrain] rank 1 failed first at step 3 (in forward/backward): exited with code 137"), (
        console
    )
    assert "rank 0 failed first" not in console and "(it waited for the ranks above)" in console, console
    assert elapsed < 120, elapsed


def test_a_rank_holds_a_contiguous_padded_slice_at_its_global_positions():
    tokens = torch.arange(10).reshape(2, 5)
    slices = [SequenceShard(None, rank, 2).split(tokens, IGNORE) for rank in range(2)]
    assert slices[0].tolist() == [[0, 1, 2], [5, 6, 7]]
    assert slices[1].tolist() == [[3, 4, IGNORE], [8, 9, IGNORE]]  # padded at the end: no real token sees a pad
    assert SequenceShard(None, 1, 2).positions(3, torch.device("cpu")).tolist() == [3, 4, 5]
    # a Hugging Face batch goes in without its mask: only right padding keeps real tokens from pads then
    assert right_padded(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])) and right_padded(None)
    assert not right_padded(torch.tensor([[1, 1, 1], [0, 1, 1]]))  # left padding
    assert not right_padded(torch.tensor([[1, 0, 1]]))  # a hole
    four = [SequenceShard(None, rank, 4).split(tokens[:, :4], 0) for rank in range(4)]
    assert torch.equal(torch.cat(four, dim=1), tokens[:, :4])  # an even length: no pad
    # the ring's balanced layout: 2N pieces, rank c holds pieces c and 2N-1-c (as much causal work on each rank)
    ring = [SequenceShard(None, rank, 2, engine="ring") for rank in range(2)]
    assert ring[0].split(tokens, IGNORE).tolist() == [[0, 1, IGNORE, IGNORE], [5, 6, IGNORE, IGNORE]]
    assert ring[1].split(tokens, IGNORE).tolist() == [[2, 3, 4, IGNORE], [7, 8, 9, IGNORE]]
    assert ring[0].positions(4, torch.device("cpu")).tolist() == [0, 1, 6, 7]
    assert ring[0].last_slice == ((0, 2, 8), (6, 8, 8))
    assert ring[1].positions(4, torch.device("cpu")).tolist() == [2, 3, 4, 5]


def test_the_ring_refuses_what_it_cannot_compute_in_one_line():
    """The ring runs its own kernel: no attention dropout (the GPT's, refused when the engine is set; a Hugging Face
    layer's, at its first call). Ulysses runs the model's own attention, dropout included. Neither masks a sliding
    window: a sequence longer than one is refused, one within it computes what the model does."""
    from distrain.models.gpt import GPT, GPTConfig
    from distrain.parallel.context_parallel import engine_for

    assert engine_for([4], 2, 1, "m") == "ulysses" and engine_for([4, 2], 4, 1, "m") == "ring"  # kv heads too
    assert engine_for([6], 3, 2, "m") == "ulysses" and engine_for([6], 2, 2, "m") == "ring"  # 3 heads per TP rank
    assert engine_for(None, 3, 1, "m") == "ulysses"  # a model that does not say its heads
    with pytest.raises(ValueError, match="m has 6 attention heads, which tensor_parallel_size=4 does not divide"):
        engine_for([6], 2, 4, "m")
    gpt = GPT(GPTConfig(n_layer=1, n_head=3, n_embd=24, block_size=8, dropout=0.1))
    with pytest.raises(ValueError, match=r"ring engine .* cannot run attention dropout \(dropout=0.1\)"):
        gpt.enable_context_parallel(SequenceShard(None, 0, 2, engine="ring"))
    attend = SequenceShard(None, 0, 2, engine="ring").attention(None)
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"cannot run attention dropout \(0.1\)"):
        attend(q, q, q, scaling=None, dropout=0.1)
    with pytest.raises(ValueError, match=r"cannot run a sliding window of 6 tokens over sequences of 8 "):
        attend(q, q, q, sliding_window=6)  # 4 tokens on each of 2 ranks
    shard = SequenceShard(None, 0, 2, engine="ring")
    shard.split(torch.zeros(1, 7), 0)  # 7 tokens, padded to 8: the pad is past every real token
    with pytest.raises(ValueError, match=r"cannot run a sliding window of 6 tokens over sequences of 7 "):
        shard.attention(None)(q, q, q, sliding_window=6)
    shard.split(torch.zeros(1, 6), 0)  # 6 tokens, padded to 8, within a window of 7: on to the ring (no group here)
    with pytest.raises(Exception) as info:
        shard.attention(None)(q, q, q, sliding_window=7)
    assert "sliding window" not in str(info.value)
    for extra, what in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks")):  # Gemma's, gpt-oss's
        with pytest.raises(ValueError, match=rf"cannot run this model's attention: it asks for {what} \({extra}\)"):
            attend(q, q, q, **{extra: torch.zeros(3)})


def test_verify_fails_a_split_whose_slices_do_not_tile_the_sequence():
    from distrain.verify.report import _sequence_split

    def ranks(*slices):  # each rank's pieces: one (Ulysses), or two (the ring)
        return [{"data_parallel_rank": 0, "sequence_slice": s} for s in slices]

    assert _sequence_split(ranks([(0, 8, 16)], [(8, 16, 16)])) == []
    assert _sequence_split(ranks([(0, 8, 16)], [(0, 8, 16)], [(8, 16, 16)])) == []  # tensor-parallel peers
    assert _sequence_split(ranks([(0, 4, 16), (12, 16, 16)], [(4, 8, 16), (8, 12, 16)])) == []  # the ring's
    assert "do not tile" in _sequence_split(ranks([(0, 8, 16)], [(4, 12, 16)]))[0]  # a token computed twice
    assert "stop at 8 of 16" in _sequence_split(ranks([(0, 8, 16)]))[0]  # half the sequence left out
    assert "do not tile" in _sequence_split(ranks([(0, 8, 16)], [(12, 16, 16)]))[0]  # a hole
    assert "do not tile" in _sequence_split(ranks([(0, 4, 16), (12, 16, 16)], [(4, 8, 16), (10, 12, 16)]))[0]


def test_ranks_are_numbered_tensor_then_context_then_data_then_pipeline():
    layout = ParallelLayout(pipeline=2, data=3, tensor=2, context=2)
    assert layout.world_size == 24
    grid = torch.arange(24).reshape(2, 3, 2, 2)  # the DeviceMesh's (pipeline, data, context, tensor) layout
    for rank in range(24):
        assert grid[layout.coordinates(rank)].item() == rank
    assert layout_for(8, 4, False, "auto", "auto", None, 1, context_parallel_size=2).tensor == 2  # a node's 4 ÷ 2
    assert ParallelLayout(data=2, context=2).describe() == "pipeline 1 × data 2 × context 2 × tensor 1"


def test_impossible_context_parallel_layouts_are_refused_in_one_line_before_any_rank_starts(capsys):
    from distrain import cli
    from distrain.config import build_config

    def cp(size, **kw):
        return distrain.ModelParallelStrategy(
            tensor_parallel_size=kw.pop("tensor", 1), context_parallel_size=size, **kw
        )

    with pytest.raises(ValueError, match=r"3 ranks cannot hold .* context_parallel_size=2 .* multiple of 2"):
        distrain.Trainer(accelerator="cpu", devices=3, strategy=cp(2))
    with pytest.raises(ValueError, match=r"does not compose with pipeline stages"):
        distrain.Trainer(accelerator="cpu", devices=4, strategy=cp(2, pipeline_stages=2))
    with pytest.raises(ValueError, match=r"context_parallel_size.* must be a positive integer, got 0"):
        distrain.Trainer(accelerator="cpu", devices=2, strategy=cp(0))
    # a layout asked of a strategy that has none would be ignored silently (or reach DistributedDataParallel):
    # refused, naming the key, from the Trainer and from a config
    trainer = distrain.Trainer(accelerator="cpu", devices=2, strategy="model_parallel", context_parallel_size=2)
    assert (trainer.runtime.strategy.layout.context, trainer.runtime.strategy.layout.tensor) == (2, 1)  # TP auto: 2/2
    for strategy in ("auto", "ddp", "fsdp", "pipeline", "deepspeed_stage_3"):
        with pytest.raises(ValueError, match=rf"context_parallel_size applies to strategy='model_parallel', but the "
                                             rf"strategy is '{strategy}'"):  # fmt: skip
            distrain.Trainer(accelerator="cpu", devices=2, strategy=strategy, context_parallel_size=2)
    for strategy in ("fsdp", "ddp", "auto"):
        with pytest.raises(
            ConfigError, match=r"distributed.context_parallel_size=2 applies to strategy model_parallel"
        ):
            build_config(None, {"distributed.strategy": strategy}, ["distributed.context_parallel_size=2"])
    # heads no engine takes (gpt-tiny's 4 over tensor_parallel_size=3), from the CLI in one line, no rank started
    code = cli.main(
        ["train", "--strategy", "model_parallel", "--devices", "6", "--accelerator", "cpu"]
        + [
            "--output-dir",
            "/nonexistent/x",
            "distributed.tensor_parallel_size=3",
            "distributed.context_parallel_size=2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "gpt-tiny has 4 attention heads, which tensor_parallel_size=3 does not divide" in err, err
    assert len(err.strip().splitlines()) == 1
    # the planner refuses it with the run's own line; a size it can run is planned as the run takes it: heads
    # that the size does not divide (4 over 3) take the ring, named in the row
    plan = ["plan", "--strategy", "model_parallel", "--accelerator", "cpu"]
    refused = ["--devices", "6", "distributed.tensor_parallel_size=3", "distributed.context_parallel_size=2"]
    assert cli.main([*plan, *refused]) == 2
    assert "gpt-tiny has 4 attention heads, which tensor_parallel_size=3" in capsys.readouterr().err
    for size, engine in ((2, ""), (3, r" \(ring\)")):
        asked = [f"--devices={size}", "distributed.tensor_parallel_size=1", f"distributed.context_parallel_size={size}"]
        assert cli.main([*plan, *asked]) == 0
        table = capsys.readouterr().out
        assert re.search(rf"^context parallel {size}{engine} × fsdp .* ← this run$", table, re.M), table
    # models of the user's own: one that cannot split sequences, and a GPT whose heads TP × CP cannot split
    import matrix_models

    from distrain.models.gpt import GPT, GPTConfig

    class ThreeHeads(matrix_models.MLP):
        def __init__(self):
            super().__init__()
            self.gpt = GPT(GPTConfig(n_layer=1, n_head=3, n_embd=24, block_size=8))

    for module, strategy, says in (
        (matrix_models.MLP(), cp(2), "MLP has no enable_context_parallel"),
        (ThreeHeads(), cp(2, tensor=2), "ThreeHeads has 3 attention heads, which tensor_parallel_size=2 does not"),
    ):
        trainer = distrain.Trainer(
            accelerator="cpu", devices=4 if "tensor" in says else 2, strategy=strategy, logger=False
        )
        with pytest.raises(ValueError, match=says) as info:
            trainer.fit(module, module.train_dataloader())
        assert "\n" not in str(info.value)


# ---- planned: distrain plan's rows, against measured peaks ------------------------------------------------------
@pytest.mark.slow
def test_the_plan_of_context_parallelism_peaks_within_ten_percent_of_measured_on_two_ranks(tmp_path):
    """The simulated step (the real strategy on a fake process group) against MemTracker's peak of a real run."""
    from plan_measure import Case, hf_dirs, measure_cases, predict

    cases = [Case("gpt-tiny", "cp", False, 2, seq_len=512), Case("gpt-tiny", "cp", True, 2, seq_len=512)]
    cases += [Case("tiny-llama", "cp", False, 4, seq_len=64), Case("tiny-llama-gqa", "cp", False, 4, seq_len=64)]
    hf = hf_dirs(str(tmp_path))
    measured = run_ranks(measure_cases, 2, cases, 2, hf, str(tmp_path))
    for i, case in enumerate(cases):
        peak, predicted = max(rank[i] for rank in measured), predict(case, 2, hf).peak
        assert abs(predicted - peak) / peak < 0.10, (case, predicted, peak)


def test_distrain_plan_has_context_parallel_rows_for_long_sequences_and_the_run_that_asks_for_one():
    from dataclasses import replace

    from distrain.planner.decide import Decision
    from distrain.planner.estimate import Job, Option
    from distrain.planner.model_stats import ModelSpec
    from distrain.planner.models.tensor import LONG_SEQUENCE
    from distrain.planner.plan import Budget, Planner, option_for_run

    def planner(seq_len: int) -> Planner:
        job = Job(ModelSpec.builtin_gpt("gpt-tiny", seq_len), 1, world_size=2)
        return Planner(job, Budget(device=2**34, host=2**36, gpu=False, source="test"))

    def layouts(planner: Planner) -> dict:  # the model-parallel layouts `all` and `auto` look at beside DDP's kin
        return {option.family: (p, option) for p, option in planner.model_parallel_planners()}

    short = layouts(planner(128))
    assert "cp" not in short and "tp" in short  # a short sequence: its all-to-alls cost more than they save
    long = planner(LONG_SEQUENCE)
    job = long.job
    cp_planner, cp_option = layouts(long)["cp"]  # at the accumulation that keeps the global batch
    cp, ddp = cp_planner.row(cp_option), long.row(Option("ddp"))
    assert (cp.option.context, cp.option.tensor, cp.accumulate) == (2, 1, 2)  # its ranks share samples
    assert cp.option.label == "context parallel 2 × fsdp" and cp.option.strategy == "model_parallel"
    assert cp.activations < 0.6 * ddp.activations  # each rank holds half of every sequence
    assert cp.max_seq_len > 1.6 * ddp.max_seq_len  # so a longer sequence fits the same budget
    assert cp.to_json()["context_parallel_size"] == 2 and cp.to_json()["max_seq_len"] == cp.max_seq_len
    # a what-if row (`distrain plan --num-nodes 1,2`) that takes it keeps the global batch: micro × accumulate ×
    # data-parallel, where the two context-parallel ranks are one data-parallel rank
    from distrain.batch import BatchLayout
    from distrain.planner.cli import TimingArgs, _shape_row

    timing = TimingArgs()
    timed = Planner(cp_planner.job, cp_planner.budget, timing.hardware(job)).row(cp_option)
    shape = _shape_row(job, BatchLayout(job.micro_batch, job.accumulate, job.world_size), timed, timing)
    assert (shape["micro_batch"], shape["accumulate"], shape["data_parallel_size"]) == (1, 2, 1), shape
    # the run that names it: its own row, Ulysses's or (heads the size does not divide) the ring's
    asked = replace(job, context_parallel=2, spec=ModelSpec.builtin_gpt("gpt-tiny", 128))
    assert (
        option_for_run("model_parallel", asked).context == 2
        and option_for_run("model_parallel", asked).get("engine") is None
    )
    ring = option_for_run("model_parallel", replace(asked, context_parallel=3, world_size=3))
    assert (ring.context, ring.get("engine"), ring.label) == (3, "ring", "context parallel 3 (ring) × fsdp")
    # auto's choice of it reaches the strategy, and the ranks the launcher starts
    decision = Decision(strategy="model_parallel", context=2)
    assert decision.strategy_options(()) == {"context_parallel_size": 2, "tensor_parallel_size": 1}
    assert Decision.from_env(decision.to_env("f"), "f") == decision
    # on a node of 4: every size that splits the heads, 2 and 4, each at the accumulation that keeps the batch
    four = Planner(replace(job, world_size=4), long.budget)
    cps = sorted((o.context, p.job.accumulate) for p, o in four.model_parallel_planners() if o.family == "cp")
    assert cps == [(2, 2), (4, 4)]


def _ring_against_whole_attention(rank, world, balanced, device="cpu", dtype="float32"):
    """Each rank's slice of ring attention's output and of q/k/v's gradients against attention over the whole
    sequence (in this process), as relative errors (by norm). On CUDA, NCCL with a GPU per rank."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from distrain.parallel import ring_attention

    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    B, H, T, d = 2, 3, 24, 8  # 3 heads: no split of 2 or 4 ranks gives each whole heads (Ulysses could not)
    q, k, v = (torch.randn(B, H, T, d).to(device=device, dtype=getattr(torch, dtype)) for _ in range(3))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*whole, is_causal=True, scale=0.3)
    weight = torch.arange(T, device=device).view(1, 1, T, 1)  # a gradient that differs by position
    (reference.float() * weight).sum().backward()
    chunk = T // (2 * world if balanced else world)
    if balanced:  # chunks r and 2N-1-r of 2N
        first, second = rank * chunk, (2 * world - 1 - rank) * chunk
        index = torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)
    else:
        index = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention.ring_attention(*mine, dist.group.WORLD, scale=0.3, balanced=balanced)
    (out.float() * index.view(1, 1, -1, 1)).sum().backward()
    pairs = [(out, reference[:, :, index])] + [(m.grad, w.grad[:, :, index]) for m, w in zip(mine, whole)]
    return [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in pairs]


@pytest.mark.parametrize(
    "world,balanced", [(2, True), (2, False), (4, True)], ids=["2-balanced", "2-contiguous", "4-balanced"]
)
def test_ring_attention_on_gloo_matches_whole_sequence_attention(world, balanced):
    """torch's ring attention (its forward and backward templates, here with the CPU flash kernel): each rank's
    slice of the output and of the gradients of q, k and v is what attention over the whole sequence gives, with
    torch's load-balanced layout (chunks r and 2N-1-r) and with contiguous slices; 3 heads, a custom scale."""
    for rank, errors in enumerate(run_ranks(_ring_against_whole_attention, world, world, balanced)):
        assert max(errors) < 1e-6, (rank, errors)
