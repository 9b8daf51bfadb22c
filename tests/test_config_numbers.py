"""Every numeric config key refuses the numbers it cannot mean (NaN, ±inf, 0, -1), on every route a value arrives
by, unless config.py documents that value next to the field (``number(..., means={...})``); and ``data.max_bytes``
reads only that many bytes."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import sys
import tracemalloc
import types
import typing
from pathlib import Path

import pytest

from distrain import config as cfg
from distrain.config import ConfigError, RunConfig, build_config

PROBES = (math.nan, math.inf, -math.inf, 0, -1)


def _is_number_type(tp) -> bool:
    """int or float, alone or in a union (``int | None``, ``int | str``); bool is not a number."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(a in (int, float) for a in args)


def numeric_keys(cls=RunConfig, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every numeric field of every section, found by introspection: a new key is in."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += numeric_keys(hints[f.name], f"{prefix}{f.name}.")
        elif _is_number_type(hints[f.name]):
            keys.append((f"{prefix}{f.name}", f))
    return keys


KEYS = numeric_keys()


def _field_docstrings() -> dict[str, str]:
    """``Section.field`` → the docstring written under the field, in config.py or the file of a strategy's section."""
    modules = {sys.modules[section.__module__] for section in _sections()} - {None}
    docs = {}
    for node in (node for module in modules for node in ast.parse(inspect.getsource(module)).body):
        if isinstance(node, ast.ClassDef):
            body = node.body
            for stmt, nxt in zip(body, body[1:]):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                ):
                    docs[f"{node.name}.{stmt.target.id}"] = str(nxt.value.value)
    return docs


def test_the_introspection_finds_the_numeric_keys():
    keys = {k for k, _ in KEYS}
    assert {"training.learning_rate", "training.max_grad_norm", "distributed.timeout_seconds", "data.max_bytes"} <= keys
    assert {"fsdp.activation_checkpointing.every_n_layers", "deepspeed.stage", "distributed.devices"} <= keys
    assert not keys & {"training.compile", "training.pretrained", "logging.use_tensorboard"}  # booleans: no numbers
    assert all(cfg.bounds_of(f) is f.metadata.get("bounds") for _, f in KEYS), "a numeric key declares no bounds"


@pytest.mark.parametrize("key, f", KEYS, ids=[k for k, _ in KEYS])
def test_a_number_a_key_cannot_mean_is_refused_naming_key_and_value(key, f):
    means = cfg.bounds_of(f).means
    for value in PROBES:
        if value in means:  # documented in config.py next to the field: it must be accepted
            config = build_config(overrides={key: value})
            section, _, name = key.rpartition(".")
            node = config
            for part in section.split("."):
                node = getattr(node, part)
            assert getattr(node, name) == value
            continue
        with pytest.raises(ConfigError) as error:
            build_config(overrides={key: value})
        message = str(error.value)
        assert key in message and repr(value) in message, (key, value, message)


def test_every_documented_value_is_explained_in_the_fields_docstring():
    docs = _field_docstrings()
    for key, f in KEYS:
        means = cfg.bounds_of(f).means
        if not means:
            continue
        owner = next(c for c in _sections() if f in dataclasses.fields(c))
        doc = docs.get(f"{owner.__name__}.{f.name}", "")
        for value in means:
            assert f"{value:g}" in doc, f"{key}: {value} means {means[value]!r}, which its docstring does not say"


