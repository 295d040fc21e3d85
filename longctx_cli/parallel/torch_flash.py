"""The ``torch_flash`` kernel: the segment blocks on PyTorch's own flash-attention op (CUDA).

PyTorch ships flash-attention 2 as ``aten._flash_attention_forward/backward`` (the op behind
``torch.nn.attention.varlen.varlen_attn``), so a GPU without the ``flash-attn`` wheel still
gets an O(tokens) attention kernel. The op's varlen form is what the segment decomposition
of :mod:`.block_geometry` needs:

* packed ``[tokens, heads, dim]`` tensors, sequences given by ``cu_seqlens_q/k`` (int32);
* causal masking aligned to the *bottom right* of each sequence (query ``i`` of ``n`` sees
  keys up to ``seqlen_k - n + i``), which is a :class:`~.features.Segment`'s rule;
* ``window_size_left/right`` relative to that diagonal: a sliding window ``W`` is ``(W-1, 0)``
  (passed with ``is_causal=False``, as ``varlen_attn`` does);
* GQA (``Hq`` a multiple of ``Hkv``, query head ``h`` reads KV head ``h // (Hq / Hkv)``);
* the log-sum-exp ``[heads, total_q]`` in float32, and a backward that takes the *merged*
  ``out``/``lse``, so a block's gradients are exact whatever else the rows attended to;
* fp16/bf16 only, one head dim for q, k and v, a multiple of 8 up to 256; no softcap
  argument. (Multi-head latent attention's value head dim differs from q/k's: each call pads
  the smaller side with zeros, :func:`pad_head_dim`.)

One op call covers every segment of a *run*: consecutive segments whose key ranges follow each
other without overlap or gap, so that ``k[k0:k1]`` is their packed keys. A contiguous shard or
a full row is one run; a zigzag shard is two (its second chunk's documents may start in the
first). Runs cover disjoint query rows, so their results need no merge.

What the op cannot take (float32, softcapping, other head dims, CPU tensors) falls back, per
call, to the block paths of :mod:`.torch_kernel` (on CUDA the tiled matmul path); ``validate``
names and budgets that path. Tests point :func:`use_flash_ops` at a CPU stand-in of the two
ops (``tests/torch_flash_standin.py``); library code never patches torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import torch

from longctx_cli.kernel_choice import FLASH_MAX_HEAD_DIM

from .features import AttentionFeatures, Segment

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _aten_supports(q: torch.Tensor) -> bool:
    """What PyTorch's CUDA flash kernel accepts (see the module doc)."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in HALF_DTYPES and d % 8 == 0 and d <= FLASH_MAX_HEAD_DIM


@dataclass(frozen=True)
class FlashOps:
    """The two ops the kernel calls, with the signatures of ``aten._flash_attention_*``.

    ``supports(q)`` says whether ``forward`` can take these queries (dtype, device, head dim).
    """

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    supports: Callable[[torch.Tensor], bool]
    name: str


ATEN_OPS = FlashOps(
    forward=torch.ops.aten._flash_attention_forward,
    backward=torch.ops.aten._flash_attention_backward,
    supports=_aten_supports,
    name="aten._flash_attention_forward/backward",
)
_ops = ATEN_OPS


def flash_ops() -> FlashOps:
    """The ops the ``torch_flash`` kernel calls now."""
    return _ops


def use_flash_ops(ops: FlashOps) -> FlashOps:
    """Point the kernel at other ops (a test stand-in); returns the previous ones."""
    global _ops
    previous, _ops = _ops, ops
    return previous


def flash_applies(q: torch.Tensor, feats: AttentionFeatures, v: torch.Tensor | None = None,
                  ops: FlashOps | None = None) -> bool:
    """True when the op computes this call exactly; otherwise the caller's fallback runs.

    ``v``: the values, when their head dim may differ from q's (multi-head latent
    attention); the op then runs on both padded to the larger one (see :func:`pad_head_dim`).
    ``ops``: the ops with this signature to ask (default: :func:`flash_ops`; the ``fa4``
    kernel passes flash-attn 4's).
    """
    if feats.softcap is not None:
        return False
    d = q.shape[-1] if v is None else max(q.shape[-1], v.shape[-1])
    return (ops or _ops).supports(q if d == q.shape[-1] else q.new_empty(0, 1, d))


