"""What a run shows: host readings (psutil) summarized over ranks, GPU readings (NVML, on a GPU
only), and the pictures of `distrain plot` / plots/summary.png."""

import json
import warnings
from pathlib import Path

import psutil
import pytest
import torch

import distrain
from distrain.training.monitor import NVML_KEYS, SystemMonitor, across_ranks
from helpers import TinyGPT, loader, make_trainer, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _fit_with_ballast(rank, tmp):
    ballast = torch.ones(300 * 2**20 // 4) if rank == 1 else None  # rank 1 holds 300 MiB more
    trainer, _ = make_trainer(tmp, strategy="ddp", devices=2, max_steps=2, enable_checkpointing=False)
    trainer.fit(TinyGPT(), loader(4))
    del ballast
    return psutil.virtual_memory().total / 2**20


@pytest.mark.slow
def test_host_readings_are_summarized_over_ranks(tmp_path):
    total_mb = run_ranks(_fit_with_ballast, 2, str(tmp_path))[0]
    last = _records(tmp_path)[-1]
    for key in ("host_rss_mb", "host_cpu_percent", "host_mem_available_mb", "mem_peak_rss_mb"):
        assert last[f"{key}_min"] <= last[f"{key}_mean"] <= last[key], key  # the plain name is the max
    # the rank with the ballast is the maximum, the other the minimum: a straggler shows
    assert last["host_rss_mb"] - last["host_rss_mb_min"] > 250
    assert 30 < last["host_rss_mb_min"] and last["host_rss_mb"] < total_mb
    assert 0 < last["host_mem_available_mb"] <= total_mb
    assert last["host_cpu_percent"] > 0  # the ranks computed during the window
    assert len(last["mem_per_rank_mb"]) == 2


def test_the_mean_over_ranks_lies_between_their_min_and_max_even_where_rounding_would_move_it():
    # the values CI met (two ranks waited the same 0.000429263 s: the mean rounded to 6 places fell below
    # both), a sum's own rounding (three 0.1s average to 0.10000000000000002), NaN readings left out
    per_rank = [[0.0004292627527320292, 0.1, 5.0, float("nan")]] * 3 + [[0.0004292627527320292, 0.1, 7.25, 1.0]]
    out = across_ranks(["wait_s", "tenth", "mb", "partly"], per_rank)
    for name in ("wait_s", "tenth", "mb", "partly"):
        assert out[f"{name}_min"] <= out[f"{name}_mean"] <= out[name], (name, out)
    assert out["wait_s"] == out["wait_s_mean"] == 0.0004292627527320292
    assert out["mb_mean"] == 5.5625 and (out["mb_min"], out["mb"]) == (5.0, 7.25)
    assert out["partly"] == out["partly_min"] == out["partly_mean"] == 1.0


def test_single_process_readings_and_no_gpu_keys_on_cpu():
    sample = SystemMonitor(torch.device("cpu")).sample()
    assert set(sample) == {"host_rss_mb", "host_cpu_percent", "host_mem_available_mb"}
    assert abs(sample["host_rss_mb"] - psutil.Process().memory_info().rss / 2**20) < 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVML readings need an NVIDIA GPU (none here)")
def test_nvml_readings_on_a_gpu():
    device = torch.device("cuda", 0)
    x = torch.ones(256 * 2**20 // 4, device=device)  # 256 MiB that NVML must see as used
    sample = SystemMonitor(device).sample()
    assert set(NVML_KEYS) <= set(sample), f"NVML unavailable: {SystemMonitor(device).nvml_error}"
    assert 0 <= sample["gpu_util_percent"] <= 100 and 0 < sample["gpu_temp_c"] < 120 and sample["gpu_power_w"] > 0
    total = torch.cuda.get_device_properties(device).total_memory / 2**20
    assert abs(sample["gpu_mem_total_mb"] - total) < 1 and 256 < sample["gpu_mem_used_mb"] < total
    del x


# ---- pictures --------------------------------------------------------------------------------


def _png(path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def _assert_drawn(path, size=(800, 1500)):
    image = _png(path)
    assert image.shape[:2] == size
    rgb = image[..., :3]
    ink = (rgb.sum(-1) < 2.9).mean()  # share of pixels that are not (near) white
    colours = {tuple(p) for p in (rgb[::7, ::7].reshape(-1, 3) * 255).astype(int).tolist()}
    assert 0.02 < ink < 0.5 and len(colours) > 20, (ink, len(colours))  # curves, text, axes: not blank


def _fit(tmp, lr, steps=6, **kw):
    trainer, _ = make_trainer(
        tmp, strategy="single", devices=1, max_steps=steps, val_check_interval=3, gradient_clip_val=1.0,
        enable_checkpointing=False, enable_plots=True, **kw,
    )  # fmt: skip
    module = TinyGPT(lr=lr)
    trainer.fit(module, loader(8), loader(8, n=16, shuffle=False))
    return trainer


def test_summary_png_at_the_end_of_a_run_and_cli_overlay(tmp_path):
    _fit(tmp_path / "a", lr=3e-3)
    _assert_drawn(tmp_path / "a" / "plots" / "summary.png")
    _fit(tmp_path / "b", lr=1e-3)
    from distrain.cli import main  # what the `distrain` console script runs

    code = main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "both.png"),
                 "--labels", "lr 3e-3", "lr 1e-3"])  # fmt: skip
    assert code == 0
    _assert_drawn(tmp_path / "both.png")
    # two runs differ from one: the second run's colour is drawn too
    one, two = _png(tmp_path / "a" / "plots" / "summary.png"), _png(tmp_path / "both.png")
    orange = lambda im: ((im[..., 0] > 0.9) & (im[..., 1] > 0.4) & (im[..., 1] < 0.6) & (im[..., 2] < 0.2)).sum()  # noqa: E731
    assert orange(one) == 0 and orange(two) > 200


