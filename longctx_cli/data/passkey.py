"""The passkey retrieval task: a random key hidden at a chosen depth in filler text.

One generator serves training data (`type: passkey`) and `longctx eval`. A sample is

    [bos] INTRO  filler ... NEEDLE ... filler  QUESTION | ANSWER eos

where NEEDLE is " The pass key is [12345]. Remember it. [12345] is the pass key.", QUESTION
is " What is the pass key? The pass key is [" and ANSWER is "12345]". Every piece is
tokenized on its own and the ids concatenated, so the needle's and the key's token positions
are exact for any tokenizer. The filler is a few repeated sentences (the usual choice: cheap,
and it makes the key the only surprising thing in the context).

Why the brackets: the question ends with the token that opens the key, and that token occurs
nowhere else but in the needle, so retrieval is one unambiguous copy for every tokenizer.
Without them the key follows " is", which the filler repeats every few words: a byte-level
model would have to match the whole "pass key is" phrase before it could find the key.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data.formats import bos_prefix, text_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INTRO = "A pass key is hidden in this text. Find it and remember it."
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
QUESTION = " What is the pass key? The pass key is ["


@dataclass(frozen=True)
class PasskeySample:
    """One sample. `prompt_ids` ends right before the key; `answer_ids` = key, "]", eos."""

    prompt_ids: list[int]
    answer_ids: list[int]
    key: str
    depth: float  # requested relative depth, 0 = start of the filler, 1 = its end
    needle_pos: int  # index in prompt_ids of the needle's first token
    key_span: tuple[int, int]  # [start, end) of the key's tokens ("12345") in prompt_ids

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.answer_ids)


def make_key(key_length: int, rng: random.Random) -> str:
    """A random key of `key_length` digits with no leading zero (so its length is exact)."""
    first = str(rng.randint(1, 9))
    return first + "".join(str(rng.randint(0, 9)) for _ in range(key_length - 1))


def make_passkey_sample(
    tokenizer: PreTrainedTokenizerBase,
    context_len: int,
    depth: float,
    key_length: int,
    rng: random.Random,
) -> PasskeySample:
    """A sample of exactly `context_len` tokens (prompt + answer) with the key at `depth`.

    The needle goes at the filler sentence boundary nearest to `depth` of the filler, so the
    achieved depth is within one filler sentence of the request. Raises ValueError when
    `context_len` cannot hold the fixed parts (intro, needle, question, answer).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = make_key(key_length, rng)
    head = bos_prefix(tokenizer) + text_ids(tokenizer, INTRO)
    before_key = text_ids(tokenizer, " The pass key is [")
    key_ids = text_ids(tokenizer, key)  # the same tokens in the needle and the answer
    close = text_ids(tokenizer, "]")
    after_key = close + text_ids(tokenizer, ". Remember it. [") + key_ids + text_ids(
        tokenizer, "] is the pass key."
    )
    question = text_ids(tokenizer, QUESTION)
    answer = key_ids + close + _eos(tokenizer)
    needle = before_key + key_ids + after_key
    budget = context_len - len(head) - len(needle) - len(question) - len(answer)
    if budget < 0:
        raise ValueError(
            f"context_len {context_len} is too short for a passkey sample "
            f"(needs at least {context_len - budget} tokens with this tokenizer)"
        )
    filler, boundaries = _filler(tokenizer, budget)
    cut = min(boundaries, key=lambda b: (abs(b - depth * budget), b))
    prompt = head + filler[:cut] + needle + filler[cut:] + question
    needle_pos = len(head) + cut
    key_start = needle_pos + len(before_key)
    return PasskeySample(
        prompt_ids=prompt,
        answer_ids=answer,
        key=key,
        depth=depth,
        needle_pos=needle_pos,
        key_span=(key_start, key_start + len(key_ids)),
    )


def _eos(tok: PreTrainedTokenizerBase) -> list[int]:
    return [tok.eos_token_id] if tok.eos_token_id is not None else []


def _filler(tok: PreTrainedTokenizerBase, n: int) -> tuple[list[int], list[int]]:
    """`n` filler tokens (the last sentence may be cut) and the sentence boundaries in it."""
    sentence = text_ids(tok, FILLER)
    reps = n // len(sentence) + 1
    filler = (sentence * reps)[:n]
    boundaries = list(range(0, n + 1, len(sentence)))
    if boundaries[-1] != n:
        boundaries.append(n)
    return filler, boundaries


def training_labels(sample: PasskeySample) -> list[int]:
    """Labels for a training sample: every token is a target except the key's first mention.

    Why not the answer alone: the key's second mention in the needle is a short-range copy of
    the first, and learning it builds the same copy mechanism the long-range answer needs; the
    fixed text around it is learnt within a few dozen steps and then costs nothing. The key's
    first mention is random digits that nothing predicts; training on it is pure noise.
    """
    labels = list(sample.input_ids)
    start, end = sample.key_span
    labels[start:end] = [IGNORE_INDEX] * (end - start)
    return labels


def passkey_grid(
    num_samples: int, context_lengths: list[int], depths: list[float]
) -> list[tuple[int, float]]:
    """The (context_len, depth) of each of `num_samples` samples, cycling over the grid.

    Cycling (rather than drawing at random) covers every cell evenly even for few samples.
    """
    cells = [(c, d) for d in depths for c in context_lengths]
    return [cells[i % len(cells)] for i in range(num_samples)]


# Needle depths (0 = start of the filler, 1 = its end): training data covers every tenth;
# `longctx eval` asks at five, enough to see a depth the model misses at a fifth of the cost.
DEFAULT_DEPTHS = [round(i / 10, 1) for i in range(11)]
EVAL_DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


def generate_passkey_samples(
    tokenizer: PreTrainedTokenizerBase,
    num_samples: int,
    context_lengths: list[int],
    depths: list[float] | None,
    key_length: int,
    seed: int,
) -> list[PasskeySample]:
    """`num_samples` samples over the grid, deterministic for `seed`."""
    rng = random.Random(seed)
    grid = passkey_grid(num_samples, context_lengths, depths or DEFAULT_DEPTHS)
    return [make_passkey_sample(tokenizer, c, d, key_length, rng) for c, d in grid]
