"""A Lightning name this namespace does not have is refused where it is imported, in one line that says so."""

from __future__ import annotations

from collections.abc import Callable


def refusing(module: str, instead: str = "") -> Callable[[str], object]:
    """A module's ``__getattr__``: an ImportError naming the missing Lightning name, and ``instead``, what does its
    work under distrain (Python's own attributes, such as ``__path__``, stay plain AttributeErrors: the import
    machinery asks for them)."""

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        why = f": {instead}" if instead else ""
        raise ImportError(
            f"{module}.{name}: distrain has no counterpart of Lightning's {name}{why} (docs/migrating.md)"
        )

    return __getattr__
