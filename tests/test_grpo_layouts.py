"""`rl: grpo` at the layouts real RL runs use: FSDP2 over several data-parallel groups, whose
SP groups decode different numbers of tokens, and a generation batch split over several
optimizer steps (TRL's `steps_per_generation`).

The model ends a sequence on many token ids, so completions end at different steps and each
data-parallel group's rollout needs its own number of decode forwards. Under FSDP2 every
forward gathers the layers' weights over all ranks; the rollout either gathers them once
(`ds3_gather_for_generation`, the default) or lets the groups decode in lockstep. Either way
the run must step exactly as the same run without FSDP. Rewards come from a function and from
a reward model, the model scored under SP by every rank of a group (checked against its own
forward).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_grpo_train import REWARDS, assert_same_grpo_run, grpo_config, write_prompts
from tests.train_helpers import TINY_LLAMA, read_metrics, train

# Ids 100-189 end a sequence: about a quarter of the byte vocabulary, so a random model's
# completions end after a few tokens, at different steps for different prompts.
MANY_EOS = {**TINY_LLAMA, "eos_token_id": list(range(100, 190))}
ACCUMULATION = 2
SPLIT = 2  # optimizer steps per generation batch


def layout_config(tmp_path: Path, name: str, data: Path, **overrides) -> Path:
    settings = {
        "model_config": MANY_EOS, "micro_batch_size": 2, "learning_rate": 0.01,
        "gradient_accumulation_steps": ACCUMULATION, "max_steps": 2 * SPLIT,
        # A reward function and a reward model (scored under SP by every rank of a group).
        "trl": {"reward_funcs": ["rewards.letters", "./tiny-rm"], "reward_weights": [1.0, 0.5],
                "num_generations": 2, "max_completion_length": 24, "beta": 0.04,
                "loss_type": "grpo", "steps_per_generation": SPLIT * ACCUMULATION},
    }
    trl = {**settings["trl"], **overrides.pop("trl", {})}
    return grpo_config(tmp_path, name, data, **{**settings, **overrides, "trl": trl})


def decode_steps(run: Path, dp: int, g: int = 2) -> list[list[int]]:
    """Decode forwards each data-parallel group ran per prompt of the first generation batch
    (the longest of the prompt's completions), from completions.jsonl (written in
    data-parallel rank order, each prompt's `g` completions together)."""
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    first = [r["completion_tokens"] for r in rows if r["step"] == 1]
    per_prompt = [max(first[i:i + g]) for i in range(0, len(first), g)]
    per_group = len(per_prompt) // dp
    return [per_prompt[i * per_group:(i + 1) * per_group] for i in range(dp)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The prompts, the reward model, and the run at dp 2 without FSDP."""
    from tests.test_reward_model import save_byte_tokenizer, save_model

    tmp_path = tmp_path_factory.mktemp("grpo-layouts")
    (tmp_path / "rewards.py").write_text(REWARDS)
    save_byte_tokenizer(save_model(tmp_path / "tiny-rm"))
    data = write_prompts(tmp_path / "prompts.jsonl", count=16)
    train(layout_config(tmp_path, "dp2", data), 2)
    return tmp_path, data


@pytest.mark.slow
def test_reference_run_is_a_real_check(reference):
    """What the layout tests compare against: groups that decode different numbers of
    tokens, a batch reused across steps (rewards logged every SPLIT steps, the later step's
    ratios off 1), losses that are not zero by construction."""
    tmp_path, _ = reference
    run = tmp_path / "dp2"
    steps = decode_steps(run, 2)
    assert steps[0] != steps[1] and max(steps[0]) < 24, steps  # none cut at the limit
    records = read_metrics(run)
    assert ["reward" in r for r in records] == [True, False] * SPLIT
    assert all(r["grad_norm"] > 0 for r in records)
    # The second step of a batch scores it with weights one update old.
    assert records[1]["kl"] > 0 and abs(records[1]["loss"]) > 1e-6


def assert_same_as_reference(run: Path, reference: Path) -> None:
    assert_same_grpo_run(run, reference, adapter=True)
    for mine, theirs in zip(read_metrics(run), read_metrics(reference), strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert mine["tokens"] == theirs["tokens"]


@pytest.fixture(scope="module")
def lockstep(reference) -> Path:
    """The run at dp 2 x sp 2 under FSDP, its data-parallel groups decoding in lockstep."""
    tmp_path, data = reference
    train(layout_config(tmp_path, "dp2-sp2-fsdp-lockstep", data, fsdp=True,
                        sequence_parallel_degree=2,
                        trl={"ds3_gather_for_generation": False}), 4)
    return tmp_path / "dp2-sp2-fsdp-lockstep"


@pytest.mark.slow
def test_fsdp_weights_gathered_once_at_dp2(reference):
    tmp_path, data = reference
    train(layout_config(tmp_path, "dp2-fsdp-gathered", data, fsdp=True), 2)
    assert_same_as_reference(tmp_path / "dp2-fsdp-gathered", tmp_path / "dp2")


def test_fsdp_lockstep_at_dp2_sp2(reference, lockstep):
    assert_same_as_reference(lockstep, reference[0] / "dp2")


# The other FSDP layouts SFT trains with, each against the same run without FSDP (slow extras).
FULL = {"adapter": None, "lora_r": None, "lora_alpha": None, "lora_target_modules": None,
        "learning_rate": 1e-3}
QLORA = {"adapter": "qlora", "lora_target_modules": None, "lora_target_linear": True}
SLOW_LAYOUTS = {  # name -> (FSDP run's overrides, its reference's (None: the dp 2 run))
    "zero2": ({"fsdp": True, "fsdp_config": {"reshard_after_forward": False}}, None),
    "full-kl-frozen-copy": ({**FULL, "fsdp": True}, FULL),
    "qlora": ({**QLORA, "fsdp": True}, QLORA),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_LAYOUTS)
def test_other_fsdp_layouts_step_as_without_fsdp(reference, name):
    tmp_path, data = reference
    overrides, reference_overrides = SLOW_LAYOUTS[name]
    if reference_overrides is None:
        expected = tmp_path / "dp2"
    else:
        expected = tmp_path / f"{name}-reference"
        train(layout_config(tmp_path, expected.name, data, **reference_overrides), 2)
    train(layout_config(tmp_path, name, data, **overrides), 2)
    adapter = overrides.get("adapter", "lora") is not None
    assert_same_grpo_run(tmp_path / name, expected, adapter=adapter)


# ---- what `validate` says of these layouts (no processes) --------------------------------

def grpo_plan(world: int = 4, shape=None, **overrides):
    from longctx_cli.config import config_from_dict
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform
    from tests.test_plan import SMALL

    settings = {"model_config": {"model_type": "llama"}, "sequence_len": 4096, "rl": "grpo",
                "datasets": [{"path": "prompts.jsonl", "type": "prompt"}],
                "micro_batch_size": 4, "gradient_accumulation_steps": 2,
                "trl": {"reward_funcs": ["rewards.letters"], "num_generations": 4,
                        **overrides.pop("trl", {})}, **overrides}
    return build_plan(config_from_dict(settings), world, shape or SMALL,
                      platform=Platform(cuda=False, ring_flash_attn=False))


def test_plan_prints_what_gathering_for_rollouts_costs():
    """Under FSDP the rollout holds the whole model: the plan's memory rows say how much
    beyond the shard, and nothing when the groups decode in lockstep or without FSDP."""
    from longctx_cli.config.units import format_gib
    from tests.test_plan import LLAMA3_8B

    gathered = grpo_plan(fsdp=True, shape=LLAMA3_8B, dtype="bfloat16")
    weights = gathered.memory.rollout_weights
    # bf16 Llama-3-8B: ~16 GB of weights, 3/4 of them on other ranks at world 4.
    assert 0.74 * 16e9 < weights < 0.76 * 16.1e9, weights
    assert gathered.memory.rollout_total == (gathered.memory.parameters + weights
                                             + gathered.memory.gradients
                                             + gathered.memory.optimizer)
    text = "\n".join(" ".join(map(str, row)) for _, rows in gathered._sections(LLAMA3_8B)
                     for row in rows)
    assert f"+{format_gib(weights)}" in text and "lockstep" in text
    lockstep = grpo_plan(fsdp=True, shape=LLAMA3_8B, dtype="bfloat16",
                         trl={"ds3_gather_for_generation": False})
    assert lockstep.memory.rollout_weights == 0
    assert grpo_plan(shape=LLAMA3_8B).memory.rollout_weights == 0


def test_plan_states_decoding_by_full_forwards():
    from dataclasses import replace

    from tests.test_plan import SMALL

    windowed = replace(SMALL, plain_fields={"sliding_window": 64})
    notes = grpo_plan(shape=windowed, prefix_sharing=False).notes
    assert any("one full SP forward per generated token" in n and "sliding window" in n
               for n in notes), notes
    assert not any("per generated token" in n for n in grpo_plan().notes)


@pytest.mark.parametrize("trl,world,message", [
    ({"steps_per_generation": 3}, 4, "not a multiple of `gradient_accumulation_steps: 2`"),
    ({"generation_batch_size": 12}, 4, "must be a multiple of micro_batch_size x "
                                       "data-parallel groups = 4 x 4 = 16"),
])
def test_generation_batch_that_does_not_split_into_steps(trl, world, message):
    from longctx_cli.errors import UserError

    with pytest.raises(UserError) as e:
        grpo_plan(world, trl=trl)
    assert message in str(e.value), str(e.value)
    assert f"trl.{next(iter(trl))}" in str(e.value)


def test_generation_batch_size_sets_the_steps_it_feeds():
    from longctx_cli.config import config_from_dict
    from longctx_cli.train.schedule import rows_per_batch, steps_per_batch

    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "sequence_len": 4096, "rl": "grpo",
        "datasets": [{"path": "p.jsonl", "type": "prompt"}], "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "trl": {"reward_funcs": ["rewards.letters"], "num_generations": 4,
                "generation_batch_size": 32, "num_iterations": 3}})
    # 32 completions at dp 2 = 4 micro-batches of 4 per group: two optimizer steps, each
    # run 3 times; 8 prompts of 4 completions.
    assert steps_per_batch(config, 2) == 6
    assert rows_per_batch(config, 2) == 8


def test_reward_model_scores_rollouts_as_its_own_forward(reference, lockstep):
    """The reward model beside the function, in the dp 2 x sp 2 run: each completion's reward
    in completions.jsonl is the model's own forward on TRL's text, and the run's reward
    metrics carry the model's name."""
    from tests.test_reward_model import hf_rewards

    tmp_path, run = reference[0], lockstep
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] == 1]
    assert len(rows) == 16 and all(set(r["rewards"]) == {"letters", "tiny-rm"} for r in rows)
    want = hf_rewards(tmp_path / "tiny-rm", [r["prompt"] for r in rows],
                      [r["completion"] for r in rows])
    got = [r["rewards"]["tiny-rm"] for r in rows]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len(set(got)) > 1  # rewards that differ: advantages are not all zero
    metrics = read_metrics(run)[0]
    assert metrics["rewards/tiny-rm/mean"] == pytest.approx(sum(want) / len(want), rel=1e-5)


