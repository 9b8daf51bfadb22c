"""A model built in configure_model holds exactly the weights of a one-process eager build with the
same seed, on every world size and sharding: FSDP (meta device) and ZeRO-3 (zero.Init) included."""

import contextlib
import os
import warnings

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import distrain
from distrain.checkpoint.state import FULL_EVERY_RANK
from distrain.models.lm import GPTLanguageModel
from helpers import run_ranks


def _gpt():
    return GPTLanguageModel("gpt-tiny", block_size=32)


def _hf(task: str, path: str, pretrained: bool):
    from distrain.hf.tasks import TASK_MODULES

    return TASK_MODULES[task](model_name=path, pretrained=pretrained, seed=5)


@pytest.fixture(autouse=True)
def _one_rank_group_ends_with_the_test():
    """A one-rank build starts its process group in the test process: it ends with the test, not in a later one."""
    yield
    from distrain.distributed import shutdown

    shutdown(barrier=False)


def _built(strategy, make_module) -> tuple[dict, torch.Tensor, int | None]:
    """(full weights and buffers, the RNG state after the build, bytes of full temporaries held at once)."""
    rt = distrain.Runtime(strategy=strategy, devices=int(os.environ.get("WORLD_SIZE", 1)), accelerator="cpu")
    rt.setup_environment()
    rt.seed_everything(7)
    module = make_module()
    with rt.init_module():
        module.configure_model()
    model = rt.strategy.unwrap(rt.strategy.setup(module).model)
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3 partitions: read them whole
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gathered:
        state = get_model_state_dict(model, options=FULL_EVERY_RANK)
        buffers = {"buffer:" + k.replace("_checkpoint_wrapped_module.", ""): b for k, b in model.named_buffers()}
        out = {k: v.detach().cpu().clone() for k, v in {**state, **buffers}.items()}
    return out, torch.get_rng_state(), getattr(rt.strategy, "init_peak_bytes", None)


class AttnBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d, 2, batch_first=True)
        self.norm = torch.nn.LayerNorm(d)


class TorchLayers(distrain.Module):
    """Every torch.nn layer that holds parameters, built in configure_model: torch's attention (its initializer is
    ``_reset_parameters``), its Transformer (which draws every matrix again once built) and the encoder that
    deep-copies one layer, recurrent, convolutional, normalization and embedding layers."""

    def __init__(self, copies: bool = True):
        super().__init__()
        self.copies = copies  # DeepSpeed's zero.Init partitions no deep copy: ZeRO-3 builds without them

    def configure_model(self):
        nn, d = torch.nn, 8
        self.emb, self.bag = nn.Embedding(10, d), nn.EmbeddingBag(10, d)
        self.blocks = nn.ModuleList([AttnBlock(d), AttnBlock(d)])
        if self.copies:
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 2, 16, batch_first=True), 2)
            self.transformer = nn.Transformer(d, 2, 2, 2, 16, batch_first=True)
        self.rnns = nn.ModuleList([nn.LSTM(d, d), nn.GRU(d, d, bidirectional=True), nn.RNN(d, d), nn.LSTMCell(d, d)])
        self.convs = nn.ModuleList([nn.Conv1d(d, d, 3), nn.Conv2d(d, d, 3), nn.ConvTranspose1d(d, d, 2)])
        self.norms = nn.ModuleList(
            [nn.BatchNorm1d(d), nn.GroupNorm(2, d), nn.RMSNorm(d), nn.InstanceNorm1d(d, affine=True)]
        )
        self.bilinear, self.prelu, self.head = nn.Bilinear(d, d, 4), nn.PReLU(), nn.Linear(d, 10)
        self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(d, 20, [10])


def _models(tiny):
    return {
        "torch.nn": TorchLayers,
        "torch.nn without copies": lambda: TorchLayers(copies=False),
        "gpt": _gpt,
        "llama": lambda: _hf("causal_lm", tiny["llama"], True),
        "llama-fresh": lambda: _hf("causal_lm", tiny["llama"], False),
        "bert": lambda: _hf("sequence_classification", tiny["bert"], True),
    }


def _is_block(module) -> bool:
    return type(module).__name__ in ("Block", "LlamaDecoderLayer", "BertLayer", "AttnBlock", "TransformerEncoderLayer")


def _strategies(world):
    out = {
        "fsdp": lambda: distrain.FSDPStrategy(),
        "fsdp-grad-op": lambda: distrain.FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"),
        "fsdp-hybrid": lambda: distrain.FSDPStrategy(sharding_strategy="HYBRID_SHARD"),
        "fsdp-no-shard": lambda: distrain.FSDPStrategy(sharding_strategy="NO_SHARD"),
        # activation checkpointing wraps the blocks before sharding: names change, weights must not
        "fsdp-ac": lambda: distrain.FSDPStrategy(activation_checkpointing_policy=_is_block),
        "zero3": lambda: distrain.DeepSpeedStrategy(stage=3),
    }
    if world == 2:  # ZeRO-3 with parameter offload (zero.Init builds the partitions on the CPU)
        out["zero3-offload"] = lambda: distrain.DeepSpeedStrategy(
            stage=3, offload_parameters=True, offload_optimizer=True
        )
    return out


