"""`longctx train` with `rl: grpo` end to end: rollouts under SP, rewards, the update; the same
run at sp 1 and sp 2; TRL's metric names; the paragraphs bad GRPO input gets."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tests.train_helpers import (
    final_tensors,
    read_metrics,
    relative_error,
    run_longctx,
    train,
    write_config,
)

REWARDS = '''
def letters(completions, target, **kwargs):
    """The prompt's target letter counts most; any character something (a spread of values
    even for a random model's completions)."""
    return [5.0 * c.count(t) + sum(ord(ch) % 5 for ch in c) / 10 for c, t in
            zip(completions, target)]


def short(completions, **kwargs):
    return [1.0]


def nan(completions, **kwargs):
    return [float("nan")] * len(completions)
'''
METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/letters/mean",
           "rewards/letters/std", "completions/mean_length", "completions/clipped_ratio",
           "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "num_tokens", "rollout_s", "update_s")


def write_prompts(path: Path, count: int = 32, seed: int = 0) -> Path:
    """Prompts of very different lengths (some longer than a rank's slice), a `target`
    column the reward function reads."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    with path.open("w") as f:
        for i in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.choice([3, 12, 40])))
            f.write(json.dumps({"prompt": f"{i}: {text}.", "target": rng.choice("aeiou")})
                    + "\n")
    return path


def grpo_config(tmp_path: Path, name: str, data: Path, **overrides) -> Path:
    settings = {
        "datasets": [{"path": str(data), "type": "prompt"}],
        "rl": "grpo", "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
        "lora_target_modules": ["q_proj", "v_proj", "o_proj"], "sequence_len": 512,
        "trl": {"reward_funcs": ["rewards.letters"], "num_generations": 4,
                "max_completion_length": 6, "beta": 0.04, "num_iterations": 2,
                "loss_type": "grpo"},
        "micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 4,
        "val_set_size": 0, "eval_steps": None, "learning_rate": 0.05,
    }
    return write_config(tmp_path, name, data, **{**settings, **overrides})


def assert_same_grpo_run(run: Path, reference: Path, adapter: bool = False) -> None:
    """Per-step losses, KL and gradient norms and the final weights equal within 1e-4
    relative. A step's loss can be ~0 by construction (ratio 1 and centred advantages at a
    generation batch's first step, KL 0 before the policy moves), which any run would match;
    the gradient norm is not, so each step's is compared too."""
    mine, theirs = read_metrics(run), read_metrics(reference)
    assert [m["step"] for m in mine] == [m["step"] for m in theirs]
    for a, b in zip(mine, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] > 1e-3
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    got, want = final_tensors(run, adapter), final_tensors(reference, adapter)
    assert set(got) == set(want)
    assert max(relative_error(got[k], want[k]) for k in want) < 1e-4


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    return write_prompts(tmp_path / "prompts.jsonl")


@pytest.mark.slow
def test_grpo_sp2_trains_as_sp1(tmp_path, prompts):
    """Two generation batches (num_iterations 2: rollout-time log-probabilities kept), the KL
    to the adapter-off reference, two micro-batches a step: the run over 2 ranks (each prompt
    prefilled across both, its completions sampled from that prefill, the update with the
    prompt once per group) steps as the single-process run, with TRL's metrics."""
    one = grpo_config(tmp_path, "sp1", prompts)
    two = grpo_config(tmp_path, "sp2", prompts, sequence_parallel_degree=2,
                      sequence_parallel_mode="ulysses")
    for config, ranks in ((one, 1), (two, 2)):
        train(config, ranks)
    assert_same_grpo_run(tmp_path / "sp2", tmp_path / "sp1", adapter=True)
    records = read_metrics(tmp_path / "sp2")
    for key in METRICS:
        assert key in records[0], key
    for mine, theirs in zip(records, read_metrics(tmp_path / "sp1"), strict=True):
        for key in ("reward", "completions/mean_length", "kl", "entropy"):
            if key not in theirs:  # a reused generation batch logs no new rewards
                assert key not in mine
                continue
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    # Step 1's loss is ~0 and its KL 0 by construction (ratio 1, centred advantages, policy =
    # reference); step 2 reuses the generation batch after an update, so neither is.
    assert records[0]["reward_std"] > 0
    assert abs(records[1]["loss"]) > 1e-3 and records[1]["kl"] > 1e-4
    assert "reward" not in records[1]  # a reused generation batch logs no new rewards
    samples = [json.loads(line) for line in
               (tmp_path / "sp2" / "completions.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "rewards", "advantage"} <= set(samples[0])
    assert set(samples[0]["rewards"]) == {"letters"}


def test_wrong_number_of_rewards_names_the_function():
    from longctx_cli.errors import UserError
    from longctx_cli.train.rewards import RewardFunctions

    namespace: dict = {}
    exec(REWARDS, namespace)  # noqa: S102 - the test's own reward functions
    functions = RewardFunctions([namespace["short"]], ["short"], __import__("torch").ones(1))
    with pytest.raises(UserError, match=r"`short` returned 1 values for 2 completions"):
        functions.score(["p", "p"], ["c", "d"], [[1], [2]], [{}, {}], 0, ["d.jsonl:1"] * 2)


@pytest.mark.slow
def test_reward_function_returning_too_few_values(tmp_path, prompts):
    config = grpo_config(tmp_path, "short", prompts, max_steps=1,
                         trl={"reward_funcs": ["rewards.short"], "num_generations": 4,
                              "max_completion_length": 4})
    result = run_longctx("train", str(config), "--nproc-per-node", "2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "reward function `short` returned 1 values for 8 completions" in result.stderr
    assert "prompts.jsonl:" in result.stderr  # the sample is named by file and line
    assert "Traceback" not in result.stderr


def test_reward_function_that_does_not_import(tmp_path, prompts):
    config = grpo_config(tmp_path, "missing", prompts,
                         trl={"reward_funcs": ["no_such_module.score"], "num_generations": 4,
                              "max_completion_length": 6})
    result = run_longctx("validate", str(config))
    assert result.returncode == 2
    assert "trl.reward_funcs[0]" in result.stderr and "does not import" in result.stderr
    assert "Traceback" not in result.stderr


def test_nan_reward_names_the_function_and_sample():
    from longctx_cli.errors import UserError
    from longctx_cli.train.rewards import RewardFunctions

    namespace: dict = {}
    exec(REWARDS, namespace)  # noqa: S102 - the test's own reward functions
    functions = RewardFunctions([namespace["nan"]], ["nan"], __import__("torch").ones(1))
    with pytest.raises(UserError, match=r"`nan` returned nan for completion 0 of data.jsonl:3"):
        functions.score(["p"], ["c"], [[1]], [{}], 0, ["data.jsonl:3"])


@pytest.mark.parametrize("change, message", [
    ({"micro_batch_size": 6}, "must be a multiple of `trl.num_generations: 4`"),
    ({"trl": {"reward_funcs": ["rewards.letters"], "num_generations": 4, "use_vllm": True}},
     "trl.use_vllm"),
    ({"trl": {"reward_funcs": ["rewards.letters"], "num_generations": 4,
              "max_completion_length": 600}}, "leaves no room for a prompt"),
    ({"trl": {"reward_funcs": ["letters"], "num_generations": 4}},
     "must be `module.function`"),
    ({"rl": None}, "`trl:` holds the settings of `rl: grpo`"),
    ({"trl": None}, "needs a `trl:` section"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
])
def test_grpo_config_errors(tmp_path, prompts, change, message):
    from longctx_cli.config.load import load_config
    from longctx_cli.errors import UserError

    config = grpo_config(tmp_path, "bad", prompts, **change)
    with pytest.raises(UserError) as info:
        load_config(config)
    assert message in str(info.value)


def _vowels(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def _length_or_none(completions, **kwargs):
    return [None if len(c) % 3 == 0 else float(len(c)) for c in completions]


@pytest.mark.parametrize("scale, aggregation", [
    ("group", "sum_then_normalize"),
    pytest.param("batch", "sum_then_normalize", marks=pytest.mark.slow),
    pytest.param("none", "sum_then_normalize", marks=pytest.mark.slow),
    ("batch", "normalize_then_sum")])
def test_advantages_match_trl(scale, aggregation):
    """TRL's GRPOTrainer samples a generation batch and computes its advantages and reward
    metrics; longctx's, from the same reward functions on TRL's completions, are equal
    (None rewards included)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from longctx_cli.train.rewards import advantages, function_metrics
    from tests.test_preference import base_model, tokenizer

    tok = tokenizer()
    prompts = ["the sky is", "two and two make", "a cat sat on"]
    args = GRPOConfig(output_dir="/tmp/longctx-trl-grpo-adv", report_to=[], use_cpu=True,
                      bf16=False, per_device_train_batch_size=12, num_generations=4,
                      max_completion_length=6, reward_weights=[1.0, 0.5],
                      scale_rewards=scale, multi_objective_aggregation=aggregation)
    torch.manual_seed(0)
    trainer = GRPOTrainer(model=base_model(), reward_funcs=[_vowels, _length_or_none],
                          args=args, train_dataset=Dataset.from_list([{"prompt": "x"}]),
                          processing_class=tok)
    out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts
                                                   for _ in range(4)])
    mask = out["completion_mask"].bool()
    ids = [row[m].tolist() for row, m in zip(out["completion_ids"], mask, strict=True)]
    completions = tok.batch_decode(ids, skip_special_tokens=True)
    rewards = torch.tensor([[math.nan if v is None else v for v in (a, b)] for a, b in zip(
        _vowels(completions), _length_or_none(completions), strict=True)])
    got, metrics = advantages(rewards, torch.tensor([1.0, 0.5]), 4, scale, aggregation)
    torch.testing.assert_close(got, out["advantages"], rtol=1e-5, atol=1e-6)
    metrics.update(function_metrics(rewards, ["_vowels", "_length_or_none"]))
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for key, value in metrics.items():
        assert value == pytest.approx(logged[key], rel=1e-5, nan_ok=True), key
    assert float(out["advantages"].abs().sum()) > 0


TRANSFORM = '''
def to_prompt(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["question"]}],
                "answer": example["solution"].split("####")[-1].strip()}
    return transform_fn, {"remove_columns": ["question", "solution"]}
