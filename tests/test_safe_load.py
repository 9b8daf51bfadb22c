"""A checkpoint never runs code: crafted files through every path that reads one.

Each crafted file, if it were unpickled as torch does by default, would create a marker file; every
test asserts the marker is absent and the refusal is one line that names the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from distrain.checkpoint import CheckpointError, safe_load
from distrain.checkpoint.state import saved_model_shapes
from helpers import TinyGPT, loader, make_trainer

PREVIOUS = Path(__file__).parent / "data" / "previous"
ROOT = Path(__file__).resolve().parents[1]


# ---- crafting -------------------------------------------------------------------------------------------------
def _text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little") + raw


def crafted_pickle(module: str, name: str, arg: str, stack_global: bool = True) -> bytes:
    """A protocol-4 pickle that calls ``module.name(arg)`` when loaded (``name`` may be dotted)."""
    if stack_global:
        lookup = _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL
    else:
        lookup = b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL
    return b"\x80\x04" + lookup + _text(arg) + b"\x85R."  # TUPLE1, REDUCE, STOP


def write_torch_file(path: Path, payload: bytes) -> None:
    """A real ``torch.save`` zip archive whose ``data.pkl`` is ``payload``."""

    class RawPickler:
        def __init__(self, buffer, protocol=None):
            self.buffer = buffer

        def dump(self, obj):
            self.buffer.write(payload)

    torch.save({}, path, pickle_module=types.SimpleNamespace(__name__="raw", Pickler=RawPickler))


class MakeDir:
    """Pickled by torch.save as a call of os.mkdir: what a crafted checkpoint entry would run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _dcp_copy(tmp: Path, name: str = "crafted") -> Path:
    target = tmp / "checkpoints" / name
    shutil.copytree(PREVIOUS / "fsdp2-step3", target)
    return target


def _one_line_naming(error: BaseException | str, file: Path | str) -> None:
    text = str(error)
    assert "\n" not in text.strip(), text
    assert str(file) in text, (file, text)
    assert "refusing to load" in text, text


def _resume_single(root: Path, ckpt_path: str):
    trainer, _ = make_trainer(root, strategy="single", devices=1, max_steps=4, logger=False)
    trainer.fit(TinyGPT(), loader(4), ckpt_path=ckpt_path)
    return trainer