def _sharded_builds(rank, tiny, names):
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for strategy_name, make_strategy in _strategies(int(os.environ["WORLD_SIZE"])).items():
            for model_name, make_module in _models(tiny).items():
                zero3 = strategy_name.startswith("zero3")
                if model_name.startswith("torch.nn") and (
                    zero3 != model_name.endswith("without copies") or strategy_name not in ("fsdp", "fsdp-ac", "zero3")
                ):
                    # ZeRO-3 builds torch.nn's layers without the Transformer's copies, the others with; on one
                    # strategy of each way a shard is seen (DTensor shards, gathered partitions), and checkpointed
                    continue
                if names == "all" or (strategy_name, model_name) in names:
                    results[strategy_name, model_name] = _built(make_strategy(), make_module)
    rng_warnings = [str(w.message) for w in caught if "DTensor random" in str(w.message)]
    return results, rng_warnings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from distrain.hf.tiny import make_tiny_bert, make_tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    return {"llama": make_tiny_llama(root / "llama"), "bert": make_tiny_bert(root / "bert")}


def _assert_same(reference, built, label):
    ref_state, ref_rng, _ = reference
    state, rng, _ = built
    assert state.keys() == ref_state.keys(), label
    different = [k for k in ref_state if not torch.equal(ref_state[k], state[k])]
    assert not different, (label, different[:5])
    assert torch.equal(rng, ref_rng), (label, "the RNG stream after the build differs from an eager build's")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_builds_equal_the_one_process_build(tiny, world):
    references = {name: _built("single", make) for name, make in _models(tiny).items()}
    for rank_results, rng_warnings in run_ranks(_sharded_builds, world, tiny, "all"):
        assert not rng_warnings
        assert {model_name for _, model_name in rank_results} == set(references)  # every model, somewhere
        for (strategy_name, model_name), built in rank_results.items():
            _assert_same(references[model_name], built, f"{strategy_name} {model_name} on {world} ranks")


def test_one_rank_fsdp_and_memory_held_at_once(tiny):
    """On one rank too; and initialization holds at most one sharded unit (a GPT block, or the
    root's own embeddings and head) whole at a time, never the model."""
    reference = _built("single", _gpt)
    built = _built(distrain.FSDPStrategy(), _gpt)
    _assert_same(reference, built, "fsdp on 1 rank")
    model = _gpt()
    model.configure_model()
    total = sum(p.numel() * 4 for p in model.parameters())
    block = sum(p.numel() * 4 for p in model.gpt.blocks[0].parameters())
    root = total - block * len(model.gpt.blocks)
    assert built[2] <= max(block, root) < total


def test_a_parameter_nothing_initializes_is_an_error():
    class NoInit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

    class Job(distrain.Module):
        def configure_model(self):
            self.layer = NoInit()

    rt = distrain.Runtime(strategy=distrain.FSDPStrategy(), devices=1, accelerator="cpu")
    rt.setup_environment()
    module = Job()
    with rt.init_module():
        module.configure_model()
    with pytest.raises(RuntimeError, match=r"^Job was built .* nothing initializes layer\.w: .*reset_parameters"):
        rt.strategy.setup(module)
    # through the Trainer: the user's class and names, not those of distrain's wrapper around it
    trainer = distrain.Trainer(
        strategy=distrain.FSDPStrategy(), devices=1, accelerator="cpu", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^Job was built .* nothing initializes layer\.w: "):
        trainer.fit(Job(), torch.utils.data.DataLoader(torch.zeros(4, 4)))


def _eager_build_with_rank_dependent_rng(rank):
    torch.manual_seed(100 + rank)  # a script that drew random numbers differently on each rank before this
    rt = distrain.Runtime(strategy=distrain.FSDPStrategy(), devices=2, accelerator="cpu")
    rt.setup_environment()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sharded = rt.strategy.unwrap(rt.strategy.setup(model).model)
    return before, {k: v.clone() for k, v in get_model_state_dict(sharded, options=FULL_EVERY_RANK).items()}


def test_fsdp_model_built_in_init_starts_from_rank_zeros_weights():
    (before0, after0), (before1, after1) = run_ranks(_eager_build_with_rank_dependent_rng, 2)
    assert not torch.equal(before0["0.weight"], before1["0.weight"])
    for k in before0:  # as under DDP: rank 0's weights, on every rank
        assert torch.equal(after0[k], before0[k]) and torch.equal(after1[k], before0[k]), k
