"""The small JSON files the planner keeps between starts (``cache.py``'s decisions, ``machine.py``'s rates,
``timing.py``'s links): read as untrusted bytes (JSON only, at most a bound; the caller checks every field), written
whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: Path, max_bytes: int) -> Any:
    """The JSON value in ``path``, or None: no file, more than ``max_bytes``, or not JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
        return json.loads(raw) if len(raw) <= max_bytes else None
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: Any) -> bool:
    """Replace ``path`` with ``value`` at once (a reader never sees half a file); best effort: a read-only home only
    costs the next start what the file would have saved (False)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        return False
    return True
