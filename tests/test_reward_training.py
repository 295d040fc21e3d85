"""Reward-model training under every SP strategy against TRL's own `RewardTrainer` on the same
pairs.

The reference is TRL itself, in this process: `RewardTrainer` (its tokenization, the eos it
appends, its collator and `compute_loss`) on a tiny Llama sequence-classification model.
longctx lays the same token ids out as preference rows (each pair's chosen, then its rejected
sequence), shards the row over the SP group of each layout, and computes the loss, TRL's
metrics and every parameter's gradient; they must match TRL's within float32 noise.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_preference import GRAD_TOL, TOL, grad_error, tokenizer

PAIRS = [  # (prompt, chosen, rejected, margin)
    ("A pass key is hidden in this text. The grass is green. The key is 4721. What is the "
     "key?", " 4721.", " 9130, I think.", 0.5),
    ("Name the colour of the sky on a clear day, in one word.", " Blue.", " Green.", 0.0),
    ("Two plus two is", " four.", " five, or maybe six.", 1.25),
]
LOSSES = {  # name -> (RewardConfig keys, with TRL's margin column)
    "plain": ({}, False),
    "margin": ({}, True),
    "centred": ({"center_rewards_coefficient": 0.01}, True),
}
LAYOUTS = {  # name -> (world, layout keywords)
    "sp1": (1, {"sp": 1}),
    "ring-zigzag": (2, {"sp": 2, "layout": "zigzag"}),
    "ulysses": (2, {"sp": 2, "mode": "ulysses"}),
    "p2p-stripe": (2, {"sp": 2, "ring_attn_func": "batch_stripe"}),  # the default ring
    "hybrid": (4, {"sp": 4, "mode": "hybrid", "ulysses_degree": 2}),
    "ring-sp4": (4, {"sp": 4, "layout": "zigzag"}),
}
SLOW_LAYOUTS = ("hybrid", "ring-sp4")
METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def reward_model(attn: str = "eager"):
    """A tiny Llama with a one-output `score` head, trained a little: rewards differ."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      num_labels=1, pad_token_id=0, attn_implementation=attn)
    model = LlamaForSequenceClassification(cfg).float()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # rewards of O(1): the loss is not flat
    return model


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def trl_reward(keys: dict, with_margin: bool) -> dict:
    """TRL's RewardTrainer on PAIRS (one batch of all): ids, loss, metrics, gradients."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    records = [{"prompt": p, "chosen": c, "rejected": r, **({"margin": m} if with_margin else {})}
               for p, c, r, m in PAIRS]
    args = RewardConfig(output_dir="/tmp/longctx-trl-reward", report_to=[], use_cpu=True,
                        per_device_train_batch_size=len(PAIRS), max_length=None, **keys)
    trainer = RewardTrainer(model=reward_model(), args=args,
                            train_dataset=Dataset.from_list(records),
                            processing_class=tokenizer())
    model = trainer.model
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    model.train()
    loss = trainer.compute_loss(model, trainer.data_collator(rows))
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ids = [(r["chosen_ids"], r["rejected_ids"]) for r in rows]
    return {"loss": loss.item(), "metrics": metrics, "grads": grads(model), "ids": ids}


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {name: trl_reward(*spec) for name, spec in LOSSES.items()}


def reward_row(ids: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's token ids as one longctx preference row: each pair's chosen, then its rejected
    sequence (no targets: a reward model scores, it does not predict tokens)."""
    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.data.pack import make_row

    samples = [(seq, [IGNORE_INDEX] * len(seq), list(range(len(seq))))
               for pair in ids for seq in pair]
    row = make_row(samples)
    return tuple(torch.tensor(row[k]) for k in ("input_ids", "position_ids", "labels"))


def longctx_worker(rank: int, world: int, layout: dict, losses: dict, ids: list) -> dict:
    import torch.distributed as dist

    from longctx_cli.parallel import register_sp_attention, shard_batch
    from longctx_cli.train.objectives.reward_training import (
        RewardLoss,
        RewardTraining,
        reward_loss_sum,
    )

    state = sp_state(kernel="torch", **layout)
    margins = torch.tensor([m for *_, m in PAIRS])
    out = {}
    for name, (keys, with_margin) in losses.items():
        batch = shard_batch(*reward_row(ids), state)
        model = reward_model(register_sp_attention())
        decoder = getattr(model, model.base_model_prefix)
        loss = RewardLoss(**keys)
        result = reward_loss_sum(decoder, model.score, batch, state, loss, pad_id=0,
                                 margins=margins if with_margin else None)
        (result.loss_sum / result.pairs).backward()
        mine = grads(model)
        for g in mine.values():
            dist.all_reduce(g)  # the step's gradient sync (over SP)
        objective = RewardTraining(state, decoder, model.score, loss, pad_id=0)
        counts = objective.counts([batch])
        with torch.no_grad():
            share = objective.loss_share(batch, counts) if not with_margin else None
        metrics = objective.step_metrics([share.metrics], counts) if share else None
        out[name] = {"loss": result.loss_sum.item() / result.pairs, "metrics": metrics,
                     "grads": {n: g.numpy() for n, g in mine.items()}}
    return out if rank == 0 else {}


