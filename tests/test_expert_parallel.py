"""Expert parallelism's dispatch (``distrain.parallel.expert_parallel``) on real gloo ranks: a mixture-of-experts
layer whose experts are split over 2 ranks gives each token the output, and each weight the gradient, that one
process computes over the same global batch, whatever the routing: even, every token's first choice one expert,
or no token at all for one rank's experts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from distrain.models.gpt import GPT, gpt_config
from distrain.models.moe import MoE
from distrain.parallel.expert_parallel import moe_layers, scale_expert_grads, split_experts, split_model
from helpers import run_ranks

WIDTH, EXPERTS, TOKENS = 8, 4, 12  # tokens per rank
ROUTINGS = ("even", "one expert", "one rank idle")


def _layer(routing: str) -> MoE:
    torch.manual_seed(0)
    layer = MoE(WIDTH, 2 * WIDTH, EXPERTS, top_k=2)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        if routing == "one expert":  # expert 0 first for every token (the inputs are positive)
            layer.router.weight[0] = 5.0
        elif routing == "one rank idle":  # experts 2 and 3 (rank 1's) never chosen
            layer.router.weight[2:] = -5.0
    return layer


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.rand(2 * TOKENS, WIDTH, generator=g)  # positive: the routings above hold for every token


def _grads(layer: MoE) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in layer.named_parameters()}


def _reference(routing: str):
    layer = _layer(routing)
    x = _tokens()
    out = layer(x)
    out.square().mean().backward()  # the mean over the global batch
    return out.detach(), _grads(layer), layer.tokens_per_expert


def _expert_parallel(rank: int, routing: str):
    dist.init_process_group("gloo")
    layer = _layer(routing)
    split_experts(layer, dist.group.WORLD)
    x = _tokens()[rank * TOKENS : (rank + 1) * TOKENS]  # this rank's half
    out = layer(x)
    out.square().mean().backward()  # each rank's mean over its own tokens, as under data parallelism
    dist.all_reduce(layer.router.weight.grad, op=dist.ReduceOp.AVG)  # what DDP does for the rest of the model
    scale_expert_grads(layer, 2)
    return out.detach(), _grads(layer), layer.tokens_per_expert


@pytest.mark.parametrize("routing", ROUTINGS)
def test_experts_split_over_two_ranks_match_one_process(routing):
    out, grads, counts = _reference(routing)
    if routing == "one expert":
        assert counts[0] == 2 * TOKENS
    if routing == "one rank idle":
        assert counts[2:].sum() == 0
    results = run_ranks(_expert_parallel, 2, routing)
    for rank, (rank_out, rank_grads, _) in enumerate(results):
        torch.testing.assert_close(rank_out, out[rank * TOKENS : (rank + 1) * TOKENS], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank_grads["router.weight"], grads["router.weight"], rtol=1e-5, atol=1e-6)
        for name in ("experts.fc", "experts.proj"):  # each rank holds experts 2·rank and 2·rank + 1
            mine = grads[name][2 * rank : 2 * rank + 2]
            torch.testing.assert_close(rank_grads[name], mine, rtol=1e-5, atol=1e-6)


def _hidden_split(rank: int) -> dict:
    """Tensor parallelism's split of every expert's hidden units (``ExpertTensorParallel``) over 2 ranks, which
    both hold every token: the same output, and each rank its units' gradients, whatever the routing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    from distrain.parallel.tensor_parallel import ExpertTensorParallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for routing in ROUTINGS:
        layer = ExpertTensorParallel(output_layout=Replicate())._apply(_layer(routing), mesh)
        y = layer(_tokens())
        y.square().mean().backward()
        grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in layer.named_parameters()}
        out[routing] = y.detach(), grads, layer.tokens_per_expert
    return out


