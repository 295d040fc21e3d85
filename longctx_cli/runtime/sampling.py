"""Decoding under sequence parallelism: greedy continuations (`longctx generate`, RULER) and
sampled ones (GRPO's rollouts), from one prefill of the prompt spread over the SP group.

The prompt is prefilled by the SP forward the trainer uses (exact against the model's own
forward, see the family matrix), which leaves each rank's keys and values of its prompt shard
in a KV cache. Those are held out of the cache once (`parallel/decode.py`), and the `n`
sequences that continue the prompt (GRPO's `num_generations`) decode as one batch of `n`
queries per step, every one attending the shared prompt shard and its own decoded tokens: the
prompt is neither repeated per sequence nor gathered on one rank, so a prompt longer than one
device holds can still be continued.

Tokens are picked the way `model.generate` picks them: its own logits processors (repetition
penalty, temperature, top-k, top-p, min-p, in its order), then `argmax`, or `multinomial`
over the `[n, vocab]` probabilities, with sequences that ended padded with `pad_id` until
all have. SP rank 0 picks for the group (every rank holds the same logits after a decode
step), so the group agrees whatever the ranks' random states. Models whose layers attend
within a window or chunk, or mix tokens outside attention, decode by one full SP forward
per token instead (the same tokens, slower).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.parallel.decode import DecodeMeta, DecodeUnsupported, held_out_prompt_kv
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import shard_batch
from longctx_cli.runtime.batches import to_device
from longctx_cli.runtime.model import cache_kwargs, sp_hidden_states
from longctx_cli.runtime.vision import VisionInputs, VisionLanguageForward, with_vision


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy, or sampled as `generate(do_sample=True)` does
    with these parameters (TRL's GRPO sampling keys)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def processors(self):
        """transformers' own logits processors, in the order `generate` applies them."""
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            MinPLogitsWarper,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if not self.do_sample:
            return out
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(min_p=self.min_p))
        return out


GREEDY = Sampling()


@dataclass
class Continuations:
    """The `n` continuations of one prompt, each cut after its first end-of-sequence token
    (kept), and the log-probability of every picked token under the model's distribution
    divided by the temperature (what GRPO scores; equal across the group)."""

    tokens: list[list[int]]
    logps: list[list[float]] = field(default_factory=list)
    decode_seconds: float = 0.0  # the one-token steps after the prefill (all, without cache)


def decode(decoder, head, prompt: list[int], max_new_tokens: int, state: ParallelState,
           pad_id: int, device: torch.device, eos_ids: tuple[int, ...] = (),
           sampling: Sampling = GREEDY, n: int = 1,
           generator: torch.Generator | None = None, lockstep: bool = False,
           media: VisionInputs | None = None) -> Continuations:
    """Up to `max_new_tokens` tokens after `prompt` for each of `n` sequences; every rank of
    the SP group returns the same. `generator` (sampling): the random source of SP rank 0
    (default: torch's global one, as `generate` uses). `lockstep`: every rank of the world
    runs the same number of decode forwards (a group whose sequences ended keeps stepping
    until every group's have), for a model whose forwards issue collectives over the whole
    world (FSDP2 gathering its weights layer by layer). `media`: the prompt's images for a
    vision-language model (its decoder is `runtime.vision.VisionLanguageForward`)."""
    if state.layout.tp > 1:  # each token's heads and vocabulary are split across TP ranks
        raise ValueError("decoding under tensor parallelism is not supported")
    try:
        return _decode_with_cache(decoder, head, prompt, max_new_tokens, state, pad_id,
                                  device, eos_ids, sampling, n, generator, lockstep, media)
    except DecodeUnsupported as e:
        if media is not None and n != 1:
            raise ValueError(f"decoding {n} sequences of a vision-language model: {e}") from None
        if state.sp_rank == 0 and state.dp_rank == 0:
            print(f"decoding by full forwards: {e}", file=sys.stderr, flush=True)
        return _decode_by_forwards(decoder, head, prompt, max_new_tokens, state, pad_id,
                                   device, eos_ids, sampling, n, generator, lockstep, media)


