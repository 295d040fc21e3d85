"""The user's own Python code a config names (`module.function`): GRPO reward functions and
Axolotl's dataset transforms. Imported from the config file's folder first, then the Python
path, as Axolotl resolves them; a name that does not import is one paragraph, not a trace."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from longctx_cli.errors import UserError


def resolve_callable(name: str, config_dir: str | None, where: str) -> Callable:
    """The function `module.function` names; `where` is the key that named it."""
    module_name, _, attr = name.rpartition(".")
    added = config_dir is not None and config_dir not in sys.path
    if added:
        sys.path.insert(0, config_dir)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        folder = f" (looked in {config_dir} and the Python path)" if config_dir else ""
        raise UserError(
            f"`{name}` does not import: {type(e).__name__}: {e}{folder}.",
            where=where,
            fix=f"put `{module_name.replace('.', '/')}.py` beside the config file (or on "
            "PYTHONPATH) and check that it imports on its own: `python -c 'import "
            f"{module_name}'`.",
        ) from None
    finally:
        if added:
            sys.path.remove(config_dir)
    function = getattr(module, attr, None)
    if not callable(function):
        raise UserError(
            f"`{name}`: module `{module_name}` ({getattr(module, '__file__', '?')}) has no "
            f"function `{attr}`.",
            where=where, fix="check the function's name.",
        )
    return function


def source_digest(name: str, config_dir: str | None) -> str | None:
    """A digest of the file that defines `module.function` (None where it cannot be found
    without importing it), so that editing a transform rebuilds the prepared prompts."""
    import hashlib

    module_name = name.rpartition(".")[0]
    relative = Path(*module_name.split("."))
    for base in ([Path(config_dir)] if config_dir else []) + [Path(p) for p in sys.path if p]:
        for candidate in (base / relative.with_suffix(".py"), base / relative / "__init__.py"):
            if candidate.is_file():
                return hashlib.sha256(candidate.read_bytes()).hexdigest()[:16]
    return None
