"""The ``cudnn`` kernel: the segment blocks on PyTorch's own cuDNN attention ops (CUDA).

PyTorch ships cuDNN's fused attention as two pairs of ops (no extra package):

* dense ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``): ``[B, H, S, D]``
  tensors (any strides with a unit last one: our ``[S, H, D]`` rows are passed as the
  ``[1, H, S, D]`` view ``x.transpose(0, 1)[None]``), GQA by fewer KV heads, log-sum-exp
  ``[B, H, S_q, 1]`` float32; used for a block of one document;
* ragged ``aten._cudnn_attention_forward`` / ``_cudnn_attention_backward`` with int32
  cumulative sequence lengths over packed ``[tokens, H, D]`` tensors; used for the blocks of
  a packed row. Its log-sum-exp is ``[H, total_q]`` in recent PyTorch (``MHA.cpp``: "cuDNN
  wants T, H, 1, but torch/FA convention is H, T") and ``[total_q, H, 1]`` in older ones: the
  forward's layout is kept and the backward is handed the merged one in that layout.

The facts this module relies on, read in PyTorch's source (torch 2.13 schemas from
``torch.ops.aten.<op>.default._schema``; ``aten/src/ATen/native/cudnn/MHA.cpp``,
``transformers/cuda/attention_backward.cu``, ``transformers/cuda/sdp_utils.cpp``,
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``,
``torch/nn/attention/varlen.py``):

* causal is **top-left** aligned in both forms (``set_causal_mask(is_causal)`` /
  ``CausalMask::TOP_LEFT``; bottom-right only with a KV cache, ``seqused_k``), unlike the flash
  op. So every causal call here is a square: a segment is cut into its diagonal square
  (causal, where top-left and bottom-right agree) and the keys before it (no mask), merged
  through the log-sum-exp, as PyTorch's own ring CP does (``is_causal`` only on the diagonal
  step, ``_SDPAMerger`` merging the cuDNN ``[.., 1]`` log-sum-exp like flash's);
* the log-sum-exp is natural-log, float32, and the backward takes any (merged) ``out`` and
  log-sum-exp; ``scale`` is passed explicitly; no window or softcap argument exists (torch's
  ``varlen_attn`` raises on windows for its cuDNN backend), so ``kernel_choice`` refuses those
  models and :func:`applies` sends such calls elsewhere;
* the dense backward reads the sequence lengths from its ``max_q``/``max_k`` arguments (so
  they are the block's true lengths); undefined tensors (``attn_bias``, ``cum_seq_*`` of the
  dense form) are passed as ``None``; dropout is off, so the philox tensors are never read;
* SDPA's cuDNN gate refuses key length 1 (``check_cudnn_tensor_shapes``), so one-key blocks
  (one-token documents) are computed here directly, exactly: the row's output is that key's
  value and its log-sum-exp the one score; and ``MHA.cpp`` refuses one query row (the decode
  shape, ``check_cudnn_sdpa_decode``) for some cuDNN versions on Blackwell, so a block of one
  row (a document's single row on this rank, against the keys before it) runs on PyTorch's
  flash op (:mod:`.torch_flash`, which runs wherever this kernel is allowed);
* ragged offsets are int32 (``check_ragged_offset_capacity``): a batch whose packed extent
  would not fit runs as one dense call per document;
* the ragged **backward** is the least travelled of the four: SDPA's gate says cuDNN's nested
  path "does not support backward", torch 2.13's ``varlen_attn`` keeps its cuDNN path off and
  passes that op's arguments in the flash op's order, and in the ``attention_backward.cu``
  read the nested branch sizes its graph from ``query.size(2)`` (the head dim of a packed
  ``[T, H, D]`` query) rather than ``max_q``/``max_k``. So packed rows run the ragged
  forward and, by default, the dense backward per document (the same merged out/lse, so the
  same gradients); :func:`use_ragged_backward` switches the ragged backward on, and
  ``benchmarks/gpu.py`` checks and times both on a GPU.

Tests point :func:`use_cudnn_ops` at a CPU stand-in (``tests/cudnn_standin.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import torch

from .features import AttentionFeatures, Segment
from .torch_flash import HALF_DTYPES, _device_cu, _rows_dense, pad_head_dim
from .torch_flash import block_backward as flash_block_backward
from .torch_flash import block_forward as flash_block_forward

CUDNN_MAX_HEAD_DIM = 256
INT32_MAX = 2**31 - 1


def _aten_supports(q: torch.Tensor) -> bool:
    """What the ops take at all (``kernel_choice`` checks the GPU, cuDNN version and limits)."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in HALF_DTYPES and d % 8 == 0 and d <= CUDNN_MAX_HEAD_DIM


