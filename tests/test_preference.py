"""Preference losses under every SP strategy against TRL's own computation of the same pairs.

The reference is TRL itself, in this process: `DPOTrainer` (its tokenization, collator and
`compute_loss`, the reference being the PEFT model with its adapter disabled) for the dpo loss
types and `rl: ipo`; `CPOTrainer`'s `get_batch_logps` and `cpo_loss` on the model's own
logits for simpo; `ORPOTrainer` (its tokenization, collator and `get_batch_loss_metrics`)
for orpo. longctx packs the same pairs into one row, shards it over the SP group of
each layout and computes the loss, TRL's metrics and the adapter's gradients; they must match
TRL's within float32 noise.
"""

from __future__ import annotations

import types
import zlib

import pytest
import torch

from longctx_cli.data.preference import orpo_pair_sample, pair_sample
from longctx_cli.errors import UserError
from tests.distributed import run_distributed
from tests.layouts import sp_state

TOL = 2e-5  # loss
# Gradients: relative error of all adapter gradients as one vector. The float32 rounding of
# the rings' merge order alone moves this tiny adapter's gradients by up to 9e-5 on these
# rows (the same row's SFT gradient, stripe vs sp1), and DPO's cancellation between chosen
# and rejected magnifies it (measured up to 1.4e-4). A real fault (a pair mis-assigned, a
# share counted twice, a shifted label) moves them by O(1).
GRAD_TOL = 3e-4
BETA = 0.2
PAIRS = [  # prompts longer than the answers, as in long-context preference data
    ("A pass key is hidden in this text. The grass is green. The key is 4721. The sky is "
     "blue. What is the key?", " 4721.", " 9130, I think."),
    ("Name the colour of the sky on a clear day, in one word, after reading this line.",
     " Blue.", " Green."),
    ("Two plus two is", " four.", " five, or maybe six."),
]
LOSSES = {  # name -> (rl, dpo loss types, label smoothing)
    "sigmoid": ("dpo", ["sigmoid"], 0.0),
    "hinge": ("dpo", ["hinge"], 0.0),
    "ipo": ("ipo", ["ipo"], 0.0),
    "robust": ("dpo", ["robust"], 0.1),
    "sigmoid+hinge": ("dpo", ["sigmoid", "hinge"], 0.0),
    "simpo": ("simpo", [], 0.1),
    "orpo": ("orpo", [], 0.0),
    # prefix_sharing: the prompt once per pair; TRL's unshared computation is the reference
    "sigmoid-shared": ("dpo", ["sigmoid"], 0.0),
    "ipo-shared": ("ipo", ["ipo"], 0.0),
    "simpo-shared": ("simpo", [], 0.1),
}
SHARED_PROMPT = {"sigmoid-shared": "sigmoid", "ipo-shared": "ipo", "simpo-shared": "simpo"}
LAYOUTS = {  # name -> (world, layout keywords)
    "sp1": (1, {"sp": 1}),
    "ring-contiguous": (2, {"sp": 2, "layout": "contiguous"}),
    "ring-zigzag": (2, {"sp": 2, "layout": "zigzag"}),
    "p2p-stripe": (2, {"sp": 2, "ring_attn_func": "batch_stripe"}),
    "p2p-zigzag": (2, {"sp": 2, "ring_attn_func": "batch_zigzag", "layout": "zigzag"}),
    "ulysses": (2, {"sp": 2, "mode": "ulysses"}),
    "hybrid": (4, {"sp": 4, "mode": "hybrid", "ulysses_degree": 2}),
    "dp2-x-sp2": (4, {"sp": 2, "layout": "zigzag"}),
    "ring-sp4": (4, {"sp": 4, "layout": "zigzag"}),
    "tp2": (2, {"tp": 2}),  # TP-sp: each TP rank scores its part of the tokens vocab-parallel
    "tp2-x-sp2": (4, {"sp": 2, "tp": 2, "mode": "ulysses"}),
}
SIMPO_GAMMA = 0.5


