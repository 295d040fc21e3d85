"""The objective of `rl: grpo`: rollouts under SP (when due), rewards, advantages, then the
update on rows that hold each prompt once (TRL's GRPOTrainer, the prompt never gathered).

A generation batch is rolled out every `steps_per_generation / gradient_accumulation_steps x
num_iterations` optimizer steps (TRL's buffered inputs): this DP rank's `steps_per_generation`
micro-batches of `micro_batch_size / num_generations` prompts, each prefilled across its SP
group and continued `num_generations` times from that one prefill (`runtime/sampling.py`),
seeded per prompt from `seed`, the batch and the prompt's place in it, so every layout samples
alike. Under FSDP2 the weights are gathered once for the rollout (or, with
`ds3_gather_for_generation: false`, the DP groups decode in lockstep). The first rank of each
SP group scores its completions with the reward functions; every rank gathers the rewards and
lengths and computes the advantages (groups, or the batch, for the std), as TRL does over its
processes. Each optimizer step takes the next `gradient_accumulation_steps` micro-batches of
the batch through `train/grpo.py`'s `grpo_loss` and one update (`step.optimizer_step`; each
micro-batch's loss is already its share of the step's: the divisor is 1). Where a batch feeds
more than one step, its rollout-time log-probabilities are computed once in a `no_grad` SP
pass; with `beta > 0` so are the reference's (the adapter switched off, or a frozen copy of the
initial model), both under the update's autocast.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longctx_cli.config import Config
from longctx_cli.errors import UserError
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import shard_batch
from longctx_cli.runtime.batches import step_row_indices, to_device
from longctx_cli.runtime.distributed import all_reduce_sum
from longctx_cli.runtime.model import fsdp_weights_gathered, sp_hidden_states
from longctx_cli.runtime.sampling import Sampling, decode
from longctx_cli.train.grpo import (
    GrpoLoss,
    RolloutBatch,
    grpo_loss,
    score_tokens,
    step_tokens_of,
)
from longctx_cli.train.objectives import LossShare, StepCounts
from longctx_cli.train.precision import Precision
from longctx_cli.train.preference import reference_model
from longctx_cli.train.rewards import RewardFunctions, advantages, function_metrics
from longctx_cli.train.rollout_rows import group_row

COMPLETIONS_FILE = "completions.jsonl"
# What the step line shows of the run's metrics (metrics.jsonl and trackers get them all).
SHOWN = ("reward", "reward_std", "completions/mean_length", "kl", "entropy",
         "clip_ratio/region_mean", "rollout_s", "update_s")


def sampling_of(config: Config) -> Sampling:
    trl = config.trl
    return Sampling(do_sample=True, temperature=trl.temperature, top_k=trl.top_k or 0,
                    top_p=trl.top_p, min_p=trl.min_p,
                    repetition_penalty=trl.repetition_penalty)


@dataclass
class _CurrentStep:
    """The optimizer step `Grpo.micro_batches` handed out last: its rollout's seconds (0: none
    this step), the step's micro-batches over every DP rank, its scored tokens, and when its
    update began."""

    rollout_s: float = 0.0
    micro_batches: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Generation:
    """A rolled-out generation batch: this rank's micro-batches and what the step logs."""

    index: int
    batches: list[RolloutBatch]
    # Scored completion tokens of the whole batch (every DP rank's) per optimizer step it
    # feeds: TRL's dapo/cispo normaliser (`num_items_in_batch` x accumulation / steps).
    step_tokens: float
    split_tokens: list[int]  # scored tokens of each optimizer step's part, every DP rank's
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


