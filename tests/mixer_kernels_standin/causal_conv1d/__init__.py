"""A CPU stand-in for the `causal-conv1d` package (CUDA only), with its entry points'
signatures and semantics: ``x`` is ``[batch, dim, seqlen]``, ``weight`` ``[dim, width]``,
the convolution is causal and depthwise, ``activation`` is None, "silu" or "swish".

transformers uses the package when it can import it (its hub-kernel fallback), so a test
that puts this directory first on ``sys.path`` runs the models' conv layers through the
package's interface. ``CALLS`` records the batch size of every call. Features longctx does
not use (``seq_idx``, initial/final states) raise: longctx keeps documents apart by giving
each its own batch row."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS: list[int] = []


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(out)
    if activation is not None:
        raise ValueError(f"activation must be None, silu or swish, got {activation!r}")
    return out


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    if seq_idx is not None or initial_states is not None or return_final_states:
        raise NotImplementedError("stand-in: seq_idx and conv states are not used by longctx")
    CALLS.append(x.shape[0])
    width = weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])
    return _activate(out[..., :x.shape[-1]], activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                         cache_seqlens=None, conv_state_indices=None):
    raise NotImplementedError("stand-in: cached decoding is not used by longctx")
