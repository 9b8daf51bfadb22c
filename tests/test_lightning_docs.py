"""The Trainer and Strategy lines of Lightning's own documentation pages (``tests/lightning_docs/snippets.py``: its
docstring names the source, its license and the one hardware stand-in) construct under ``distrain.lightning`` with
their imports switched (``migrate``), or are refused in one line where Lightning itself needs what this machine
lacks. A snippet that should construct and does not is a strict xfail carrying its exact error. Each case runs in
this process, in a fresh namespace and the test's own folder, and only constructs (never fits): a Trainer with
devices=2 checks its arguments and starts nothing, which each case checks."""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter

import psutil
import pytest
import torch.distributed as dist
from lightning_docs.snippets import FURTHER_PAGES, LEGITIMATE, PAGES, SNIPPETS, Snippet, stand_in

from distrain.lightning import migrate


class StillFails(Exception):
    """A known gap: the snippet fails with exactly its recorded error (the strict xfail's only accepted failure)."""


def _case(snippet: Snippet):
    marks = ()
    if snippet.xfail:
        marks = pytest.mark.xfail(strict=True, raises=StillFails, reason=snippet.xfail)
    return pytest.param(snippet, id=snippet.key, marks=marks)


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """The test's own folder (relative paths such as ``some/path/`` land there), no ``PL_TRAINER_*`` or launcher
    variables, and the environment as it was afterwards (a construction may fill some in)."""
    saved = dict(os.environ)
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith(("PL_TRAINER_", "SLURM_", "TORCHELASTIC_")) or key in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "NODE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "PL_GLOBAL_SEED",
        ):
            del os.environ[key]
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a remote root's local stage
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def _run(code: str, name: str) -> str | None:
    """Executes ``code`` in a fresh namespace: None where it ran, else its error as ``Type: message``."""
    namespace = {"__name__": "lightning_docs_snippet"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own warnings (16-mixed on a CPU runs bf16-mixed) are fine here
        try:
            exec(compile(code, name, "exec"), namespace)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
    return None


def _in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


@pytest.mark.parametrize("snippet", [_case(s) for s in SNIPPETS])
def test_a_lightning_docs_snippet_constructs_or_is_refused_for_what_this_machine_lacks(snippet, isolated):
    code, applied = stand_in(migrate(snippet.defs + snippet.source), snippet.devices)
    assert "; ".join(applied) == snippet.stand_in_applied, applied  # the stand-in changes what the record says
    children, grouped = set(psutil.Process().children(recursive=True)), _in_process_group()
    error = _run(code, f"<{snippet.page}:{snippet.line} {snippet.id}>")
    assert set(psutil.Process().children(recursive=True)) <= children, "constructing started a process"
    assert _in_process_group() == grouped, "constructing joined a process group"
    if snippet.xfail:
        if error == snippet.xfail:
            raise StillFails(error)
        assert error is None, f"fails otherwise than recorded: {error}"
    elif snippet.expect == "constructs":
        assert error is None, error
    else:
        assert error is not None, f"constructs, but the record expects {snippet.expect!r}"
        assert "\n" not in error and re.search(snippet.expect.removeprefix("refused: "), error), error


def test_the_corpus_records_are_whole_and_each_refusal_says_why_it_is_legitimate():
    assert len({s.key for s in SNIPPETS}) == len(SNIPPETS)
    assert {s.page for s in SNIPPETS} <= set(PAGES) | set(FURTHER_PAGES)
    for s in SNIPPETS:
        assert s.expect == "constructs" or s.expect.startswith("refused: "), s.key
        refused = s.expect != "constructs"
        assert refused == bool(s.because), s.key  # a refusal says why, and only a refusal
        assert not (refused and s.xfail), s.key  # a gap is a constructing snippet that fails
        assert not s.because or s.because.startswith(LEGITIMATE), s.key
        assert "lightning" in s.source and ("Trainer(" in s.source or "Strategy(" in s.source), s.key
    counts = Counter(s.page for s in SNIPPETS)
    assert sum(counts.values()) == len(SNIPPETS) > 100