class Grpo:
    """The objective of a `rl: grpo` run: its micro-batches are the rollouts' rows."""

    shown = SHOWN

    def __init__(self, config: Config, state: ParallelState, model: torch.nn.Module,
                 decoder: torch.nn.Module, head: torch.nn.Module, tokenizer, rows,
                 generations_per_epoch: int, reference: torch.nn.Module | None,
                 pad_id: int):
        self.config, self.state, self.model = config, state, model
        self.decoder, self.head, self.tokenizer, self.rows = decoder, head, tokenizer, rows
        self.pad_id = pad_id
        self.trl = config.trl
        self.loss = GrpoLoss.from_trl(config.trl)
        self.sampling = sampling_of(config)
        self.rewards = RewardFunctions.from_config(config, state)
        self.reference = reference  # a frozen copy, or None: the adapter switched off
        self.per_micro = config.training.micro_batch_size // self.trl.num_generations  # prompts
        # One generation batch: `micro_batches_per_generation` micro-batches per DP rank, split
        # over `split` optimizer steps, each split run `num_iterations` times (TRL's buffered
        # inputs).
        self.micro_batches_per_generation = config.generation_steps(state.layout.dp)
        self.split = (self.micro_batches_per_generation
                      // config.training.gradient_accumulation_steps)
        self.steps_per_generation = self.split * self.trl.num_iterations
        self.prompts_per_generation = (state.layout.dp * self.micro_batches_per_generation
                                       * self.per_micro)
        self.generations_per_epoch = generations_per_epoch
        if self.trl.disable_dropout:  # TRL's disable_dropout_in_model, policy and reference
            for module in (model, reference):
                for dropout in _dropouts(module):
                    dropout.p = 0.0
        self.chunk = config.memory.loss_chunk_size if config.memory.chunked_loss else None
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = {tokenizer.eos_token_id} | set(
            generation_eos if isinstance(generation_eos, list) else [generation_eos])
        self.eos_ids = tuple(sorted(e for e in eos if e is not None))
        self.generation: Generation | None = None
        self.input_tokens_seen = 0
        self.counted = state.sp_rank == 0 and state.tp_rank == 0  # once per SP x TP group
        self.current = _CurrentStep()  # what this step's `micro_batches` chose

    # ---- the objective ------------------------------------------------------------------

    def micro_batches(self, step: int, use_fsdp: bool, precision: Precision,
                      ) -> list[RolloutBatch]:
        """The step's part of its generation batch, rolled out first when due."""
        index, within = divmod(step, self.steps_per_generation)
        rolled = self.generation is None or self.generation.index != index
        if rolled:
            self.generation = self.roll_out(index, step, use_fsdp, precision)
        assert self.generation is not None
        accumulation = self.config.training.gradient_accumulation_steps
        first = within % self.split * accumulation
        batches = self.generation.batches[first:first + accumulation]
        self.current = _CurrentStep(self.generation.seconds if rolled else 0.0,
                                    self.state.layout.dp * len(batches),
                                    self.generation.split_tokens[within % self.split])
        return batches

    def counts(self, batches: list[RolloutBatch]) -> StepCounts:
        return StepCounts(1.0, self.current.tokens)  # each loss is already its share

    def loss_share(self, rollout: RolloutBatch, counts: StepCounts) -> LossShare:
        assert self.generation is not None
        hidden = sp_hidden_states(self.decoder, rollout.batch)
        result = grpo_loss(self.head, hidden, rollout, self.loss, self.state, self.chunk,
                           self.current.micro_batches, self.generation.step_tokens)
        sums = {key: (num * self.counted, den * self.counted)
                for key, (num, den) in result.metric_sums.items()}
        return LossShare(result.loss, result.loss.item() * self.counted,
                         {"sums": sums, "extremes": result.extremes})

    def step_metrics(self, values: list[dict], counts: StepCounts) -> dict[str, float]:
        assert self.generation is not None
        rollout_s = self.current.rollout_s
        metrics = dict(self.generation.metrics) if rollout_s else {
            k: v for k, v in self.generation.metrics.items() if not k.startswith("rewards/")
            and k not in ("reward", "reward_std", "frac_reward_zero_std")}
        sums: dict[str, list[float]] = {}
        extremes: dict[str, list[float]] = {}
        for value in values:
            for key, (num, den) in value["sums"].items():
                total = sums.setdefault(key, [0.0, 0.0])
                total[0] += num
                total[1] += den
            for key, extreme in value["extremes"].items():
                extremes.setdefault(key, []).append(extreme)
        keys = sorted(sums)
        totals = all_reduce_sum([v for k in keys for v in sums[k]], self.state.device)
        for i, key in enumerate(keys):
            if totals[2 * i + 1]:
                metrics[key] = totals[2 * i] / totals[2 * i + 1]
        metrics.update(self._extremes(extremes))
        metrics["rollout_s"] = rollout_s
        metrics["update_s"] = time.perf_counter() - self.current.started
        return metrics

    def _extremes(self, extremes: dict[str, list[float]]) -> dict[str, float]:
        """The step's clip-ratio extremes over every rank's completions (NaN: none scored)."""
        out = {}
        for key, op, pick in (("clip_ratio/low_min", dist.ReduceOp.MIN, min),
                              ("clip_ratio/high_max", dist.ReduceOp.MAX, max)):
            if key not in extremes:  # alike on every rank: the loss type decides
                continue
            fill = math.inf if pick is min else -math.inf
            value = pick((v for v in extremes[key] if v == v), default=fill)
            t = torch.tensor([value], dtype=torch.float64, device=self.state.device)
            dist.all_reduce(t, op=op)
            out[key] = float(t) if math.isfinite(float(t)) else math.nan
        return out

    # ---- rollouts -------------------------------------------------------------------------

    def roll_out(self, index: int, step: int, use_fsdp: bool = False,
                 precision: Precision | None = None) -> Generation:
        """Sample, score and lay out this rank's share of generation batch `index`.

        Under FSDP2 the weights are gathered once for the whole rollout (TRL's
        `ds3_gather_for_generation`), so each SP group decodes as long as its own completions
        need; without that (`ds3_gather_for_generation: false`) every forward gathers each
        layer over all ranks, and the groups decode in lockstep."""
        started = time.perf_counter()
        state, config, g = self.state, self.config, self.trl.num_generations
        order = step_row_indices(index, self.generations_per_epoch,
                                 self.prompts_per_generation, len(self.rows), config.training.seed,
                                 not config.data.curriculum_sampling)
        mine = order[state.dp_rank * len(order) // state.layout.dp:
                     (state.dp_rank + 1) * len(order) // state.layout.dp]
        first = state.dp_rank * len(mine)  # the place of my first prompt in the step
        records = [self.rows[i] for i in mine]
        gather = use_fsdp and self.trl.ds3_gather_for_generation
        self.model.eval()  # no dropout, and a KV cache even with gradient checkpointing
        samples: list[list[list[int]]] = []
        with fsdp_weights_gathered(self.model, config.parallel.fsdp_config) if gather else (
                contextlib.nullcontext()):
            for k, record in enumerate(records):
                generator = None
                if state.sp_rank == 0:
                    generator = torch.Generator(device=state.device).manual_seed(
                        zlib.crc32(f"{config.training.seed}:{index}:{first + k}".encode()))
                samples.append(decode(self.decoder, self.head, record["prompt_ids"],
                                      self.trl.max_completion_length, state, self.pad_id,
                                      state.device, self.eos_ids, self.sampling, g,
                                      generator, lockstep=use_fsdp and not gather).tokens)
        self.model.train()
        local = self._score(records, samples, step)
        # Every rank needs the rewards and lengths; only the completions file the texts.
        texts = {k: local.pop(k) for k in ("prompts", "completions") if k in local}
        texts["dp_rank"] = state.dp_rank
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local if self.counted else None)
        leaders = [part for part in everyone if part is not None]
        problem = next((p["error"] for p in leaders if "error" in p), None)
        if problem is not None:
            raise UserError(problem)
        leaders.sort(key=lambda p: p["dp_rank"])
        rewards = torch.tensor([r for p in leaders for r in p["rewards"]], dtype=torch.float32)
        advantage, metrics = advantages(rewards, self.rewards.weights, g,
                                        self.trl.scale_rewards,
                                        self.trl.multi_objective_aggregation)
        metrics.update(function_metrics(rewards, self.rewards.names))
        lengths = torch.tensor([n for p in leaders for n in p["lengths"]], dtype=torch.float32)
        truncated = torch.tensor([t for p in leaders for t in p["truncated"]])
        metrics.update(_length_metrics(lengths, truncated))
        prompt_tokens = sum(p["prompt_tokens"] for p in leaders)
        self.input_tokens_seen += prompt_tokens + int(lengths.sum())
        metrics["num_tokens"] = float(self.input_tokens_seen)
        for name, values in self.rewards.logged.items():  # the functions' own log_metric
            metrics[name] = sum(values) / len(values)
        self.rewards.logged.clear()
        mask = ~truncated if self.trl.mask_truncated_completions else torch.ones_like(truncated)
        scored = (lengths * mask).view(state.layout.dp, self.split, -1).sum((0, 2))
        step_tokens = step_tokens_of(float(scored.sum()),
                                     config.training.gradient_accumulation_steps,
                                     self.micro_batches_per_generation)
        offset = state.dp_rank * len(mine) * g
        my_advantages = advantage[offset:offset + len(mine) * g].tolist()
        my_mask = mask[offset:offset + len(mine) * g].tolist()
        if step % config.output.logging_steps == 0:
            self._write_completions(step, leaders, texts if self.counted else None, advantage)
        batches = self._rows(records, samples, my_advantages, my_mask, precision)
        return Generation(index, batches, step_tokens, [int(n) for n in scored], metrics,
                          time.perf_counter() - started)

    def _score(self, records: list[dict], samples: list[list[list[int]]], step: int) -> dict:
        """This SP group's completions, rewards and lengths (what its first rank reports).
        Every rank of the group decodes the texts and scores them with the reward models
        (collectives over the group); the reward functions run on its first rank."""
        g = self.trl.num_generations
        prompts, completions, ids, columns, where = [], [], [], [], []
        for record, group in zip(records, samples, strict=True):
            prompt = json.loads(record["prompt"])
            try:
                texts = self.tokenizer.batch_decode(group, skip_special_tokens=True)
            except (ValueError, IndexError, KeyError, OverflowError) as e:
                return {"dp_rank": self.state.dp_rank, "error": (
                    f"base_model: the tokenizer cannot decode a completion sampled for "
                    f"{record['where']} ({type(e).__name__}: {e}); the model's vocabulary "
                    f"({max(map(max, group))} sampled) is larger than the tokenizer's "
                    f"({len(self.tokenizer)}). Fix: use the tokenizer the model was trained "
                    "with (`tokenizer:`), or a model whose embeddings match it.")}
            for text, completion in zip(texts, group, strict=True):
                prompts.append(prompt)
                completions.append([{"role": "assistant", "content": text}]
                                   if isinstance(prompt, list) else text)
                ids.append(completion)
                columns.append(json.loads(record["columns"]))
                where.append(record["where"])
        out = {"dp_rank": self.state.dp_rank, "prompts": prompts, "completions": completions,
               "lengths": [len(c) for c in ids],
               "truncated": [bool(c) and c[-1] not in (*self.eos_ids, self.pad_id)
                             for c in ids],
               "prompt_tokens": sum(len(r["prompt_ids"]) for r in records) * g}
        try:
            model_scores = self.rewards.score_models(prompts, completions, self.state)
            if self.counted:
                out["rewards"] = self.rewards.score(prompts, completions, ids, columns, step,
                                                    where, model_scores)
        except UserError as e:
            out["error"] = str(e)
        return out if self.counted else {}

    def _rows(self, records: list[dict], samples: list[list[list[int]]],
              advantage: list[float], mask: list[bool], precision: Precision | None,
              ) -> list[RolloutBatch]:
        """This rank's micro-batches: rows of whole groups, with their per-token passes."""
        g, per = self.trl.num_generations, self.per_micro
        out = []
        for start in range(0, len(records), per):
            groups = [(records[k]["prompt_ids"], samples[k], mask[k * g:(k + 1) * g])
                      for k in range(start, start + per)]
            ids, positions, labels, scored = group_row(groups, self.config.objective.prefix_sharing)
            batch = to_device(shard_batch(ids, positions, labels, self.state, self.pad_id),
                              self.state.device)
            docs = len(batch.sp_meta.cu_host) - 1
            b = len(scored)
            rollout = RolloutBatch(
                batch, torch.tensor(advantage[start * g:start * g + b] + [0.0] * (docs - b)),
                torch.tensor(scored + [0] * (docs - b), dtype=torch.float32), b)
            self._side_passes(rollout, precision)
            out.append(rollout)
        return out

    @torch.no_grad()
    def _side_passes(self, rollout: RolloutBatch, precision: Precision | None) -> None:
        """The rollout-time and reference (beta > 0) log-probabilities of this rank's tokens,
        in `no_grad` SP passes over the same row, under the update's autocast. Rollout-time
        ones only where a batch outlives an optimizer step (TRL: `gradient_accumulation_steps`
        not a multiple of `steps_per_generation x num_iterations`); else the update's own,
        detached, are the same numbers."""
        targets = rollout.batch.shift_labels.reshape(-1)
        autocast = precision.autocast if precision is not None else contextlib.nullcontext

        def scored(decoder, head) -> torch.Tensor:
            with autocast():
                hidden = sp_hidden_states(decoder, rollout.batch)
                return score_tokens(head, hidden, targets, self.state, self.chunk,
                                    self.loss.temperature)[0]

        if self.steps_per_generation > 1:
            rollout.old_logps = scored(self.decoder, self.head)
        if self.loss.beta != 0.0:
            if self.reference is not None:
                from longctx_cli.runtime.model import decoder_and_head

                rollout.ref_logps = scored(*decoder_and_head(self.reference))
            else:
                with reference_model(self.model):
                    rollout.ref_logps = scored(self.decoder, self.head)

    def _write_completions(self, step: int, leaders: list[dict], texts: dict | None,
                           advantage: torch.Tensor) -> None:
        """Sample completions with their rewards and advantages (TRL's completions table):
        every rank hands its SP group's texts (`texts`, None but on a group's first rank) to
        rank 0, which writes them."""
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(texts, gathered, dst=0)
        if dist.get_rank() != 0:
            return
        # Leaders' parts in data-parallel order, as `leaders` is sorted.
        parts = [t for t in gathered if t is not None]
        for part, text in zip(leaders, sorted(parts, key=lambda t: t["dp_rank"]), strict=True):
            part.update(text)
        limit = self.trl.num_completions_to_print
        path = Path(self.config.output.output_dir) / COMPLETIONS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        i = 0
        with path.open("a", encoding="utf-8") as f:
            for part in leaders:
                for prompt, completion, rewards, length in zip(
                        part["prompts"], part["completions"], part["rewards"], part["lengths"],
                        strict=True):
                    if limit is not None and i >= limit:
                        return
                    f.write(json.dumps({
                        "step": step + 1, "prompt": prompt, "completion": completion,
                        "completion_tokens": length,
                        "rewards": dict(zip(self.rewards.names, rewards, strict=True)),
                        "advantage": float(advantage[i])}, default=str) + "\n")
                    i += 1


def _length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's `completions/*` over the generation batch."""
    terminated = lengths[~truncated]
    if terminated.numel() == 0:
        terminated = torch.zeros(1)
    return {"completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max())}


def _dropouts(module: torch.nn.Module | None) -> list[torch.nn.Dropout]:
    """Every dropout layer of `module` (none for None)."""
    if module is None:
        return []
    return [m for m in module.modules() if isinstance(m, torch.nn.Dropout)]
