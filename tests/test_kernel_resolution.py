"""The kernel is decided once per rank: `parallel/kernel.py:resolve_kernel` is the one reader
of the layout's kernel name, every `ParallelState` holds what it resolved, and the fused ops
it names are looked up when they run (a test's stand-in installed later is what runs)."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from longctx_cli.layout import CONCRETE_KERNELS, Layout
from longctx_cli.parallel.features import AttentionFeatures, Segment
from longctx_cli.parallel.kernel import resolve_kernel
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.torch_flash import use_flash_ops
from longctx_cli.parallel.torch_kernel import doc_causal_forward
from tests import torch_flash_standin

PARALLEL = Path(__file__).resolve().parent.parent / "longctx_cli" / "parallel"


def test_every_kernel_resolves_and_states_hold_their_layouts_kernel() -> None:
    for name in CONCRETE_KERNELS:
        state = ParallelState(Layout(kernel=name))
        assert state.kernel is resolve_kernel(name) and state.kernel.name == name
        assert replace(state, sp_rank=0).kernel is state.kernel
    state = ParallelState(Layout(kernel="torch"))
    assert state.with_layout(kernel="cudnn").kernel is resolve_kernel("cudnn")
    assert state == ParallelState(Layout(kernel="torch"))  # the kernel is no extra identity
    with pytest.raises(ValueError, match="unknown attention kernel"):
        resolve_kernel("flex")  # type: ignore[arg-type]


def _names_compared(tree: ast.AST) -> list[str]:
    """Kernel names a module compares anything with (``==``, ``!=``, ``in``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            found += [i.value for i in items
                      if isinstance(i, ast.Constant) and i.value in CONCRETE_KERNELS]
    return found


def test_no_strategy_or_block_function_reads_the_kernel_name() -> None:
    read = {path.name: names for path in sorted(PARALLEL.glob("*.py"))
            if path.name != "kernel.py" and (names := _names_compared(ast.parse(path.read_text())))}
    assert not read, read
    readers = [path.name for path in sorted(PARALLEL.glob("*.py"))
               if "layout.kernel" in path.read_text()]
    assert readers == ["mesh.py"], readers  # where the state resolves its layout's kernel


def test_a_stand_in_installed_after_resolution_is_what_runs() -> None:
    state = ParallelState(Layout(kernel="torch_flash"))  # resolved before the stand-in
    q, k, v = (torch.randn(16, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    previous = use_flash_ops(torch_flash_standin.OPS)
    try:
        before = torch_flash_standin.CALLS["forward"]
        doc_causal_forward(q, k, v, (Segment(0, 16, 0, 16),), AttentionFeatures(0.3),
                           kernel=state.kernel)
        assert torch_flash_standin.CALLS["forward"] == before + 1
    finally:
        use_flash_ops(previous)