'''


def test_axolotl_transform_prompts(tmp_path, prompts):
    """An Axolotl GRPO transform (`type: module.function`): chat prompts rendered with the
    chat template and its generation prompt, the transform's columns kept for the rewards,
    the removed ones gone."""
    from longctx_cli.config.load import load_config
    from longctx_cli.data.prepare import prepare
    from longctx_cli.data.tokenizer import BYTE_CHAT_TEMPLATE, load_tokenizer

    (tmp_path / "gsm.py").write_text(TRANSFORM)
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?",
                                        "solution": f"Add them. #### {2 * i}"}) + "\n"
                            for i in range(6)))
    path = grpo_config(tmp_path, "transform", data,
                       datasets=[{"path": str(data), "type": "gsm.to_prompt"}],
                       chat_template="jinja", chat_template_jinja=BYTE_CHAT_TEMPLATE)
    config = load_config(path)
    assert (config.data.datasets[0].type == "prompt"
            and config.data.datasets[0].transform == "gsm.to_prompt")
    tok = load_tokenizer(config)
    rows = prepare(config, tok).train
    assert len(rows) == 6
    first = rows[0]
    assert json.loads(first["prompt"]) == [{"role": "user", "content": "What is 0 + 0?"}]
    assert json.loads(first["columns"]) == {"answer": "0"}
    rendered = tok.apply_chat_template(json.loads(first["prompt"]),
                                       chat_template=BYTE_CHAT_TEMPLATE, tokenize=True,
                                       add_generation_prompt=True, return_dict=True)
    assert first["prompt_ids"] == list(rendered["input_ids"])
    assert first["where"].endswith("gsm.jsonl:1")


@pytest.mark.slow
def test_full_fine_tune_kl_reference_is_a_frozen_copy(tmp_path, prompts):
    """No adapter to switch off: the reference is a frozen copy of the initial model; the run
    at sp 2 equals sp 1 and the KL moves once the policy does."""
    settings = {"adapter": None, "learning_rate": 0.01}
    one = grpo_config(tmp_path, "sp1", prompts, **settings)
    two = grpo_config(tmp_path, "sp2", prompts, sequence_parallel_degree=2, **settings)
    for config, ranks in ((one, 1), (two, 2)):
        train(config, ranks)
    assert_same_grpo_run(tmp_path / "sp2", tmp_path / "sp1")
    assert read_metrics(tmp_path / "sp2")[-1]["kl"] > 0