def test_experts_hidden_units_split_over_two_tensor_parallel_ranks_match_one_process():
    results = run_ranks(_hidden_split, 2)
    for routing in ROUTINGS:
        out, grads, counts = _reference(routing)
        half = grads["experts.fc"].shape[1] // 2  # each rank: its half of every expert's hidden units
        for rank, result in enumerate(results):
            rank_out, rank_grads, rank_counts = result[routing]
            what = f"{routing}, rank {rank}"
            torch.testing.assert_close(rank_out, out, rtol=1e-5, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")
            assert torch.equal(rank_counts, counts), what
            mine = {
                "router.weight": grads["router.weight"],
                "experts.fc": grads["experts.fc"][:, rank * half : (rank + 1) * half],
                "experts.proj": grads["experts.proj"][..., rank * half : (rank + 1) * half],
            }
            for name, expected in mine.items():
                torch.testing.assert_close(
                    rank_grads[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m, w=f"{what} {name}": f"{w}: {m}"
                )


def test_a_layout_the_experts_cannot_take_is_refused_naming_the_layer(tmp_path):
    # a world of 3 processes is not needed to check the refusal: the group's size is what divides
    results = run_ranks(_refusals, 3)
    assert "expert_parallel_size=3 does not divide blocks.0.mlp's 4 experts" in results[0]["odd"]
    assert "has no mixture-of-experts layer to split" in results[0]["dense"]


def _refusals(rank: int) -> dict[str, str]:
    dist.init_process_group("gloo")
    out = {}
    for name, cfg in (("odd", dict(n_experts=4)), ("dense", {})):
        try:
            split_experts(GPT(gpt_config("gpt-tiny", **cfg)), dist.group.WORLD)
        except ValueError as e:
            out[name] = str(e)
    return out


def test_the_gpt_finds_its_mixture_layers_by_structure():
    model = GPT(gpt_config("gpt-tiny", n_experts=4, top_k=2))
    assert len(moe_layers(model)) == model.cfg.n_layer
    assert moe_layers(GPT(gpt_config("gpt-tiny"))) == []
    # one expert chosen by every token is the dense MLP it holds
    one = GPT(gpt_config("gpt-tiny", n_experts=1, top_k=1, aux_loss_coef=0.0))
    x = torch.randint(0, 256, (2, 16))
    block = one.blocks[0]
    h = torch.randn(2, 16, 128)
    dense = torch.nn.functional.gelu(h @ block.mlp.experts.fc[0].t()) @ block.mlp.experts.proj[0].t()
    torch.testing.assert_close(block.mlp(h), dense)
    assert one(x, x).isfinite()


def test_the_balance_loss_of_a_batch_is_the_mean_of_its_sequences():
    """However the global batch is split into micro-batches and ranks, its load-balancing loss is the same."""
    torch.manual_seed(0)
    layer = MoE(WIDTH, 2 * WIDTH, EXPERTS, top_k=2)
    x = torch.randn(3, 5, WIDTH)
    layer(x)
    whole = layer.aux_loss
    parts = []
    for rows in ([0], [1, 2]):  # one micro-batch of one sequence, one of two
        layer(x[rows])
        parts.append(layer.aux_loss * len(rows))
    torch.testing.assert_close(whole, sum(parts) / 3)
    layer(torch.ones(2, 5, WIDTH))  # every token of both sequences alike: the same 2 experts, the worst balance
    assert layer.aux_loss.item() == pytest.approx(
        EXPERTS / 2 * layer.router(torch.ones(WIDTH)).softmax(-1).topk(2)[0].sum().item(), rel=1e-5
    )


def test_the_balance_over_the_experts_is_in_the_metrics(tmp_path):
    from distrain.models.lm import GPTLanguageModel
    from helpers import make_trainer

    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=2, log_every_n_steps=1)
    module = GPTLanguageModel(block_size=16, n_experts=4, top_k=1)
    tokens = torch.randint(0, 256, (8, 17))
    trainer.fit(module, torch.utils.data.DataLoader([(t[:-1], t[1:]) for t in tokens], batch_size=4))
    metrics = trainer.callback_metrics
    load = float(metrics["moe_load_max_over_mean"])
    assert 1.0 <= load <= 4.0 and float(metrics["moe_aux_loss"]) > 0
    counts = [b.mlp.tokens_per_expert.float() for b in module.gpt.blocks]
    assert load == pytest.approx(max(float(c.max() / c.mean()) for c in counts))
    # the run's summary plot shows them, against the step (what an MoE user watches for a collapse)
    from distrain.plotting import draw_runs

    panel = next(ax for ax in draw_runs([trainer.log_dir]).axes if ax.get_title().startswith("Expert load"))
    (steps, loads), (_, aux) = (line.get_data() for line in panel.lines)
    assert (
        list(steps) == [1, 2] and loads[-1] == pytest.approx(load) and aux[-1] == pytest.approx(metrics["moe_aux_loss"])
    )


# ---- checkpoints: each layer's experts whole, under the model's names, whatever the layout --------------------------
STEPS, HALF, CLIP = 4, 2, 0.3


def _fit(tmp, strategy, devices, steps, ckpt_path=None, save=None, ep=1):
    """The mixture GPT on a global batch of 8; ``save``: a checkpoint written where the run ends."""
    import distrain
    from helpers import TinyGPT, loader, make_trainer

    options = {"expert_parallel_size": ep} if ep > 1 else {}
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        gradient_clip_val=CLIP,
        enable_checkpointing=False,
        logger=False,
        **options,
    )
    distrain.seed_everything(0)
    trainer.fit(TinyGPT(n_experts=4), loader(8 // devices), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return rec.losses


def _layouts(rank, tmp):
    """Saved with experts split over 2 ranks (FSDP: DCP shards; DDP: one file), resumed onto other layouts."""
    return {
        "fsdp ep2 saves": _fit(tmp / "a", "fsdp", 2, HALF, save=tmp / "fsdp_ep2.ckpt", ep=2),
        "ddp ep2 saves": _fit(tmp / "b", "ddp", 2, HALF, save=tmp / "ddp_ep2.ckpt", ep=2),
        "single → fsdp ep2": _fit(tmp / "c", "fsdp", 2, STEPS, ckpt_path=tmp / "single.ckpt", ep=2),
        "fsdp ep2 → ddp": _fit(tmp / "d", "ddp", 2, STEPS, ckpt_path=tmp / "fsdp_ep2.ckpt"),
        "ddp ep2 → fsdp": _fit(tmp / "e", "fsdp", 2, STEPS, ckpt_path=tmp / "ddp_ep2.ckpt"),
    }


@pytest.mark.slow
def test_a_checkpoint_resumes_on_another_expert_layout_with_the_experts_whole_under_their_names(tmp_path):
    from distrain.checkpoint.state import read_model_weights

    reference = _fit(tmp_path / "ref", "single", 1, STEPS)
    _fit(tmp_path / "half", "single", 1, HALF, save=tmp_path / "single.ckpt")
    runs = run_ranks(_layouts, 2, tmp_path)[0]
    runs["fsdp ep2 → single"] = _fit(tmp_path / "f", "single", 1, STEPS, ckpt_path=tmp_path / "fsdp_ep2.ckpt")
    for name, losses in runs.items():
        expected = reference[:HALF] if name.endswith("saves") else reference[HALF:]
        assert len(losses) == len(expected), name
        for a, b in zip(expected, losses):
            assert abs(a - b) <= 1e-5 * abs(a), (name, expected, losses)
    whole = read_model_weights(tmp_path / "single.ckpt")
    for saved in ("fsdp_ep2.ckpt", "ddp_ep2.ckpt"):  # the experts whole, under the model's own names
        weights = read_model_weights(tmp_path / saved)
        assert weights.keys() == whole.keys()
        for key in ("gpt.blocks.0.mlp.experts.fc", "gpt.blocks.1.mlp.experts.proj"):
            assert weights[key].shape == whole[key].shape == (4, *whole[key].shape[1:])
            torch.testing.assert_close(weights[key], whole[key], rtol=1e-4, atol=1e-5)


# ---- Hugging Face mixture-of-experts models (transformers 5: stacked experts), found by structure -------------------
def _hf_config(family: str):
    import transformers

    shape = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=2,
    )
    if family == "mixtral":
        return transformers.MixtralConfig(**shape, intermediate_size=24, num_local_experts=4)
    if family == "qwen2_moe":  # a shared expert beside the routed ones
        return transformers.Qwen2MoeConfig(
            **shape, intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=12, num_experts=4
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**shape, intermediate_size=24, moe_intermediate_size=12, num_experts=4)
    if family == "olmoe":
        return transformers.OlmoeConfig(**shape, intermediate_size=12, num_experts=4)
    if family == "deepseek_v3":  # a dense first layer, grouped routing, shared experts
        return transformers.DeepseekV3Config(
            **{**shape, "num_hidden_layers": 3},
            intermediate_size=24,
            moe_intermediate_size=12,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=8,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
        )
    if family == "phimoe":  # sparsemixer routing; its block calls its router `router`, as distrain's own MoE does
        return transformers.PhimoeConfig(**shape, intermediate_size=24, num_local_experts=4)
    if family == "hunyuan_v1_moe":  # its router keeps its weight in a sub-layer (gate.wg)
        return transformers.HunYuanMoEV1Config(**shape, intermediate_size=24, num_experts=4, moe_topk=2, head_dim=8)
    if family == "inkling2_text":  # its experts gate through a two-argument, softcapped SwiGLU (_apply_gate)
        return transformers.Inkling2TextConfig(**shape, head_dim=8, moe_intermediate_size=12, n_routed_experts=4)
    if family == "llama4_text":  # its experts take every token for every expert (rows grouped by expert)
        return transformers.Llama4TextConfig(**shape, head_dim=8, intermediate_size=24, num_local_experts=4)
    if family == "zaya":  # its router scores one class more than experts: a skip expert, its tokens weighted 0
        shape = {**shape, "num_experts_per_tok": 1}  # the only choice ZAYA takes
        return transformers.ZayaConfig(
            **shape, num_experts=4, moe_intermediate_size=12, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2
        )
    if family == "gpt_oss":  # experts transposed, with biases, gate and up interleaved: transformers' grouped forward
        return transformers.GptOssConfig(**shape, intermediate_size=12, num_local_experts=4, head_dim=8)
    raise AssertionError(family)


HF_FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "phimoe",
    "hunyuan_v1_moe",
    "inkling2_text",
    "gpt_oss",
    "llama4_text",
    "zaya",
)


