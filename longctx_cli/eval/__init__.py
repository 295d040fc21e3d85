"""`longctx eval`: passkey retrieval grid and per-position loss of a checkpoint, run
sequence-parallel with the same launch as training (forward passes only)."""
