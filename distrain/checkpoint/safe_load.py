"""Reading bytes that someone else wrote — checkpoints, DeepSpeed's files, a model directory —
without ever running code from them.

A checkpoint is a file anyone could have handed you, and a pickle can name any function and call
it. Every path that deserializes such bytes goes through this module, and each one resolves only
the names its format really holds:

- ``torch.save`` files (``state.pt``, ``meta.pt``, DeepSpeed's ``*.pt``, ``pytorch_model.bin``):
  ``torch.load(weights_only=True)`` — tensors, plain containers, and DeepSpeed's three record
  classes allowed by name (``deepspeed_records``).
- DCP's ``.metadata``: torch reads it with a plain ``pickle.load``; here an unpickler resolves
  exactly the (module, name) pairs a real one holds, never a dotted name (from pickle protocol 4
  on, ``"os.system"`` under an allowed module would reach anything that module imports).
- DCP's byte entries (non-tensor values such as learning rates): torch's ``DefaultLoadPlanner``
  unpickles them with ``weights_only=False``; ``SafeLoadPlanner`` uses ``weights_only=True``.
- DeepSpeed's loaders call ``torch.load(weights_only=False)`` themselves (same world size,
  universal conversion, ``zero_to_fp32``): they run inside ``deepspeed_loading()``, which turns
  every such call into a weights-only one.
- Hugging Face directories: weights from safetensors (or ``pytorch_model.bin`` weights-only);
  configs and tokenizers never run a repository's own code unless the user sets
  ``training.trust_remote_code`` (``distrain/hf/models.py`` passes it).

A refusal is one line naming the file: ``UnsafeCheckpointError``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import io
import math
import pickle
from pathlib import Path
from typing import Any

import torch

from distrain.checkpoint import CheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A file names Python objects its format never holds (it could run code): refused, not loaded."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def refused(file: str | Path, error: BaseException) -> UnsafeCheckpointError:
    # torch's message opens with advice to retry with weights_only=False; the line that names the global is the news
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = next((line for line in lines if "Unsupported global" in line), _first_line(error))
    return UnsafeCheckpointError(
        f"{file}: refusing to load: it holds Python objects other than tensors and plain containers, "
        f"which could run code (weights_only=True: {cause[:300]})"
    )


# ---- torch.save files ----------------------------------------------------------------------------------------
def load_torch_file(file: str | Path | io.BytesIO, name: str | Path | None = None, **kwargs: Any) -> Any:
    """``torch.load(file, weights_only=True)`` on CPU; a pickle that names code is an
    ``UnsafeCheckpointError`` naming the file. Other errors (a truncated file) propagate."""
    kwargs.setdefault("map_location", "cpu")
    try:
        with _deepspeed_records_allowed():
            return torch.load(file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise refused(name or file, e) from None


# ---- torch.distributed.checkpoint ----------------------------------------------------------------------------
_DCP = "torch.distributed.checkpoint.metadata"
#: the classes whose instances a ``.metadata`` builds field by field (NEWOBJ, then BUILD): DCP's records
_DCP_RECORDS = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
)
#: Everything a DCP ``.metadata`` holds (torch 2.6–2.14): its records, tensor shapes, dtypes and layouts, the
#: memory-format enum, and the checkpoint's path.
_DCP_METADATA_GLOBALS = (
    _DCP_RECORDS
    | {
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
)
#: the largest ``.metadata`` read (a 70B model's with its optimizer state is tens of MB)
MAX_METADATA_BYTES = 1 << 30


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be checked one by one
    """Resolves only the names a real ``.metadata`` holds, and — since an allowed name is still a live class or
    function of this process — lets no opcode change one: BUILD only on a record this load made itself, REDUCE and
    NEWOBJ only on the allowed classes (and ``_get_layout``), SETITEM(S)/APPEND(S)/ADDITEMS only on a dict, list or
    set, and never INST/OBJ, NEWOBJ_EX, extension codes or persistent ids (``refused`` names the opcode)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source
        self._made: dict[int, object] = {}  # records made by this load (kept alive, so their ids stay theirs)

    def find_class(self, module: str, name: str):
        if (module, name) not in _DCP_METADATA_GLOBALS:  # a dotted name is never in the set
            raise UnsafeCheckpointError(
                f"{self.source}: refusing to load: it names {module}.{name}, which a checkpoint's metadata "
                "never holds (it could run code)"
            )
        return super().find_class(module, name)

    def _refuse(self, what: str):
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to load: {what}, which a checkpoint's metadata never does (it could change "
            "this process's classes or run code)"
        )

    def _callable(self, obj) -> bool:
        return any(obj is allowed for allowed in _allowed_callables())

    def load_reduce(self):
        func, args = self.stack[-2], self.stack[-1]
        if not self._callable(func) or type(args) is not tuple:
            self._refuse(f"it calls {func!r} (REDUCE)")
        super().load_reduce()

    def load_newobj(self):
        cls, args = self.stack[-2], self.stack[-1]
        if not (isinstance(cls, type) and self._callable(cls)) or type(args) is not tuple:
            self._refuse(f"it makes an object of {cls!r} (NEWOBJ)")
        super().load_newobj()
        made = self.stack[-1]
        if _is_record(type(made)):
            self._made[id(made)] = made

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        if self._made.get(id(inst)) is not inst:  # a class, a function, a dtype, an enum member, ...
            self._refuse(f"it sets the state of {inst!r} (BUILD)")
        if "__setstate__" not in type(inst).__dict__:  # the record's own fields only
            fields = {f.name for f in dataclasses.fields(inst)} if dataclasses.is_dataclass(inst) else set()
            parts = state if type(state) is tuple and len(state) == 2 else (state, None)
            for part in parts:
                if part is not None and (type(part) is not dict or not set(part) <= fields):
                    self._refuse(f"it sets {type(inst).__name__} attributes it does not have (BUILD)")
        super().load_build()

    def _into(self, target, kinds: tuple[type, ...], opcode: str):
        if type(target) not in kinds:
            self._refuse(f"it adds items to {target!r} ({opcode})")

    # the target of SETITEM/APPEND sits under its key and value (or item); of SETITEMS/APPENDS/ADDITEMS, under the mark
    def load_setitem(self):
        self._into(self.stack[-3], (dict, collections.OrderedDict), "SETITEM")
        super().load_setitem()

    def load_setitems(self):
        self._into(self.metastack[-1][-1], (dict, collections.OrderedDict), "SETITEMS")
        super().load_setitems()

    def load_append(self):
        self._into(self.stack[-2], (list,), "APPEND")
        super().load_append()

    def load_appends(self):
        self._into(self.metastack[-1][-1], (list,), "APPENDS")
        super().load_appends()

    def load_additems(self):
        self._into(self.metastack[-1][-1], (set,), "ADDITEMS")
        super().load_additems()

    def _never(opcode: str):  # noqa: N805 — builds a method
        def refuse(self):
            self._refuse(f"it uses pickle's {opcode} opcode")

        return refuse

    for _name, _opcode, _method in (
        ("REDUCE", pickle.REDUCE, load_reduce),
        ("NEWOBJ", pickle.NEWOBJ, load_newobj),
        ("BUILD", pickle.BUILD, load_build),
        ("SETITEM", pickle.SETITEM, load_setitem),
        ("SETITEMS", pickle.SETITEMS, load_setitems),
        ("APPEND", pickle.APPEND, load_append),
        ("APPENDS", pickle.APPENDS, load_appends),
        ("ADDITEMS", pickle.ADDITEMS, load_additems),
    ):
        dispatch[_opcode[0]] = _method
    for _name in ("INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"):
        dispatch[getattr(pickle, _name)[0]] = _never(_name)
    del _name, _opcode, _method, _never


