"""Every field TRL 1.16's GRPOConfig adds to TrainingArguments is honoured (a TrlConfig field),
ignored with a reason or refused with a reason by `trl:`, and has a row in docs/axolotl.md.

TRL is the reference: its dataclass is read here, so a TRL release that adds a key fails this
test until longctx decides what the key means.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from longctx_cli.config.sections.grpo import TRL_IGNORED, TRL_REFUSED, TrlConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "axolotl.md"
# A value that asks for something, for each refused GRPOConfig key (TRL's default asks for
# nothing and is accepted).
ASKING = {
    "use_vllm": True, "sync_ref_model": True, "use_adaptive_entropy": True,
    "model_init_kwargs": {"dtype": "bfloat16"}, "trust_remote_code": True,
    "log_completions_hub_repo": "me/completions",
    "generation_kwargs": {"num_beams": 2}, "chat_template_kwargs": {"enable_thinking": False},
    "num_generations_eval": 2,
}
# A value other than TRL's default for each honoured GRPOConfig key that reaches the loss.
LOSS_KEYS = {
    "loss_type": "vespo", "beta": 0.04, "epsilon": 0.1, "epsilon_high": 0.3, "delta": 1.5,
    "importance_sampling_level": "sequence", "temperature": 0.7,
    "max_completion_length": 64, "use_bias_correction_kl": False,
    "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2, "vespo_k_pos": 1.5,
    "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5,
    "top_entropy_quantile": 0.2, "entropy_coef": 0.01, "off_policy_mask_threshold": 0.5,
}


def grpo_fields() -> dict[str, dataclasses.Field]:
    """GRPOConfig's own fields, by name."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.name not in base}


def trl_default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def test_trl_1_16_is_the_reference():
    import trl

    assert trl.__version__.startswith("1.16"), trl.__version__
    assert len(grpo_fields()) == 77


def test_every_grpo_key_is_honoured_ignored_or_refused():
    honoured = set(TrlConfig.model_fields)
    for name in grpo_fields():
        places = [name in honoured, name in TRL_IGNORED, name in TRL_REFUSED]
        assert sum(places) == 1, (name, places)


def test_every_grpo_key_has_a_row_in_docs():
    text = DOC.read_text()
    section = text[text.index("## GRPO: the `trl:` section"):]
    section = section[:section.index("\n## ", 1)]
    rows = dict(re.findall(r"^\| `(\w+)` \| (honoured|ignored|refused) \|", section, re.M))
    for name in grpo_fields():
        assert name in rows, f"docs/axolotl.md has no row for trl.{name}"
        expected = ("honoured" if name in TrlConfig.model_fields
                    else "ignored" if name in TRL_IGNORED else "refused")
        assert rows[name] == expected, (name, rows[name])


def test_honoured_keys_default_as_trl():
    for name, field in grpo_fields().items():
        if name in TrlConfig.model_fields:
            ours = TrlConfig.model_fields[name].default
            assert ours == trl_default(field), (name, ours, trl_default(field))


@pytest.mark.parametrize("name", sorted(set(TRL_REFUSED) & set(ASKING)))
def test_refused_keys_name_key_value_and_fix(name):
    from pydantic import ValidationError

    field = grpo_fields()[name]
    TrlConfig(reward_funcs=["rewards.r"], **{name: trl_default(field)})  # TRL's default: fine
    with pytest.raises(ValidationError) as info:
        TrlConfig(reward_funcs=["rewards.r"], **{name: ASKING[name]})
    message = str(info.value)
    assert f"`trl.{name}: {ASKING[name]}` cannot run" in message
    assert re.search(r"\. (Drop|Set|Use|Give)", TRL_REFUSED[name]), TRL_REFUSED[name]


def test_every_refused_grpo_key_has_an_example():
    assert {n for n in grpo_fields() if n in TRL_REFUSED} <= set(ASKING)


def test_ignored_keys_are_listed_in_the_plan(tmp_path):
    from longctx_cli.config.schema import Config

    ignored = {name: trl_default(f) for name, f in grpo_fields().items() if name in TRL_IGNORED}
    config = Config(base_model="m", rl="grpo", micro_batch_size=4, sequence_len=1024,
                    datasets=[{"path": "p.jsonl", "type": "prompt"}],
                    trl={"reward_funcs": ["rewards.r"], "num_generations": 4, **ignored})
    notes = dict(config.axolotl_notes)
    for name in ignored:
        assert notes[f"trl.{name}"].startswith("ignored: "), name