@dataclass(frozen=True)
class CudnnOps:
    """The four ops the kernel calls, with the signatures of PyTorch's cuDNN attention ops."""

    dense_forward: Callable[..., Any]
    dense_backward: Callable[..., Any]
    ragged_forward: Callable[..., Any]
    ragged_backward: Callable[..., Any]
    supports: Callable[[torch.Tensor], bool]
    name: str


ATEN_OPS = CudnnOps(
    dense_forward=torch.ops.aten._scaled_dot_product_cudnn_attention,
    dense_backward=torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
    ragged_forward=torch.ops.aten._cudnn_attention_forward,
    ragged_backward=torch.ops.aten._cudnn_attention_backward,
    supports=_aten_supports,
    name="aten._scaled_dot_product_cudnn_attention / aten._cudnn_attention_forward",
)
_ops = ATEN_OPS
_ragged_lse_3d = False  # the ragged forward's log-sum-exp came as [T, H, 1] (older PyTorch)
# The ragged backward op is off by default: packed rows' backward runs the dense backward per
# document (exact with the ragged forward's merged out/lse). See the module doc.
_ragged_backward = False


def cudnn_ops() -> CudnnOps:
    return _ops


def use_ragged_backward(on: bool) -> bool:
    """Run packed rows' backward on the ragged op (``on``) or per document on the dense one;
    returns the previous setting (``benchmarks/gpu.py`` measures both; tests run both)."""
    global _ragged_backward
    previous, _ragged_backward = _ragged_backward, on
    return previous


def use_cudnn_ops(ops: CudnnOps) -> CudnnOps:
    """Point the kernel at other ops (a test stand-in); returns the previous ones."""
    global _ops
    previous, _ops = _ops, ops
    return previous


def applies(q: torch.Tensor, feats: AttentionFeatures, v: torch.Tensor | None = None) -> bool:
    """True when the cuDNN ops compute this call exactly (no window, no softcap)."""
    if feats.softcap is not None or feats.window is not None:
        return False
    d = q.shape[-1] if v is None else max(q.shape[-1], v.shape[-1])
    return _ops.supports(q if d == q.shape[-1] else q.new_empty(0, 1, d))


class _Batch(NamedTuple):
    """One op call: rows ``[q0, q1)`` against keys ``[k0, k1)``, sequences by relative
    ``cu_q``/``cu_k``; ``causal`` batches hold squares only."""

    causal: bool
    q0: int
    q1: int
    k0: int
    k1: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]


class _Single(NamedTuple):
    """Rows ``[q0, q1)`` that see exactly one key of this block, ``key``."""

    q0: int
    q1: int
    key: int


class _Plan(NamedTuple):
    diagonal: tuple[_Batch | _Single, ...]  # covers every row once
    before: tuple[_Batch | _Single, ...]  # keys before each diagonal: merged into the rows


def _pieces(pieces: list[tuple[int, int, int, int]], causal: bool) -> tuple[_Batch | _Single,
                                                                              ...]:
    """Pieces ``(q0, q1, k0, k1)`` in row order grouped into batches whose rows and keys each
    follow on without a gap (one op call); one-key pieces become :class:`_Single`."""
    out: list[_Batch | _Single] = []
    group: list[tuple[int, int, int, int]] = []

    def close() -> None:
        if group:
            cu_q, cu_k = [0], [0]
            for a, b, c, d in group:
                cu_q.append(cu_q[-1] + b - a)
                cu_k.append(cu_k[-1] + d - c)
            out.append(_Batch(causal, group[0][0], group[-1][1], group[0][2], group[-1][3],
                              tuple(cu_q), tuple(cu_k)))
            group.clear()

    for piece in pieces:
        q0, q1, k0, k1 = piece
        if k1 - k0 == 1:
            close()
            out.append(_Single(q0, q1, k0))
            continue
        if group and (q0 != group[-1][1] or k0 != group[-1][3]):
            close()
        group.append(piece)
    close()
    return tuple(out)


