"""Sizes as the plan counts and prints them."""

from __future__ import annotations

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def format_count(n: int) -> str:
    """A parameter count as the plan prints it: 135M, 20.4K."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def format_gib(n: int) -> str:
    if n < GIB:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / GIB:.2f} GiB" if n < 10 * GIB else f"{n / GIB:.1f} GiB"


_SIZE_UNITS = {
    "b": 1, "kib": 1024, "mib": 1024**2, "gib": GIB, "tib": 1024**4,
    "k": 1024, "m": 1024**2, "g": GIB, "t": 1024**4,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def memory_size(text: str) -> int | None:
    """Bytes in "80GiB", "80G" (binary), "80GB" (decimal), "512MiB" or a plain byte count;
    None: not a memory size."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):] or "b"
    try:
        value = float(number)
    except ValueError:
        return None
    if unit not in _SIZE_UNITS or value <= 0:
        return None
    return int(value * _SIZE_UNITS[unit])
