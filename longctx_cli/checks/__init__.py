"""Checks that build a model: the fidelity probe (`validate` and every rank run it)."""
