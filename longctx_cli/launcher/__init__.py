"""The launcher side of a run: torchrun's launch, its supervision, warm ranks, start-up."""