def tokenizer():
    from longctx_cli.data.tokenizer import byte_tokenizer

    return byte_tokenizer()


def base_model(attn: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).float()


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def trained_adapter(model) -> None:
    """Give the new adapter seeded values (B is zero at creation, A drawn from the global
    RNG), as after some training: the policy then differs from the reference (the base with
    the adapter off), and TRL's copy and ours hold the same weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def policy_model(attn: str = "eager"):
    """The tiny Llama with a LoRA adapter whose B is not zero (policy != reference)."""
    from peft import get_peft_model

    model = get_peft_model(base_model(attn), lora_config())
    trained_adapter(model)
    return model


def adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_error(mine: dict, ref: dict[str, torch.Tensor]) -> float:
    """Relative error of all adapter gradients as one vector (`mine`: name -> numpy array
    from a worker, `ref`: name -> tensor), the same parameters on both sides."""
    assert set(mine) == set(ref)
    mine_flat = torch.cat([torch.from_numpy(mine[n]).flatten() for n in ref])
    ref_flat = torch.cat([g.flatten() for g in ref.values()])
    return float((mine_flat - ref_flat).norm() / ref_flat.norm())


def trl_dpo(loss_types: list[str], smoothing: float) -> dict:
    """TRL's DPOTrainer on PAIRS: token ids, loss, metrics and the adapter's gradients."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    args = DPOConfig(output_dir="/tmp/longctx-trl-dpo", report_to=[], use_cpu=True,
                     per_device_train_batch_size=len(PAIRS), loss_type=loss_types, beta=BETA,
                     label_smoothing=smoothing, max_length=None)
    trainer = DPOTrainer(model=base_model(), args=args, train_dataset=data,
                         processing_class=tokenizer(), peft_config=lora_config())
    model = trainer.model
    trained_adapter(model)
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    batch = trainer.data_collator(rows)
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ids = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
    return {"loss": loss.item(), "metrics": metrics, "grads": adapter_grads(model), "ids": ids}


