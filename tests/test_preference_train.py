"""`longctx train` with `rl:` end to end: the same run at sp 1 and sp 2, TRL's metric names,
held-out pairs, and the paragraphs bad preference input gets."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.train_helpers import (
    TINY_LLAMA,
    assert_same_run,
    read_metrics,
    run_longctx,
    train,
    write_config,
)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def write_pairs(path: Path, count: int = 48, seed: int = 0) -> Path:
    """chatml.intel records: prompts of very different lengths (some longer than the rank's
    slice, so pairs cross rank boundaries), short answers."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    with path.open("w") as f:
        for i in range(count):
            question = " ".join(rng.choice(words) for _ in range(rng.choice([2, 9, 30])))
            record = {"question": f"{i}: {question}?", "chosen": rng.choice(words),
                      "rejected": rng.choice(words) + " no"}
            if i % 3 == 0:
                record["system"] = "Be brief."
            f.write(json.dumps(record) + "\n")
    return path


def dpo_config(tmp_path: Path, name: str, data: Path, **overrides) -> Path:
    settings = {
        "datasets": [{"path": str(data), "type": "chatml.intel"}],
        "rl": "dpo", "rl_beta": 0.5, "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
        "lora_target_modules": ["q_proj", "v_proj", "o_proj"], "sequence_len": 256,
        "gradient_accumulation_steps": 2, "max_steps": 3, "val_set_size": 4, "eval_steps": 3,
        "learning_rate": 0.05,
    }
    return write_config(tmp_path, name, data, **{**settings, **overrides})


def test_dpo_sp2_trains_as_sp1(tmp_path):
    """The DPO run split over 2 ranks (zigzag) matches the single-process run step by step,
    and reports TRL's metrics for training and the held-out pairs; so does the same run with
    `prefix_sharing` over Ulysses sp 2 (each pair's prompt once, the rejected answer a
    branch). One pair a row, long enough for every unshared pair: all runs step the same
    pairs."""
    data = write_pairs(tmp_path / "pairs.jsonl")
    rows = {"sample_packing": False, "sequence_len": 640}
    one = dpo_config(tmp_path, "sp1", data, **rows)
    two = dpo_config(tmp_path, "sp2", data, **rows, sequence_parallel_degree=2,
                     sp_sharding="zigzag")
    shared = dpo_config(tmp_path, "shared", data, **rows, prefix_sharing=True,
                        sequence_parallel_degree=2, sequence_parallel_mode="ulysses")
    for config, ranks in ((one, 1), (two, 2), (shared, 2)):
        train(config, ranks)
    for run in ("sp2", "shared"):
        assert_same_run(tmp_path / run, tmp_path / "sp1", adapter=True, tol=1e-4)
        records = read_metrics(tmp_path / run)
        assert all(name in r for r in records for name in METRICS)
        last = records[-1]
        assert all(f"eval_{name}" in last for name in METRICS) and "eval_loss" in last
        assert 0.0 <= last["rewards/accuracies"] <= 1.0
        # The adapter moves the policy away from the reference (the base): rewards move.
        assert abs(last["rewards/margins"]) > 0
    assert (tmp_path / "sp2" / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_dpo_result_merges_and_evaluates(tmp_path):
    """After dpo, `merge_lora` writes a plain model and `longctx eval` runs on the adapter as
    after SFT; the held-out pairs are not rows whose loss by position means anything, and it
    says so."""
    data = write_pairs(tmp_path / "pairs.jsonl")
    config = dpo_config(tmp_path, "sp2", data, sequence_parallel_degree=2, merge_lora=True)
    train(config, 2)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "sp2" / "merged")
    assert merged.config.model_type == "llama"
    result = run_longctx("eval", str(config), "--checkpoint", str(tmp_path / "sp2" / "final"),
                         "--eval-context-lengths", "[256]", "--eval-samples-per-cell", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "position_loss skipped: the held-out rows are preference pairs" in result.stderr
    assert (tmp_path / "sp2" / "eval" / "passkey.json").is_file()


@pytest.mark.slow  # the precomputed reference against TRL runs by default (test_preference)
def test_dpo_full_finetune_precomputed_reference(tmp_path):
    """A full fine-tune with dpo: the reference log-probs are computed once from the initial
    weights, before training, and kept in output_dir; sp 2 (Ulysses) equals sp 1."""
    data = write_pairs(tmp_path / "pairs.jsonl", seed=3)
    full = {"adapter": None, "rl_beta": 0.2, "learning_rate": 0.01}
    one = dpo_config(tmp_path, "sp1", data, **full)
    two = dpo_config(tmp_path, "sp2", data, **full, sequence_parallel_degree=2,
                     sequence_parallel_mode="ulysses")
    train(one, 1)
    result = train(two, 2)
    assert "reference log-probabilities:" in result.stdout
    assert (tmp_path / "sp2" / "reference_logps.pt").is_file()
    assert_same_run(tmp_path / "sp2", tmp_path / "sp1", tol=1e-4)
    assert abs(read_metrics(tmp_path / "sp2")[-1]["rewards/margins"]) > 0


@pytest.mark.slow
def test_precomputed_reference_is_read_on_resume(tmp_path):
    """A resumed full fine-tune reads the reference table the first run saved (the same rows
    in the prepared-data cache, the same model) and ends where the uninterrupted run ends."""
    data = write_pairs(tmp_path / "pairs.jsonl", seed=5)
    full = {"adapter": None, "rl_beta": 0.2, "learning_rate": 0.01, "max_steps": 4,
            "save_steps": 2}
    train(dpo_config(tmp_path, "straight", data, **full), 1)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed",
                    ignore=shutil.ignore_patterns("final", "checkpoint-4"))
    resumed = dpo_config(tmp_path, "resumed", data, **full, resume_from_checkpoint="auto")
    result = train(resumed, 1)
    assert "reference log-probabilities: read from" in result.stdout
    assert_same_run(tmp_path / "resumed", tmp_path / "straight", tol=1e-5)


