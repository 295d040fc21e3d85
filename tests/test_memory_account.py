"""The memory estimate against the measured step (`benchmarks/live_activations.py --account`):
within 0.9-1.15x of each rank's measured peak of live tensors, moment by moment; and the
families whose Ulysses q, k, v the estimate counts once (`Family.spent_qkv`)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from longctx_cli.families import SPENT_QKV_MODEL_TYPES
from tests import family_matrix as fm

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "benchmarks" / "results").glob("live-activations-account-*.json"))
# The newest record of the step's phases (older ones split only the resident peak).
RECORD = next((json.loads(p.read_text()) for p in reversed(RECORDS)
               if '"phases"' in p.read_text()), None)
RUNS = [] if RECORD is None else [
    (int(n), tool) for n, results in RECORD["results"].items() for tool, r in results.items()
    if r.get("phases")]


@pytest.mark.skipif(not RUNS, reason="no recorded account with the step's phases")
@pytest.mark.parametrize(("tokens", "tool"), RUNS)
def test_the_estimate_is_within_0_9_to_1_15_of_each_ranks_measured_peak(tokens, tool):
    from live_activations import MOMENTS, estimate_of, moment_peaks

    estimate = estimate_of(RECORD, tokens, tool)
    planned = dict(estimate.moments())
    for rank, phases in enumerate(RECORD["results"][str(tokens)][tool]["phases"]):
        peaks = moment_peaks(phases)
        ratio = estimate.total / peaks["the step"]
        assert 0.9 <= ratio <= 1.15, (rank, ratio, peaks, planned)
        for moment in MOMENTS:  # each moment on its own, not only the largest
            assert 0.85 <= planned[moment] / peaks[moment] <= 1.2, (rank, moment, peaks,
                                                                   planned)


def test_spent_qkv_families_hand_over_spent_projections_of_their_own():
    """Every model type the estimate believes Ulysses writes over is one whose attention
    class the runtime finds spent (`attention_inputs_spent`) and whose q, k and v are three
    projections of their own (no fused QKV whose slices would be copied)."""
    from longctx_cli.config.shape import causal_lm_class
    from longctx_cli.parallel.attention import attention_inputs_spent
    from longctx_cli.runtime.head import decoder_of

    assert "llama" in SPENT_QKV_MODEL_TYPES  # the measured family
    families = {f.model_type: f for f in fm.FAMILIES}
    assert SPENT_QKV_MODEL_TYPES <= set(families)
    for model_type in sorted(SPENT_QKV_MODEL_TYPES):
        fields = families[model_type].config()
        fields.pop("model_type")
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = causal_lm_class(hf_config).from_config(hf_config)
        attentions = [m for layer in decoder_of(model).layers for m in layer.modules()
                      if "attention_interface" in inspect.getsource(type(m).forward)]
        assert attentions, model_type
        for attention in attentions:
            assert attention_inputs_spent(type(attention)), model_type
            assert all(isinstance(getattr(attention, n, None), torch.nn.Linear)
                       for n in ("q_proj", "k_proj", "v_proj")), model_type
