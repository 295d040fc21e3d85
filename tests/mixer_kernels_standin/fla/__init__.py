"""A CPU stand-in for `flash-linear-attention`'s gated delta rule (Triton, GPU only), with the
package's signature: ``q, k`` ``[batch, tokens, heads, dk]``, ``v`` ``[batch, tokens, heads,
dv]``, ``g`` and ``beta`` ``[batch, tokens, heads]``, ``initial_state`` ``[batch, heads, dk,
dv]`` (state passing between ranks starts from it); returns ``(output, final_state)``.

It computes with transformers' own PyTorch reference of the same rule, so a test with this
directory first on ``sys.path`` checks the interface longctx drives, not the kernel's math.
``CALLS`` records the batch size of every call; ``cu_seqlens`` (varlen) raises: longctx
keeps documents apart by giving each its own batch row."""

from __future__ import annotations

CALLS: list[int] = []


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False, **kwargs):
    if cu_seqlens is not None:
        raise NotImplementedError("stand-in: varlen rows are not used by longctx")
    from transformers.models.qwen3_next import modeling_qwen3_next

    # The module's name for it is transformers' dispatcher (which calls this stand-in); the
    # PyTorch function it wraps is the reference.
    reference = modeling_qwen3_next.torch_chunk_gated_delta_rule.__wrapped__

    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError("stand-in: only the default scale 1/sqrt(dk)")
    CALLS.append(q.shape[0])
    return reference(
        q, k, v, g=g, beta=beta, initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule(*args, **kwargs):
    raise NotImplementedError("stand-in: cached decoding is not used by longctx")