def test_moe_model_needs_router_aux_loss_off_as_trl_would_add_it():
    """TRL adds a mixture-of-experts model's load-balancing loss at its default; longctx
    computes the GRPO loss alone, so it asks for `router_aux_loss_coef: 0.0` (and refuses any
    other value)."""
    from dataclasses import replace

    from pydantic import ValidationError

    from longctx_cli.config.sections.grpo import TrlConfig
    from longctx_cli.errors import UserError
    from tests.test_plan import SMALL

    moe = replace(SMALL, plain_fields={"output_router_logits": False,
                                       "router_aux_loss_coef": 0.02})
    with pytest.raises(UserError) as e:
        grpo_plan(shape=moe)
    assert "0.02" in str(e.value) and "trl.router_aux_loss_coef: 0.0" in str(e.value)
    grpo_plan(shape=moe, trl={"router_aux_loss_coef": 0.0})  # the GRPO loss alone
    grpo_plan()  # a dense model: nothing to ask
    with pytest.raises(ValidationError, match="router_aux_loss_coef: 0.01` cannot run"):
        TrlConfig(reward_funcs=["rewards.r"], router_aux_loss_coef=0.01)


# ---- the first ratio of a batch is exactly 1 -----------------------------------------------
# With `epsilon` 1e-6 any token whose ratio is off 1 by more than rounding is clipped, so the
# clip ratio of a batch's first step shows whether the rollout-time pass and the update pass
# computed the same log-probabilities.
EXACT_RATIO = {"num_iterations": 2, "epsilon": 1e-6, "beta": 0.0,
               "reward_funcs": ["rewards.letters"], "reward_weights": None,
               "steps_per_generation": ACCUMULATION}
