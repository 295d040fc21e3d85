"""Test-only stand-in for the `flash_attn` package, written with plain PyTorch.

It provides just the private kernel entry points that `ring_flash_attn` imports, with the
signatures and return conventions of flash-attn 2.7, so that ring-flash-attn's real Python
code can run on CPU. Only tests put this directory on ``sys.path``.
"""

__version__ = "0.0.0+standin"

from .flash_attn_interface import flash_attn_varlen_func

__all__ = ["flash_attn_varlen_func"]
