"""`longctx validate` gives every model type a verdict, never a traceback
(benchmarks/family_sweep.py runs all of transformers' causal-LM and image-text-to-text types;
docs/families.md shows its summary). Here: a sample of every kind of verdict, on each
family's own default config as transformers gives it (per-layer fields and all), and the
refused families of Axolotl's examples with the reason each is refused for. The families
Axolotl's examples train exactly are rows of the family matrix (tests/test_family_matrix.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.family_sweep import model_types, reason_group, verdict

# model type -> (verdict, why): the reason group `family_sweep.reason_group` reads off the
# one paragraph, or "" for exact ones.
EXPECTED = {
    # exact on their heterogeneous or odd-named defaults (tracebacks or refusals before)
    "gemma4_text": ("exact", ""),  # per_layer_config: full-attention heads of 512
    "qwen2_moe": ("exact", ""),  # builds a sliding mask of window 0 no layer uses
    "codegen": ("exact", ""),  # n_embd / n_head / rotary_dim
    "nemotron": ("exact", ""),  # its layers call attention without the forward's kwargs
    "granitemoehybrid": ("exact", ""),  # all-Mamba stack at its defaults
    # no attention layer at all: scans only, their state passed or their prefixes rerun
    "mamba": ("exact", ""),
    "mamba2": ("exact", ""),
    "falcon_mamba": ("exact", ""),
    # vision-language defaults the probe's own shrinking failed on before
    "qwen2_vl": ("exact", ""),  # its merger writes the tower's hidden_size
    "qwen2_5_vl": ("exact", ""),  # mrope_section (16, 24, 24) shrinks with the head dim
    "glm46v": ("exact", ""),  # its default sections (8, 12, 12) shrink to the tiny head
    "glm4v_moe": ("exact", ""),  # GLM-4.6V's forward with MoE layers
    "paddleocr_vl": ("exact", ""),  # a SigLIP-style tower (no `depth`) shrinks as one
    "gemma4": ("exact", ""),  # a wrapper without towers: its text config shrinks inside it
    "internvl": ("exact", ""),  # tiles through a pixel-shuffled tower (and SmolVLM's)
    "smolvlm": ("exact", ""),
    # attention dropout 0.1 at its defaults: applied at sp 1 (refused before)
    "seed_oss": ("exact", ""),
    # refused, each for its own reason
    "rwkv": ("refused", "no attention layers (recurrent / state-space)"),
    "xlstm": ("refused", "no attention layers (recurrent / state-space)"),
    "deepseek_v32": ("refused", "sparse attention (an indexer's top-k keys)"),
    "deepseek_v4": ("refused", "sparse attention (an indexer's top-k keys)"),
    "glm_moe_dsa": ("refused", "sparse attention (an indexer's top-k keys)"),
    "dots3_note_text": ("refused", "sparse attention (an indexer's top-k keys)"),
    "musicgen": ("refused", "an encoder-decoder model"),
    "florence2": ("refused", "an encoder-decoder model"),
    "bloom": ("refused", "attention outside transformers' AttentionInterface"),
    "gpt_neo": ("refused", "attention outside transformers' AttentionInterface"),
    "minimax": ("refused", "layers that mix tokens outside attention (not covered)"),
    "paligemma": ("refused", "a prefix LM (image and prompt attend both ways)"),
    "gemma3n": ("refused", "a timm vision tower (no tiny copy; its text model is checked "
                "alone)"),
    "llava_next": ("refused", "a vision-language family longctx does not rebuild"),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sweep")


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_every_verdict_is_exact_or_one_paragraph(model_type: str, folder: Path) -> None:
    got = verdict(model_type, folder)
    want, why = EXPECTED[model_type]
    assert got["verdict"] == want, got
    if want == "refused":
        assert reason_group(got["reason"]) == why, got["reason"]
        assert "Fix:" in got["reason"] and "\n" not in got["reason"], got["reason"]
    else:
        assert got["reason"].startswith("fidelity probe: passed"), got["reason"]


def test_the_sweep_covers_both_mappings() -> None:
    types = model_types()
    assert len(types) > 250 and {"llama", "gemma4_text", "qwen2_5_vl", "llava"} <= set(types)
