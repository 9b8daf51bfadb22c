"""Errors a user can act on: distrain's own problems in one line; anything else with its traceback in the
rank's log and one line saying where; no stale failure reported as this run's; clear errors for a missing
loader and for reading a sharded checkpoint whole."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distrain
from helpers import TinyGPT, console_of_a_faulty_rank, env_without_rank, loader, make_trainer

ROOT = Path(__file__).resolve().parents[1]
PREVIOUS = Path(__file__).parent / "data" / "previous"

USER_MODULE = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
import distrain


class Empty(distrain.Module):
    """Its data has no sample: torch's RandomSampler raises a ValueError of its own."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=2, shuffle=True)


class FailsOnRankOne(Empty):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2, shuffle=True)

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1:
            raise RuntimeError("rank one broke")
        return super().training_step(batch, batch_idx)
'''


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distrain.cli", "train", "--output-dir", str(tmp / "run"), *args],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env_without_rank(),
        timeout=300,
    )


def _distrain_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("distrain", "[distrain]"))]


def test_a_library_value_error_keeps_its_traceback_in_the_rank_log(tmp_path):
    """torch's own ValueError ("num_samples should be a positive integer value, but got num_samples=0") was
    printed as if it were a config error, one line and no traceback anywhere."""
    (tmp_path / "mine.py").write_text(USER_MODULE)
    proc = _cli(tmp_path, "--devices", "1", "training.module=mine.py:Empty")
    assert proc.returncode == 1, proc.stderr
    (line,) = _distrain_lines(proc.stderr)
    log = tmp_path / "run" / "logs" / "rank_0.log"
    assert "error on rank 0: ValueError: num_samples" in line and str(log) in line, line
    assert "Traceback" in log.read_text() and "num_samples" in log.read_text()


def test_an_error_before_the_rank_log_exists_is_in_it(tmp_path):
    """A SyntaxError in training.module=file.py:Cls: the summary pointed at a log that did not hold it."""
    (tmp_path / "broken.py").write_text("import distrain\nclass Mine(distrain.Module)\n    pass\n")
    proc = _cli(tmp_path, "--devices", "1", "training.module=broken.py:Mine")
    assert proc.returncode == 1, proc.stderr
    (line,) = _distrain_lines(proc.stderr)
    log = tmp_path / "run" / "logs" / "rank_0.log"
    assert "SyntaxError" in line and str(log) in line, line
    assert "SyntaxError" in log.read_text() and "broken.py" in log.read_text()


def test_a_failure_of_an_earlier_run_is_not_reported_as_this_ones(tmp_path):
    """A resumed run in the same output directory reported the stale rank_0.error.json of the run before."""
    (tmp_path / "mine.py").write_text(USER_MODULE)
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    stale = {"time": time.time() - 3600, "rank": 0, "type": "OldError", "message": "an hour ago"}
    (logs / "rank_0.error.json").write_text(json.dumps(stale))
    proc = _cli(tmp_path, "--devices", "2", "--strategy", "ddp", "training.module=mine.py:FailsOnRankOne")
    assert proc.returncode != 0
    assert "OldError" not in proc.stderr, proc.stderr
    broke = "rank 1 failed first at step 1 (in forward/backward): RuntimeError: rank one broke"
    assert broke in proc.stderr, proc.stderr


def test_a_rank_that_dies_in_native_code_is_named_with_its_last_words_and_the_users_line(tmp_path):
    """A rank killed by a signal from native code (a segfault here; gloo's or NCCL's abort alike) leaves no Python
    exception: the console names it, its signal, the native message and, from the stack ``faulthandler`` dumped in
    its log, the innermost frame and the user's own line that called it. (A CI run once ended on "rank 1 ... SIGABRT"
    and nothing else: its log was gone with the machine.)"""
    console, _ = console_of_a_faulty_rank(tmp_path, "import ctypes; ctypes.string_at(0)", 3.0)
    lines = console.splitlines()
    assert lines[0].startswith("[distrain] rank 1 failed first at step 3 (in forward/backward): exited with code -11")
    assert "SIGSEGV" in lines[0], console
    said = [line.removeprefix("[distrain]   it said: ") for line in lines if line.startswith("[distrain]   it said: ")]
    assert said[0] == "Fatal Python error: Segmentation fault", console
    assert said[1].startswith('File "') and "ctypes" in said[1], console  # where it died: a library
    assert said[2] == f'File "{tmp_path / "train.py"}", line 11 in training_step', console  # the user's line
    assert lines[len(said) + 1].startswith("[distrain]   its whole output and traceback: "), console


def test_an_empty_training_set_says_why(tmp_path):
    """Texts that all tokenize to fewer than 2 tokens (a tokenizer that does not match the data): the
    dataset, the tokenizer, how many were dropped and why — not torch's num_samples=0."""
    pytest.importorskip("transformers")
    from distrain.config import ConfigError, DataConfig
    from distrain.hf import data as hf_data
    from distrain.hf import tiny
    from distrain.hf.models import load_tokenizer

    model = tiny.make_tiny_llama(tmp_path / "llama")
    texts = tiny.write_jsonl(tmp_path / "letters.jsonl", [{"text": c} for c in "abcdefghij" * 3])
    data = DataConfig(dataset=texts, packing=False)
    with pytest.raises(ConfigError) as error:
        hf_data.prepare(data, load_tokenizer(model), "causal_lm", cache_dir=str(tmp_path / "cache"))
    message = str(error.value)
    assert "\n" not in message and texts in message and "llama" in message, message
    assert re.search(r"all \d+ were dropped", message) and "at least 2 tokens" in message, message


def test_validate_without_a_loader_says_what_it_needs(tmp_path):
    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, logger=False)
    with pytest.raises(ValueError, match=r"validate\(\) needs dataloaders, a datamodule with val_dataloader\(\)"):
        trainer.validate(TinyGPT())

    class WithItsOwn(TinyGPT):
        def val_dataloader(self):
            return loader(4, n=8, shuffle=False)

    (metrics,) = trainer.validate(WithItsOwn())  # the module's own, as in Lightning
    assert metrics["val_loss"] > 0


def test_runtime_load_reads_a_sharded_checkpoint_whole():
    """Runtime.load(path) on an FSDP (DCP) checkpoint said "not a distrain checkpoint"."""
    from distrain.checkpoint.state import read_model_weights

    runtime = distrain.Runtime(strategy="single", devices=1, accelerator="cpu")
    loaded = runtime.load(PREVIOUS / "fsdp2-step3")
    assert loaded["progress"]["global_step"] == 3
    expected = read_model_weights(PREVIOUS / "fsdp2-step3")
    assert loaded["model"].keys() == expected.keys()
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