# ---- DCP .metadata: a dotted name under an allowed module ------------------------------------------------------
DOTTED = [
    ("torch.distributed.checkpoint.metadata", "os.mkdir"),  # what the metadata module imports
    ("torch", "serialization.os.mkdir"),
    ("pathlib", "os.mkdir"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
]


@pytest.mark.parametrize("module,name", DOTTED)
def test_dcp_metadata_naming_code_is_refused_on_every_read_path(tmp_path, module, name):
    marker = tmp_path / "ran"
    crafted = _dcp_copy(tmp_path)
    (crafted / ".metadata").write_bytes(crafted_pickle(module, name, str(marker)))

    with pytest.raises(safe_load.UnsafeCheckpointError) as error:  # the reader every path uses
        safe_load.read_dcp_metadata(crafted)
    _one_line_naming(error.value, crafted / ".metadata")
    # --resume PATH (Trainer.fit(ckpt_path=...)): refused before loading anything
    with pytest.raises(CheckpointError) as error:
        _resume_single(tmp_path / "run", str(crafted))
    _one_line_naming(error.value, crafted / ".metadata")
    # distrain convert: one line, exit code 2
    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "convert", str(crafted), str(tmp_path / "w.safetensors")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    _one_line_naming(out.stderr, crafted / ".metadata")
    # Module.load_from_checkpoint
    with pytest.raises(CheckpointError) as error:
        TinyGPT.load_from_checkpoint(str(crafted))
    _one_line_naming(error.value, crafted / ".metadata")
    # distrain train --resume's shape check before launch: no shapes (the load then refuses it, as above)
    assert saved_model_shapes(crafted) is None
    assert not marker.exists()


def test_resume_auto_skips_a_crafted_sibling_and_names_it(tmp_path):
    """``--resume auto``: `last` points at a crafted checkpoint; the scan of its siblings reads every
    sibling's metadata, runs nothing, and resumes from the intact one, saying why."""
    marker = tmp_path / "ran"
    good = _dcp_copy(tmp_path, "good")
    crafted = _dcp_copy(tmp_path, "newer")
    (crafted / ".metadata").write_bytes(crafted_pickle(*DOTTED[0], str(marker)))
    (tmp_path / "checkpoints" / "last").symlink_to("newer")
    os.utime(good, (1, 1))  # older than the crafted one
    with pytest.warns(UserWarning, match="refusing to load") as warned:
        trainer = _resume_single(tmp_path, "auto")
    assert any(str(crafted) in str(w.message) and str(good) in str(w.message) for w in warned)
    assert trainer.global_step == 4  # resumed at step 3 from the intact one, trained to 4
    assert not marker.exists()


# ---- DCP shard files: non-tensor entries --------------------------------------------------------------------
def test_dcp_byte_entries_are_read_weights_only(tmp_path):
    """torch's DefaultLoadPlanner unpickles a DCP checkpoint's non-tensor entries (learning rates,
    steps) with weights_only=False: a crafted shard file ran code there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    marker = tmp_path / "ran"
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(PREVIOUS / "fsdp2-step3", whole)  # a checkpoint we trust (our own fixture)
    state = torch.load(whole, weights_only=False)
    state.pop("meta", None)
    state["optimizers"][0]["param_groups"][0]["lr"] = MakeDir(marker)
    crafted = tmp_path / "checkpoints" / "crafted"
    dcp.save(state, checkpoint_id=str(crafted), no_dist=True)
    shutil.copy(PREVIOUS / "fsdp2-step3" / "meta.pt", crafted / "meta.pt")
    with pytest.raises(CheckpointError) as error:
        _resume_single(tmp_path / "run", str(crafted))
    shard = next(crafted.glob("*.distcp"))
    _one_line_naming(error.value, shard)
    assert "optimizers.0.param_groups.0.lr" in str(error.value)
    assert not marker.exists()


# ---- torch.save files: meta.pt, state.pt ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["meta.pt", "state.pt"])
def test_torch_files_of_a_checkpoint_naming_code_are_refused(tmp_path, kind):
    marker = tmp_path / "ran"
    if kind == "meta.pt":
        checkpoint = _dcp_copy(tmp_path)
    else:
        checkpoint = tmp_path / "checkpoints" / "crafted"
        shutil.copytree(PREVIOUS / "single-step3", checkpoint)
    state = torch.load(checkpoint / kind, weights_only=True)
    state["hyper_parameters"] = {"lr": MakeDir(marker)}
    torch.save(state, checkpoint / kind)
    with pytest.raises(CheckpointError) as error:
        _resume_single(tmp_path / "run", str(checkpoint))
    _one_line_naming(error.value, checkpoint / kind)
    with pytest.raises(CheckpointError) as error:
        TinyGPT.load_from_checkpoint(str(checkpoint))
    _one_line_naming(error.value, checkpoint / kind)
    assert saved_model_shapes(checkpoint) is None or kind == "meta.pt"  # state.pt memory-mapped: refused too
    assert not marker.exists()


# ---- Hugging Face model directories ------------------------------------------------------------------------------
REMOTE_CODE = """
import os
open({marker!r}, "w").close()
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "evil"
"""


def _tiny_llama(tmp: Path) -> Path:
    from distrain.hf.tiny import make_tiny_llama

    return Path(make_tiny_llama(tmp / "llama"))


def test_hf_remote_code_runs_only_when_the_user_trusts_it(tmp_path):
    pytest.importorskip("transformers")
    from distrain.config import ConfigError
    from distrain.hf.models import load_config

    marker = tmp_path / "ran"
    directory = _tiny_llama(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil_config.EvilConfig"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "evil_config.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    with pytest.raises(ConfigError) as error:
        load_config(str(directory))
    text = str(error.value)
    assert "training.trust_remote_code" in text and str(directory) in text and "\n" not in text, text
    assert not marker.exists()
    load_config(str(directory), trust_remote_code=True)  # the user's own decision: then it runs
    assert marker.exists()


def test_hf_pytorch_model_bin_naming_code_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from distrain.hf.models import checkpoint_tensors

    marker = tmp_path / "ran"
    directory = _tiny_llama(tmp_path)
    weights = {}
    for key, read in checkpoint_tensors(directory):
        weights[key] = read()
    (directory / "model.safetensors").unlink()
    weights["evil"] = MakeDir(marker)
    torch.save(weights, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as error:
        list(checkpoint_tensors(directory))
    _one_line_naming(error.value, directory / "pytorch_model.bin")
    assert not marker.exists()


# ---- every pickle whose globals come from what these files' modules import (hypothesis) ---------------------------
def _catalog() -> list[tuple[str, str]]:
    """(module, name) pairs a crafted pickle might name: what the readers' modules import, reached
    directly and through dotted names, plus the classic code-running callables."""
    import importlib

    pairs = {("os", "mkdir"), ("posix", "mkdir"), ("os", "system"), ("builtins", "exec"), ("builtins", "eval")}
    pairs |= {("subprocess", "call"), ("pathlib", "Path.touch"), ("shutil", "rmtree"), ("pickle", "loads")}
    for module_name in (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.serialization",
        "distrain.checkpoint.safe_load",
        "deepspeed.runtime.zero.config",
        "deepspeed.runtime.fp16.loss_scaler",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in sorted(vars(module)):
            if attr.startswith("__"):
                continue
            pairs.add((module_name, attr))
            value = getattr(module, attr)
            if isinstance(value, types.ModuleType):  # os, sys, torch, pickle, io ... as dotted names
                pairs |= {(module_name, f"{attr}.{sub}") for sub in ("mkdir", "system", "exec", "loads", "load")}
    return sorted(pairs)


def _allowed_anyway(module: str, name: str) -> bool:
    """Names a real file of that format holds: loading them builds data, it runs nothing."""
    from torch._weights_only_unpickler import _get_allowed_globals

    return (module, name) in safe_load._DCP_METADATA_GLOBALS or f"{module}.{name}" in _get_allowed_globals()


CATALOG = _catalog()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("crafted")


def test_crafted_pickles_never_run_code(scratch):
    import hypothesis
    from hypothesis import strategies as st

    marker = scratch / "ran"
    arguments = [str(marker), f"open({str(marker)!r}, 'w').close()", f"touch {marker}"]

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
    @hypothesis.given(
        pair=st.sampled_from([p for p in CATALOG if not _allowed_anyway(*p)]),
        arg=st.sampled_from(arguments),
        stack_global=st.booleans(),
        reader=st.sampled_from(["dcp metadata", "torch file", "deepspeed file"]),
    )
    def never_runs(pair, arg, stack_global, reader):
        payload = crafted_pickle(*pair, arg, stack_global)
        folder = scratch / "case"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        if reader == "dcp metadata":
            file = folder / ".metadata"
            file.write_bytes(payload)
            read = lambda: safe_load.read_dcp_metadata(folder)  # noqa: E731
        else:
            file = folder / "state.pt"
            write_torch_file(file, payload)
            read = lambda: safe_load.load_torch_file(file)  # noqa: E731
            if reader == "deepspeed file":  # DeepSpeed's own torch.load(weights_only=False), inside our context

                def read():
                    with safe_load.deepspeed_loading():
                        return torch.load(file, weights_only=False)

        with pytest.raises(safe_load.UnsafeCheckpointError) as error:
            read()
        _one_line_naming(error.value, file)
        assert not marker.exists(), pair

    never_runs()


def test_the_fixtures_own_metadata_still_reads(tmp_path):
    """The allow-list is exact, and complete for what torch writes: our fixtures and a fresh save read."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3, dtype=torch.bfloat16), "n": 3, "lr": 0.1}, checkpoint_id=str(tmp_path), no_dist=True)
    for path in (PREVIOUS / "fsdp2-step3", tmp_path):
        assert safe_load.read_dcp_metadata(path).state_dict_metadata
    into = {"w": torch.zeros(3, dtype=torch.bfloat16), "n": 0, "lr": 0.0}
    safe_load.dcp_load(into, tmp_path, no_dist=True)
    assert into["n"] == 3 and into["lr"] == 0.1 and torch.equal(into["w"], torch.ones(3, dtype=torch.bfloat16))


# ---- DeepSpeed's own files: same world size, another one (universal conversion), ZeRO-3 consolidation ------------
def _deepspeed_run(rank, root: Path, devices: int, steps: int, resume: str | None):
    """ZeRO-3 on ``devices`` ranks; with ``resume``: (error class, message, seconds to fail) per rank."""
    import time

    from test_deepspeed import LazyTinyGPT

    trainer, _ = make_trainer(
        root, strategy="deepspeed_stage_3", devices=devices, max_steps=steps, logger=False, gradient_clip_val=0.5
    )
    start = time.monotonic()
    try:
        trainer.fit(LazyTinyGPT(), loader(4), ckpt_path=resume)
    except Exception as error:  # noqa: BLE001 — what each rank saw is the result
        return type(error).__name__, str(error), time.monotonic() - start
    return None


def _craft_deepspeed_file(checkpoint: Path, pattern: str, marker: Path) -> Path:
    files = sorted((checkpoint / "deepspeed").glob(pattern))
    assert files, pattern
    for file in files:
        state = torch.load(file, weights_only=False)  # our own file, trusted here
        state["crafted"] = MakeDir(marker)
        torch.save(state, file)
    manifest = checkpoint / "manifest.json"  # an adversary writes a manifest that fits (it is no signature)
    recorded = json.loads(manifest.read_text())
    recorded["files"] = {name: (checkpoint / name).stat().st_size for name in recorded["files"]}
    manifest.write_text(json.dumps(recorded))
    return files[0]


@pytest.mark.slow
@pytest.mark.alone  # rank 1 learns of rank 0's refusal within seconds
def test_deepspeed_files_naming_code_are_refused_on_every_path(tmp_path):
    pytest.importorskip("deepspeed")
    from helpers import run_ranks

    marker = tmp_path / "ran"
    run_ranks(_deepspeed_run, 1, tmp_path / "written", 1, 2, None)
    written = tmp_path / "written" / "checkpoints" / "last"
    for pattern in ("*model_states.pt", "*optim_states.pt"):
        crafted = tmp_path / pattern.strip("*.") / "checkpoints" / "crafted"
        shutil.copytree(written.resolve(), crafted)
        file = _craft_deepspeed_file(crafted, pattern, marker)
        # the same world size: the engine's own loader
        (result,) = run_ranks(_deepspeed_run, 1, tmp_path / "same", 1, 4, str(crafted))
        assert result is not None and result[0] == "UnsafeCheckpointError", result
        _one_line_naming(result[1], file.parent)
        # ZeRO-3 consolidation (distrain convert): zero_to_fp32
        out = subprocess.run(
            [sys.executable, "-m", "distrain.cli", "convert", str(crafted), str(tmp_path / "w.safetensors")],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        _one_line_naming(out.stderr, file.parent)
    # another world size: rank 0 converts to the universal format; rank 1 learns of the refusal at once
    results = run_ranks(_deepspeed_run, 2, tmp_path / "other", 2, 4, str(crafted))
    for rank, result in enumerate(results):
        assert result is not None and result[0] == "UnsafeCheckpointError", (rank, result)
        _one_line_naming(result[1], file.parent)
        assert result[2] < 10, f"rank {rank} learned of the failure after {result[2]:.1f} s"
    assert "raised on rank 0" in results[1][1]
    assert not marker.exists()
