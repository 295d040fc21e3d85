"""GRPO losses under every SP strategy against TRL's own `GRPOTrainer._compute_loss`.

TRL computes the loss, its metrics and the adapter's gradients of a padded batch of prompt +
completion rows (each prompt repeated per completion) with the model's own Hugging Face
forward; longctx lays the same completions out in one row, each prompt once and every further
completion a branch after it (or, unshared, each completion after its own prompt copy), shards
it over the SP group of each layout and computes the same from each rank's own tokens. They
must match within float32 noise, for every loss type, token- and sequence-level ratios, with
and without the KL term, with rollout-time log-probabilities (num_iterations > 1) or without.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_preference import (
    GRAD_TOL,
    adapter_grads,
    base_model,
    grad_error,
    lora_config,
    policy_model,
    tokenizer,
    trained_adapter,
)

TOL = 2e-5
TEMPERATURE = 0.8
G = 3  # num_generations
PROMPT_LEN = 24
COMPLETION_LENGTHS = [[5, 9, 3], [7, 2, 8]]  # per prompt
ADVANTAGES = [0.9, -1.1, 0.3, -0.4, 1.2, -0.7]
MASKED = (4,)  # a truncated completion, masked out (mask_truncated_completions)
CASES = {  # name -> (TRL GRPOConfig keys, rollout-time log-probs given, prompt shared)
    "grpo": ({"loss_type": "grpo"}, True, True),
    "grpo-kl": ({"loss_type": "grpo", "beta": 0.1}, True, True),
    "grpo-unshared": ({"loss_type": "grpo", "beta": 0.1}, True, False),
    "bnpo": ({"loss_type": "bnpo", "beta": 0.05}, True, True),
    "dr_grpo": ({"loss_type": "dr_grpo"}, True, True),
    "dapo": ({"loss_type": "dapo", "beta": 0.1, "epsilon_high": 0.28}, True, True),
    "dapo-on-policy": ({"loss_type": "dapo", "beta": 0.1}, False, True),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.2}, True, True),
    "sapo": ({"loss_type": "sapo"}, True, True),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, True, True),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.1},
             True, True),
    "gspo-dapo": ({"loss_type": "dapo", "importance_sampling_level": "sequence"}, True, True),
    "grpo-delta": ({"loss_type": "grpo", "delta": 1.1}, True, True),
    "grpo-kl-biased": ({"loss_type": "grpo", "beta": 0.1, "use_bias_correction_kl": False},
                       True, True),
    "gspo-kl-biased": ({"loss_type": "grpo", "importance_sampling_level": "sequence",
                        "beta": 0.1, "use_bias_correction_kl": False}, True, True),
    "cispo-seq": ({"loss_type": "cispo", "importance_sampling_level": "sequence",
                   "epsilon_high": 1.1}, True, True),
    "sapo-seq": ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, True, True),
    "bnpo-seq": ({"loss_type": "bnpo", "importance_sampling_level": "sequence", "beta": 0.05},
                 True, True),
    "dr_grpo-seq": ({"loss_type": "dr_grpo", "importance_sampling_level": "sequence"},
                    True, True),
    "vespo": ({"loss_type": "vespo", "beta": 0.1}, True, True),
    "vespo-seq": ({"loss_type": "vespo", "importance_sampling_level": "sequence",
                   "vespo_k_neg": 2.5, "vespo_lambda_pos": 2.0, "beta": 0.1}, True, True),
    "top-entropy": ({"loss_type": "dapo", "top_entropy_quantile": 0.25, "beta": 0.1},
                    True, True),
    "gspo-top-entropy": ({"loss_type": "grpo", "importance_sampling_level": "sequence",
                          "top_entropy_quantile": 0.75}, True, True),
    "entropy-bonus": ({"loss_type": "grpo", "entropy_coef": 0.3, "top_entropy_quantile": 0.15},
                      True, True),
    "dapo-entropy-bonus": ({"loss_type": "dapo", "entropy_coef": 0.2}, False, True),
    "dapo-plain": ({"loss_type": "dapo"}, True, True),
    "off-policy-mask": ({"loss_type": "dapo", "off_policy_mask_threshold": 0.02}, True, True),
}
PER_LAYOUT = ("dapo", "gspo", "grpo-unshared")  # on every layout (all at sp 1 and slow)
# The entropy-quantile threshold spans the SP group's tokens: on one SP layout too.
AT_LAYOUT = {"ulysses": ("gspo-top-entropy", "entropy-bonus")}
LAYOUTS = {  # name -> (world, layout keywords)
    "sp1": (1, {"sp": 1}),
    "ring-zigzag": (2, {"sp": 2, "layout": "zigzag"}),
    "p2p-stripe": (2, {"sp": 2, "ring_attn_func": "batch_stripe"}),
    "ulysses": (2, {"sp": 2, "mode": "ulysses"}),
    "hybrid": (4, {"sp": 4, "mode": "hybrid", "ulysses_degree": 2}),
    "dp2-x-sp2": (4, {"sp": 2, "layout": "zigzag"}),
    "ring-sp4": (4, {"sp": 4, "layout": "contiguous"}),
    "tp2": (2, {"tp": 2}),
    "tp2-x-sp2": (4, {"sp": 2, "tp": 2, "mode": "ulysses"}),
}
SLOW_LAYOUTS = ("ring-sp4", "tp2-x-sp2")


def rollouts(lengths_per_prompt: list[list[int]] = COMPLETION_LENGTHS, seed: int = 11) -> dict:
    """Prompts, completions (the last of some ending in EOS), their rollout-time and
    reference log-probability offsets, drawn from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    eos = tokenizer().eos_token_id
    prompts = [torch.randint(3, 250, (PROMPT_LEN,), generator=g).tolist()
               for _ in lengths_per_prompt]
    completions = []
    for lengths in lengths_per_prompt:
        for n in lengths:
            ids = torch.randint(3, 250, (n,), generator=g).tolist()
            completions.append(ids[:-1] + [eos] if n % 2 else ids)
    noise = [torch.randn(len(c), generator=g) for c in completions]
    ref_noise = [torch.randn(len(c), generator=g) for c in completions]
    return {"prompts": prompts, "completions": completions,
            "old_noise": [0.3 * n for n in noise], "ref_noise": [0.5 * n for n in ref_noise]}