PHI3_WITH_DROPOUT = {"model_type": "phi3", "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 384,
                     "max_position_embeddings": 1024, "resid_pdrop": 0.3,
                     "pad_token_id": 0, "eos_token_id": list(range(100, 190))}


def first_clip_ratio(tmp_path: Path, name: str, data: Path, **overrides) -> float:
    train(layout_config(tmp_path, name, data, max_steps=1, **overrides), 1)
    return read_metrics(tmp_path / name)[0]["clip_ratio/region_mean"]


@pytest.mark.slow
def test_disable_dropout_makes_the_first_ratio_one(reference):
    """Phi-3's residual dropout: on, the update pass and the rollout-time pass drop different
    units (ratios off 1, clipped); with `disable_dropout` they agree exactly."""
    tmp_path, data = reference
    # The fidelity probe compares a training forward with the model's own: with dropout on,
    # the two draw different masks, so it is off here.
    phi3 = {"model_config": PHI3_WITH_DROPOUT, "lora_target_modules": ["qkv_proj", "o_proj"],
            "fidelity_probe": False}
    on = first_clip_ratio(tmp_path, "dropout-on", data, trl=EXACT_RATIO, **phi3)
    off = first_clip_ratio(tmp_path, "dropout-off", data,
                           trl={**EXACT_RATIO, "disable_dropout": True}, **phi3)
    assert on > 0.1 and off == 0.0, (on, off)


