"""A CPU stand-in for the `mamba-ssm` package's kernels (Triton/CUDA, GPU only), laid out as
the package is (``mamba_ssm.ops.triton.ssd_combined``, ``...selective_state_update``,
``mamba_ssm.ops.selective_scan_interface``), where transformers looks for them.

``mamba_chunk_scan_combined`` computes with transformers' own PyTorch reference of the chunked
scan, ``selective_scan_fn`` (Mamba's, in Jamba) with its selective scan;
``mamba_split_conv1d_scan_combined`` (Mamba2's fused training path: in-projection split,
causal conv, scan, gated RMSNorm, out-projection) composes the package's documented steps.
So a test with ``tests/mixer_kernels_standin`` first on ``sys.path`` checks the interface
longctx drives, not the kernels' math. ``CALLS`` records ``(function, batch size, whether an
initial state was given)`` per call; ``seq_idx`` and ``cu_seqlens`` (varlen) raise: longctx
keeps documents apart by giving each its own batch row, and passes states between ranks as
initial and final states."""

from __future__ import annotations

CALLS: list[tuple[str, int, bool]] = []