@lru_cache(maxsize=256)
def _plan(segments: tuple[Segment, ...]) -> _Plan:
    """Each segment as its diagonal square (causal) and the keys before it (no mask)."""
    diagonal, before = [], []
    for s in segments:
        n = s.q_end - s.q_start
        if n <= 0:
            continue
        diag = s.k_end - n
        if diag < s.k_start:
            raise ValueError(f"segment {s} has more query rows than keys")
        diagonal.append((s.q_start, s.q_end, diag, s.k_end))
        if diag > s.k_start:
            before.append((s.q_start, s.q_end, s.k_start, diag))
    return _Plan(_pieces(diagonal, True), _pieces(before, False))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[S, H, D]`` -> the ``[1, H, S, D]`` view the dense ops take."""
    return x.transpose(0, 1).unsqueeze(0)


def _fits_int32(*tensors: torch.Tensor) -> bool:
    return all(t.shape[0] * t.stride(0) <= INT32_MAX for t in tensors)


def _lse_ht(lse: torch.Tensor, heads: int, rows: int, ragged: bool) -> torch.Tensor:
    """The ops' log-sum-exp as ``[H, rows]`` float32: dense ``[1, H, S, 1]``; ragged
    ``[H, T]``, or ``[T, H, 1]`` in older PyTorch (remembered for the backward)."""
    global _ragged_lse_3d
    if not ragged:
        return lse.reshape(heads, rows).float()
    _ragged_lse_3d = lse.dim() == 3  # one PyTorch per process: the last forward's layout
    return (lse[..., 0].transpose(0, 1) if _ragged_lse_3d else lse).float()


def _empty_rng(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def _dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.shape[0] == 1:  # the decode shape: see the module doc
        return flash_block_forward(q, k, v, causal, AttentionFeatures(scale))
    out, lse, *_ = _ops.dense_forward(_bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal,
                                      False, scale=scale)
    return out[0].transpose(0, 1), _lse_ht(lse, q.shape[1], q.shape[0], ragged=False)


def _dense_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.shape[0] == 1:
        return flash_block_backward(dout, q, k, v, out, lse, causal, AttentionFeatures(scale))
    lse4 = lse.reshape(1, *lse.shape, 1).contiguous()
    rng = _empty_rng(q.device)
    gq, gk, gv = _ops.dense_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse4, rng, rng, None, None, None,
        q.shape[0], k.shape[0], 0.0, causal, scale=scale,
    )
    return gq[0].transpose(0, 1), gk[0].transpose(0, 1), gv[0].transpose(0, 1)


def _one_row_each(b: _Batch) -> bool:
    """Every sequence of the batch has one query row (the ragged op's decode shape)."""
    return all(bq - aq == 1 for aq, bq in zip(b.cu_q[:-1], b.cu_q[1:], strict=True))


def _batch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: _Batch, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [rows, H, D]`` (q's dtype) and ``lse [H, rows]`` of one batch."""
    qs, ks, vs = q[b.q0 : b.q1], k[b.k0 : b.k1], v[b.k0 : b.k1]
    if len(b.cu_q) == 2 or _one_row_each(b) or not _fits_int32(qs, ks, vs):
        parts = [_dense_forward(qs[qa:qb], ks[ka:kb], vs[ka:kb], b.causal, scale)
                 for qa, qb, ka, kb in zip(b.cu_q[:-1], b.cu_q[1:], b.cu_k[:-1], b.cu_k[1:],
                                           strict=True)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([o for o, _ in parts]), torch.cat([lo for _, lo in parts], dim=1)
    out, lse, *_ = _ops.ragged_forward(
        qs, ks, vs, None, _device_cu(b.cu_q, q.device), _device_cu(b.cu_k, q.device),
        max(np - na for na, np in zip(b.cu_q[:-1], b.cu_q[1:], strict=True)),
        max(np - na for na, np in zip(b.cu_k[:-1], b.cu_k[1:], strict=True)),
        True, 0.0, b.causal, False, scale=scale,
    )
    return out, _lse_ht(lse, q.shape[1], qs.shape[0], ragged=True)


def _batch_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, b: _Batch, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, keys = slice(b.q0, b.q1), slice(b.k0, b.k1)
    qs, ks, vs, os_, ds = q[rows], k[keys], v[keys], out[rows], dout[rows]
    ls = lse[:, rows]
    if (len(b.cu_q) == 2 or not _ragged_backward or _one_row_each(b)
            or not _fits_int32(qs, ks, vs, os_, ds)):
        grads = [_dense_backward(ds[qa:qb], qs[qa:qb], ks[ka:kb], vs[ka:kb], os_[qa:qb],
                                 ls[:, qa:qb], b.causal, scale)
                 for qa, qb, ka, kb in zip(b.cu_q[:-1], b.cu_q[1:], b.cu_k[:-1], b.cu_k[1:],
                                           strict=True)]
        if len(grads) == 1:
            return grads[0]
        return tuple(torch.cat([g[i] for g in grads]) for i in range(3))  # type: ignore[return-value]
    native = ls.transpose(0, 1).unsqueeze(-1).contiguous() if _ragged_lse_3d else ls.contiguous()
    rng = _empty_rng(q.device)
    cu_q, cu_k = _device_cu(b.cu_q, q.device), _device_cu(b.cu_k, q.device)
    gq, gk, gv = _ops.ragged_backward(
        ds, qs, ks, vs, os_, native, rng, rng, None, cu_q, cu_k,
        max(np - na for na, np in zip(b.cu_q[:-1], b.cu_q[1:], strict=True)),
        max(np - na for na, np in zip(b.cu_k[:-1], b.cu_k[1:], strict=True)),
        0.0, b.causal, scale=scale,
    )
    return gq, gk, gv


def _single_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: _Single,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that see one key: output = its value, log-sum-exp = the one score (exact)."""
    groups = q.shape[1] // k.shape[1]
    key = k[s.key].repeat_interleave(groups, 0).float()  # [Hq, D]
    val = v[s.key].repeat_interleave(groups, 0)
    lse = (q[s.q0 : s.q1].float() * key).sum(-1).transpose(0, 1) * scale  # [Hq, rows]
    return val.expand(s.q1 - s.q0, *val.shape).to(q.dtype), lse


def _single_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, s: _Single, scale: float,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one-key rows given the merged ``out``/``lse`` (as the ops compute them:
    ``p = exp(s - lse)``, ``ds = p (dO . v - dO . out)``)."""
    hq, hk = q.shape[1], k.shape[1]
    groups = hq // hk
    rows = slice(s.q0, s.q1)
    qs, do, os_ = q[rows].float(), dout[rows].float(), out[rows].float()
    key = k[s.key].repeat_interleave(groups, 0).float()
    val = v[s.key].repeat_interleave(groups, 0).float()
    score = (qs * key).sum(-1) * scale  # [rows, Hq]
    p = torch.exp(score - lse[:, rows].transpose(0, 1))
    ds = p * ((do * val).sum(-1) - (do * os_).sum(-1)) * scale
    dq = ds[..., None] * key
    dk = (ds[..., None] * qs).sum(0).view(hk, groups, -1).sum(1)
    dv = (p[..., None] * do).sum(0).view(hk, groups, -1).sum(1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor,
           lo: torch.Tensor) -> None:
    """Merge ``o``/``lo`` (over other keys) into ``out``/``lse`` rows in place (float32)."""
    l1 = lse[:, rows]
    new = torch.logaddexp(l1, lo)
    w1 = torch.exp(l1 - new).transpose(0, 1)[..., None]
    w2 = torch.exp(lo - new).transpose(0, 1)[..., None]
    out[rows] = out[rows] * w1 + o.float() * w2
    lse[:, rows] = new


def _forward_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if (len(plan.diagonal) == 1 and not plan.before and isinstance(plan.diagonal[0], _Batch)
            and (plan.diagonal[0].q0, plan.diagonal[0].q1) == (0, q.shape[0])):
        return _batch_forward(q, k, v, plan.diagonal[0], scale)  # the op's own tensors
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for part in (*plan.diagonal, *plan.before):
        if isinstance(part, _Single):
            o, lo = _single_forward(q, k, v, part, scale)
        else:
            o, lo = _batch_forward(q, k, v, part, scale)
        _merge(out, lse, slice(part.q0, part.q1), o, lo)
    return out.to(q.dtype), lse


def _backward_plan(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, plan: _Plan, scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = (*plan.diagonal, *plan.before)
    if (len(parts) == 1 and isinstance(parts[0], _Batch)
            and (parts[0].q0, parts[0].q1, parts[0].k0, parts[0].k1)
            == (0, q.shape[0], 0, k.shape[0])):
        return _batch_backward(dout, q, k, v, out, lse, parts[0], scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for part in parts:
        if isinstance(part, _Single):
            g = _single_backward(dout, q, k, v, out, lse, part, scale)
            dq[part.q0 : part.q1] += g[0]
            dk[part.key] += g[1]
            dv[part.key] += g[2]
            continue
        gq, gk, gv = _batch_backward(dout, q, k, v, out, lse, part, scale)
        dq[part.q0 : part.q1] += gq
        dk[part.k0 : part.k1] += gk
        dv[part.k0 : part.k1] += gv
    return dq, dk, dv


def _prepared(*xs: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """What the ops read: unit last stride, one head dim for q, k and v (MLA: zero-padded)."""
    return [pad_head_dim(_rows_dense(x), dim) for x in xs]


def varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
    feats: AttentionFeatures,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [Lq, Hq, Dv]`` and ``lse [Hq, Lq]`` (float32) of every segment."""
    d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    qd, kd, vd = _prepared(q, k, v, dim=d)
    out, lse = _forward_plan(qd, kd, vd, _plan(tuple(segments)), feats.scale)
    return out[..., :dv], lse


def varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, segments: Sequence[Segment], feats: AttentionFeatures,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients given the rows' merged ``out``/``lse``: ``dq`` like q, ``dk``/``dv`` like k/v."""
    d, dqk, dvd = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
    do, qd, kd, vd, od = _prepared(dout, q, k, v, out, dim=d)
    gq, gk, gv = _backward_plan(do, qd, kd, vd, od, lse, _plan(tuple(segments)), feats.scale)
    return gq[..., :dqk], gk[..., :dqk], gv[..., :dvd]


def _causal_block(rows: int, keys: int) -> tuple[Segment, ...]:
    """A bottom-right causal block as its one segment."""
    if keys < rows:
        raise ValueError(f"a causal block with {rows} rows needs at least as many keys")
    return (Segment(0, rows, 0, keys),)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, feats: AttentionFeatures
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: ``q [rows, Hq, D]`` against ``k, v [keys, Hkv, D]``, bottom-right causal or
    every key visible. Returns ``out [rows, Hq, Dv]`` and ``lse [Hq, rows]`` (float32)."""
    if causal:
        return varlen_forward(q, k, v, _causal_block(q.shape[0], k.shape[0]), feats)
    d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    qd, kd, vd = _prepared(q, k, v, dim=d)
    part = (_Single(0, q.shape[0], 0) if k.shape[0] == 1 else
            _Batch(False, 0, q.shape[0], 0, k.shape[0], (0, q.shape[0]), (0, k.shape[0])))
    if isinstance(part, _Single):
        o, lo = _single_forward(qd, kd, vd, part, feats.scale)
    else:
        o, lo = _batch_forward(qd, kd, vd, part, feats.scale)
    return o[..., :dv], lo


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, feats: AttentionFeatures,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`block_forward`'s block given the rows' merged ``out``/``lse``."""
    if causal:
        return varlen_backward(dout, q, k, v, out, lse, _causal_block(q.shape[0], k.shape[0]),
                               feats)
    d, dqk, dvd = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
    do, qd, kd, vd, od = _prepared(dout, q, k, v, out, dim=d)
    if k.shape[0] == 1:
        gq, gk, gv = _single_backward(do, qd, kd, vd, od, lse, _Single(0, q.shape[0], 0),
                                      feats.scale)
        gk, gv = gk[None], gv[None]
    else:
        gq, gk, gv = _batch_backward(
            do, qd, kd, vd, od, lse,
            _Batch(False, 0, q.shape[0], 0, k.shape[0], (0, q.shape[0]), (0, k.shape[0])),
            feats.scale)
    return gq[..., :dqk], gk[..., :dqk], gv[..., :dvd]
