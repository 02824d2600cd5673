"""Byte sizes as users write them.

    >>> parse_bytes("512MiB")
    536870912
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
"""

from __future__ import annotations

GiB = 2**30
MiB = 2**20

_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12, "b": 1, "": 1}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"512MiB"``, ``"1.5e9"`` or ``"4GB"`` -> bytes; ValueError says the accepted forms."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    if unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as bytes; write e.g. 80GiB, 512MiB, 4GB or 1.5e9")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as bytes; write e.g. 80GiB, 512MiB, 4GB or 1.5e9") from None
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Bytes in GiB with two decimals (MiB below one GiB)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"
