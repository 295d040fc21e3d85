"""KTO under every SP strategy against TRL's own `KTOTrainer` on the same examples.

The reference is TRL itself, in this process: `KTOTrainer` (its tokenization, its KL
completions rotated within the batch, its collator and `compute_loss`, the reference being
the PEFT model with its adapter disabled). longctx lays the same token ids out as KTO rows
(each example's completion, then its mismatched KL sequence), shards the row over the SP
group of each layout and computes the loss, TRL's metrics and the adapter's gradients; they
must match TRL's within float32 noise.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_preference import (
    GRAD_TOL,
    TOL,
    adapter_grads,
    base_model,
    grad_error,
    lora_config,
    policy_model,
    tokenizer,
    trained_adapter,
)

BETA = 0.2
EXAMPLES = [  # (prompt, completion, desirable); more desirable than not, as in real data
    ("A pass key is hidden in this text. The grass is green. The key is 4721. What is the "
     "key?", " 4721.", True),
    ("Name the colour of the sky on a clear day, in one word.", " Green.", False),
    ("Two plus two is", " four.", True),
    ("The capital of France is", " Paris, the city of light.", True),
]
LOSSES = {  # name -> KTOConfig keys
    "kto": {"loss_type": "kto"},
    "kto-weighted": {"loss_type": "kto", "desirable_weight": 0.75, "undesirable_weight": 1.5},
    "apo_zero_unpaired": {"loss_type": "apo_zero_unpaired"},
}
LAYOUTS = {  # name -> (world, layout keywords)
    "sp1": (1, {"sp": 1}),
    "ring-zigzag": (2, {"sp": 2, "layout": "zigzag"}),
    "ulysses": (2, {"sp": 2, "mode": "ulysses"}),
    "hybrid": (4, {"sp": 4, "mode": "hybrid", "ulysses_degree": 2}),
    "ring-sp4": (4, {"sp": 4, "layout": "zigzag"}),
    "ulysses-sp4": (4, {"sp": 4, "mode": "ulysses"}),
    # DP ranks each take the same row: the KL mean over them is each one's, counted once
    # per SP group; their gradient shares are divided by the DP degree.
    "dp2-x-sp2": (4, {"sp": 2, "layout": "zigzag"}),
}
SLOW_LAYOUTS = ("hybrid", "ring-sp4", "ulysses-sp4", "dp2-x-sp2")
# What the KTO metrics are: TRL's means over the chosen (or rejected) examples of the batch.
SHOWN = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected",
         "rewards/margins")


def trl_kto(keys: dict) -> dict:
    """TRL's KTOTrainer on EXAMPLES (one batch of all): ids, loss, metrics, gradients
    (apo_zero_unpaired has no KL sequences: `None` in their place)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    data = Dataset.from_list([{"prompt": p, "completion": c, "label": d}
                              for p, c, d in EXAMPLES])
    args = KTOConfig(output_dir="/tmp/longctx-trl-kto", report_to=[], use_cpu=True,
                     per_device_train_batch_size=len(EXAMPLES), beta=BETA, max_length=None,
                     **keys)
    trainer = KTOTrainer(model=base_model(), args=args, train_dataset=data,
                         processing_class=tokenizer(), peft_config=lora_config())
    model = trainer.model
    trained_adapter(model)
    rows = [trainer.train_dataset[i] for i in range(len(EXAMPLES))]
    model.train()
    loss = trainer.compute_loss(model, trainer.data_collator(rows))
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ids = [(r["prompt_ids"], r["completion_ids"], r.get("KL_completion_ids"), r["label"])
           for r in rows]
    return {"loss": loss.item(), "metrics": metrics, "grads": adapter_grads(model), "ids": ids}


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {name: trl_kto(keys) for name, keys in LOSSES.items()}


def kto_row(ids: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's token ids as one longctx row: each example's completion sequence, then its KL
    sequence, targets on the answers only; and the examples' labels."""
    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.data.pack import make_row

    def sample(prompt: list[int], answer: list[int]) -> tuple[list, list, list]:
        seq = prompt + answer
        return seq, [IGNORE_INDEX] * len(prompt) + answer, list(range(len(seq)))

    samples = []
    for prompt, completion, kl_completion, _ in ids:
        (a, la, pa), (b, lb, pb) = sample(prompt, completion), sample(prompt, kl_completion)
        samples.append((a + b, la + lb, pa + pb))
    row = make_row(samples)
    labels = torch.tensor([label for *_, label in ids])
    return (*(torch.tensor(row[k]) for k in ("input_ids", "position_ids", "labels")), labels)


def longctx_worker(rank: int, world: int, layout: dict, losses: dict, ids: list) -> dict:
    import torch.distributed as dist

    from longctx_cli.parallel import register_sp_attention, shard_batch
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.train.objectives.kto import KtoLoss, kto_loss_sum

    state = sp_state(kernel="torch", **layout)
    *row, labels = kto_row(ids)
    out = {}
    for name, keys in losses.items():
        batch = shard_batch(*row, state)
        model = policy_model(register_sp_attention())
        decoder, head = decoder_and_head(model)
        loss = KtoLoss(beta=BETA, **keys)
        result = kto_loss_sum(model, decoder, head, batch, labels, state, loss,
                              chunk_size=16 if name == "kto-weighted" else None)
        (result.loss_sum / result.examples / state.layout.dp).backward()
        grads = adapter_grads(model)
        for g in grads.values():
            dist.all_reduce(g)  # the step's gradient sync (over SP and DP)
        sums = result.metric_sums
        metrics = {"kl": result.kl}
        for side in ("chosen", "rejected"):
            for what in ("rewards", "logps"):
                metrics[f"{what}/{side}"] = sums[f"{what}/{side}"] / sums[f"count/{side}"]
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        out[name] = {"loss": result.loss_sum.item() / result.examples, "metrics": metrics,
                     "grads": {n: g.numpy() for n, g in grads.items()}}
    return out if rank == 0 else {}


def test_kl_sequences_are_the_rotated_completions(references):
    """TRL's KL completions are the batch's completions rotated by one: what the row's odd
    documents hold."""
    ids = references["kto"]["ids"]
    completions = [c for _, c, _, _ in ids]
    assert [kl for _, _, kl, _ in ids] == completions[-1:] + completions[:-1]


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow)
                                    if name in SLOW_LAYOUTS else name for name in LAYOUTS])
def test_matches_trl(layout, references):
    world, kwargs = LAYOUTS[layout]
    (got, *_) = run_distributed(longctx_worker, world, kwargs, LOSSES,
                                references["kto"]["ids"], timeout_s=240)
    assert set(got) == set(LOSSES)
    for name, mine in got.items():
        ref = references[name]
        assert abs(mine["loss"] - ref["loss"]) < TOL * max(1.0, abs(ref["loss"])), (
            name, mine["loss"], ref["loss"])
        for key in SHOWN:
            value = mine["metrics"][key]
            assert abs(value - ref["metrics"][key]) < 1e-4 * max(1.0, abs(value)), (name, key)
        error = grad_error(mine["grads"], ref["grads"])
        assert error < GRAD_TOL, (name, error)
        assert ref["loss"] != pytest.approx(0.0)
    assert references["kto"]["metrics"]["kl"] > 0  # the KL term is exercised, not clamped