def trl_simpo(smoothing: float) -> dict:
    """TRL's CPOTrainer simpo loss (`get_batch_logps` averaged, `cpo_loss`) on the model's
    own logits of each sequence (padded batch, answer-only labels)."""
    from trl.experimental.cpo import CPOTrainer

    model = policy_model()
    tok = tokenizer()
    seqs, labels = [], []
    for prompt, chosen, rejected in PAIRS:
        ids, labs, pos, _ = pair_sample(tok, prompt, chosen, rejected)
        split = pos.index(0, 1)
        seqs += [ids[:split], ids[split:]]
        labels += [labs[:split], labs[split:]]
    order = list(range(0, len(seqs), 2)) + list(range(1, len(seqs), 2))  # chosen, then rejected
    width = max(len(s) for s in seqs)
    input_ids = torch.tensor([seqs[i] + [0] * (width - len(seqs[i])) for i in order])
    mask = torch.tensor([[1] * len(seqs[i]) + [0] * (width - len(seqs[i])) for i in order])
    label_t = torch.tensor([labels[i] + [-100] * (width - len(labels[i])) for i in order])
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    logps = CPOTrainer.get_batch_logps(logits, label_t, average_log_prob=True)
    chosen, rejected = logps.chunk(2)
    stub = types.SimpleNamespace(alpha=0.0, beta=BETA, simpo_gamma=SIMPO_GAMMA,
                                 label_smoothing=smoothing, loss_type="simpo",
                                 accelerator=types.SimpleNamespace(device="cpu"))
    losses, chosen_r, rejected_r = CPOTrainer.cpo_loss(stub, chosen, rejected)
    loss = losses.mean()
    loss.backward()
    metrics = {"rewards/chosen": chosen_r.mean().item(),
               "rewards/rejected": rejected_r.mean().item(),
               "rewards/accuracies": (chosen_r > rejected_r).float().mean().item(),
               "rewards/margins": (chosen_r - rejected_r).mean().item(),
               "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}
    return {"loss": loss.item(), "metrics": metrics, "grads": adapter_grads(model)}


def trl_orpo() -> dict:
    """TRL's ORPOTrainer on PAIRS (LoRA, no reference): token ids, loss, metrics, gradients."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    args = ORPOConfig(output_dir="/tmp/longctx-trl-orpo", report_to=[], use_cpu=True,
                      per_device_train_batch_size=len(PAIRS), beta=BETA)
    trainer = ORPOTrainer(model=base_model(), args=args, train_dataset=data,
                          processing_class=tokenizer(), peft_config=lora_config())
    model = trainer.model
    trained_adapter(model)
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    model.train()
    loss, metrics = trainer.get_batch_loss_metrics(model, trainer.data_collator(rows))
    loss.backward()
    ids = [(r["chosen_input_ids"], r["chosen_labels"], r["rejected_input_ids"],
            r["rejected_labels"]) for r in rows]
    return {"loss": loss.item(), "metrics": metrics, "grads": adapter_grads(model), "ids": ids}


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    out = {}
    for name, (rl, loss_types, smoothing) in LOSSES.items():
        if name in SHARED_PROMPT:
            continue
        out[name] = (trl_simpo(smoothing) if rl == "simpo" else trl_orpo() if rl == "orpo"
                     else trl_dpo(loss_types, smoothing))
    return out


def packed_pairs(rl: str = "dpo", share_prompt: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every pair in one row, chosen then rejected, as longctx's data pipeline packs them
    (tokenized as TRL's trainer of `rl` does; `share_prompt`: with `prefix_sharing`)."""
    from longctx_cli.data.pack import make_row

    tok = tokenizer()
    if rl == "orpo":
        samples = (orpo_pair_sample(tok, *pair) for pair in PAIRS)
    else:
        samples = (pair_sample(tok, *pair, share_prompt=share_prompt) for pair in PAIRS)
    row = make_row(sample[:3] for sample in samples)
    return tuple(torch.tensor(row[k]) for k in ("input_ids", "position_ids", "labels"))


def longctx_worker(rank: int, world: int, layout: dict, losses: dict) -> dict:
    import torch.distributed as dist

    from longctx_cli.parallel import register_sp_attention, shard_batch
    from longctx_cli.parallel.tensor_parallel import apply_tensor_parallel
    from longctx_cli.runtime.model import decoder_and_head, decoder_of
    from longctx_cli.train.preference import PreferenceLoss, chosen_targets, preference_loss_sum
    from longctx_cli.train.step import sum_gradients

    state = sp_state(kernel="torch", **layout)
    out = {}
    for name, (rl, loss_types, smoothing) in losses.items():
        # DP ranks each take the same row here: their sums are divided by the DP degree.
        batch = shard_batch(*packed_pairs(rl, name in SHARED_PROMPT), state,
                            next_tokens=rl == "orpo")
        if name in SHARED_PROMPT:  # every pair's rejected answer is a branch of its prompt
            assert len(batch.sp_meta.prefixes) == len(PAIRS)
        model = policy_model(register_sp_attention())
        if state.layout.tp > 1:  # as build_model does: the adapter first, then TP
            base = model.get_base_model()
            apply_tensor_parallel(decoder_of(base), base.get_output_embeddings(), state,
                                  base.config)
        decoder, head = decoder_and_head(model)
        objective = PreferenceLoss(rl, tuple(loss_types), (1.0,) * len(loss_types), BETA,
                                   smoothing, SIMPO_GAMMA)
        config = types.SimpleNamespace(memory=types.SimpleNamespace(
            chunked_loss=name in ("hinge", "orpo"), loss_chunk_size=16))
        # The step's weight (train_step): pairs / chosen targets, here of the one row.
        nll_weight = len(PAIRS) / chosen_targets(batch)
        result = preference_loss_sum(model, decoder, head, batch, config, state, objective,
                                     nll_weight=nll_weight)
        (result.loss_sum / result.pairs / state.layout.dp).backward()
        if state.layout.tp > 1:  # the trainer's sync: TP partial sums, then SP and DP
            sum_gradients([p for p in model.parameters() if p.requires_grad], state)
            grads = {n: g.full_tensor() for n, g in adapter_grads(model).items()}
        else:
            grads = adapter_grads(model)
            for g in grads.values():
                dist.all_reduce(g)  # the step's gradient sync (over SP and DP)
        out[name] = {"loss": result.loss_sum.item() / result.pairs,
                     "grads": {n: g.numpy() for n, g in grads.items()},  # tensors die with us
                     "metrics": {k: v / result.pairs for k, v in result.metric_sums.items()}}
    return out if rank == 0 else {}


def test_every_shipped_chat_template_is_declared():
    from longctx_cli.config.sections.data import SHIPPED_CHAT_TEMPLATES
    from longctx_cli.data.chat_templates import END_OF_TURN, TEMPLATES

    assert sorted(TEMPLATES) == sorted(END_OF_TURN) == sorted(SHIPPED_CHAT_TEMPLATES)


def test_every_declared_type_is_rendered():
    from longctx_cli.config.sections.data import PREFERENCE_TYPES
    from longctx_cli.data.preference import RENDERED_TYPES

    assert sorted(PREFERENCE_TYPES) == sorted(RENDERED_TYPES)


def test_shared_prompt_sample():
    """prefix_sharing: the rejected sequence keeps the prompt's last token, positions going
    on from the prompt's; the targets are those of the unshared pair."""
    tok = tokenizer()
    for pair in PAIRS:
        ids, labels, pos, _ = pair_sample(tok, *pair)
        shared_ids, shared_labels, shared_pos, skip = pair_sample(tok, *pair, share_prompt=True)
        assert not skip
        split = pos.index(0, 1)
        shared_split = next(i for i in range(1, len(shared_pos))
                            if shared_pos[i] != shared_pos[i - 1] + 1)
        assert shared_ids[:shared_split] == ids[:split]
        start = shared_pos[shared_split]  # the prompt's last token
        assert ids[split:][start:] == shared_ids[shared_split:]
        assert shared_pos[shared_split:] == list(range(start, len(ids) - split))
        assert [t for t in shared_labels if t != -100] == [t for t in labels if t != -100]


def test_tokenization_matches_trl(references):
    tok = tokenizer()
    for (prompt, chosen, rejected), (p_ids, c_ids, r_ids) in zip(
            PAIRS, references["sigmoid"]["ids"], strict=True):
        ids, labels, pos, skip = pair_sample(tok, prompt, chosen, rejected)
        assert not skip
        assert ids == p_ids + c_ids + p_ids + r_ids
        assert pos == list(range(len(p_ids + c_ids))) + list(range(len(p_ids + r_ids)))
        assert [t for t in labels if t != -100] == c_ids + r_ids


# The default run keeps one layout of each kind (dp x sp: its DP ranks take the same row and
# divide by dp; the step's own DP arithmetic is covered by the CLI tests).
SLOW_LAYOUTS = ("ring-contiguous", "ring-sp4", "tp2-x-sp2", "p2p-zigzag")


# The dpo loss types differ only in the formula applied to the same summed log-probs: every
# one runs at sp 1 and on the slow layouts; the other layouts run one of each method (dpo,
# ipo, simpo, orpo) and a shared prompt.
PER_METHOD = ("sigmoid", "ipo", "simpo", "orpo", "sigmoid-shared")


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow)
                                    if name in SLOW_LAYOUTS else name for name in LAYOUTS])
