"""Units: parsing ``80GB``; printing bytes, seconds and rates. Outside the planner, which imports torch: the
config parses sizes without it."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int | float) -> int:
    """``80GB``, ``80G``, ``80GiB``, ``512MB``, ``1TB``, or a number of bytes. Binary units (as
    ``nvidia-smi`` and PyTorch report memory: an "80 GB" GPU holds 80 GiB)."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"not a memory size: {text!r} (examples: 80GB, 512MB, 1TB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_size(n: float, unit: str = "GiB") -> str:
    value = n / {"GiB": 2**30, "MiB": 2**20}[unit]
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def human(n: float) -> str:
    """``48.9 MiB``, ``1.5 GiB``, ``117 GiB``."""
    unit = "GiB" if n >= 2**30 else "MiB"
    return f"{format_size(n, unit)} {unit}"


def cell(n: float) -> str:
    """A table cell: ``48.9M``, ``1.5G``, ``117G``."""
    if n == 0:
        return "0"
    unit = "GiB" if n >= 2**30 else "MiB"
    return format_size(n, unit) + unit[0]


def format_seconds(s: float) -> str:
    """``850 ms``, ``2.6 s``, ``41 s``."""
    if s < 1:
        return f"{s * 1000:.0f} ms" if s >= 0.01 else f"{s * 1000:.1f} ms"
    return f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def format_rate(n: float) -> str:
    """``850``, ``12.3k``, ``4.5M``."""
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"