def pad_head_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with zero columns appended to its last (head) dimension up to ``dim``.

    The flash ops take one head dim for q, k and v; multi-head latent attention (DeepSeek)
    has a value head dim unlike the q/k one. Padding the smaller side with zeros is exact:
    zero q/k columns add nothing to any score (the scale is always passed explicitly), zero
    value columns give zero output columns, which are cut off; their gradients are dropped.
    """
    extra = dim - x.shape[-1]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, extra))


def _dense(x: torch.Tensor, dim: int) -> torch.Tensor:
    """What the op reads: unit last stride, head dim padded to ``dim``."""
    return pad_head_dim(_rows_dense(x), dim)


class _Run(NamedTuple):
    """One op call: local query rows ``[q0, q1)``, keys ``[k0, k1)``, relative cu_seqlens."""

    q0: int
    q1: int
    k0: int
    k1: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int


@lru_cache(maxsize=256)
def _runs(segments: tuple[Segment, ...]) -> tuple[_Run, ...]:
    """Group consecutive segments whose keys pack into one slice (see the module doc).

    Cached: every layer of a row (and its backward) asks for the same segments.
    """
    runs: list[_Run] = []
    group: list[Segment] = []

    def close() -> None:
        k0 = group[0].k_start
        cu_q, cu_k = [0], [0]
        for s in group:
            cu_q.append(cu_q[-1] + s.q_end - s.q_start)
            cu_k.append(s.k_end - k0)
        runs.append(_Run(
            group[0].q_start, group[-1].q_end, k0, group[-1].k_end, tuple(cu_q), tuple(cu_k),
            max(s.q_end - s.q_start for s in group), max(s.k_end - s.k_start for s in group),
        ))

    for seg in segments:
        if seg.q_end <= seg.q_start:
            continue
        if group and (seg.k_start != group[-1].k_end or seg.q_start != group[-1].q_end):
            close()
            group = []
        group.append(seg)
    if group:
        close()
    return tuple(runs)


@lru_cache(maxsize=256)
def _device_cu(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """cu_seqlens as an int32 tensor on the op's device, built once per row and device."""
    return torch.tensor(values, dtype=torch.int32, device=device)


def _mask_args(feats: AttentionFeatures) -> tuple[bool, int, int]:
    """``(is_causal, window_size_left, window_size_right)`` as ``varlen_attn`` passes them:
    causal is ``(-1, 0)``; a sliding window ``W`` is the local window ``(W - 1, 0)``, which the
    kernel aligns bottom-right like its causal mask."""
    if feats.window is None:
        return True, -1, 0
    return False, feats.window - 1, 0


def _rows_dense(x: torch.Tensor) -> torch.Tensor:
    """The op reads rows with a unit stride in the last dim (head slices are fine)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
    feats: AttentionFeatures,
    ops: FlashOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [Lq, Hq, D]`` and ``lse [Hq, Lq]`` (float32) of every segment, one op call per run
    (``ops``: as in :func:`flash_applies`)."""
    out, lse, _ = varlen_dropout_forward(q, k, v, segments, feats, 0.0, ops)
    return out, lse


