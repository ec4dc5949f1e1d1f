"""Byte sizes as people write them ("24GiB", "1.5 GB", "512MiB", "100") and back.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024 and SI units (kB, MB, GB, TB)
powers of 1000, as the IEC standard says; a bare K/M/G/T is binary, because that is
what GPU users mean by "80G".  format_size mirrors the C extension's formatting so
that error messages and CLI output look alike.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["parse_size", "format_size", "has_unit"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
    "p": 1 << 50,
    "pib": 1 << 50,
    "pb": 10**15,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*$", re.ASCII)


def parse_size(text) -> int:
    """Return the number of bytes `text` names.

    Accepts a non-negative int, or a string: a number (integer or decimal, optional
    exponent) and an optional unit (B, K/KiB/kB, M/MiB/MB, G/GiB/GB, T/TiB/TB,
    P/PiB/PB; case-insensitive).  Fractions of a byte round to the nearest byte.
    Raises ValueError for anything else (negative numbers, junk, unknown units).
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r} (expected an int or a string such as '24GiB')")
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. '24GiB', '1.5 GB', '512MiB' or '100')")
    number, exponent, unit = m.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB)")
    value = Fraction(number)
    if exponent:
        e = int(exponent)
        if abs(e) > 30:
            raise ValueError(f"size exponent out of range in {text!r}")
        value *= Fraction(10) ** e
    return round(value * scale)


def has_unit(text) -> bool:
    """Whether a size string names its unit ("24GiB", "100B"); a bare "24" or "1.5" does not."""
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    return bool(m and m.group(3))


def format_size(n: int) -> str:
    """Format a byte count the way gpumem's messages do: '512 B', '1.50 GiB'."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format_size needs an int, not {type(n).__name__}")
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} B"
    value = n / 1024.0
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024.0:
            return f"{sign}{value:.2f} {unit}"
        value /= 1024.0
    return f"{sign}{value:.2f} PiB"
