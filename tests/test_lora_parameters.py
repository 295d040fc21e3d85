"""`lora_target_parameters` (peft's `target_parameters`): LoRA on a MoE block's fused expert
weights, which no linear module holds. A tiny Qwen3-MoE trained by longctx with it, at sp 2
(the P2P stripe default and Ulysses), equals the same peft model trained by its own
Hugging Face forward in one process (tests/own_training.py), and the experts' LoRA weights
are trained (their B factors, zero at the start, are not after three steps)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import family_matrix as fm
from tests.distributed import run_distributed

FAMILY = next(f for f in fm.FAMILIES if f.name == "qwen3_moe")
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8,
        "lora_target_modules": ["q_proj", "v_proj"], "lora_target_parameters": EXPERTS}
COLUMNS = ["P2P stripe sp2 (default)", "Ulysses sp2"]


def _peft_reference() -> dict:
    """The same peft model (longctx's `apply_lora`: peft's `get_peft_model`) trained by the
    model's own forward, one process, no SP."""
    from longctx_cli.runtime.model import apply_lora, load_base_model
    from longctx_cli.train.optim import make_optimizer
    from tests.own_training import own_training

    config = fm.make_config(FAMILY, LORA)
    model = apply_lora(load_base_model(config, "eager"), config).train()
    optimizer = make_optimizer(config, [p for p in model.parameters() if p.requires_grad])
    steps = [[(d, None) for i in fm.step_rows(step) for d in fm.documents(i) if d.numel() > 1]
             for step in range(fm.STEPS)]
    return own_training(model, optimizer, steps, config.training.max_grad_norm)


def _worker(rank: int, world: int) -> dict:
    out = {c: fm.longctx_training(FAMILY, {**fm.COLUMN[c].settings, **LORA}) for c in COLUMNS}
    if rank == 0:
        out["reference"] = _peft_reference()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_worker, 2, timeout_s=600)[0]


def test_expert_lora_weights_exist_and_train(runs):
    # peft wraps the experts module once per targeted parameter (nested wrappers).
    weights = runs["reference"]["weights"]
    layers = fm.make_config(FAMILY).model.model_config_dict["num_hidden_layers"]
    lora_b = [k for k in weights if ".mlp.experts." in k and "lora_B" in k]
    assert len(lora_b) == len(EXPERTS) * layers, sorted(weights)
    assert all(np.abs(weights[k]).max() > 0 for k in lora_b)


@pytest.mark.parametrize("column", COLUMNS)
def test_sp2_equals_the_peft_models_own_training(runs, column):
    run = runs[column]
    assert "refused" not in run, run.get("refused")
    assert sorted(run["weights"]) == sorted(runs["reference"]["weights"])
    cell = fm.compare(run, runs["reference"])
    assert cell["loss"] < fm.LOSS_TOL and cell["weights"] < fm.WEIGHT_TOL, cell


def test_dropout_and_dora_are_refused_with_parameters():
    for key, value in (("lora_dropout", 0.1), ("peft_use_dora", True)):
        with pytest.raises(ValueError, match=f"cannot be trained with `{key}`"):
            fm.make_config(FAMILY, {**LORA, key: value})


def test_validate_names_the_experts_parameters_for_a_wrong_name():
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import check_lora_parameters

    check_lora_parameters(fm.make_config(FAMILY, LORA))  # the right names pass
    config = fm.make_config(FAMILY, {**LORA, "lora_target_parameters": ["experts.gate_proj"]})
    with pytest.raises(UserError) as error:
        check_lora_parameters(config)
    assert "'experts.gate_proj'" in str(error.value)
    assert "mlp.experts.gate_up_proj" in str(error.value)
