"""logging.histogram_every_n_steps: weights and gradients, gathered whole from FSDP shards one
parameter at a time, agree with DDP's replicated ones; TensorBoard receives them."""

import pytest
import torch

from distrain.loggers import Logger, TensorBoardLogger
from helpers import TinyGPT, loader, make_trainer, run_ranks


class Recorder(Logger):
    def __init__(self):
        self.seen = {}

    def log_metrics(self, metrics, step):
        pass

    def log_histogram(self, name, values, step):
        v = values.detach().double().cpu()
        self.seen[(name, step)] = (v.numel(), v.sum().item(), v.min().item(), v.max().item())


def _histograms(rank, strategy, tmp):
    recorder = Recorder()
    trainer, _ = make_trainer(
        tmp, strategy=strategy, devices=2, max_steps=2, enable_checkpointing=False, histogram_every_n_steps=2,
        logger=[recorder, TensorBoardLogger(tmp)], gradient_clip_val=1.0,
    )  # fmt: skip
    torch.manual_seed(0)  # the same initial weights under both strategies
    module = TinyGPT()
    trainer.fit(module, loader(4))
    full_sizes = {n: p.numel() for n, p in TinyGPT().named_parameters()}
    return recorder.seen, full_sizes


@pytest.mark.slow
def test_fsdp_histograms_are_of_whole_parameters_and_match_ddp(tmp_path):
    ddp, sizes = run_ranks(_histograms, 2, "ddp", str(tmp_path / "ddp"))[0]
    fsdp_ranks = run_ranks(_histograms, 2, "fsdp", str(tmp_path / "fsdp"))
    fsdp = fsdp_ranks[0][0]
    assert fsdp_ranks[1][0] == {}  # only rank 0 logs
    names = {n for n, _ in fsdp}
    assert names == {f"{kind}/{n}" for kind in ("weights", "gradients") for n in sizes}
    assert all(step == 2 for _, step in fsdp)  # every 2 steps: step 2 only
    for key, (numel, total, low, high) in fsdp.items():
        assert numel == sizes[key[0].split("/", 1)[1]]  # the whole parameter, not a shard
        d_numel, d_total, d_low, d_high = ddp[key]
        assert numel == d_numel
        assert torch.allclose(torch.tensor([total, low, high]), torch.tensor([d_total, d_low, d_high]), atol=1e-5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "fsdp" / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    assert "weights/gpt.tok_emb.weight" in events.Tags()["histograms"]
    (hist,) = events.Histograms("gradients/gpt.blocks.0.mlp.fc.weight")
    assert hist.step == 2 and hist.histogram_value.num == sizes["gpt.blocks.0.mlp.fc.weight"]