@pytest.mark.slow
def test_half_precision_side_passes_run_under_the_updates_autocast(reference):
    """float16, a full fine-tune (autocast over float32 master weights): the rollout-time pass
    runs under the same autocast as the update, so the first ratio is exactly 1."""
    tmp_path, data = reference
    assert first_clip_ratio(tmp_path, "fp16", data, dtype="float16", trl=EXACT_RATIO,
                            **FULL) == 0.0


# ---- the rollout's one gather, and what it leaves behind (FSDP2's public API) -------------

def _resharding_worker(rank: int, world: int, reshard: bool | None) -> dict[str, list[bool]]:
    """Which FSDP2 modules hold gathered (plain) weights after a forward: before a rollout's
    gather, inside it, and after it. FSDP2 registers the sharded DTensors again after a
    forward only where the module reshards after forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, LlamaConfig

    from longctx_cli.config import Config
    from longctx_cli.runtime.model import apply_fsdp, fsdp_weights_gathered

    fields = {} if reshard is None else {"fsdp": True,
                                          "fsdp_config": {"reshard_after_forward": reshard}}
    config = Config.model_validate({"model_config": TINY_LLAMA, "tokenizer": "byte",
                                    "datasets": [{"type": "passkey"}], **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{
        k: v for k, v in TINY_LLAMA.items() if k != "model_type"}))
    apply_fsdp(model, init_device_mesh("cpu", (world,)), config if fields else None)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    ids = torch.arange(16)[None]

    def managed(module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The weights `module`'s own FSDP group holds (none of a nested group's)."""
        nested = {id(p) for m in module.modules() if m is not module and m in modules
                  for p in m.parameters()}
        return [p for p in module.parameters() if id(p) not in nested]

    def gathered_after_forward() -> list[bool]:
        with torch.no_grad():
            model(input_ids=ids)
        return [not any(isinstance(p, DTensor) for p in managed(m)) for m in groups]

    groups = [m for m in modules if managed(m)]  # the root of a causal LM holds none

    before = gathered_after_forward()
    with fsdp_weights_gathered(model, config.parallel.fsdp_config):
        inside = gathered_after_forward()
    return {"before": before, "inside": inside, "after": gathered_after_forward(),
            "root": [m is model for m in groups]}


@pytest.mark.parametrize("reshard", [None, True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["default", "zero3", "zero2"])
def test_a_rollouts_gather_restores_each_modules_resharding(reshard):
    for result in run_distributed(_resharding_worker, 2, reshard, timeout_s=180):
        assert all(result["inside"]), result  # every weight stays gathered for the rollout
        assert result["after"] == result["before"], result  # and is resharded as it was
        if reshard is None:  # FSDP2's default: all but the root reshard after forward
            assert result["before"] == result["root"], result
        else:
            assert result["before"] == [not reshard] * len(result["root"]), result