def test_tokenization_appends_eos(references):
    """TRL's reward rows end with the eos (the pooled token); the pad id is not the eos."""
    for chosen, rejected in references["plain"]["ids"]:
        assert chosen[-1] == rejected[-1] == 1


def test_pair_losses_are_trls_formula():
    from longctx_cli.train.objectives.reward_training import RewardLoss

    chosen, rejected = torch.tensor([1.0, -0.5]), torch.tensor([0.25, 0.5])
    margins = torch.tensor([0.5, 0.0])
    got = RewardLoss(0.1).pair_losses(chosen, rejected, margins).mean()
    want = (-torch.nn.functional.logsigmoid(chosen - rejected - margins).mean()
            + 0.1 * torch.mean((chosen + rejected) ** 2))
    assert got == pytest.approx(want.item())


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow)
                                    if name in SLOW_LAYOUTS else name for name in LAYOUTS])
def test_matches_trl(layout, references):
    world, kwargs = LAYOUTS[layout]
    (got, *_) = run_distributed(longctx_worker, world, kwargs, LOSSES,
                                references["plain"]["ids"], timeout_s=240)
    assert set(got) == set(LOSSES)
    for name, mine in got.items():
        ref = references[name]
        assert abs(mine["loss"] - ref["loss"]) < TOL * max(1.0, abs(ref["loss"])), (
            name, mine["loss"], ref["loss"])
        error = grad_error(mine["grads"], ref["grads"])
        assert error < GRAD_TOL, (name, error)
        if mine["metrics"] is not None:  # the objective's step metrics, margin-free rows
            for key in METRICS:
                value, want = mine["metrics"][key], ref["metrics"][key]
                assert abs(value - want) < 1e-4 * max(1.0, abs(want)), (name, key, value, want)
    losses = {name: references[name]["loss"] for name in LOSSES}
    assert len({round(v, 6) for v in losses.values()}) == len(losses)  # each option matters


def reward_config(tmp_path, name: str, data, **overrides):
    from tests.train_helpers import write_config

    settings = {
        "datasets": [{"path": str(data), "type": "chatml.intel"}], "reward_model": True,
        "sequence_len": 640, "sample_packing": False, "gradient_accumulation_steps": 2,
        "max_steps": 3, "learning_rate": 0.01, "center_rewards_coefficient": 0.01,
        "val_set_size": 0, "eval_steps": None,
    }
    return write_config(tmp_path, name, data, **{**settings, **overrides})


def test_train_sp2_as_sp1_and_loads_as_a_classifier(tmp_path):
    """`longctx train` with `reward_model: true`: a full fine-tune of the tiny Llama's
    classifier over Ulysses sp 2 steps as the single-process run does, logs TRL's metric
    names, and its final/ loads with AutoModelForSequenceClassification (one label, the
    tokenizer's pad id)."""
    from transformers import AutoModelForSequenceClassification

    from tests.test_preference_train import write_pairs
    from tests.train_helpers import assert_same_run, read_metrics, train

    data = write_pairs(tmp_path / "pairs.jsonl", count=24)
    one = reward_config(tmp_path, "sp1", data)
    two = reward_config(tmp_path, "sp2", data, sequence_parallel_degree=2,
                        sequence_parallel_mode="ulysses")
    train(one, 1)
    train(two, 2)
    assert_same_run(tmp_path / "sp2", tmp_path / "sp1", tol=1e-4)
    records = read_metrics(tmp_path / "sp2")
    assert all(name in r for r in records for name in METRICS)
    assert 0.0 <= records[-1]["accuracy"] <= 1.0
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "sp2" / "final")
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    assert type(model).__name__ == "LlamaForSequenceClassification"


def test_bradley_terry_pairs_are_the_rendered_conversation():
    """Axolotl's `bradley_terry.chat_template`: `system` and `input` are the prompt turns,
    `chosen` and `rejected` the assistant's answer, rendered with the chat template."""
    from longctx_cli.data.preference import pair_texts

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    record = {"system": "Be brief.", "input": "Sky?", "chosen": "Blue.", "rejected": "Green."}
    got = pair_texts(record, "bradley_terry.chat_template", "r:1", tok=tokenizer(),
                     template=template)
    assert got == ("<system>Be brief.</s><user>Sky?</s><assistant>", "Blue.</s>", "Green.</s>")
    record["system"] = ""  # an empty system turn is left out, as Axolotl does
    assert pair_texts(record, "bradley_terry.chat_template", "r:1", tok=tokenizer(),
                      template=template)[0] == "<user>Sky?</s><assistant>"