def test_loss_keys_reach_the_loss():
    """Each honoured key that changes the loss arrives in `GrpoLoss`, as the run builds it."""
    from longctx_cli.config.schema import Config
    from longctx_cli.train.grpo import GrpoLoss

    assert set(LOSS_KEYS) <= set(grpo_fields())
    config = Config(base_model="m", rl="grpo", micro_batch_size=4, sequence_len=1024,
                    datasets=[{"path": "p.jsonl", "type": "prompt"}],
                    trl={"reward_funcs": ["rewards.r"], "num_generations": 4, **LOSS_KEYS})
    loss = GrpoLoss.from_trl(config.trl)  # what the Grpo objective runs with
    expected = {**LOSS_KEYS, "epsilon_low": LOSS_KEYS["epsilon"]}
    for field in dataclasses.fields(GrpoLoss):
        assert getattr(loss, field.name) == expected[field.name], field.name


@pytest.mark.parametrize("trl, fields, message", [
    ({"generation_batch_size": 16, "steps_per_generation": 2}, {}, "give only one of them"),
    ({"generation_batch_size": 6}, {}, "must be a multiple of `micro_batch_size: 4`"),
    ({"generation_batch_size": 12}, {"micro_batch_size": 6, "num_generations": 3,
                                     "gradient_accumulation_steps": 1}, None),
    ({"shuffle_dataset": False}, {"curriculum_sampling": False}, "disagree"),
])
def test_generation_batch_rules(trl, fields, message):
    from pydantic import ValidationError

    from longctx_cli.config.schema import Config

    generations = fields.pop("num_generations", 4)
    kwargs = {"base_model": "m", "rl": "grpo", "micro_batch_size": 4, "sequence_len": 1024,
              "datasets": [{"path": "p.jsonl", "type": "prompt"}],
              "trl": {"reward_funcs": ["rewards.r"], "num_generations": generations, **trl},
              **fields}
    if message is None:
        config = Config(**kwargs)
        assert config.trl.generation_steps(2, config.training.micro_batch_size, 1) == 1
        with pytest.raises(ValueError, match="multiple of micro_batch_size x data-parallel"):
            config.trl.generation_steps(4, config.training.micro_batch_size, 1)
        return
    with pytest.raises(ValidationError, match=re.escape(message)):
        Config(**kwargs)


def test_generation_steps_as_trl():
    """TRL's resolution of steps_per_generation / generation_batch_size (its __post_init__,
    one process per data-parallel group)."""
    from trl import GRPOConfig

    for given in ({}, {"steps_per_generation": 4}, {"generation_batch_size": 16}):
        args = GRPOConfig(output_dir="/tmp/longctx-trl-keys", report_to=[], use_cpu=True,
                          bf16=False, per_device_train_batch_size=4, num_generations=4,
                          gradient_accumulation_steps=2, **given)
        ours = TrlConfig(reward_funcs=["rewards.r"], num_generations=4, **given)
        assert ours.generation_steps(1, 4, 2) == args.steps_per_generation, given


def test_shuffle_dataset_false_keeps_the_order():
    from longctx_cli.config.schema import Config

    config = Config(base_model="m", rl="grpo", micro_batch_size=4, sequence_len=1024,
                    datasets=[{"path": "p.jsonl", "type": "prompt"}],
                    trl={"reward_funcs": ["rewards.r"], "num_generations": 4,
                         "shuffle_dataset": False})
    assert config.data.curriculum_sampling is True


def test_cast_lm_head_to_fp32_builds_a_float32_head():
    """`trl.cast_lm_head_to_fp32` in a bfloat16 run: the built model's head weights are
    float32 (the decoder's stay bfloat16) and the run's head computes in float32."""
    import torch

    from longctx_cli.config.schema import Config
    from longctx_cli.runtime.model import build_model, decoder_and_head, unwrap
    from tests.train_helpers import TINY_LLAMA

    def built(cast: bool):
        config = Config(model_config=TINY_LLAMA, rl="grpo", micro_batch_size=4,
                        sequence_len=256, dtype="bfloat16", adapter="lora",
                        lora_target_modules=["q_proj"],
                        datasets=[{"path": "p.jsonl", "type": "prompt"}],
                        trl={"reward_funcs": ["rewards.r"], "num_generations": 4,
                             "max_completion_length": 8, "cast_lm_head_to_fp32": cast})
        return build_model(config)

    model = built(True)
    base = unwrap(model)
    assert base.lm_head.weight.dtype == torch.float32
    assert base.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    _, head = decoder_and_head(model)
    assert head.float32 and not decoder_and_head(built(False))[1].float32
    hidden = torch.randn(3, base.config.hidden_size).to(torch.bfloat16)  # the decoder's dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as a bf16-autocast step would call it
        logits = head(hidden)
    torch.testing.assert_close(logits, hidden.float() @ base.lm_head.weight.T, rtol=0,
                               atol=1e-5)