def own_logps(model, data: dict, group: int = G) -> list[list[float]]:
    """Each completion token's log-probability under `model` (its own forward, the logits
    divided by the temperature): the base of the rollout-time and reference values."""
    out = []
    with torch.no_grad():
        for i, completion in enumerate(data["completions"]):
            prompt = data["prompts"][i // group]
            logits = model(torch.tensor([prompt + completion])).logits[0] / TEMPERATURE
            picked = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
            out.append(picked.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist())
    return out


def side_logps(data: dict) -> tuple[list[list[float]], list[list[float]]]:
    """(rollout-time, reference) log-probabilities: the policy's own, moved by fixed noise
    (ratios away from 1, some clipped)."""
    model = policy_model()
    base = own_logps(model, data)
    old = [[b + n for b, n in zip(bs, ns.tolist(), strict=True)]
           for bs, ns in zip(base, data["old_noise"], strict=True)]
    ref = [[b + n for b, n in zip(bs, ns.tolist(), strict=True)]
           for bs, ns in zip(base, data["ref_noise"], strict=True)]
    return old, ref


def trl_loss(keys: dict, with_old: bool, data: dict, old: list, ref: list) -> dict:
    """TRL's `_compute_loss` on the padded batch: loss, metrics, adapter gradients."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def no_reward(completions, **kwargs):
        return [0.0] * len(completions)

    b = len(data["completions"])
    longest = max(len(c) for c in data["completions"])
    args = GRPOConfig(output_dir="/tmp/longctx-trl-grpo", report_to=[], use_cpu=True,
                      bf16=False, per_device_train_batch_size=b, num_generations=G,
                      max_completion_length=longest + 3, temperature=TEMPERATURE,
                      **{"beta": 0.0, **keys})
    trainer = GRPOTrainer(model=base_model(), reward_funcs=no_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * b),
                          processing_class=tokenizer(), peft_config=lora_config())
    model = trainer.model
    trained_adapter(model)
    model.train()
    trainer.current_gradient_accumulation_steps = 1

    def padded(rows: list[list[float]], value: float, dtype) -> torch.Tensor:
        return torch.tensor([r + [value] * (longest - len(r)) for r in rows], dtype=dtype)

    mask = [[0 if i in MASKED else 1] * len(c) for i, c in enumerate(data["completions"])]
    inputs = {
        "prompt_ids": torch.tensor([data["prompts"][i // G] for i in range(b)]),
        "prompt_mask": torch.ones(b, PROMPT_LEN, dtype=torch.long),
        "completion_ids": padded(data["completions"], 0, torch.long),
        "completion_mask": padded(mask, 0, torch.long),
        "advantages": torch.tensor(ADVANTAGES),
        "num_items_in_batch": torch.tensor(float(sum(map(sum, mask)))),
    }
    if with_old:
        inputs["old_per_token_logps"] = padded(old, 0.0, torch.float32)
    if args.beta:
        inputs["ref_per_token_logps"] = padded(ref, 0.0, torch.float32)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": loss.item(), "metrics": metrics, "grads": adapter_grads(model)}


def objective_of(keys: dict):
    """longctx's loss settings from the same TRL keys, through the run's own mapping."""
    from longctx_cli.config.sections.grpo import TrlConfig
    from longctx_cli.train.grpo import GrpoLoss

    longest = max(max(lengths) for lengths in COMPLETION_LENGTHS)
    return GrpoLoss.from_trl(TrlConfig(reward_funcs=["rewards.none"], temperature=TEMPERATURE,
                                       max_completion_length=longest + 3, **keys))


def longctx_worker(rank: int, world: int, layout: dict, cases: dict, data: dict, old: list,
                   ref: list) -> dict:
    import torch.distributed as dist

    from longctx_cli.parallel import register_sp_attention, shard_batch
    from longctx_cli.parallel.tensor_parallel import apply_tensor_parallel
    from longctx_cli.runtime.model import decoder_and_head, decoder_of, sp_hidden_states
    from longctx_cli.train.grpo import RolloutBatch, grpo_loss
    from longctx_cli.train.rollout_rows import group_row, local_tokens, token_values
    from longctx_cli.train.step import sum_gradients

    state = sp_state(kernel="torch", **layout)
    b = len(data["completions"])
    kept = [i not in MASKED for i in range(b)]
    out = {}
    for name, (keys, with_old, shared) in cases.items():
        groups = [(data["prompts"][p], data["completions"][p * G:(p + 1) * G],
                   kept[p * G:(p + 1) * G]) for p in range(len(data["prompts"]))]
        ids, positions, labels, scored = group_row(groups, shared)
        batch = shard_batch(ids, positions, labels, state)
        assert len(batch.sp_meta.prefixes) == (2 * (G - 1) if shared else 0)
        total = batch.sp_meta.total_len
        docs = len(batch.sp_meta.cu_host) - 1

        def local(values: list[list[float]], labels=labels, total=total) -> torch.Tensor:
            scored_values = [v if kept[i] else [] for i, v in enumerate(values)]
            return local_tokens(token_values(scored_values, labels, total), state)

        rollout = RolloutBatch(
            batch, torch.tensor(ADVANTAGES + [0.0] * (docs - b)),
            torch.tensor(scored + [0] * (docs - b), dtype=torch.float32), b,
            old_logps=local(old) if with_old else None,
            ref_logps=local(ref) if keys.get("beta") else None)
        model = policy_model(register_sp_attention())
        if state.layout.tp > 1:  # as build_model does: the adapter first, then TP
            base = model.get_base_model()
            apply_tensor_parallel(decoder_of(base), base.get_output_embeddings(), state,
                                  base.config)
        decoder, head = decoder_and_head(model)
        # scored a block at a time (the entropy bonus's gradient through the recomputation)
        chunk = 16 if name in ("dapo", "gspo", "entropy-bonus") else None
        result = grpo_loss(head, sp_hidden_states(decoder, batch), rollout, objective_of(keys),
                           state, chunk)
        (result.loss / state.layout.dp).backward()
        if state.layout.tp > 1:  # the trainer's sync: TP partial sums, then SP and DP
            sum_gradients([p for p in model.parameters() if p.requires_grad], state)
            grads = {n: g.full_tensor() for n, g in adapter_grads(model).items()}
        else:
            grads = adapter_grads(model)
            for g in grads.values():
                dist.all_reduce(g)  # the step's gradient sync (over SP and DP)
        metrics = {k: n / d for k, (n, d) in result.metric_sums.items()}
        out[name] = {"loss": result.loss.item(), "metrics": {**metrics, **result.extremes},
                     "grads": {n: g.numpy() for n, g in grads.items()}}
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def inputs() -> dict:
    data = rollouts()
    old, ref = side_logps(data)
    return {"data": data, "old": old, "ref": ref}


@pytest.fixture(scope="module")
def references(inputs) -> dict:
    return {name: trl_loss(keys, with_old, inputs["data"], inputs["old"], inputs["ref"])
            for name, (keys, with_old, _) in CASES.items()}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow)
                                    if name in SLOW_LAYOUTS else name for name in LAYOUTS])
def test_matches_trl(layout, inputs, references):
    world, kwargs = LAYOUTS[layout]
    every = layout == "sp1" or layout in SLOW_LAYOUTS
    cases = {k: v for k, v in CASES.items()
             if every or k in PER_LAYOUT or k in AT_LAYOUT.get(layout, ())}
    if layout.startswith("tp"):  # the vocab-parallel head computes no entropy (refused)
        cases = {k: v for k, v in cases.items() if not ({"top_entropy_quantile",
                                                         "entropy_coef"} & set(v[0]))}
    (got, *_) = run_distributed(longctx_worker, world, kwargs, cases, inputs["data"],
                                inputs["old"], inputs["ref"], timeout_s=300)
    assert set(got) == set(cases)
    for name, mine in got.items():
        ref = references[name]
        assert abs(mine["loss"] - ref["loss"]) < TOL * max(1.0, abs(ref["loss"])), (
            name, mine["loss"], ref["loss"])
        shown = {k for k in ref["metrics"] if not (layout.startswith("tp") and k == "entropy")}
        assert set(mine["metrics"]) == shown, (name, set(mine["metrics"]) ^ shown)
        for key in shown:
            expected, value = ref["metrics"][key], mine["metrics"][key]
            assert abs(value - expected) < 1e-4 * max(1.0, abs(expected)), (name, key, value,
                                                                           expected)
        error = grad_error(mine["grads"], ref["grads"])
        assert error < GRAD_TOL, (name, error)
        assert ref["loss"] != pytest.approx(0.0)


def test_cases_clip_and_differ(references):
    """The inputs exercise clipping and the KL term (a loss that ignored them would not
    match TRL by chance)."""
    assert references["grpo"]["metrics"]["clip_ratio/region_mean"] > 0.05
    assert references["grpo-kl"]["metrics"]["kl"] > 0.01
    assert references["grpo"]["loss"] != pytest.approx(references["grpo-kl"]["loss"])
    # Each new key changes TRL's loss on these inputs (a loss that ignored it would differ).
    for case, plain in (("grpo-kl-biased", "grpo-kl"), ("gspo-kl-biased", "gspo"),
                        ("top-entropy", "dapo"), ("off-policy-mask", "dapo-plain"),
                        ("gspo-top-entropy", "gspo"), ("vespo-seq", "vespo")):
        assert references[case]["loss"] != pytest.approx(references[plain]["loss"], rel=1e-3), (
            case)
    assert references["vespo"]["metrics"]["vespo/phi_seq_mean"] != pytest.approx(1.0, abs=1e-3)


def test_entropy_quantiles_are_decisive(inputs):
    """The tiny model's entropies lie within 2e-3 of each other, so a quantile whose threshold
    fell within float noise (~1e-6) of a token's entropy would let rounding pick the mask:
    each case's threshold keeps a clear margin from every scored token's entropy."""
    data = inputs["data"]
    model = policy_model()
    entropies = []
    with torch.no_grad():
        for i, completion in enumerate(data["completions"]):
            if i in MASKED:
                continue
            prompt = data["prompts"][i // G]
            logits = model(torch.tensor([prompt + completion])).logits[0] / TEMPERATURE
            logps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
            entropies.append(-(logps.exp() * logps).sum(-1))
    values = torch.cat(entropies)
    quantiles = {keys["top_entropy_quantile"] for keys, _, _ in CASES.values()
                 if "top_entropy_quantile" in keys}
    assert quantiles
    for q in quantiles:
        margin = (values - torch.quantile(values, 1 - q)).abs().min()
        assert margin > 2e-5, (q, float(margin))


# ---- several micro-batches per step, several data-parallel processes ---------------------

# One prompt group per micro-batch; micro-batch k of the generation batch is process
# k % DP's (k // DP)-th. A generation batch of STEPS_PER_GENERATION micro-steps spans two
# optimizer steps in the "-spg" cases (only the first step is computed; the normaliser
# counts the whole generation batch's tokens, as TRL's `num_items_in_batch` does).
DP, ACCUMULATION = 2, 2
STEP_LENGTHS = [[4, 7, 2], [6, 3, 9], [5, 8, 2], [3, 6, 7], [9, 2, 5], [7, 4, 6], [2, 8, 3],
                [6, 5, 4]]
STEP_ADVANTAGES = [[0.7, -1.2, 0.5], [-0.3, 1.1, -0.8], [1.4, -0.6, -0.8], [0.2, 0.9, -1.1],
                   [-1.3, 0.4, 0.9], [0.6, -0.2, -0.4], [1.0, -1.0, 0.0], [-0.5, 0.8, -0.3]]
STEP_CASES = {  # name -> (TRL keys, steps_per_generation)
    **{t: ({"loss_type": t, "beta": 0.05}, ACCUMULATION)
       for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo")},
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, ACCUMULATION),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, ACCUMULATION),
    "entropy-bonus": ({"loss_type": "grpo", "entropy_coef": 0.2}, ACCUMULATION),
    "dapo-spg": ({"loss_type": "dapo", "beta": 0.05}, 2 * ACCUMULATION),
    "cispo-spg": ({"loss_type": "cispo", "epsilon_high": 1.1}, 2 * ACCUMULATION),
}


def micro_batch(data: dict, k: int, values: list | None = None) -> list:
    """Micro-batch k's completions (or their per-token `values`)."""
    return (values or data["completions"])[k * G:(k + 1) * G]


def trl_step(keys: dict, spg: int, data: dict, old: list, ref: list) -> dict:
    """TRL's loss and gradients for one optimizer step: `_compute_loss` on each process's
    micro-batches with the step's accumulation, each loss backpropagated as its training
    step does (summed over the accumulation), the gradients then averaged over the processes
    (one TRL model stands in for the DP processes: `num_items_in_batch` per process is the
    generation batch's tokens over the processes, as TRL's normaliser divides them)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def no_reward(completions, **kwargs):
        return [0.0] * len(completions)

    longest = max(max(lengths) for lengths in STEP_LENGTHS)
    args = GRPOConfig(output_dir="/tmp/longctx-trl-grpo-step", report_to=[], use_cpu=True,
                      bf16=False, per_device_train_batch_size=G, num_generations=G,
                      gradient_accumulation_steps=ACCUMULATION, steps_per_generation=spg,
                      gradient_checkpointing=False,  # TRL's default recomputes: slower, same
                      max_completion_length=longest + 3, temperature=TEMPERATURE,
                      **{"beta": 0.0, **keys})
    trainer = GRPOTrainer(model=base_model(), reward_funcs=no_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * G),
                          processing_class=tokenizer(), peft_config=lora_config())
    model = trainer.model
    trained_adapter(model)
    model.train()
    trainer.current_gradient_accumulation_steps = ACCUMULATION
    generation_tokens = sum(sum(lengths) for lengths in STEP_LENGTHS[:DP * spg])
    total = 0.0
    for k in range(DP * ACCUMULATION):  # this step's micro-batches, every process's
        completions = micro_batch(data, k)
        width = max(map(len, completions))

        def padded(rows, value, dtype, width=width):
            return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)

        inputs = {
            "prompt_ids": torch.tensor([data["prompts"][k]] * G),
            "prompt_mask": torch.ones(G, PROMPT_LEN, dtype=torch.long),
            "completion_ids": padded(completions, 0, torch.long),
            "completion_mask": padded([[1] * len(c) for c in completions], 0, torch.long),
            "advantages": torch.tensor(STEP_ADVANTAGES[k]),
            "num_items_in_batch": torch.tensor(generation_tokens / DP),
            "old_per_token_logps": padded(micro_batch(data, k, old), 0.0, torch.float32),
        }
        if args.beta:
            inputs["ref_per_token_logps"] = padded(micro_batch(data, k, ref), 0.0, torch.float32)
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        total += loss.item()
    grads = {n: g / DP for n, g in adapter_grads(model).items()}
    return {"loss": total / DP, "grads": grads}


def step_worker(rank: int, world: int, cases: dict, data: dict, old: list, ref: list) -> dict:
    """One optimizer step at dp 2 (sp 1) as objectives/grpo.py's `Grpo` runs it: each
    rank's micro-batches through `grpo_loss` with the step's micro-batch count and tokens,
    each loss backpropagated, the gradients summed over the ranks."""
    import torch.distributed as dist

    from longctx_cli.parallel import register_sp_attention, shard_batch
    from longctx_cli.runtime.model import decoder_and_head, sp_hidden_states
    from longctx_cli.train.grpo import RolloutBatch, grpo_loss, step_tokens_of
    from longctx_cli.train.rollout_rows import group_row, local_tokens, token_values

    state = sp_state(kernel="torch", sp=1)
    assert state.layout.dp == DP
    model = policy_model(register_sp_attention())
    decoder, head = decoder_and_head(model)
    out = {}
    for name, (keys, spg) in cases.items():
        model.zero_grad(set_to_none=True)
        generation_tokens = sum(sum(lengths) for lengths in STEP_LENGTHS[:DP * spg])
        loss = 0.0
        for m in range(ACCUMULATION):
            k = m * DP + state.dp_rank
            completions = micro_batch(data, k)
            ids, positions, labels, scored = group_row(
                [(data["prompts"][k], completions, [True] * G)], True)
            batch = shard_batch(ids, positions, labels, state)
            docs = len(batch.sp_meta.cu_host) - 1

            def local(values, labels=labels, total=batch.sp_meta.total_len):
                return local_tokens(token_values(values, labels, total), state)

            rollout = RolloutBatch(
                batch, torch.tensor(STEP_ADVANTAGES[k] + [0.0] * (docs - G)),
                torch.tensor(scored + [0] * (docs - G), dtype=torch.float32), G,
                old_logps=local(micro_batch(data, k, old)),
                ref_logps=local(micro_batch(data, k, ref)) if keys.get("beta") else None)
            result = grpo_loss(head, sp_hidden_states(decoder, batch), rollout,
                               objective_of(keys), state, None, DP * ACCUMULATION,
                               step_tokens_of(generation_tokens, ACCUMULATION, spg))
            result.loss.backward()
            loss += result.loss.item()
        grads = adapter_grads(model)
        for g in grads.values():
            dist.all_reduce(g)
        total = torch.tensor([loss])
        dist.all_reduce(total)
        out[name] = {"loss": float(total), "grads": {n: g.numpy() for n, g in grads.items()}}
    return out if rank == 0 else {}


def test_accumulation_and_data_parallel_match_trl():
    """Every loss type's normalisation over 2 micro-batches per step on each of 2 DP ranks
    (and a generation batch spanning 2 optimizer steps): the step's loss and gradients equal
    TRL's accumulated, process-averaged ones."""
    data = rollouts(STEP_LENGTHS, seed=5)
    old, ref = side_logps(data)
    (got, _) = run_distributed(step_worker, DP, STEP_CASES, data, old, ref, timeout_s=300)
    for name, (keys, spg) in STEP_CASES.items():
        want = trl_step(keys, spg, data, old, ref)
        mine = got[name]
        assert abs(mine["loss"] - want["loss"]) < TOL * max(1.0, abs(want["loss"])), (
            name, mine["loss"], want["loss"])
        assert abs(want["loss"]) > 1e-4, name  # the ratios and advantages move the loss
        error = grad_error(mine["grads"], want["grads"])
        assert error < GRAD_TOL, (name, error)


# ---- cast_lm_head_to_fp32 ------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_float32_head_matches_trl_cast(tied):
    """A bfloat16 model with `cast_head_to_float32` (TRL's `cast_lm_head_to_fp32`): the head's
    weights become float32 (tied: the embedding's output stays bfloat16), and the log-
    probabilities and entropies it scores from the model's bfloat16 hidden states equal those
    of TRL's own cast head, which the bfloat16 head misses by far more."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from longctx_cli.parallel.mesh import ParallelState
    from longctx_cli.runtime.head import cast_head_to_float32
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.train.grpo import score_tokens

    def bf16_model():
        model = base_model()
        if tied:
            model.config.tie_word_embeddings = True
            model.tie_weights()
        return model.to(torch.bfloat16)

    def no_reward(completions, **kwargs):
        return [0.0] * len(completions)

    data = rollouts()
    prompt, completion = data["prompts"][0], data["completions"][1]
    ids = torch.tensor([prompt + completion])
    args = GRPOConfig(output_dir="/tmp/longctx-trl-grpo-fp32", report_to=[], use_cpu=True,
                      bf16=False, per_device_train_batch_size=G, num_generations=G,
                      temperature=TEMPERATURE, cast_lm_head_to_fp32=True)
    trainer = GRPOTrainer(model=bf16_model(), reward_funcs=no_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * G),
                          processing_class=tokenizer())
    with torch.no_grad():
        want_logps, want_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, torch.ones_like(ids), len(completion), compute_entropy=True)

    def scored(cast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model = bf16_model()
        if cast:
            cast_head_to_float32(model)
            assert model.lm_head.weight.dtype == torch.float32
            assert model.get_input_embeddings()(ids).dtype == torch.bfloat16
            with torch.no_grad():  # the model's own forward runs through the float32 head
                assert model(ids).logits.dtype == torch.float32
        decoder, head = decoder_and_head(model)
        with torch.no_grad():
            hidden = decoder(input_ids=ids).last_hidden_state[0, len(prompt) - 1:-1]
            logps, entropy = score_tokens(head, hidden, torch.tensor(completion),
                                          ParallelState(), None, TEMPERATURE)
        return logps, entropy

    logps, entropy = scored(cast=True)
    torch.testing.assert_close(logps, want_logps[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, want_entropy[0], rtol=0, atol=2e-5)
    plain, _ = scored(cast=False)
    assert (plain - want_logps[0]).abs().max() > 2e-4  # 10x the tolerance above


# ---- a real pretrained model: SmolLM2-135M-Instruct (tests/real_model.py) ---------------

REAL_QUESTION = [{"role": "user", "content": "Name the capital of France in one word."}]
REAL_G, REAL_NEW = 4, 10


def _small_adapter(model) -> None:
    """Seeded adapter values small enough to keep the real model's outputs sensible."""
    import zlib

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def _real_worker(rank: int, world: int, folder: str) -> dict:
    """At sp 2: sample the group from one sharded prefill, score the reference (the model's
    own eager forward, adapter off), compute the dapo loss with the KL and its gradients."""
    import torch.distributed as dist
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longctx_cli.parallel import register_sp_attention, shard_batch
    from longctx_cli.runtime.model import decoder_and_head, sp_hidden_states
    from longctx_cli.runtime.sampling import Sampling, decode
    from longctx_cli.train.grpo import GrpoLoss, RolloutBatch, grpo_loss
    from longctx_cli.train.rollout_rows import group_row, local_tokens, token_values

    tok = AutoTokenizer.from_pretrained(folder)
    prompt = list(tok.apply_chat_template(REAL_QUESTION, add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=register_sp_attention()),
        lora_config())
    _small_adapter(model)
    state = sp_state(kernel="torch", sp=2, layout="zigzag")
    decoder, head = decoder_and_head(model)
    torch.manual_seed(5)
    sampled = decode(decoder, head, prompt, REAL_NEW, state, tok.pad_token_id or 0,
                     torch.device("cpu"), (tok.eos_token_id,),
                     Sampling(do_sample=True, temperature=TEMPERATURE, top_k=50), REAL_G)
    own = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                               attn_implementation="eager")
    ref = own_logps(own, {"prompts": [prompt], "completions": sampled.tokens}, REAL_G)
    ids, positions, labels, scored = group_row([(prompt, sampled.tokens, [True] * REAL_G)],
                                               True)
    batch = shard_batch(ids, positions, labels, state, tok.pad_token_id or 0)
    docs = len(batch.sp_meta.cu_host) - 1
    rollout = RolloutBatch(batch, torch.tensor([0.8, -0.3, 0.5, -1.0] + [0.0] * (docs - 4)),
                           torch.tensor(scored + [0] * (docs - 4), dtype=torch.float32), 4,
                           ref_logps=local_tokens(token_values(ref, labels,
                                                               batch.sp_meta.total_len), state))
    objective = GrpoLoss(loss_type="dapo", beta=0.1, temperature=TEMPERATURE,
                         max_completion_length=REAL_NEW)
    model.train()
    result = grpo_loss(head, sp_hidden_states(decoder, batch), rollout, objective, state, 64)
    result.loss.backward()
    grads = adapter_grads(model)
    for g in grads.values():
        dist.all_reduce(g)
    return {"prompt": prompt, "tokens": sampled.tokens, "ref": ref, "loss": result.loss.item(),
            "metrics": {k: n / d for k, (n, d) in result.metric_sums.items()},
            "grads": {n: g.numpy() for n, g in grads.items()}}


