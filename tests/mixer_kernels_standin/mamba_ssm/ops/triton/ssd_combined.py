"""``mamba_chunk_scan_combined`` and ``mamba_split_conv1d_scan_combined`` with mamba-ssm's
signatures: ``x`` ``[batch, seqlen, nheads, headdim]``, ``dt`` ``[batch, seqlen, nheads]``,
``A`` ``[nheads]``, ``B, C`` ``[batch, seqlen, ngroups, dstate]``, ``initial_states`` and the
final states ``[batch, nheads, headdim, dstate]``; ``zxbcdt`` is ``[batch, seqlen, 2 * dim +
2 * ngroups * dstate + nheads]`` (gate ``z``, conv input ``xBC``, ``dt``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mamba_ssm


def _reference_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus,
                    dt_limit, return_final_states):
    from transformers.models.bamba import modeling_bamba

    # The module's name for it is transformers' dispatcher (which calls this stand-in); the
    # PyTorch function it wraps is the reference.
    reference = modeling_bamba.mamba2_chunk_scan.__wrapped__
    return reference(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                     initial_states=initial_states, dt_softplus=dt_softplus,
                     dt_limit=dt_limit, return_final_states=return_final_states)


def _refuse_varlen(seq_idx, cu_seqlens=None, return_varlen_states=False) -> None:
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("stand-in: varlen rows (seq_idx, cu_seqlens) are not used "
                                  "by longctx")


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    _refuse_varlen(seq_idx, cu_seqlens, return_varlen_states)
    mamba_ssm.CALLS.append(("chunk_scan", x.shape[0], initial_states is not None))
    result = _reference_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states,
                             dt_softplus, dt_limit, return_final_states)
    out, final = result if return_final_states else (result, None)
    if z is not None:
        out = out * F.silu(z.float())
    return (out, final) if return_final_states else out


def _gated_rms_norm(out, weight, z, eps, group_size, norm_before_gate):
    out, z = out.float(), z.float()
    if not norm_before_gate:
        out = out * F.silu(z)
    grouped = out.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = grouped.flatten(-2) * weight.float()
    return out * F.silu(z) if norm_before_gate else out


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                     chunk_size, initial_states=None, seq_idx=None,
                                     dt_limit=(0.0, float("inf")), return_final_states=False,
                                     activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                     outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    _refuse_varlen(seq_idx)
    if activation not in ("silu", "swish"):
        raise ValueError(f"activation must be silu or swish, got {activation!r}")
    mamba_ssm.CALLS.append(("split_conv1d_scan", zxbcdt.shape[0], initial_states is not None))
    nheads = D.shape[0]
    headdim = headdim if D.dim() == 1 else D.shape[1]
    batch, seqlen, width = zxbcdt.shape
    dim = nheads * headdim
    dstate = (width - 2 * dim - nheads) // ngroups // 2
    z, xbc, dt = zxbcdt.split([dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    kernel = conv1d_weight.shape[-1]
    xbc = F.conv1d(xbc.transpose(1, 2), conv1d_weight.unsqueeze(1), conv1d_bias,
                   padding=kernel - 1, groups=xbc.shape[-1])[..., :seqlen]
    xbc = F.silu(xbc).transpose(1, 2)
    x, B, C = xbc.split([dim, ngroups * dstate, ngroups * dstate], dim=-1)
    result = _reference_scan(
        x.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
        C.unflatten(-1, (ngroups, dstate)), chunk_size, D, dt_bias, initial_states, True,
        dt_limit, return_final_states)
    out, final = result if return_final_states else (result, None)
    out = out.flatten(-2)
    if rmsnorm_weight is None:
        out = out * F.silu(z.float())
    else:
        out = _gated_rms_norm(out, rmsnorm_weight, z, rmsnorm_eps, dim // ngroups,
                              norm_before_gate)
    out = out.to(zxbcdt.dtype)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out
