"""`longctx train` with `rl: kto` end to end at sp 2, against TRL's `KTOTrainer`: the second
step's loss and metrics (at the adapter after the first update, which a one-step run leaves
in final/) equal TRL's `compute_loss` on the same examples (its tokenization, its KL
completions, its collator) with the same adapter weights; and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train_helpers import read_metrics, run_longctx, train, write_config

# A heavy desirable weight: the first update raises the completions' log-ratios, so the
# second step's KL point is positive (with lighter ones it is clamped to 0 here).
BETA, DESIRABLE = 0.5, 4.0
BATCH = 2  # micro_batch_size: TRL's per_device_train_batch_size


def write_examples(path: Path) -> Path:
    """Axolotl's `llama3.ultra` KTO records, desirable and not."""
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    with path.open("w") as f:
        for i in range(8):
            record = {"prompt": f"{i}: " + " ".join(words[: 2 + 3 * (i % 3)]) + "?",
                      "completion": words[(3 * i) % len(words)] + (" no" * (i % 2)),
                      "label": i % 2 == 0}
            if i % 2:
                record["system"] = "Be brief."
            f.write(json.dumps(record) + "\n")
    return path


def kto_config(tmp_path: Path, name: str, data: Path, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tmp_path / "base"
    if not base.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(
            vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        )).save_pretrained(base)
    settings = {
        "model_config": None, "base_model": str(base),
        "datasets": [{"path": str(data), "type": "llama3.ultra"}],
        "rl": "kto", "rl_beta": BETA, "kto_desirable_weight": DESIRABLE, "adapter": "lora",
        "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"], "sequence_len": 512,
        "sample_packing": False, "shuffle_merged_datasets": False,
        "micro_batch_size": BATCH, "gradient_accumulation_steps": 1, "max_steps": 2,
        "val_set_size": 0, "eval_steps": None, "learning_rate": 0.05,
    }
    return write_config(tmp_path, name, data, **{**settings, **overrides})


def trl_loss(tmp_path: Path, data: Path, checkpoint: Path, first: int) -> dict:
    """TRL's KTOTrainer loss and metrics on examples `first, first + 1` (one of its batches)
    with the adapter of `checkpoint`."""
    from datasets import Dataset
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    from longctx_cli.data.kto import kto_texts
    from longctx_cli.data.tokenizer import byte_tokenizer

    records = [json.loads(line) for line in data.read_text().splitlines()]
    texts = [kto_texts(r, "llama3.ultra", "r") for r in records[first:first + BATCH]]
    dataset = Dataset.from_list([{"prompt": p, "completion": c, "label": d}
                                 for p, c, d in texts])
    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                     per_device_train_batch_size=BATCH, beta=BETA, max_length=None,
                     desirable_weight=DESIRABLE)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "v_proj"])
    trainer = KTOTrainer(model=AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                         args=args, train_dataset=dataset, processing_class=byte_tokenizer(),
                         peft_config=lora)
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(trainer.model, saved)
    assert not result.unexpected_keys, result.unexpected_keys
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    return {"loss": loss.item(), **{k: v[-1] for k, v in trainer._metrics["train"].items()}}


def test_kto_sp2_step_matches_trl(tmp_path):
    """Both runs step the same first batch (examples 0, 1); the sp 2 run's second step (2, 3)
    is computed at the adapter the one-step sp 1 run saved."""
    data = write_examples(tmp_path / "kto.jsonl")
    one = kto_config(tmp_path, "sp1", data, max_steps=1)
    two = kto_config(tmp_path, "sp2", data, sequence_parallel_degree=2, sp_sharding="zigzag")
    train(one, 1)
    train(two, 2)
    first, steps = read_metrics(tmp_path / "sp1"), read_metrics(tmp_path / "sp2")
    assert [r["step"] for r in steps] == [1, 2]
    assert abs(first[0]["loss"] - steps[0]["loss"]) < 1e-6
    assert steps[0]["loss"] == pytest.approx((DESIRABLE + 1) / 4)  # policy = reference at first
    want = trl_loss(tmp_path, data, tmp_path / "sp1" / "final", first=BATCH)
    got = steps[1]
    assert abs(got["loss"] - want["loss"]) < 2e-5 * max(1.0, abs(want["loss"])), (got, want)
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert abs(got[key] - want[key]) < 1e-4 * max(1.0, abs(want[key])), (key, got, want)
    assert abs(got["rewards/margins"]) > 0  # the first update moved the policy
    assert want["kl"] > 0  # the KL point is exercised, not clamped to 0


@pytest.mark.parametrize("overrides, expected", [
    ({"micro_batch_size": 1}, "2 or more"),
    ({"adapter": None}, "set `adapter: lora`"),
    ({"sample_packing": True}, "sample_packing: false"),
    ({"val_set_size": 2}, "no evaluation"),
    ({"dpo_loss_type": "sigmoid"}, "DPO family"),
    ({"datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]}, "KTO type"),
    ({"rl": "dpo"}, "set `rl: kto`"),
])
def test_config_refusals(tmp_path, overrides, expected):
    data = write_examples(tmp_path / "kto.jsonl")
    config = kto_config(tmp_path, "bad", data, **overrides)
    result = run_longctx("validate", str(config))
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, text
    assert "Traceback" not in text, text
    assert expected in text, text