def test_matches_trl(layout, references):
    world, kwargs = LAYOUTS[layout]
    every = layout == "sp1" or layout in SLOW_LAYOUTS
    losses = {k: v for k, v in LOSSES.items() if every or k in PER_METHOD}
    (got, *_) = run_distributed(longctx_worker, world, kwargs, losses, timeout_s=240)
    assert set(got) == set(losses)
    for name in got:
        ref, mine = references[SHARED_PROMPT.get(name, name)], got[name]
        assert abs(mine["loss"] - ref["loss"]) < TOL * max(1.0, abs(ref["loss"])), (name, mine,
                                                                                    ref["loss"])
        for key, value in mine["metrics"].items():
            assert abs(value - ref["metrics"][key]) < 1e-4 * max(1.0, abs(value)), (name, key)
        if name == "orpo":  # all of ORPOTrainer's, but the means of the full logits
            assert {k for k in ref["metrics"] if not k.startswith("logits/")} == set(
                mine["metrics"])
        error = grad_error(mine["grads"], ref["grads"])
        assert error < GRAD_TOL, (name, error)
        assert ref["loss"] != pytest.approx(0.0)


def test_orpo_tokenization_matches_trl(references):
    tok = tokenizer()
    for pair, (c_ids, c_labels, r_ids, r_labels) in zip(PAIRS, references["orpo"]["ids"],
                                                       strict=True):
        ids, labels, pos, skip = orpo_pair_sample(tok, *pair)
        assert not skip
        assert (ids, labels) == (c_ids + r_ids, c_labels + r_labels)
        assert pos == list(range(len(c_ids))) + list(range(len(r_ids)))