@functools.cache
def _allowed_callables() -> tuple:
    """The allowed names that can be called: the record classes, ``torch.Size``, the path classes, the enum,
    ``OrderedDict`` and ``_get_layout`` (not the dtypes)."""
    found = (getattr(importlib.import_module(module), name) for module, name in _DCP_METADATA_GLOBALS)
    return tuple(obj for obj in found if callable(obj))


def _is_record(cls: type) -> bool:
    return (cls.__module__, cls.__qualname__) in _DCP_RECORDS


def read_dcp_metadata(path: str | Path):
    """A DCP checkpoint's ``Metadata`` (``path/.metadata``), through the restricted unpickler, checked against the
    files beside it (``check_storage``)."""
    file = Path(path) / ".metadata"
    with open(file, "rb") as f:
        return _unpickle_metadata(f, file)


def _unpickle_metadata(stream, file: Path):
    data = stream.read(MAX_METADATA_BYTES + 1)  # bounded, and pickle's lengths then read from memory only
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{file}: refusing to load: larger than {MAX_METADATA_BYTES} bytes")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 — whatever an allowed constructor raises on bytes that are not metadata
        raise CheckpointError(f"{file} is damaged or not DCP metadata ({type(e).__name__}: {_first_line(e)})") from None
    check_storage(metadata, file)
    return metadata


