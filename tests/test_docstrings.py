"""Every public class of distrain's API has a docstring, and so does every public method and property it defines:
docs/api.md renders them (mkdocstrings). An override of a documented method inherits its base's docstring
(``inspect.getdoc``), so it needs one of its own only where it behaves differently."""

import dataclasses
import functools
import inspect

import distrain
from distrain.strategies.fault_tolerant import TorchFTStrategy


def _public_classes() -> list[type]:
    classes = [getattr(distrain, name) for name in dir(distrain) if not name.startswith("_")]
    return [cls for cls in classes if inspect.isclass(cls)] + [TorchFTStrategy]


def _doc(cls: type, name: str, value) -> str | None:
    """``inspect.getdoc`` of the attribute, else that of the same name in a base class: a lambda defined in the class
    body (``on_exception = lambda ...``) inherits its base's docstring as a ``def`` would."""
    if isinstance(value, (property, functools.cached_property)):
        doc = inspect.getdoc(value)
    else:
        doc = inspect.getdoc(getattr(cls, name))
    for base in cls.__mro__[1:]:
        if doc or name not in vars(base):
            continue
        doc = inspect.getdoc(vars(base)[name]) if isinstance(vars(base)[name], property) else None
        doc = doc or inspect.getdoc(getattr(base, name))
    return doc


def _missing(cls: type) -> list[str]:
    doc = cls.__dict__.get("__doc__")
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if fields and doc and doc.startswith(f"{cls.__name__}("):  # the signature a dataclass writes when it has none
        doc = None
    missing = [] if doc else [cls.__qualname__]
    for name, value in vars(cls).items():
        if name in fields:  # a field's default (a function, for PipelineSplit.context): documented as a field
            continue
        callable_kind = inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))
        if name.startswith("_") or not (callable_kind or isinstance(value, (property, functools.cached_property))):
            continue
        if not _doc(cls, name, value):
            missing.append(f"{cls.__qualname__}.{name}")
    return missing


def test_the_public_classes_are_found():
    names = {cls.__name__ for cls in _public_classes()}
    assert {"Trainer", "Module", "Strategy", "Callback", "RunConfig", "TorchFTStrategy"} <= names


def test_every_public_class_method_and_property_has_a_docstring():
    missing = [name for cls in _public_classes() for name in _missing(cls)]
    assert not missing, f"{len(missing)} without a docstring:\n" + "\n".join(missing)