def test_orpo_tokenization_with_bos_and_a_merge():
    """A tokenizer with a bos token and an answer whose first piece merges with the prompt's
    last: the bos before both sequences, the answer starting one token earlier, as in TRL."""
    from transformers import PreTrainedTokenizerFast
    from trl.experimental.orpo import ORPOTrainer

    from tests.real_model import smollm2_folder

    tok = PreTrainedTokenizerFast.from_pretrained(smollm2_folder())
    tok.bos_token = "<|im_start|>"
    stub = types.SimpleNamespace(processing_class=tok, is_encoder_decoder=False, max_length=512)
    stub.build_tokenized_answer = types.MethodType(ORPOTrainer.build_tokenized_answer, stub)
    pair = ("The answer is", "n't four.", " four.")
    row = ORPOTrainer.tokenize_row(stub, {"prompt": pair[0], "chosen": pair[1],
                                          "rejected": pair[2]})
    ids, labels, _, skip = orpo_pair_sample(tok, *pair)
    assert not skip
    assert ids == row["chosen_input_ids"] + row["rejected_input_ids"]
    assert labels == row["chosen_labels"] + row["rejected_labels"]
    assert ids[0] == tok.bos_token_id


def test_reference_differs_from_policy(references):
    """The adapter is on for the policy and off for the reference: rewards are not zero."""
    assert abs(references["sigmoid"]["metrics"]["rewards/margins"]) > 1e-4


@pytest.mark.parametrize("type_, record, prompt", [
    ("chatml.intel", {"system": "S", "question": "Q", "chosen": "A", "rejected": "B"},
     "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"),
    ("chatml.argilla", {"instruction": "Q", "chosen_response": "A", "rejected_response": "B"},
     "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3.prompt_pairs", {"prompt": "Q", "chosen": "A", "rejected": "B"},
     "<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("chatml.ultra", {"prompt": "Q", "chosen": [{"role": "user", "content": "Q"},
                                                {"role": "assistant", "content": "A"}],
                      "rejected": [{"role": "user", "content": "Q"},
                                   {"role": "assistant", "content": "B"}]},
     "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3.argilla_chat", {"chosen": [{"role": "user", "content": "Q"},
                                        {"role": "assistant", "content": "A"}],
                             "rejected": [{"role": "user", "content": "Q"},
                                          {"role": "assistant", "content": "B"}]},
     "<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
])
def test_axolotl_prompt_strings(type_, record, prompt):
    """Axolotl's preference types: its prompt wording, answers closed by the turn's end."""
    from longctx_cli.data.preference import pair_texts

    end = "<|im_end|>" if type_.startswith("chatml") else "<|eot_id|>"
    assert pair_texts(record, type_, "r:1", tok=tokenizer()) == (prompt, "A" + end, "B" + end)