def check_storage(metadata, file: Path) -> None:
    """Every storage entry a ``.metadata`` lists stays inside its checkpoint and within its files, before anything is
    read: a file name in the checkpoint's own directory (never absolute, never ``..``, never a link), no stream
    transforms (distrain writes none; a decompressor's output has no bound), an offset and length inside that file,
    and tensors that together declare no more bytes than the files hold (``read_model_weights`` allocates them up
    front)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    def bad(what: str):
        raise UnsafeCheckpointError(f"{file}: refusing to load: {what}")

    if type(metadata) is not Metadata or not isinstance(metadata.storage_data, dict):
        bad("it is not DCP metadata with a storage index")
    directory, sizes = file.parent, {}
    for index, info in metadata.storage_data.items():
        if type(info) is not _StorageInfo or type(info.relative_path) is not str:
            bad(f"the storage entry of {getattr(index, 'fqn', index)!r} is not a file, offset and length")
        name, offset, length = info.relative_path, info.offset, info.length
        if name in ("", ".", "..", ".metadata") or name != Path(name).name or "\\" in name or "\0" in name:
            bad(f"the entry of {index.fqn!r} names the file {name!r}, outside the checkpoint's own files")
        if getattr(info, "transform_descriptors", None):
            bad(f"the entry of {index.fqn!r} asks for stream transforms {info.transform_descriptors!r}")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            bad(f"the entry of {index.fqn!r} has offset {offset!r} and length {length!r}")
        if name not in sizes:
            if (directory / name).is_symlink():  # its bytes would come from wherever the link points
                bad(f"the entry of {index.fqn!r} names {name!r}, a link")
            sizes[name] = (directory / name).stat().st_size if (directory / name).is_file() else None
        if sizes[name] is None or offset + length > sizes[name]:
            raise CheckpointError(
                f"{directory / name}: shorter than its .metadata says ({offset + length} bytes needed for "
                f"{index.fqn!r}, {sizes[name] or 0} there): the checkpoint is damaged or incomplete"
            )
    declared = 0
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            if type(meta.size) is not torch.Size or any(type(d) is not int or d < 0 for d in meta.size):
                bad(f"the tensor {fqn!r} has the shape {meta.size!r}")
            if not isinstance(meta.properties.dtype, torch.dtype):
                bad(f"the tensor {fqn!r} has the dtype {meta.properties.dtype!r}")
            declared += math.prod(meta.size) * meta.properties.dtype.itemsize
    held = sum(size or 0 for size in sizes.values())
    if declared > held:
        bad(f"its tensors declare {declared} bytes, but its files hold {held}")


def dcp_reader(path: str | Path):
    """torch's ``FileSystemReader`` whose ``read_metadata`` uses the restricted unpickler (as torch
    2.13.0's own does: the metadata path, then ``storage_meta.load_id``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as f:
                metadata = _unpickle_metadata(f, Path(metadata_path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def safe_load_planner(checkpoint: str | Path):
    """torch's ``DefaultLoadPlanner``, but non-tensor entries are read weights-only (torch 2.13.0's
    ``load_bytes`` unpickles them with ``weights_only=False``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import (
        set_element,  # private (torch 2.13.0), as the default planner uses
    )

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            file = Path(checkpoint) / info.relative_path if info is not None else Path(checkpoint)
            loaded = load_torch_file(value, name=f"{file} (entry {read_item.dest_index.fqn})")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


def dcp_load(state: dict[str, Any], path: str | Path, no_dist: bool) -> None:
    """``dcp.load`` of ``path`` into ``state`` through the safe reader and planner. A refused file is
    one ``UnsafeCheckpointError`` (DCP wraps each rank's error in a ``CheckpointException``)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=dcp_reader(path), planner=safe_load_planner(path), no_dist=no_dist)
    except BaseException as e:
        unsafe = _find_unsafe(e)
        if unsafe is not None:
            raise unsafe from None
        raise


def _find_unsafe(error: BaseException) -> UnsafeCheckpointError | None:
    if isinstance(error, UnsafeCheckpointError):
        return error
    for wrapped in (getattr(error, "failures", None) or {}).values():
        found = _find_unsafe(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        if found is not None:
            return found
    return None


# ---- DeepSpeed (checked against deepspeed 0.19.8) ------------------------------------------------------------
def deepspeed_records() -> list[type]:
    """The plain-record classes DeepSpeed pickles into its checkpoints, allowed by name for
    ``weights_only=True`` loads (none without DeepSpeed)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [LossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def _deepspeed_records_allowed():
    # only what is not allowed yet: torch's context removes its globals on exit, even when an
    # enclosing context (a nested load) had added them too
    import sys

    if "deepspeed" not in sys.modules:  # a file DeepSpeed wrote can only be read where DeepSpeed is loaded
        yield
        return
    missing = [g for g in deepspeed_records() if g not in torch.serialization.get_safe_globals()]
    with torch.serialization.safe_globals(missing):
        yield


@contextlib.contextmanager
def deepspeed_loading():
    """While DeepSpeed reads its own files (``engine.load_checkpoint``, ``ds_to_universal``,
    ``zero_to_fp32``: each calls ``torch.load(..., weights_only=False)`` and has no switch for it),
    every ``torch.load`` is a weights-only one with DeepSpeed's record classes allowed; a file that
    names anything else is an ``UnsafeCheckpointError`` naming it. ``torch.load`` is replaced for the
    duration of the context only."""
    original = torch.load
    torch.load = functools.partial(_weights_only_load, original)
    try:
        yield
    finally:
        torch.load = original


def _weights_only_load(load, file, *args, **kwargs):
    kwargs["weights_only"] = True
    try:
        with _deepspeed_records_allowed():
            return load(file, *args, **kwargs)
    except pickle.UnpicklingError as e:
        raise refused(file, e) from None


def deepspeed_checkpoint_engine_loads_safely(engine) -> None:
    """Make the engine's checkpoint engine load weights-only (its own ``load`` unpickles anything).
    ``engine.checkpoint_engine.load(path, map_location)``: deepspeed 0.19.8."""
    if engine.checkpoint_engine is None:  # an engine without optimizer has none
        return

    def load(path: str, map_location=None):
        return load_torch_file(path, map_location=map_location)

    engine.checkpoint_engine.load = load