def test_resumed_run_draws_each_step_once(tmp_path):
    from distrain.plotting import series

    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 1.0}]
    assert series(records, "loss") == ([1, 2, 3], [3.0, 2.5, 1.0])  # the continued run's value wins


def test_plot_errors_are_one_line_and_never_fail_a_run(tmp_path, capsys):
    from distrain.cli import main

    assert main(["plot", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("no metrics file (a run directory holds metrics.jsonl)")
    blocked = tmp_path / "blocked"  # (a file in a run's folder would make it an earlier run: a new one goes beside)
    blocked.write_text("a file where the plots directory would go")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path / "run", lr=3e-3, steps=2, callbacks=[distrain.callbacks.PlotSummary(str(blocked))])
    assert trainer.global_step == 2
    assert any("could not draw" in str(w.message) for w in caught)


def test_plot_summary_is_a_default_callback():
    trainer = distrain.Trainer(accelerator="cpu", devices=1, logger=False)
    assert any(isinstance(c, distrain.callbacks.PlotSummary) for c in trainer.callbacks)
    assert not any(
        isinstance(c, distrain.callbacks.PlotSummary)
        for c in distrain.Trainer(accelerator="cpu", devices=1, enable_plots=False).callbacks
    )


def test_new_config_keys_are_validated_with_clear_errors():
    from distrain.config import ConfigError, build_config

    config = build_config(cli_items=["logging.histogram_every_n_steps=5", "training.compile=true"])
    assert config.logging.histogram_every_n_steps == 5 and config.training.compile
    for items, message in (
        (["logging.histogram_every_n_steps=0"], "logging.histogram_every_n_steps must be > 0, got 0"),
        (["logging.wandb_mode=cloud"], "logging.wandb_mode must be online, offline, disabled or null"),
        (["training.compile=yes please"], "training.compile in the command line: expected bool"),
        (["training.compile=true", "distributed.strategy=deepspeed_stage_3"], "training.compile is not supported"),
    ):
        with pytest.raises(ConfigError, match=message):
            build_config(cli_items=items)