def _hf_model(family: str):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family)).float()
    if family == "gpt_oss":  # rank 1's experts (2 and 3) never chosen in the first layer: that rank gets no rows
        with torch.no_grad():
            model.model.layers[0].mlp.router.bias[2:] = -100.0
    return model


def _hf_batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))


def _hf_step(model, ids, half: int) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(100 + half)  # a router that draws in training (Phi-3.5-MoE's jitter) draws alike per half
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_expert_parallel(rank: int, families):
    dist.init_process_group("gloo")
    out = {}
    for family in families:
        model = _hf_model(family)
        split = split_model(model, 2, "cpu")
        loss, grads = _hf_step(model, _hf_batch()[2 * rank : 2 * rank + 2], rank)
        for name, grad in grads.items():
            if name in split.owners:
                grad.div_(2)  # the mean over both ranks' tokens (what the strategies do)
            else:
                dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        held = {name: tuple(split.parameter(name).shape) for name in split.owners}
        out[family] = (loss, grads, held)
    return out


@pytest.mark.slow
def test_hugging_face_mixtures_split_over_two_ranks_match_one_process():
    """Mixtral, Qwen2-MoE (a shared expert), Qwen3-MoE, OLMoE, DeepSeek-V3 (a dense first layer, shared experts),
    Phi-3.5-MoE (whose block names its router `router`: it once took the route of distrain's own MoE and failed in
    the experts' matmul), HunYuan-MoE (its router's weight in a sub-layer: it was said to have no mixture), Llama 4
    (every token for every expert: it was refused) and ZAYA (a skip expert the router scores: no mixture found): each
    layer's stacked experts split over 2 ranks by structure, each rank half of the batch; the mean of the ranks'
    losses, and every gradient, are one process's."""
    reference = {}
    for family in HF_FAMILIES:
        model = _hf_model(family)
        halves = [_hf_step(model, _hf_batch()[i : i + 2], i // 2) for i in (0, 2)]  # the ranks' halves, summed
        reference[family] = halves
    results = run_ranks(_hf_expert_parallel, 2, HF_FAMILIES)
    for family in HF_FAMILIES:
        (loss0, _), (loss1, grads) = reference[family]  # grads: accumulated over both halves
        for rank, by_family in enumerate(results):
            loss, rank_grads, held = by_family[family]
            assert abs(loss - (loss0, loss1)[rank]) <= 1e-5 * abs(loss), family
            assert held and all(shape[0] == 2 for shape in held.values()), (family, held)
            for name, grad in rank_grads.items():
                whole = grads[name] / 2
                if name in held:  # this rank's experts: 2·rank and 2·rank + 1
                    whole = whole[2 * rank : 2 * rank + 2]
                torch.testing.assert_close(grad, whole, rtol=1e-4, atol=1e-6, msg=f"{family} {name}")


def test_a_mixture_whose_experts_cannot_be_split_is_refused_naming_it():
    from distrain.parallel.expert_parallel import check_module

    model = _hf_model("mixtral")  # one row per expert kept by a sub-layer (as Ergo's experts' own norms)
    model.model.layers[1].mlp.experts.norm = torch.nn.Linear(1, 4)
    with pytest.raises(ValueError, match=r"cannot split MixtralSparseMoeBlock yet: MixtralExperts.norm.bias, "):
        check_module(model, 2)
    with pytest.raises(ValueError, match="does not divide model.layers.0.mlp's 4 experts"):
        check_module(_hf_model("mixtral"), 3)


class _HFCausal:
    """A Hugging Face mixture (``_hf_model``) as a distrain module, on ``_hf_batch``-like data of 16 sequences."""

    @staticmethod
    def fit(family: str, strategy: str, devices: int, **options) -> tuple[list[float], int]:
        """4 AdamW steps of a global batch of 4 sequences; each step's loss, the mean over the ranks, and the ranks
        that split each layer's experts."""
        import distrain

        class Module(distrain.Module):
            def __init__(self):
                super().__init__()
                self.model = _hf_model(family)

            def training_step(self, batch, batch_idx):
                return self.model(input_ids=batch[0], labels=batch[0]).loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-2)

        losses = []

        class Losses(distrain.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

        ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(2))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4 // devices)
        trainer = distrain.Trainer(
            accelerator="cpu", strategy=strategy, devices=devices, max_steps=4, seed=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, callbacks=[Losses()], **options,
        )  # fmt: skip
        trainer.fit(Module(), loader)
        split = trainer.strategy.experts.size if trainer.strategy.experts is not None else 1
        if devices == 1:
            return losses, split
        every_rank = trainer.strategy.all_gather_object(losses)
        return [sum(step) / devices for step in zip(*every_rank)], split


def _gpt_oss_beside_fsdp(rank):
    return _HFCausal.fit("gpt_oss", "fsdp", 2, expert_parallel_size=2)


@pytest.mark.slow
def test_experts_laid_out_their_own_way_train_beside_fsdps_sharding_as_one_process():
    """gpt-oss's experts (transposed, with biases, gate and up interleaved; transformers' grouped forward) split over 2
    ranks beside FSDP's sharding train as one process does: each step's loss, the mean of the ranks'. They were
    refused there (a tiny gpt-oss gave other losses from its first step on, in an earlier distrain); Aria's
    (transposed) and Nemotron-H's (no gate) were checked the same way by hand, and under model_parallel too."""
    one_process, _ = _HFCausal.fit("gpt_oss", "single", 1)
    split, experts_over = run_ranks(_gpt_oss_beside_fsdp, 2)[0]
    assert experts_over == 2 and len(one_process) == len(split) == 4
    assert split == pytest.approx(one_process, rel=1e-6), (split, one_process)


def test_expert_parallelism_it_cannot_run_is_refused_before_any_rank_starts(tmp_path):
    """Each refusal in one line, in this process: no rank was started (a rank's error would reach here as a failed
    launch, not as this ValueError)."""
    import distrain
    from distrain.config import ConfigError, build_config
    from distrain.jobs.run import job_for
    from distrain.models.lm import GPTLanguageModel
    from distrain.planner.from_config import job_from_config
    from helpers import TinyGPT

    def fit(module, devices=2, **options):
        trainer = distrain.Trainer(
            accelerator="cpu", devices=devices, max_steps=1, default_root_dir=str(tmp_path), logger=False, **options
        )
        trainer.fit(module, torch.utils.data.DataLoader(list(range(4))))

    with pytest.raises(ValueError, match="expert_parallel_size is not an option of strategy 'deepspeed_stage_2'"):
        fit(TinyGPT(n_experts=4), strategy="deepspeed_stage_2", expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 .* must divide the number of ranks, 3"):
        fit(TinyGPT(n_experts=4), devices=3, strategy="ddp", expert_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide gpt.blocks.0.mlp's 4 experts"):
        fit(TinyGPT(n_experts=4), devices=3, strategy="fsdp", expert_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size=2: TinyGPT has no mixture-of-experts layer to split"):
        fit(TinyGPT(), strategy="ddp", expert_parallel_size=2)
    # the built-in model builds its layers in configure_model: its declared experts are checked
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide the model's 4 experts"):
        fit(GPTLanguageModel(n_experts=4, block_size=16), devices=3, strategy="ddp", expert_parallel_size=3)
    with pytest.raises(ConfigError, match="distributed.expert_parallel_size applies to strategy ddp, fsdp"):
        build_config(cli_items=["distributed.strategy=deepspeed_stage_2", "distributed.expert_parallel_size=2"])
    with pytest.raises(ConfigError, match="distributed.expert_parallel_size"):
        build_config(cli_items=["distributed.expert_parallel_size=0"])
    # the built-in GPT declaring no experts (n_experts=0, the config's default): nothing to split
    with pytest.raises(ValueError, match=r"expert_parallel_size=2: GPTLanguageModel declares no experts \(n_experts=0"):
        fit(GPTLanguageModel(block_size=16), strategy="fsdp", expert_parallel_size=2)
    # under model_parallel: among the data × context ranks, and not yet beside tensor parallelism or a pipeline
    for layout in (dict(tensor_parallel_size=2), dict(tensor_parallel_size=1, pipeline_stages=2)):
        strategy = distrain.ModelParallelStrategy(**layout, expert_parallel_size=2)
        with pytest.raises(
            ValueError, match=r"expert_parallel_size=2 .* not yet with tensor parallelism or a pipeline"
        ):
            fit(TinyGPT(n_experts=4), strategy=strategy)
    strategy = distrain.ModelParallelStrategy(tensor_parallel_size=1, data_parallel_size=3, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 .* must divide the number of ranks, 3"):
        fit(TinyGPT(n_experts=4), devices=3, strategy=strategy)
    with pytest.raises(ValueError, match="expert_parallel_size=2: TinyGPT has no mixture-of-experts layer to split"):
        fit(TinyGPT(), strategy="model_parallel", tensor_parallel_size=1, expert_parallel_size=2)
    assert build_config(cli_items=["distributed.strategy=model_parallel", "distributed.expert_parallel_size=2"])
    # the config's keys that make the built-in GPT a mixture, each checked before anything is built
    with pytest.raises(ConfigError, match=r"training.top_k \(5\) must be at most training.n_experts \(4\)"):
        build_config(cli_items=["training.n_experts=4", "training.top_k=5"])
    with pytest.raises(ConfigError, match="training.n_experts must be >= 0"):
        build_config(cli_items=["training.n_experts=-2"])
    with pytest.raises(ConfigError, match="training.top_k must be > 0"):
        build_config(cli_items=["training.n_experts=4", "training.top_k=0"])
    with pytest.raises(ConfigError, match="training.n_experts makes the built-in GPT a mixture of experts"):
        build_config(cli_items=["training.module=mine.py:Model", "training.n_experts=4"])
    # a Hugging Face name: refused where a run or a plan resolves the model, before anything is loaded
    hf = build_config(cli_items=["training.model_name=org/some-llama", "training.n_experts=4"])
    for resolve in (job_for, lambda config: job_from_config(config, gpu=False)):
        with pytest.raises(ConfigError, match="training.n_experts .*; 'org/some-llama' is not one"):
            resolve(hf)


def test_the_configs_experts_make_the_built_in_gpt_a_mixture_for_the_run_and_its_plan():
    """``training.n_experts`` and ``top_k`` reach the model ``distrain train`` builds and the model it plans: the
    same parameters, the experts' FLOPs ``top_k`` of them per token, and expert-parallel rows in the plan."""
    from distrain.config import build_config
    from distrain.jobs.gpt import GPTJob
    from distrain.planner import Estimator
    from distrain.planner.from_config import job_from_config
    from distrain.planner.plan import candidate_options

    def built(items):
        config = build_config(cli_items=["data.seq_len=32", *items])
        job = GPTJob(config)
        module, _, _ = job.prepare(_Trainer())
        module.configure_model()
        return config, job, module

    dense_config, dense_job, dense = built([])
    config, job, mixture = built(["training.n_experts=4", "training.top_k=1"])
    counts = [sum(p.numel() for p in m.parameters()) for m in (dense, mixture)]
    assert mixture.gpt.cfg.n_experts == 4 and mixture.gpt.cfg.top_k == 1 and counts[1] > 2 * counts[0]
    assert (dense_job.parameter_count, job.parameter_count) == tuple(counts)
    planned = [Estimator(job_from_config(c, gpu=False)) for c in (dense_config, config)]
    assert [e.stats.numel for e in planned] == counts and [e.job.spec.experts for e in planned] == [0, 4]
    two = build_config(cli_items=["data.seq_len=32", "training.n_experts=4", "distributed.devices=2"])
    assert {o.get("experts") for o in candidate_options(job_from_config(two, gpu=False))} >= {None, 2}


def test_the_plan_of_a_model_parallel_run_splits_its_experts_as_the_run_asks(capsys):
    """``distrain plan`` for a model_parallel run with ``expert_parallel_size``: the run's row is its layout with the
    experts split (simulated: the tokens' all-to-all under even routing; against measured: the accuracy cases)."""
    from distrain import cli

    argv = ["plan", "--strategy", "model_parallel", "--devices", "2", "--accelerator", "cpu", "--no-time", "--json"]
    asked = ["data.seq_len=32", "training.n_experts=4", "distributed.tensor_parallel_size=1"]
    asked += ["distributed.context_parallel_size=2", "distributed.expert_parallel_size=2"]
    cli.main([*argv, "--model-name", "gpt-tiny", *asked])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all(r["context_parallel_size"] == 2 and r["expert_parallel_size"] == 2 for r in rows), rows


class _Trainer:
    """What ``GPTJob.prepare`` reads of a trainer (one process)."""

    data_parallel_size = max_steps = 1
    is_global_zero = False


def _verify_experts(rank, root):
    import distrain
    from helpers import TinyGPT, loader

    reports = {}
    for strategy in ("ddp", "fsdp"):  # one after the other in the same ranks, as test_verify's cells run
        trainer = distrain.Trainer(
            accelerator="cpu",
            strategy=strategy,
            devices=2,
            seed=7,
            enable_progress_bar=False,
            logger=False,
            default_root_dir=str(root / strategy),
            gradient_clip_val=CLIP,
            expert_parallel_size=2,
        )
        report = trainer.verify(TinyGPT(n_experts=4), loader(4), steps=2)
        reports[strategy] = None if report is None else report.to_json()
    return reports


@pytest.mark.slow
def test_verify_knows_the_expert_layout(tmp_path):
    """``distrain verify`` of expert parallelism under DDP and FSDP: every gradient and weight against one process
    (each expert's gradient gathered whole from the ranks that hold it), which ranks hold which experts, and a
    checkpoint that one process reads whole."""
    for strategy, report in run_ranks(_verify_experts, 2, tmp_path)[0].items():
        checks = {c["name"]: c for c in report["checks"]}
        assert report["ok"], (strategy, [c for c in report["checks"] if not c["ok"]])
        assert "(experts over 2 ranks)" in report["header"], report["header"]
        assert (
            "each layer's 4 experts over 2 ranks, each held by 1 rank (rank 0: experts 0-1"
            in (checks["experts held once per replica"]["detail"])
        )
        assert {"losses, gradients, weights", "checkpoint round trip"} <= checks.keys()


def _built_in_configure_model(rank, tmp):
    from distrain.models.lm import GPTLanguageModel

    return _fit_built_in(tmp, "fsdp", 2, GPTLanguageModel, ep=2, peak=True)


def _fit_built_in(tmp, strategy, devices, model_class, ep=1, peak=False):
    """The built-in GPT language model (its layers built in ``configure_model``: on the meta device under FSDP)."""
    from helpers import make_trainer

    tokens = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.DataLoader([(t[:-1], t[1:]) for t in tokens], batch_size=8 // devices)
    options = {"expert_parallel_size": ep} if ep > 1 else {}
    trainer, rec = make_trainer(
        tmp, strategy=strategy, devices=devices, max_steps=2, enable_checkpointing=False, logger=False, **options
    )
    module = model_class(block_size=16, n_experts=4, top_k=2)
    trainer.fit(module, data)
    tied = module.gpt.head.weight is module.gpt.tok_emb.weight
    if not peak:
        return rec.losses, tied
    whole = sum(trainer.strategy.full_shape(p).numel() * 4 for p in module.parameters())
    return rec.losses, tied, trainer.strategy.init_peak_bytes, whole


@pytest.mark.slow
def test_a_model_built_on_the_meta_device_initializes_only_its_own_experts_as_one_process_would(tmp_path):
    """Under FSDP, ``configure_model`` builds on the meta device. With expert parallelism each rank splits its
    experts there, then initializes one unit at a time, each layer's experts drawn whole as one process draws them
    and this rank's rows kept: the weights are one process's (the losses from step 1 on), and no rank holds the whole
    model. (A first version built the whole model first; its ``to_empty`` untied the GPT's head from its embedding,
    each rank trained a second matrix, and the losses left one process's from step 1.)"""
    from distrain.models.lm import GPTLanguageModel

    single, _ = _fit_built_in(tmp_path / "single", "single", 1, GPTLanguageModel)
    losses, tied, init_peak, whole = run_ranks(_built_in_configure_model, 2, tmp_path)[0]
    assert tied
    # initialized one unit at a time (each layer's experts drawn whole, as one process draws them, this rank's
    # kept): never the whole model on one rank
    assert 0 < init_peak < whole / 2, (init_peak, whole)
    for a, b in zip(single, losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (single, losses)


def _mixtral_under_fsdp_with_experts_split(rank, path, ckpt):
    import matrix_models

    import distrain

    distrain.seed_everything(0)
    module = matrix_models.hf_causal(path)
    loader = torch.utils.data.DataLoader(
        matrix_models.hf_samples(path, "causal_lm", n=16), batch_size=4, collate_fn=matrix_models.hf_collate(path)
    )
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy="fsdp",
        devices=2,
        expert_parallel_size=2,
        max_steps=2,
        seed=7,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=str(ckpt.parent),
    )
    trainer.fit(module, loader)
    trainer.save_checkpoint(ckpt)
    probe = {"input_ids": torch.arange(1, 13).view(2, 6)}
    with torch.no_grad():  # every rank, through the set-up model: the experts answer through the all-to-all
        return trainer.model("predict_step", probe, 0).detach()


@pytest.mark.slow
def test_a_hugging_face_mixture_trained_with_its_experts_split_exports_to_from_pretrained(tmp_path):
    """A tiny Mixtral under FSDP with its experts over 2 ranks, saved as DCP shards, exported with `distrain
    convert --to hf`: transformers' own from_pretrained gives the trained model's logits (its experts whole, under
    their names)."""
    from transformers import AutoModelForCausalLM

    from distrain.hf.export import export_checkpoint
    from distrain.hf.tiny import make_tiny_llama

    path = make_tiny_llama(tmp_path / "mixtral", experts=4)
    trained = run_ranks(_mixtral_under_fsdp_with_experts_split, 2, path, tmp_path / "run" / "ckpt")[0]
    with pytest.warns(UserWarning, match="names the local tokenizer"):
        out = export_checkpoint(tmp_path / "run" / "ckpt", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 13).view(2, 6)).logits
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)


def _few_experts(rank, tmp):
    """Fewer experts than the ranks that shard them: FSDP alone (2 experts over 4 ranks) and with expert
    parallelism (each rank's 1 expert over the 2 ranks that hold it)."""
    import distrain
    from helpers import TinyGPT, loader, make_trainer

    out = {}
    for ep in (1, 2):
        options = {"expert_parallel_size": ep} if ep > 1 else {}
        trainer, rec = make_trainer(
            tmp / f"ep{ep}",
            strategy="fsdp",
            devices=4,
            max_steps=STEPS,
            gradient_clip_val=CLIP,
            enable_checkpointing=False,
            logger=False,
            **options,
        )
        distrain.seed_everything(0)
        module = TinyGPT(n_experts=2)
        trainer.fit(module, loader(2))
        if ep == 2:
            trainer.save_checkpoint(tmp / "few.ckpt")
        fc = module.gpt.blocks[0].mlp.experts.fc
        out[ep] = (rec.losses, tuple(fc.to_local().shape), [str(p) for p in fc.placements])
    return out


@pytest.mark.slow
def test_fewer_experts_than_ranks_are_sharded_by_columns_not_padded_rows(tmp_path):
    """FSDP2 pads a parameter's first dimension to a multiple of the ranks: 2 stacked experts over 4 ranks left each
    rank a whole expert (half of them, where a quarter was asked for). Sharded along their second dimension they
    hold a quarter, train as one process does, and a checkpoint of them resumes in one process."""
    import distrain
    from helpers import TinyGPT, loader, make_trainer

    def single(steps, ckpt_path=None):
        trainer, rec = make_trainer(
            tmp_path / f"single{steps}",
            strategy="single",
            devices=1,
            max_steps=steps,
            gradient_clip_val=CLIP,
            enable_checkpointing=False,
            logger=False,
        )
        distrain.seed_everything(0)
        trainer.fit(TinyGPT(n_experts=2), loader(8), ckpt_path=ckpt_path)
        return rec.losses

    reference = single(STEPS)
    runs = run_ranks(_few_experts, 4, tmp_path)[0]
    assert runs[1][1:] == ((2, 32, 32), ["S(1)"])  # fc [2, 128, 32]: a quarter of each expert's rows
    assert runs[2][1:] == ((1, 64, 32), ["S(1)"])  # this rank's expert, half of it
    for ep, (losses, _, _) in runs.items():
        for a, b in zip(reference, losses, strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (ep, reference, losses)
    resumed = single(STEPS + 1, ckpt_path=tmp_path / "few.ckpt")
    assert len(resumed) == 1 and abs(resumed[0] - single(STEPS + 1)[-1]) <= 1e-5 * resumed[0]


def test_a_hugging_face_mixtures_expert_balance_is_in_the_metrics(tmp_path):
    """The tiny Mixtral's training logs its busiest expert's tokens over the mean (the least balanced layer), read
    from the experts each token chose; a dense Llama logs none."""
    import matrix_models

    import distrain
    from distrain.hf.tiny import make_tiny_llama
    from helpers import make_trainer

    seen = {}
    for name, experts in (("mixtral", 4), ("llama", 0)):
        path = make_tiny_llama(tmp_path / name, experts=experts)
        module = matrix_models.hf_causal(path)
        chosen = []
        trainer, _ = make_trainer(
            tmp_path / f"run-{name}",
            strategy="single",
            devices=1,
            max_steps=2,
            enable_checkpointing=False,
            logger=False,
        )
        loader = torch.utils.data.DataLoader(
            matrix_models.hf_samples(path, "causal_lm", n=8), batch_size=4, collate_fn=matrix_models.hf_collate(path)
        )
        if experts:  # what the metric must be, from the gates' own choices in the last step
            distrain.seed_everything(0)
            module.configure_model()
            for layer in module.model.model.layers:
                layer.mlp.gate.register_forward_hook(lambda m, a, out, into=chosen: into.append(out[2].reshape(-1)))
        trainer.fit(module, loader)
        seen[name] = trainer.callback_metrics.get("moe_load_max_over_mean")
        if experts:
            last = [torch.bincount(c, minlength=4).float() for c in chosen[-2:]]  # the last forward's 2 layers
            assert float(seen[name]) == pytest.approx(max(float(c.max() / c.mean()) for c in last))
    assert 1.0 <= float(seen["mixtral"]) <= 4.0 and seen["llama"] is None