def test_chat_template_default_renders_with_the_template():
    from longctx_cli.data.preference import pair_texts
    from longctx_cli.data.tokenizer import BYTE_CHAT_TEMPLATE

    record = {"conversation": [{"role": "user", "content": "Q"}],
              "chosen": {"role": "assistant", "content": "A"}, "rejected": "B"}
    texts = pair_texts(record, "chat_template.default", "r:1", tok=tokenizer(),
                       messages_field="conversation", template=BYTE_CHAT_TEMPLATE)
    assert texts == ("<|user|>\nQ\n<|assistant|>\n", "A</s>", "B</s>")


def test_chat_template_argilla_renders_the_conversations():
    """Axolotl's ORPO type: the prompt is the chosen conversation up to its last answer (the
    user turns from `prompt` when given), after `system`; the answers are the last turns."""
    from longctx_cli.data.preference import pair_texts
    from longctx_cli.data.tokenizer import BYTE_CHAT_TEMPLATE

    record = {"system": "S", "prompt": "Q2",
              "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
              "rejected": [{"role": "user", "content": "Q"},
                           {"role": "assistant", "content": "B"}]}
    texts = pair_texts(record, "chat_template.argilla", "r:1", tok=tokenizer(),
                       template=BYTE_CHAT_TEMPLATE)
    assert texts == ("<|system|>\nS\n<|user|>\nQ2\n<|assistant|>\n", "A</s>", "B</s>")
    with pytest.raises(UserError, match="conversations"):
        pair_texts({"chosen": "A", "rejected": "B"}, "chat_template.argilla", "r:1",
                   tok=tokenizer(), template=BYTE_CHAT_TEMPLATE)


# ---- a full fine-tune: the reference precomputed before training -------------------------


def perturbed(model):
    """The policy after some training: seeded noise on every weight (the reference keeps the
    initial weights)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def trl_full_dpo(loss_types: list[str]) -> dict:
    """TRL's DPOTrainer with a frozen copy of the initial model as its reference model."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    args = DPOConfig(output_dir="/tmp/longctx-trl-dpo-full", report_to=[], use_cpu=True,
                     per_device_train_batch_size=len(PAIRS), loss_type=loss_types, beta=BETA,
                     max_length=None)
    trainer = DPOTrainer(model=base_model(), ref_model=base_model(), args=args,
                         train_dataset=data, processing_class=tokenizer())
    model = perturbed(trainer.model)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": loss.item(), "metrics": metrics, "grads": adapter_grads(model)}


