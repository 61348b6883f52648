"""Sizes as users write them (``"4GiB"``, ``"500MB"``, a byte count): torch-free, for ``kvx node`` too."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: Any) -> int:
    """``4GiB``, ``512MiB``, ``1.5GB``, ``1000000`` -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '4GiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value):
        n = int(value)  # str() would give '1e+16', which the pattern below rejects
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"expected a size like '4GiB', '500MB' or a byte count, got {value!r}")
        # exact decimal arithmetic: float('4.1') * 10**9 is 4099999999.9999995, i.e. one byte short
        n = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"expected a positive size, got {value!r}")
    return n