def test_preference_rows_hold_trls_reward_ids(references):
    """A text pair tokenized for the preference rows (`pair_sample`) is TRL's RewardTrainer
    tokenization of `prompt + answer` (eos appended): the same sequences are scored."""
    from longctx_cli.data.preference import pair_sample

    for (prompt, chosen, rejected, _), ids in zip(PAIRS, references["plain"]["ids"],
                                                  strict=True):
        row, _, positions, why = pair_sample(tokenizer(), prompt, chosen, rejected)
        assert not why
        split = positions.index(0, 1)  # where the rejected sequence starts
        assert (row[:split], row[split:]) == tuple(ids)


RULES = [  # (keys besides the tiny model and a pair dataset, what the error names)
    ({"reward_model": True, "rl": "dpo"}, "keep one of them"),
    ({"center_rewards_coefficient": 0.01}, "set `reward_model: true`"),
    ({"reward_model": True, "rl_beta": 0.2}, "`rl_beta` is a key of `rl`"),
    ({"reward_model": True, "prefix_sharing": True}, "`prefix_sharing` is a key of `rl`"),
    ({"reward_model": True, "dpo_label_smoothing": 0.1}, "`dpo_label_smoothing` is a key"),
    ({"reward_model": True, "simpo_gamma": 1.0}, "`simpo_gamma` is a key of `rl`"),
    ({"reward_model": True, "val_set_size": 0.1}, "not supported with `reward_model: true`"),
    ({"reward_model": True, "datasets": [{"path": "d.jsonl", "type": "completion"}]},
     "trains on preference pairs"),
    ({"num_labels": 1}, "set `reward_model: true`"),
    ({"reward_model": True, "num_labels": 2}, "`num_labels` = 2"),
    ({"model_type": "AutoModelForSequenceClassification"}, "set `reward_model: true`"),
    ({"reward_model": True, "tensor_parallel_size": 2}, "`tensor_parallel_size > 1` is not"),
    ({"reward_model": True, "adapter": "lora", "merge_lora": True}, "`merge_lora: true` is"),
]


@pytest.mark.parametrize("keys, named", RULES)
def test_reward_model_keys_are_checked(keys, named):
    from longctx_cli.config import config_from_dict
    from longctx_cli.errors import UserError

    base = {"model_config": {"model_type": "llama"}, "eval_steps": None,
            "datasets": [{"path": "d.jsonl", "type": "chatml.intel"}]}
    with pytest.raises(UserError) as error:
        config_from_dict({**base, **keys})
    assert named in str(error.value), str(error.value)


def test_forward_only_commands_refuse_a_reward_model():
    from longctx_cli.config import config_from_dict
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import check_run

    config = config_from_dict({"model_config": {"model_type": "llama"}, "reward_model": True,
                               "val_set_size": 0, "eval_steps": None,
                               "datasets": [{"path": "d.jsonl", "type": "chatml.intel"}]})
    for command in ("eval", "generate", "merge-lora"):
        with pytest.raises(UserError) as error:
            check_run(config, command, 1)
        assert f"`longctx {command}` runs a causal LM" in str(error.value)


def test_reward_model_config_is_accepted():
    from longctx_cli.config import config_from_dict

    config = config_from_dict({"model_config": {"model_type": "llama"}, "reward_model": True,
                               "center_rewards_coefficient": 0.01, "val_set_size": 0,
                               "datasets": [{"path": "d.jsonl", "type": "chatml.intel"}]})
    assert config.objective.reward_model and config.objective.center_rewards_coefficient == 0.01


@pytest.mark.slow
def test_fsdp_dp2_trains_as_one_process(tmp_path):
    """FSDP2 over 2 DP ranks (the `score` head a group of its own) takes the same steps as
    one process accumulating the same 2 micro-batches."""
    from transformers import AutoModelForSequenceClassification

    from tests.test_preference_train import write_pairs
    from tests.train_helpers import assert_same_run, train

    data = write_pairs(tmp_path / "pairs.jsonl", count=16)
    one = reward_config(tmp_path, "one", data, max_steps=2)
    two = reward_config(tmp_path, "fsdp", data, max_steps=2, fsdp=True,
                        gradient_accumulation_steps=1)
    train(one, 1)
    train(two, 2)
    assert_same_run(tmp_path / "fsdp", tmp_path / "one", tol=1e-4)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "fsdp" / "final")
    assert model.config.num_labels == 1