# Default runs check TP-sp's loss against TRL (tests/test_preference.py, tp2) and its
# training with orpo (test_orpo_tensor_parallel); these add dpo's adapter-off reference.
@pytest.mark.slow
@pytest.mark.parametrize("sp, world", [(1, 2), (2, 4)])
def test_dpo_tensor_parallel(tmp_path, sp, world):
    """TP-sp: each TP rank scores its part of the SP shard vocab-parallel; tp 2 (x sp 2, the
    adapter-off reference included) equals the single-process run."""
    data = write_pairs(tmp_path / "pairs.jsonl", seed=4)
    one = dpo_config(tmp_path, "sp1", data)
    tp = dpo_config(tmp_path, "tp", data, tensor_parallel_size=2, sequence_parallel_degree=sp)
    train(one, 1)
    train(tp, world)
    assert_same_run(tmp_path / "tp", tmp_path / "sp1", adapter=True, tol=1e-4)


@pytest.mark.slow
def test_dpo_fsdp_qlora(tmp_path):
    """DPO on a 4-bit base whose packed weights FSDP2 shards, at sp 2, equals the
    single-process QLoRA run: the adapter-off reference runs through the sharded layers."""
    pytest.importorskip("bitsandbytes")
    data = write_pairs(tmp_path / "pairs.jsonl", seed=2)
    qlora = {"adapter": "qlora", "lora_target_linear": True, "lora_target_modules": None}
    one = dpo_config(tmp_path, "sp1", data, **qlora)
    two = dpo_config(tmp_path, "fsdp", data, **qlora, sequence_parallel_degree=2, fsdp=True)
    train(one, 1)
    train(two, 2)
    assert_same_run(tmp_path / "fsdp", tmp_path / "sp1", adapter=True, tol=1e-4)


