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
