"""``selective_scan_fn`` (Mamba's selective scan, CUDA only) with mamba-ssm's signature:
``u`` and ``delta`` ``[batch, dim, seqlen]``, ``A`` ``[dim, dstate]``, ``B, C`` ``[batch,
dstate, seqlen]``; it computes with transformers' own PyTorch reference (Jamba's)."""

from __future__ import annotations

import mamba_ssm


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                      delta_softplus=False, return_last_state=False):
    from transformers.models.jamba import modeling_jamba

    mamba_ssm.CALLS.append(("selective_scan", u.shape[0], False))
    reference = modeling_jamba.mamba_selective_scan.__wrapped__
    return reference(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                     delta_softplus=delta_softplus, return_last_state=return_last_state)


def mamba_inner_fn(*args, **kwargs):
    raise NotImplementedError("stand-in: transformers' Jamba does not call the fused path")
