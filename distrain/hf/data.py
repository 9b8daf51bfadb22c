"""Datasets for the Hugging Face jobs: load (hub name or local files), tokenize once, pack, collate.

Tokenization runs once per job, not once per rank: rank 0 loads and tokenizes while the others
wait at a barrier, then they open the very files rank 0 wrote to the ``datasets`` cache. That
needs cache names every rank computes alike, so each map gets an explicit fingerprint made from
its input's fingerprint, the tokenizer and the settings (never from hashing a Python closure,
which can differ between processes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distrain.config import ConfigError, DataConfig
from distrain.distributed import watch
from distrain.hf.models import looks_local, not_loadable

LOCAL_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}


# ---- loading ------------------------------------------------------------------------------------
def load_raw(
    source: str,
    config_name: str | None = None,
    split: str = "train",
    cache_dir: str | None = None,
    key: str = "data.dataset",
):
    """One split of a hub dataset, or a local file (the whole file) or directory (``split`` of it)."""
    import datasets

    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = LOCAL_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ConfigError(
                    f"{key}: {source!r} has an unknown file type; use .txt, .json, .jsonl, .csv or .parquet"
                )
            return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
        if path.is_dir():
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # save_to_disk output
                loaded = datasets.load_from_disk(str(path))
                return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return datasets.load_dataset(str(path), config_name, split=split, cache_dir=cache_dir)
        if looks_local(source):
            raise ConfigError(f"{key}: no such file or directory: {source!r}")
        return datasets.load_dataset(source, config_name, split=split, cache_dir=cache_dir)
    except ConfigError:
        raise
    except (KeyError, ValueError) as e:
        if "split" in str(e).lower():
            raise ConfigError(f"{key}: {source!r} has no split {split!r} ({str(e).splitlines()[0]})") from None
        raise
    except OSError as e:  # not found, offline, connection refused
        raise not_loadable(key, source, e, what="dataset") from None


# ---- tokenization --------------------------------------------------------------------------------
@dataclass
class Prepared:
    train: Any  # datasets.Dataset of input_ids / attention_mask (/ token_type_ids) (/ labels)
    eval: Any
    num_labels: int | None = None
    label_names: list[str] | None = None
    from_cache: bool = False  # this rank read what another rank had tokenized


@contextlib.contextmanager
def rank_zero_first(runtime):
    """Rank 0 runs the body first (download, tokenization → the datasets cache); the others wait at a
    barrier, then run it and find everything cached. ``runtime``: anything with ``world_size``,
    ``is_global_zero`` and ``barrier(name)`` (a Runtime, a Trainer's runtime), or None."""
    if runtime is None or runtime.world_size == 1:
        yield
        return
    # tokenizing a large corpus takes far longer than a training step: the wait gets the long
    # (process-group init) timeout, not the steady-state collective one
    phase = "data: rank 0 tokenizes first"
    if not runtime.is_global_zero:
        with watch.patient(phase):
            runtime.barrier(phase)
    try:
        yield
    finally:  # also when rank 0 failed: the others go on and report their own error instead of hanging
        if runtime.is_global_zero:
            with watch.patient(phase):
                runtime.barrier(phase)


def prepare(
    data: DataConfig, tokenizer, task: str, seed: int = 0, runtime=None, cache_dir: str | None = None
) -> Prepared:
    """Train and eval datasets, tokenized (and packed) as ``data`` says, for ``task``."""
    max_length = data.max_length or data.seq_len
    with rank_zero_first(runtime):
        train = load_raw(data.dataset, data.dataset_config, data.split, cache_dir)
        if data.eval_split is None:  # hold out a deterministic, shuffled slice of the training split
            fp = _fingerprint(_fp_of(train), "split", data.val_fraction, seed)
            parts = train.train_test_split(
                test_size=data.val_fraction, seed=seed, train_new_fingerprint=fp + "a", test_new_fingerprint=fp + "b"
            )
            train, evaluation = parts["train"], parts["test"]
        elif os.path.exists(os.path.expanduser(data.eval_split)):
            evaluation = load_raw(data.eval_split, key="data.eval_split", cache_dir=cache_dir)
        else:
            evaluation = load_raw(data.dataset, data.dataset_config, data.eval_split, cache_dir, key="data.eval_split")
        for ds in (train, evaluation):
            _require_column(ds, data.text_column, "data.text_column")
        label2id, label_names, num_labels = None, None, None
        if task == "sequence_classification":
            for ds in (train, evaluation):
                _require_column(ds, data.label_column, "data.label_column")
            label2id, label_names, num_labels = _labels(train, evaluation, data.label_column)
        tokenize = _Tokenize(
            tokenizer,
            data.text_column,
            data.label_column if task == "sequence_classification" else None,
            label2id,
            None if (task == "causal_lm" and data.packing) else max_length,
        )
        raw_size = len(train)
        (train, from_cache), (evaluation, _) = (_tokenize(ds, tokenize, tokenizer, task) for ds in (train, evaluation))
        if len(train) == 0:
            raise ConfigError(_nothing_left(data, tokenizer, raw_size, task))
        if task == "causal_lm" and data.packing:
            pack = _Pack(max_length, tokenizer.eos_token_id)
            train, evaluation = (
                _map(ds, pack, _fingerprint(_fp_of(ds), "pack", max_length, pack.eos_id), "packing")
                for ds in (train, evaluation)
            )
            if len(train) == 0:
                raise ConfigError(f"data.max_length={max_length}: the training text is shorter than one packed block")
    return Prepared(train, evaluation, num_labels, label_names, from_cache)


def _nothing_left(data: DataConfig, tokenizer, raw_size: int, task: str) -> str:
    """Why an empty training set is empty: the dataset, the tokenizer, what was dropped and why."""
    why = (
        "a causal LM sample needs at least 2 tokens (one next-token target), and each was empty or tokenized to "
        "fewer; a tokenizer that does not match the data (or a wrong data.text_column) does this"
        if task == "causal_lm"
        else "every sample was dropped while tokenizing"
    )
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    return (
        f"data.dataset {data.dataset!r}: no training sample is left: all {raw_size} were dropped after tokenizing "
        f"{data.text_column!r} with the tokenizer {name!r}; {why}"
    )


def _require_column(ds, column: str, key: str) -> None:
    if column not in ds.column_names:
        raise ConfigError(f"{key}: the dataset has no column {column!r} (it has: {', '.join(ds.column_names)})")


def _labels(train, evaluation, column: str):
    """(label2id or None, class names or None, num_labels): class names are sorted, ids kept as they are."""
    import datasets

    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return None, list(feature.names), feature.num_classes
    values = set(train[column]) | set(evaluation[column] if column in evaluation.column_names else [])
    if all(isinstance(v, str) for v in values):
        names = sorted(values)
        return {n: i for i, n in enumerate(names)}, names, len(names)
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise ConfigError(f"data.label_column: {column!r} must hold class ids (0, 1, ...) or class names")
    return None, None, max(values) + 1


class _Tokenize:
    """A batched map function (a class, not a closure: datasets and worker processes pickle it)."""

    def __init__(
        self, tokenizer, text_column: str, label_column: str | None, label2id: dict | None, max_length: int | None
    ):
        self.tokenizer, self.text_column, self.label_column = tokenizer, text_column, label_column
        self.label2id, self.max_length = label2id, max_length

    def settings(self) -> tuple:
        return (self.text_column, self.label_column, sorted((self.label2id or {}).items()), self.max_length)

    def __call__(self, batch: dict) -> dict:
        texts = [t if isinstance(t, str) else "" for t in batch[self.text_column]]
        enc = self.tokenizer(texts, truncation=self.max_length is not None, max_length=self.max_length)
        out = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
        if self.label_column is not None:
            labels = batch[self.label_column]
            out["labels"] = [self.label2id[v] for v in labels] if self.label2id else [int(v) for v in labels]
        return out


class _Pack:
    """Concatenate the texts with EOS between them and cut blocks of ``block`` tokens (the tail that
    does not fill a block is dropped): no padding at all, every position trains."""

    def __init__(self, block: int, eos_id: int | None):
        self.block, self.eos_id = block, eos_id

    def __call__(self, batch: dict) -> dict:
        ids: list[int] = []
        for seq in batch["input_ids"]:
            ids.extend(seq)
            if self.eos_id is not None and (not seq or seq[-1] != self.eos_id):
                ids.append(self.eos_id)
        n = len(ids) // self.block * self.block
        blocks = [ids[i : i + self.block] for i in range(0, n, self.block)]
        return {"input_ids": blocks, "attention_mask": [[1] * self.block for _ in blocks]}


def _tokenize(ds, tokenize: _Tokenize, tokenizer, task: str):
    """The tokenized dataset, and whether it came from the cache (i.e. another rank tokenized it)."""
    if task == "causal_lm":  # a sample needs two tokens for one next-token target
        keep = _fingerprint(_fp_of(ds), "nonempty", tokenize.text_column)
        ds = ds.filter(_HasText(tokenize.text_column), new_fingerprint=keep, **_cache_args(ds, keep))
    fingerprint = _fingerprint(_fp_of(ds), "tokenize", _tokenizer_fingerprint(tokenizer), *tokenize.settings())
    path = _cache_path(ds, fingerprint)
    cached = bool(path and os.path.exists(path))
    ds = _map(ds, tokenize, fingerprint, "tokenizing")
    if task == "causal_lm":
        keep = _fingerprint(_fp_of(ds), "two-tokens")
        ds = ds.filter(_AtLeastTwo(), new_fingerprint=keep, **_cache_args(ds, keep))
    return ds, cached


class _HasText:
    def __init__(self, column: str):
        self.column = column

    def __call__(self, row: dict) -> bool:
        return isinstance(row[self.column], str) and bool(row[self.column].strip())


class _AtLeastTwo:
    def __call__(self, row: dict) -> bool:
        return len(row["input_ids"]) >= 2


def _map(ds, fn, fingerprint: str, desc: str):
    return ds.map(
        fn,
        batched=True,
        remove_columns=ds.column_names,
        new_fingerprint=fingerprint,
        desc=desc,
        **_cache_args(ds, fingerprint),
    )


def _cache_args(ds, fingerprint: str) -> dict:
    """An explicit cache file next to the input's: the same name on every rank (in-memory data: none)."""
    path = _cache_path(ds, fingerprint)
    return {"cache_file_name": path} if path else {}


def _cache_path(ds, fingerprint: str) -> str | None:
    files = getattr(ds, "cache_files", None)
    if not files:
        return None
    return os.path.join(os.path.dirname(files[0]["filename"]), f"distrain-{fingerprint}.arrow")


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hashlib.sha256(f"{tokenizer.name_or_path}:{len(tokenizer)}".encode()).hexdigest()
    # truncation/padding are call-time state a previous call left behind, not part of the tokenizer
    state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _fp_of(ds) -> str:
    return getattr(ds, "_fingerprint", None) or "nofingerprint"


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


# ---- batches ------------------------------------------------------------------------------------
class PadCollator:
    """Samples → a batch of tensors, right-padded to the batch's longest sample (rounded up to a multiple of
    ``multiple_of``) or to ``pad_to``.

    ``attention_mask`` marks the real tokens: the causal-LM loss masks the padding out with it."""

    def __init__(self, pad_id: int, pad_to: int | None = None, multiple_of: int = 1):
        self.pad_id, self.pad_to, self.multiple_of = pad_id, pad_to, multiple_of

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        length = self.pad_to or -(-max(len(s["input_ids"]) for s in samples) // self.multiple_of) * self.multiple_of
        batch = {}
        for key, fill in (("input_ids", self.pad_id), ("attention_mask", 0), ("token_type_ids", 0)):
            if key in samples[0]:
                rows = [list(s[key])[:length] for s in samples]
                batch[key] = torch.tensor([r + [fill] * (length - len(r)) for r in rows], dtype=torch.long)
        if "labels" in samples[0]:
            batch["labels"] = torch.tensor([s["labels"] for s in samples], dtype=torch.long)
        return batch


def collator(data: DataConfig, tokenizer, multiple_of: int = 1) -> PadCollator:
    """``multiple_of``: batch lengths a multiple of it (sequence parallelism splits each sequence over the
    tensor-parallel ranks)."""
    pad_to = (data.max_length or data.seq_len) if data.padding == "max_length" else None
    return PadCollator(tokenizer.pad_token_id, pad_to, multiple_of)