@pytest.mark.slow  # the preference losses under TP against TRL run by default (test_preference)
def test_orpo_tensor_parallel(tmp_path):
    """orpo (NLL over the chosen prompt and answer, odds ratio) at tp 2, each TP rank scoring
    its part of the tokens vocab-parallel, with 2 micro-batches a step and held-out pairs,
    equals the single-process run; ORPOTrainer's metric names are reported."""
    data = write_pairs(tmp_path / "pairs.jsonl", seed=6)
    orpo = {"rl": "orpo", "orpo_alpha": 0.5, "rl_beta": None}
    one = dpo_config(tmp_path, "sp1", data, **orpo)
    tp = dpo_config(tmp_path, "tp", data, **orpo, tensor_parallel_size=2)
    plan = run_longctx("validate", str(tp), "--nproc-per-node", "2")
    assert "orpo, beta 0.5" in " ".join(plan.stdout.split()), plan.stdout
    train(one, 1)
    train(tp, 2)
    assert_same_run(tmp_path / "tp", tmp_path / "sp1", adapter=True, tol=1e-4)
    last = read_metrics(tmp_path / "tp")[-1]
    names = (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
    assert all(name in last and f"eval_{name}" in last for name in names), sorted(last)
    assert last["nll_loss"] > 0 and last["log_odds_ratio"] < 0


@pytest.mark.slow
def test_orpo_ring_sp2(tmp_path):
    """orpo, a full fine-tune, over the zigzag ring at sp 2 equals sp 1."""
    data = write_pairs(tmp_path / "pairs.jsonl", seed=7)
    orpo = {"rl": "orpo", "adapter": None, "rl_beta": 0.3, "learning_rate": 0.01}
    one = dpo_config(tmp_path, "sp1", data, **orpo)
    two = dpo_config(tmp_path, "sp2", data, **orpo, sequence_parallel_degree=2,
                     sp_sharding="zigzag")
    train(one, 1)
    train(two, 2)
    assert_same_run(tmp_path / "sp2", tmp_path / "sp1", tol=1e-4)


@pytest.mark.slow
def test_simpo_ring_hybrid(tmp_path):
    """simpo (no reference, full fine-tune) over sp 4 as ulysses 2 x ring 2 equals sp 1."""
    data = write_pairs(tmp_path / "pairs.jsonl", seed=1)
    base = {"rl": "simpo", "adapter": None, "rl_beta": 2.0, "val_set_size": 0,
            "eval_steps": None, "max_steps": 2}
    one = dpo_config(tmp_path, "sp1", data, **base)
    four = dpo_config(tmp_path, "sp4", data, **base, sequence_parallel_degree=4,
                      sequence_parallel_mode="hybrid", ulysses_degree=2)
    train(one, 1)
    train(four, 4)
    assert_same_run(tmp_path / "sp4", tmp_path / "sp1", tol=1e-4)


def refusal(tmp_path: Path, records: list[dict] | None = None, command: str = "validate",
            **overrides) -> str:
    data = tmp_path / "pairs.jsonl"
    if records is None:
        write_pairs(data)
    else:
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = dpo_config(tmp_path, "bad", data, **overrides)
    result = run_longctx(command, str(config))
    assert result.returncode != 0, result.stdout
    text = result.stdout + result.stderr
    assert "Traceback" not in text, text
    return " ".join(text.split())


@pytest.mark.parametrize("overrides, expected", [
    ({"rl": "kto"}, "KTO"),
    ({"rl": "orpo", "dpo_loss_type": "sigmoid"}, "has its own"),
    ({"rl": "orpo", "orpo_alpha": 0.2, "rl_beta": 0.3}, "keep one"),
    ({"orpo_alpha": 0.2}, "set `rl: orpo`"),
    ({"rl": None, "prefix_sharing": True}, "set `rl`"),
    ({"rl": "orpo", "prefix_sharing": True}, "ORPO tokenizes"),
    ({"prefix_sharing": True, "model_config": {**TINY_LLAMA, "model_type": "mistral",
                                               "sliding_window": 16}}, "sliding-window"),
    ({"rl": "grpo"}, "needs a `trl:` section"),
    ({"datasets": None}, "preference type"),
    ({"rl": None}, "set `rl`"),
    ({"excess_length_strategy": "truncate"}, "dropped and counted"),
    ({"dpo_label_smoothing": 0.1}, "robust"),
    ({"dpo_loss_type": ["sigmoid", "hinge"], "dpo_loss_weights": [1.0]}, "one per"),
    ({"rl": "ipo", "dpo_loss_type": "hinge"}, "ipo loss"),
    ({"datasets": "chat_template.default", "chat_template": "metharme"}, "ships chatml"),
])
def test_config_refusals(tmp_path, overrides, expected):
    if overrides.get("datasets") is None and "datasets" in overrides:  # an SFT type with rl
        overrides = {"datasets": [{"path": str(tmp_path / "pairs.jsonl"),
                                   "type": "completion", "field": "question"}]}
    elif "datasets" in overrides:  # that type, the rest of the entry as written
        overrides["datasets"] = [{"path": str(tmp_path / "pairs.jsonl"),
                                  "type": overrides["datasets"]}]
    assert expected in refusal(tmp_path, **overrides)


def test_pair_without_field(tmp_path):
    text = refusal(tmp_path, [{"question": "q", "chosen": "a", "rejected": "b"},
                              {"question": "q", "chosen": "a"}], command="preprocess")
    assert "pairs.jsonl:2" in text and "`rejected`" in text


def test_dropped_pairs_are_counted(tmp_path):
    """Identical answers and pairs that leave no room in sequence_len are dropped and
    counted in the data report, not trained on."""
    records = [{"question": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(20)]
    records += [{"question": "same", "chosen": "x", "rejected": "x"}] * 2
    records += [{"question": "long " * 60, "chosen": "yes", "rejected": "no"}] * 3
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = dpo_config(tmp_path, "drops", data)
    result = run_longctx("preprocess", str(config), env={"COLUMNS": "200"})
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, text
    assert "2 (chosen identical to rejected)" in text and "3 dropped" in text, text
    assert "Packing 20 samples" in text, text