def greedy_tokens(decoder, lm_head, prompt: list[int], max_new_tokens: int, state,
                  pad_id: int, device, eos_id: int | None,
                  media: VisionInputs | None = None) -> list[int]:
    """Up to `max_new_tokens` greedy ids after `prompt` (stopping after EOS); every rank of
    the SP group returns the same list."""
    eos = () if eos_id is None else (eos_id,)
    return decode(decoder, lm_head, prompt, max_new_tokens, state, pad_id, device, eos,
                  media=media).tokens[0]


class _Picker:
    """Picks every sequence's next token from its logits, as `generate` does, on SP rank 0,
    and hands the picks to the whole SP group."""

    def __init__(self, prompt: list[int], n: int, sampling: Sampling, eos_ids: tuple[int, ...],
                 pad_id: int, state: ParallelState, device: torch.device,
                 generator: torch.Generator | None):
        self.sampling, self.state, self.device = sampling, state, device
        self.processors = sampling.processors()
        self.generator = generator
        self.eos = torch.tensor(eos_ids or (-1,), device=device)
        self.pad_id = pad_id
        self.ids = torch.tensor([prompt] * n, device=device)  # what the processors read
        self.unfinished = torch.ones(n, dtype=torch.bool, device=device)
        self.picked: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[n, vocab]` (float32, alike on every SP rank) -> the next tokens `[n]`."""
        tokens = torch.full((logits.shape[0],), -1, dtype=torch.long, device=self.device)
        if self.state.sp_rank == 0:
            scores = self.processors(self.ids, logits)
            if self.sampling.do_sample:
                probs = torch.softmax(scores, dim=-1)
                tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            else:
                tokens = scores.argmax(dim=-1)
        if self.state.layout.sp > 1:
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.state.sp_group)
        scaled = logits / self.sampling.temperature if self.sampling.do_sample else logits
        self.logps.append(torch.log_softmax(scaled, -1).gather(1, tokens[:, None])[:, 0])
        tokens = torch.where(self.unfinished, tokens, torch.full_like(tokens, self.pad_id))
        self.picked.append(tokens)
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        self.unfinished &= ~torch.isin(tokens, self.eos)
        return tokens

    @property
    def done(self) -> bool:
        return not bool(self.unfinished.any())

    def active(self, max_new_tokens: int) -> bool:
        """Whether a sequence still goes on and has room for another token."""
        return len(self.picked) < max_new_tokens and not self.done

    def result(self, decode_seconds: float = 0.0) -> Continuations:
        picked = torch.stack(self.picked, 1).tolist()
        logps = torch.stack(self.logps, 1).tolist()
        eos = set(self.eos.tolist())
        out = Continuations([], [], decode_seconds)
        for ids, lps in zip(picked, logps, strict=True):
            end = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
            out.tokens.append(ids[:end])
            out.logps.append(lps[:end])
        return out


def _prefill(decoder, head, tokens: list[int], state: ParallelState, pad_id: int, device,
             cache=None, media: VisionInputs | None = None):
    """One SP forward over `tokens` (with a vision-language model, its `media` merged in):
    (the last position's logits `[vocab]` on every rank of the SP group, the sharded batch)."""
    row = torch.tensor(tokens, dtype=torch.long)
    positions = torch.arange(row.numel())
    batch = shard_batch(row, positions, torch.full_like(row, IGNORE_INDEX), state, pad_id)
    if isinstance(decoder, VisionLanguageForward):
        batch = with_vision(batch, row, positions, media, pad_id)
    batch = to_device(batch, device)
    hidden = sp_hidden_states(decoder, batch, where="--checkpoint", cache=cache)
    return _logits_at(head, hidden, batch.sp_meta.local_ranges, [len(tokens) - 1], state), batch


def _logits_at(head, hidden: torch.Tensor, ranges: tuple[tuple[int, int], ...],
               positions: list[int], state: ParallelState) -> torch.Tensor:
    """Logits `[len(positions), vocab]` of the given global positions of a sharded row, on
    every rank of the SP group (each position is computed where it lives, then summed)."""
    rows, held = [], []
    for i, position in enumerate(positions):
        local = _local_index(ranges, position)
        if local is not None:
            rows.append(local)
            held.append(i)
    picked = head(hidden[rows]).float() if rows else head(hidden[:1]).float()[:0]
    out = torch.zeros(len(positions), picked.shape[-1], device=hidden.device)
    out[held] = picked
    if state.layout.sp > 1:
        dist.all_reduce(out, group=state.sp_group)
    return out


def _decode_with_cache(decoder, head, prompt, max_new_tokens, state, pad_id, device, eos_ids,
                       sampling, n, generator, lockstep=False, media=None) -> Continuations:
    from transformers import DynamicCache, StaticCache

    picker = _Picker(prompt, n, sampling, eos_ids, pad_id, state, device, generator)
    with torch.no_grad():
        cache = DynamicCache(config=decoder.config)
        logits, batch = _prefill(decoder, head, prompt, state, pad_id, device, cache, media)
        meta = DecodeMeta.after_prefill(state, batch.sp_meta.local_ranges, len(prompt), device,
                                        held_out_prompt_kv(cache))
        del batch, cache
        token = picker(logits.repeat(n, 1))
        # The n sequences' own tokens only, in buffers allocated once (not grown per token).
        decoded = StaticCache(config=decoder.config, max_cache_len=max_new_tokens)
        cached = cache_kwargs(decoder, decoded)  # the decoder's name for it, read once
        started = time.perf_counter()
        while _keep_stepping(picker, max_new_tokens, lockstep, device):
            position = torch.full((n, 1), len(prompt) + meta.decoded - 1, device=device)
            hidden = decoder(input_ids=token[:, None], position_ids=position, sp_meta=meta,
                             **cached).last_hidden_state
            logits = head(hidden[:, -1]).float()
            if picker.active(max_new_tokens):  # else a step only to join the world's
                token = picker(logits)
            meta.decoded += 1
    return picker.result(time.perf_counter() - started)


def _decode_by_forwards(decoder, head, prompt, max_new_tokens, state, pad_id, device,
                        eos_ids, sampling, n, generator, lockstep=False,
                        media: VisionInputs | None = None) -> Continuations:
    """One SP forward per token over a row of the `n` sequences (each a document); with
    `media`, of the one sequence with the prompt's images merged in again."""
    picker = _Picker(prompt, n, sampling, eos_ids, pad_id, state, device, generator)
    started = time.perf_counter()
    with torch.no_grad():
        while _keep_stepping(picker, max_new_tokens, lockstep, device):
            sequences = picker.ids.tolist()
            if media is not None:
                logits, _ = _prefill(decoder, head, sequences[0], state, pad_id, device,
                                     media=media)
                if picker.active(max_new_tokens):
                    picker(logits)
                continue
            row = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
            length = len(sequences[0])
            positions = torch.arange(length).repeat(n)
            batch = to_device(shard_batch(row, positions, torch.full_like(row, IGNORE_INDEX),
                                          state, pad_id), device)
            hidden = sp_hidden_states(decoder, batch, where="--checkpoint")
            ends = [(i + 1) * length - 1 for i in range(n)]
            logits = _logits_at(head, hidden, batch.sp_meta.local_ranges, ends, state)
            if picker.active(max_new_tokens):
                picker(logits)
    return picker.result(time.perf_counter() - started)


def _keep_stepping(picker: _Picker, max_new_tokens: int, lockstep: bool,
                   device: torch.device) -> bool:
    """Whether to run another decode forward: while this group's sequences go on or, in
    `lockstep`, while any group's do (one world all-reduce of a flag per step)."""
    active = picker.active(max_new_tokens)
    if not lockstep:
        return active
    flag = torch.tensor([int(active)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _local_index(ranges: tuple[tuple[int, int], ...], position: int) -> int | None:
    """Where global `position` sits in this rank's local tokens, or None."""
    offset = 0
    for start, end in ranges:
        if start <= position < end:
            return offset + position - start
        offset += end - start
    return None