@pytest.mark.slow
def test_smollm2_grpo_step_matches_trl():
    """SmolLM2-135M-Instruct with a LoRA adapter, its chat-templated prompt: the 4 completions
    longctx samples at sp 2 from one sharded prefill are those of the model's own
    `generate(do_sample=True)` under the same seed, and the dapo loss with the KL, its metrics
    and the adapter's gradients on them equal TRL's `_compute_loss`."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.real_model import smollm2_folder

    folder = str(smollm2_folder())
    got = run_distributed(_real_worker, 2, folder, timeout_s=300)[0]
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = got["prompt"]
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"), lora_config())
    _small_adapter(policy)
    torch.manual_seed(5)
    out = policy.generate(torch.tensor([prompt]), max_new_tokens=REAL_NEW, do_sample=True,
                          temperature=TEMPERATURE, top_k=50, top_p=1.0,
                          num_return_sequences=REAL_G, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    expected = []
    for ids in out[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(ids) if t == tok.eos_token_id), len(ids))
        expected.append(ids[:end])
    assert got["tokens"] == expected

    def no_reward(completions, **kwargs):
        return [0.0] * len(completions)

    args = GRPOConfig(output_dir="/tmp/longctx-trl-grpo-real", report_to=[], use_cpu=True,
                      bf16=False, per_device_train_batch_size=REAL_G, num_generations=REAL_G,
                      max_completion_length=REAL_NEW, temperature=TEMPERATURE,
                      loss_type="dapo", beta=0.1)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation="eager")
    trainer = GRPOTrainer(model=base, reward_funcs=no_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * REAL_G),
                          processing_class=tok, peft_config=lora_config())
    model = trainer.model
    _small_adapter(model)
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    width = max(len(t) for t in got["tokens"])
    pad = tok.pad_token_id

    def padded(rows, value, dtype):
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)

    mask = [[1] * len(t) for t in got["tokens"]]
    inputs = {"prompt_ids": torch.tensor([prompt] * REAL_G),
              "prompt_mask": torch.ones(REAL_G, len(prompt), dtype=torch.long),
              "completion_ids": padded(got["tokens"], pad, torch.long),
              "completion_mask": padded(mask, 0, torch.long),
              "advantages": torch.tensor([0.8, -0.3, 0.5, -1.0]),
              "num_items_in_batch": torch.tensor(float(sum(map(sum, mask)))),
              "ref_per_token_logps": padded(got["ref"], 0.0, torch.float32)}
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for key in ("kl", "entropy", "clip_ratio/region_mean"):
        assert got["metrics"][key] == pytest.approx(logged[key], rel=1e-4, abs=1e-6), key
    assert grad_error(got["grads"], adapter_grads(model)) < GRAD_TOL