def _sections() -> list[type]:
    out, todo = [], [RunConfig]
    while todo:
        cls = todo.pop()
        out.append(cls)
        hints = typing.get_type_hints(cls)
        todo += [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return out


def test_the_review_examples(tmp_path):
    """The values the review found accepted: each is one ConfigError naming the key."""
    for item in (
        "training.learning_rate=nan",
        "training.max_grad_norm=nan",
        "distributed.timeout_seconds=nan",
        "distributed.collective_timeout_seconds=inf",
        "checkpointing.save_every_n_steps=-1",
        "checkpointing.keep_last_n=-2",
        "data.max_bytes=-1",
        "training.limit_val_batches=-1",
        "training.val_check_interval=-1",
        "data.num_workers=-1",
        "distributed.gpu_memory=0GB",
    ):
        with pytest.raises(ConfigError, match=item.split("=")[0]):
            build_config(cli_items=[item])
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("training:\n  learning_rate: .nan\n")
    with pytest.raises(ConfigError, match=r"training.learning_rate .*nan"):
        build_config(cfg_file)


def test_learning_rate_nan_through_the_command_line(capsys, tmp_path):
    """``distrain train training.learning_rate=nan``: the CLI's own parse (``build_config`` of the parsed
    arguments) refuses it in one line; --print-config, so that a regression prints instead of training."""
    from distrain import cli

    args = cli.train_parser().parse_intermixed_args(["training.learning_rate=nan"])
    with pytest.raises(ConfigError, match=r"training.learning_rate must be .*got nan"):
        build_config(args.config, cli._flag_values(args), args.overrides)
    code = cli.main(["train", "--output-dir", str(tmp_path / "out"), "training.learning_rate=nan", "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and "training.learning_rate" in err and "nan" in err, err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# data.max_bytes


def test_max_bytes_reads_only_the_first_max_bytes(tmp_path):
    """A 256 MiB (sparse) corpus with max_bytes=1000: the first 1000 bytes, and no more than that in memory
    (reading the file whole, then cutting it, would peak at 256 MiB)."""
    from distrain.data import load_corpus

    path = tmp_path / "corpus.txt"
    head = bytes(range(32, 127)) * 20
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(256 * 2**20)
    tracemalloc.start()
    try:
        data = load_corpus(str(path), max_bytes=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bytes(data.numpy()) == head[:1000]
    assert peak < 2**20, f"peak {peak / 2**20:.1f} MiB for 1000 bytes"
    assert bytes(load_corpus(str(path), max_bytes=len(head)).numpy()) == head
    with pytest.raises(ValueError, match="data.max_bytes"):
        load_corpus(str(path), max_bytes=-1)


def test_builtin_corpus_is_the_start_of_the_stdlib_modules():
    import sysconfig

    from distrain.data import load_corpus

    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    data = bytes(load_corpus("builtin:stdlib", max_bytes=100).numpy())
    assert data == (first + b"\n")[:100]


# ---- the same promise through the Python API: Trainer(...) and the strategies' timeouts ----------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, 0])
def test_every_numeric_trainer_argument_refuses_what_it_cannot_mean(tmp_path, value):
    import distrain
    from distrain.training.arguments import TRAINER_NUMBERS

    for name, bounds in TRAINER_NUMBERS.items():
        arguments = dict(accelerator="cpu", strategy="single", devices=1, default_root_dir=str(tmp_path))
        if value in bounds.means or bounds.in_range(value):
            distrain.Trainer(**arguments, **{name: value})
        else:
            with pytest.raises(ValueError, match=f"{name} must be"):
                distrain.Trainer(**arguments, **{name: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, 0, -5])
@pytest.mark.parametrize("key", ["timeout", "collective_timeout"])
def test_a_strategy_timeout_is_a_positive_finite_time(tmp_path, key, value):
    import distrain

    with pytest.raises(ValueError, match="positive, finite number of seconds"):
        distrain.Trainer(accelerator="cpu", strategy="ddp", devices=2, default_root_dir=str(tmp_path), **{key: value})


def test_every_documented_value_reaches_a_trainer_that_accepts_it(tmp_path):
    """A value config.py documents (``0``: validate at each epoch's end only, ...) must mean that in the Trainer the
    config builds, not be refused there after the config accepted it (``training.val_check_interval=0`` was)."""
    from distrain.jobs.common import build_trainer

    documented = [(key, value) for key, f in KEYS for value in cfg.bounds_of(f).means]
    assert ("training.val_check_interval", 0) in documented
    for key, value in documented:
        config = build_config(overrides={key: value, "output_dir": str(tmp_path), "distributed.accelerator": "cpu"})
        if key.startswith(("fsdp.", "deepspeed.", "distributed.")):
            continue  # read by a strategy, not the Trainer: tests/test_fsdp.py and test_deepspeed.py build those
        build_trainer(config, "ddp", tmp_path / "checkpoints", {})
