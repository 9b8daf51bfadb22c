"""The spec's three config files, as users have them (tests/data/spec/ holds verbatim copies of
../shared/spec/), train unchanged through `distrain train --config FILE` on 2 CPU ranks — only the model
(a local tiny model of the same family), the dataset (a local file) and, for the DDP file's nccl, the
backend are overridden — and the Hugging Face model each exports loads with `from_pretrained`."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from helpers import cli_rank, run_cli, run_ranks

SPEC = Path(__file__).parent / "data" / "spec"
SHARED_SPEC = Path(__file__).resolve().parents[2] / "shared" / "spec"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    pytest.importorskip("transformers")
    from distrain.hf import tiny

    root = tmp_path_factory.mktemp("spec")
    texts = root / "counting.txt"
    texts.write_text("\n".join(tiny.counting_texts(300)) + "\n")
    return {
        "bert": tiny.make_tiny_bert(root / "bert"),
        # the spec trains Llama with max_length 2048: the same family, as long
        "llama": tiny.make_tiny_llama(root / "llama", max_position_embeddings=2048),
        "reviews": tiny.write_jsonl(root / "reviews.jsonl", tiny.reviews(600)),
        "counting": str(texts),
    }


def test_the_copies_are_the_spec_files():
    if not SHARED_SPEC.is_dir():
        pytest.skip("../shared/spec is not beside this checkout")
    for name in ("ddp_config.yaml", "fsdp_config.yaml", "deepspeed_config.json"):
        assert (SPEC / name).read_text() == (SHARED_SPEC / name).read_text(), name


def _train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """`distrain train ARGS` in ``tmp``: ``distrain.cli.main`` in 2 forked ranks started as torchrun starts them
    (how the CLI starts ranks itself is tested in tests/test_matrix.py; here it is what the config files ask for):
    rank 0's output, and the first failing rank's exit code."""
    ranks = run_ranks(cli_rank, 2, ["train", *args], str(tmp))
    code = next((r.returncode for r in ranks if r.returncode != 0), 0)
    return subprocess.CompletedProcess(ranks[0].args, code, ranks[0].stdout, ranks[0].stderr + ranks[1].stderr)


def _here(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """`distrain train ARGS` in ``tmp`` for what is decided before any rank starts (``--print-config``, a refusal):
    ``distrain.cli.main`` in this process."""
    return run_cli(["train", *args], cwd=tmp)


def _check_run(tmp: Path, proc: subprocess.CompletedProcess, steps: int) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) >= 1 and all(math.isfinite(v) for v in losses)
    assert max(r["step"] for r in records) == steps
    from transformers import AutoModel

    AutoModel.from_pretrained(tmp / "run" / "hf")  # the export loads where the user's model would


@pytest.mark.slow
def test_spec_ddp_config(local, tmp_path):
    proc = _train(
        tmp_path,
        "--config",
        str(SPEC / "ddp_config.yaml"),
        "--mode",
        "ddp",
        "--devices",
        "2",
        "--max-steps",
        "2",
        "--output-dir",
        "run",
        f"training.model_name={local['bert']}",
        f"data.dataset={local['reviews']}",
        "distributed.backend=gloo",
    )
    _check_run(tmp_path, proc, 2)
    # static_graph: true with accumulation 4, as the file says: trained, with one line saying what changed
    assert "static_graph=false" in proc.stdout, proc.stdout
    assert (tmp_path / "checkpoints" / "last").exists()  # the file's checkpoint_dir: ./checkpoints


def test_spec_ddp_config_with_its_nccl_on_a_cpu_machine(local, tmp_path):
    if os.environ.get("CUDA_VISIBLE_DEVICES", "") or _has_cuda():
        pytest.skip("this machine has a GPU: nccl is the right backend here")
    proc = _here(
        tmp_path,
        "--config",
        str(SPEC / "ddp_config.yaml"),
        "--devices",
        "2",
        f"training.model_name={local['bert']}",
        f"data.dataset={local['reviews']}",
    )
    assert proc.returncode == 2
    error = [line for line in proc.stderr.splitlines() if line.startswith("distrain")]  # not other libraries' noise
    assert len(error) == 1 and "distributed.backend" in error[0] and "gloo" in error[0], proc.stderr


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
def test_spec_fsdp_config(local, tmp_path):
    args = [
        "--config",
        str(SPEC / "fsdp_config.yaml"),
        "--mode",
        "fsdp",
        "--devices",
        "2",
        "--max-steps",
        "2",
        "--output-dir",
        "run",
        f"training.model_name={local['llama']}",
        f"data.dataset={local['counting']}",
    ]
    printed = _here(tmp_path, *args, "--print-config")
    assert printed.returncode == 0, printed.stderr
    for moved in (
        "# training.max_length → data.max_length",
        "# activation_checkpointing.enabled → fsdp.activation_checkpointing.enabled",
        "# mixed_precision.param_dtype → fsdp.mixed_precision.param_dtype",
    ):
        assert moved in printed.stdout, printed.stdout
    _check_run(tmp_path, _train(tmp_path, *args), 2)


@pytest.mark.slow
def test_spec_deepspeed_config(local, tmp_path):
    proc = _train(
        tmp_path,
        "--config",
        str(SPEC / "deepspeed_config.json"),
        "--devices",
        "2",
        "--max-steps",
        "2",
        "--output-dir",
        "run",
        f"training.model_name={local['llama']}",
        f"data.dataset={local['counting']}",
        "training.batch_size_per_gpu=2",
    )
    _check_run(tmp_path, proc, 2)
    filled = json.loads((tmp_path / "run" / "deepspeed_config.json").read_text())
    zero = filled["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu" and "auto" not in json.dumps(filled)