def varlen_dropout_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
    feats: AttentionFeatures,
    dropout: float,
    ops: FlashOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
    """:func:`varlen_forward` with the op's own dropout of probability ``dropout``; also
    returns each call's philox seed and offset, which its backward needs to redraw the mask
    (:func:`varlen_backward`'s ``rng_states``)."""
    ops = ops or _ops
    runs = _runs(tuple(segments))
    causal, left, right = _mask_args(feats)
    d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    results, states = [], []
    for run in runs:
        cu_q, cu_k = _device_cu(run.cu_q, q.device), _device_cu(run.cu_k, q.device)
        out, lse, seed, offset, *_ = ops.forward(
            _dense(q[run.q0 : run.q1], d), _dense(k[run.k0 : run.k1], d),
            _dense(v[run.k0 : run.k1], d), cu_q, cu_k, run.max_q, run.max_k, dropout, causal,
            False, scale=feats.scale, window_size_left=left, window_size_right=right,
        )
        results.append((run, out[..., :dv], lse))
        states.append((seed, offset))
    if len(results) == 1 and (results[0][0].q0, results[0][0].q1) == (0, q.shape[0]):
        return results[0][1], results[0][2].float(), tuple(states)  # the op's own tensors
    # Rows no segment covers stay zero (there are none in practice); v's head dim.
    out = torch.zeros((*q.shape[:-1], dv), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for run, o, lo in results:
        out[run.q0 : run.q1] = o
        lse[:, run.q0 : run.q1] = lo
    return out, lse, tuple(states)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, feats: AttentionFeatures,
    ops: FlashOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: ``q [rows, Hq, D]`` against ``k, v [keys, Hkv, D]``, either bottom-right
    causal (the feature's window included) or every key visible (``causal`` False, no window).
    Returns ``out [rows, Hq, D]`` and ``lse [Hq, rows]`` (float32)."""
    mask = _mask_args(feats) if causal else (False, -1, -1)
    d = max(q.shape[-1], v.shape[-1])
    out, lse, *_ = (ops or _ops).forward(
        _dense(q, d), _dense(k, d), _dense(v, d), _device_cu((0, q.shape[0]), q.device),
        _device_cu((0, k.shape[0]), q.device), q.shape[0], k.shape[0], 0.0, mask[0], False,
        scale=feats.scale, window_size_left=mask[1], window_size_right=mask[2],
    )
    return out[..., : v.shape[-1]], lse.float()


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, feats: AttentionFeatures, ops: FlashOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`block_forward`'s block given the rows' merged ``out``/``lse``."""
    mask = _mask_args(feats) if causal else (False, -1, -1)
    d, dqk, dv = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
    gq, gk, gv = (ops or _ops).backward(
        _dense(dout, d), _dense(q, d), _dense(k, d), _dense(v, d), _dense(out, d),
        lse.contiguous(), _device_cu((0, q.shape[0]), q.device),
        _device_cu((0, k.shape[0]), q.device), q.shape[0], k.shape[0], 0.0, mask[0],
        torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device),
        scale=feats.scale, window_size_left=mask[1], window_size_right=mask[2],
    )
    return gq[..., :dqk], gk[..., :dqk], gv[..., :dv]


def varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: Sequence[Segment],
    feats: AttentionFeatures,
    ops: FlashOps | None = None,
    dropout: float = 0.0,
    rng_states: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients given the rows' merged ``out``/``lse``: ``dq`` like q, ``dk``/``dv`` like k/v.
    ``dropout``, ``rng_states``: those of :func:`varlen_dropout_forward`'s calls."""
    ops = ops or _ops
    runs = _runs(tuple(segments))
    causal, left, right = _mask_args(feats)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: never read
    unused = torch.empty(0, device=q.device)
    states = list(rng_states) if dropout else [(rng, unused)] * len(runs)
    single = len(runs) == 1 and (runs[0].q0, runs[0].q1, runs[0].k0, runs[0].k1) == (
        0, q.shape[0], 0, k.shape[0])
    if not single:
        # Runs of a zigzag shard may read the same keys: their dk, dv add up (in k's dtype,
        # as the ring's reduce-scatter adds ranks' partials: no extra float32 buffer).
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d, dqk, dvd = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
    for run, (seed, offset) in zip(runs, states, strict=True):
        rows, keys = slice(run.q0, run.q1), slice(run.k0, run.k1)
        dq1, dk1, dv1 = ops.backward(
            _dense(dout[rows], d), _dense(q[rows], d), _dense(k[keys], d),
            _dense(v[keys], d), _dense(out[rows], d), lse[:, rows].contiguous(),
            _device_cu(run.cu_q, q.device), _device_cu(run.cu_k, q.device), run.max_q,
            run.max_k, dropout, causal, seed, offset, scale=feats.scale,
            window_size_left=left, window_size_right=right,
        )
        dq1, dk1, dv1 = dq1[..., :dqk], dk1[..., :dqk], dv1[..., :dvd]
        if single:
            return dq1, dk1, dv1
        dq[rows] = dq1
        dk[keys] += dk1
        dv[keys] += dv1
    return dq, dk, dv
