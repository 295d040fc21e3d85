"""The GPU install route: the `gpu` extra resolves without building anything (CI installs it
through `dev`), and the default GPU path (PyTorch's flash op) imports neither flash-attn nor
ring-flash-attn."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

from tests.test_flash_adapter import STANDIN


def _extra(name: str) -> list[Requirement]:
    reqs = [Requirement(r) for r in requires("longctx") or []]
    return [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": name})]


def test_the_gpu_extra_installs_without_a_build() -> None:
    gpu = {r.name: r for r in _extra("gpu")}
    # flash-attn is an sdist whose setup.py imports torch: under pip's build isolation it
    # cannot build, so it must never be a requirement of an extra (docs/gpu.md installs it).
    assert "flash-attn" not in gpu and "flash_attn" not in gpu
    assert str(gpu["ring-flash-attn"].specifier) == "==0.1.8"  # the version its adapter fits
    assert any(r.name == "longctx" and "gpu" in r.extras for r in _extra("dev"))


# flash_attn (the stand-in) and ring_flash_attn are importable in this process. Every import
# of either made by longctx's own code (an `import` statement or importlib.import_module
# called from a longctx_cli frame, cached or not) is recorded; transformers may import
# flash_attn itself when it finds it, which is not longctx's path.
DEFAULT_PATH = """
import builtins, importlib, sys
sys.path.insert(0, STANDIN)
seen = []
def _watch(name, frame):
    if name.split(".")[0] in ("flash_attn", "ring_flash_attn"):
        if "longctx_cli" in frame.f_code.co_filename:
            seen.append(name + " from " + frame.f_code.co_filename)
_import, _import_module = builtins.__import__, importlib.import_module
def watched_import(name, *args, **kwargs):
    _watch(name, sys._getframe(1))
    return _import(name, *args, **kwargs)
def watched_import_module(name, *args, **kwargs):
    _watch(name, sys._getframe(1))
    return _import_module(name, *args, **kwargs)
builtins.__import__, importlib.import_module = watched_import, watched_import_module
import torch
from longctx_cli.kernel_choice import Platform
from longctx_cli.parallel import AttentionFeatures, shard_batch, sp_attention
from longctx_cli.layout import Layout
from longctx_cli.parallel.mesh import ParallelState
import longctx_cli.parallel.ring, longctx_cli.parallel.ulysses, longctx_cli.parallel.ulysses_ring
import longctx_cli.parallel.ring_p2p, longctx_cli.runtime.model, longctx_cli.train.loop
Platform.detect()
state = ParallelState(Layout(kernel="torch_flash"))
pos = torch.cat([torch.arange(5), torch.arange(11)])
meta = shard_batch(pos, pos, pos, state).sp_meta
q, k, v = (torch.randn(16, 2, 8, dtype=torch.bfloat16) for _ in range(3))
out = sp_attention(q, k, v, meta, AttentionFeatures(scale=0.35))
assert out.shape == q.shape
print("ok", seen)
"""


def test_the_default_gpu_path_imports_no_flash_package() -> None:
    code = DEFAULT_PATH.replace("STANDIN", repr(STANDIN))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok []"