def full_worker(rank: int, world: int, layout: dict, loss_types: list[str], out_dir: str,
                ) -> dict:
    import torch.distributed as dist
    from datasets import Dataset

    from longctx_cli.parallel import register_sp_attention, shard_batch
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.train.preference import PreferenceLoss, preference_loss_sum, reference_table

    state = sp_state(kernel="torch", **layout)
    ids, pos, labels = packed_pairs()
    rows = Dataset.from_dict({"input_ids": [ids.tolist()], "position_ids": [pos.tolist()],
                              "labels": [labels.tolist()]})
    space = types.SimpleNamespace
    config = space(memory=space(chunked_loss=False, loss_chunk_size=None),
                   output=space(output_dir=out_dir),
                   model=space(base_model=None, model_config_dict={"tiny": 1}, random_init=True),
                   training=space(seed=0), lora=space(lora_model_dir=None))
    objective = PreferenceLoss("dpo", tuple(loss_types), (1.0,) * len(loss_types), BETA, 0.0,
                               SIMPO_GAMMA, precomputed=True)
    model = base_model(register_sp_attention())
    objective = reference_table(model, {"train": rows}, config, state, 0, objective, print)
    perturbed(model)
    # A resumed run reads the saved table; it never recomputes it from trained weights.
    again = reference_table(model, {"train": rows}, config, state, 0, objective, print)
    assert torch.equal(again.table.rows["train"][0], objective.table.rows["train"][0])
    decoder, head = decoder_and_head(model)
    batch = shard_batch(ids, pos, labels, state)
    batch.rows = (0,)
    result = preference_loss_sum(model, decoder, head, batch, config, state, objective)
    (result.loss_sum / result.pairs / state.layout.dp).backward()
    grads = adapter_grads(model)
    for g in grads.values():
        dist.all_reduce(g)
    out = {"loss": result.loss_sum.item() / result.pairs,
           "grads": {n: g.numpy() for n, g in grads.items()},
           "metrics": {k: v / result.pairs for k, v in result.metric_sums.items()},
           "table": objective.table.rows["train"][0].numpy()}
    return out if rank == 0 else {}


def own_sequence_logps() -> torch.Tensor:
    """[pairs, 2] summed answer log-probabilities under the initial model's own forward, each
    sequence on its own."""
    model, tok, out = base_model(), tokenizer(), []
    for pair in PAIRS:
        ids, labels, pos, _ = pair_sample(tok, *pair)
        split = pos.index(0, 1)
        sums = []
        for a, b in ((0, split), (split, len(ids))):
            x, y = torch.tensor(ids[a:b]), torch.tensor(labels[a:b])
            with torch.no_grad():
                logits = model(input_ids=x[None]).logits[0, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(1, x[1:, None])[:, 0]
            sums.append(logp[y[1:] != -100].sum())
        out.append(torch.stack(sums))
    return torch.stack(out).double()


# TRL computes its reference log-probabilities under no_grad through its fused LM head,
# whose sums differ from the model's own forward by up to ~1e-3 here (-41.5144 against
# -41.5135 for the chosen mean; its gradient-enabled path agrees with the model to 1e-7).
# The loss and rewards are therefore compared to TRL with room for that, and the reference
# table itself to the model's own forward, tightly.
TRL_REFERENCE_TOL = 5e-4


@pytest.mark.parametrize("layout", ["sp1", "ring-zigzag",
                                    pytest.param("ulysses", marks=pytest.mark.slow)])
def test_full_finetune_reference_precomputed_matches_trl(layout, tmp_path):
    world, kwargs = LAYOUTS[layout]
    ref = trl_full_dpo(["sigmoid"])
    (mine, *_) = run_distributed(full_worker, world, kwargs, ["sigmoid"], str(tmp_path),
                                 timeout_s=240)
    own = own_sequence_logps()
    table = torch.from_numpy(mine["table"])
    assert float((table - own).abs().max() / own.abs().max()) < 1e-6, (table, own)
    assert abs(mine["loss"] - ref["loss"]) < TRL_REFERENCE_TOL, (mine["loss"], ref["loss"])
    for key, value in mine["metrics"].items():
        assert abs(value - ref["metrics"][key]) < TRL_REFERENCE_TOL * max(1.0, abs(value)), key
    assert abs(ref["metrics"]["rewards/margins"]) > 1e-3  # policy and reference differ
    names = sorted(ref["grads"])
    mine_flat = torch.cat([torch.from_numpy(mine["grads"][n]).flatten() for n in names])
    ref_flat = torch.cat([ref["grads"][n].flatten() for n in names])
    assert float((mine_flat - ref_flat).norm() / ref_flat.norm()) < GRAD_TOL
