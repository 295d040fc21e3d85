"""A reward model (`trl.reward_funcs` entry that names a sequence-classification model),
scored under sequence parallelism exactly as TRL's `GRPOTrainer` scores it.

What TRL 1.16 does with such an entry (`trl/trainer/grpo_trainer.py`), and longctx with it:

* it loads the string with `AutoModelForSequenceClassification.from_pretrained(source,
  num_labels=1)` and names it by the last component of the model's `_name_or_path` (metrics
  `rewards/<name>/mean`); its tokenizer is `AutoTokenizer.from_pretrained` of the same source
  unless `reward_processing_classes` gives one. A tokenizer without a pad token gets eos as
  its pad token, and the model's `pad_token_id` is set to the tokenizer's;
* scoring (`_calculate_rewards`): conversational prompts (lists of `{"role", "content"}`
  messages) are rendered with the reward tokenizer's chat template over `prompt + completion`,
  otherwise the texts are `prompt + completion`; they are tokenized with `padding=True,
  padding_side="right", add_special_tokens=False` and the reward is `model(**inputs).logits[:,
  0]`: the `score` head at each row's rightmost token that is not the pad id.

longctx computes the same numbers without ever holding a whole sequence on one rank: each
text's ids become one document of a packed row (positions from 0, so a document sees only
itself), the row is sharded over the SP group (`shard_batch`) and run through the model's
decoder with the SP attention, and each document's pooled position is scored by the rank that
holds it; one all-reduce over the SP group hands every rank all the rewards. Rows hold as many
consecutive documents as fit in the longest one's length, so packing never needs more memory
than that sequence alone.

Contract for the rollout code:

    reward_model = RewardModel.load(source, config, state)  # once, on every rank
    rewards = reward_model.score(prompts, completions, state)  # collective over the SP group

`load` reads only local files (a folder, or a hub id already in the Hugging Face cache) and
raises `UserError` (where `trl.reward_funcs`) for an entry it cannot score faithfully.
`score` must be called by every rank of the SP group with the same arguments; it returns one
float per (prompt, completion) pair on every rank, in order. Its collectives span the SP
group only (attention and one all-reduce per row), so SP groups may score different batches,
and it runs outside any autocast, in the model's own dtype. The model is frozen, in eval mode,
whole on every rank (not sharded by FSDP or TP), on `state.device`, in the run's dtype. Texts
are not truncated (neither does TRL), and an empty text is an error (TRL would pool a row of
padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from longctx_cli.config.reward_models import (
    FAMILY_FIX,
    NEEDED,
    WHERE,
    classification_class,
    first_line,
    read_reward_config,
    unsupported_family,
)
from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.errors import UserError
from longctx_cli.parallel.attention import register_sp_attention
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import shard_batch
from longctx_cli.runtime.batches import to_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config

@dataclass
class RewardModel:
    """A loaded reward model: the classification model, its tokenizer and TRL's name."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    # GRPOConfig.chat_template_kwargs, passed to the chat template as TRL passes them.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, source: str, config: Config, state: ParallelState,
             tokenizer_source: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> RewardModel:
        """Load `source` (a folder, or a hub id in the local cache) as TRL loads a reward
        model string, with the SP attention, frozen, on `state.device` in `config.model.dtype`.
        `tokenizer_source`: the tokenizer to use instead of the model's own (TRL's
        `reward_processing_classes`)."""
        from longctx_cli.runtime.model import DTYPES

        if state.layout.tp > 1:  # the model is loaded whole, its heads not split over TP
            raise UserError(
                f"the reward model {source!r} cannot be scored under tensor parallelism.",
                where=WHERE, fix="use `tensor_parallel_size: 1`, or a Python reward function.")
        trust = bool(config.model.trust_remote_code)
        hf_config = read_reward_config(source, trust)
        model_class = classification_class(source, hf_config)
        attn = register_sp_attention()
        try:
            model, info = model_class.from_pretrained(
                source, num_labels=1, dtype=DTYPES[config.model.dtype], attn_implementation=attn,
                trust_remote_code=trust, local_files_only=True, output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise UserError(
                f"the reward model {source!r} could not be loaded as TRL loads it "
                f"(`AutoModelForSequenceClassification`, `num_labels=1`): {first_line(e)}",
                where=WHERE, fix=f"point it at {NEEDED}.") from None
        _check_loaded(source, model, info, attn)
        model.requires_grad_(False)
        model.eval()
        model.to(state.device)
        from longctx_cli.parallel.meta_relay import relay_sp_meta
        from longctx_cli.parallel.token_mixing import attach_token_mixing

        attach_token_mixing(model)  # hybrid decoders: scans and convolutions per document
        relay_sp_meta(model)  # layers that call their attention without the forward's kwargs
        tokenizer = _load_tokenizer(tokenizer_source or source, trust)
        _settle_pad_token(tokenizer, tokenizer_source or source)
        # TRL: the model pools at the last token that is not the tokenizer's pad token.
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        _check_vocabulary(source, tokenizer_source, tokenizer, model)
        return cls(_trl_name(source), model, tokenizer, dict(chat_template_kwargs or {}))

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The texts TRL tokenizes for the reward model (see the module doc)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if prompts and _is_conversational(prompts[0]):
            return [self.tokenizer.apply_chat_template(
                p + c, tools=None, tokenize=False, **self.chat_template_kwargs)
                for p, c in zip(prompts, completions, strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids as TRL's padded batch holds them, without the padding (padding only
        appends pad ids, so the unpadded encodings are the same ids)."""
        return self.tokenizer(text=texts, add_special_tokens=False)["input_ids"]

    def score(self, prompts: Sequence[Any], completions: Sequence[Any],
              state: ParallelState) -> list[float]:
        """One reward per (prompt, completion) pair, equal to TRL's `logits[:, 0]`, on every
        rank of the SP group; a collective over `state.sp_group` (every rank calls it with
        the same arguments)."""
        sequences = self.token_ids(self.texts(prompts, completions))
        for i, ids in enumerate(sequences):
            if not ids:  # TRL would pool a row of padding only; nothing meaningful to match
                raise ValueError(f"reward model {self.name}: text {i} has no tokens")
        pad = self.tokenizer.pad_token_id
        rewards: list[float] = [0.0] * len(sequences)
        device_type = state.device.type
        # The model's own forward runs in its dtype: a trainer's autocast must not change it.
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            for row in _rows([len(s) for s in sequences]):
                values = self._score_row([sequences[i] for i in row], pad, state)
                for i, value in zip(row, values, strict=True):
                    rewards[i] = value
        return rewards

    def _score_row(self, sequences: list[list[int]], pad: int, state: ParallelState,
                   ) -> list[float]:
        """The rewards of sequences packed as the documents of one SP row."""
        from longctx_cli.runtime.model import sp_hidden_states

        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(len(s)) for s in sequences])
        batch = to_device(shard_batch(ids, positions, torch.full_like(ids, IGNORE_INDEX), state,
                                      pad), state.device)
        decoder = getattr(self.model, self.model.base_model_prefix)
        hidden = sp_hidden_states(decoder, batch, where=WHERE)
        # The global position each document is pooled at (HF's rightmost non-pad token).
        pooled, start = [], 0
        for s in sequences:
            pooled.append(start + _pooled_index(s, pad))
            start += len(s)
        local, held = [], []
        offset = 0
        for g0, g1 in batch.sp_meta.local_ranges:
            for i, position in enumerate(pooled):
                if g0 <= position < g1:
                    local.append(offset + position - g0)
                    held.append(i)
            offset += g1 - g0
        out = torch.zeros(len(sequences), dtype=torch.float32, device=hidden.device)
        if local:
            out[held] = self.model.score(hidden[local])[:, 0].float()
        if state.layout.sp > 1:  # each value is nonzero on one rank only: the sum is exact
            dist.all_reduce(out, group=state.sp_group)
        return out.tolist()


def _pooled_index(ids: list[int], pad: int | None) -> int:
    """`GenericForSequenceClassification`'s pooled index of one right-padded row: the
    rightmost token that is not the pad id (0 when every token is), whatever the attention
    mask says; a text ending in the pad id (pad = eos) is scored before it."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] != pad:
            return i
    return 0


def _rows(lengths: list[int]) -> list[list[int]]:
    """Consecutive sequences packed into rows no longer than the longest sequence."""
    budget = max(lengths, default=0)
    rows: list[list[int]] = []
    used = budget + 1
    for i, n in enumerate(lengths):
        if used + n > budget:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def _is_conversational(prompt: Any) -> bool:
    """TRL's `is_conversational` of `{"prompt": prompt}`: a list whose first item is a
    message dict."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and (
        "role" in prompt[0])


def _trl_name(source: str) -> str:
    """TRL's name: `_name_or_path.split("/")[-1]` (trailing slashes dropped first, where TRL
    would name a `dir/` entry by the empty string)."""
    return source.rstrip("/").split("/")[-1] or source


def _check_loaded(source: str, model: nn.Module, info: dict[str, Any], attn: str) -> None:
    from transformers.modeling_layers import GenericForSequenceClassification

    if not isinstance(model, GenericForSequenceClassification):
        raise UserError(unsupported_family(source, type(model).__name__),
                        where=WHERE, fix=FAMILY_FIX)
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise UserError(
            f"the reward model {source!r} ({type(model).__name__}) has no one-output linear "
            "`score` head.", where=WHERE, fix=FAMILY_FIX)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise UserError(
            f"the reward model {source!r} lacks weights for {', '.join(missing[:4])}"
            f"{' and more' if len(missing) > 4 else ''}, which loading would initialise at "
            "random (a checkpoint of another task, or an incomplete save).",
            where=WHERE, fix=f"point it at {NEEDED}.")
    if model.config._attn_implementation != attn:
        raise UserError(
            f"the reward model {source!r} (model type `{model.config.model_type}`) did not "
            f"accept attn_implementation `{attn}`, so sequence-parallel attention would be "
            "bypassed.", where=WHERE, fix=FAMILY_FIX)


def _load_tokenizer(source: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                             local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(
            f"the reward model's tokenizer could not be loaded from {source!r}: "
            f"{first_line(e)}",
            where=WHERE,
            fix="save the tokenizer the reward model was trained with beside it "
            "(`tokenizer.save_pretrained`).") from None


def _settle_pad_token(tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    """TRL: a reward tokenizer without a pad token pads with eos; with neither, its padded
    batch cannot be built (the tokenizer refuses to pad), so TRL cannot score."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise UserError(
            f"the reward model's tokenizer ({source!r}) has no pad token and no eos token: "
            "TRL pads the reward batch with the pad token (eos when there is none) and the "
            "model scores the last token that is not padding, so neither can be decided.",
            where=WHERE,
            fix="save the tokenizer with the pad token the reward model was trained with "
            "(`tokenizer.pad_token = ...; tokenizer.save_pretrained(folder)`).")
    tokenizer.pad_token = tokenizer.eos_token


def _check_vocabulary(source: str, tokenizer_source: str | None,
                      tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        named = f" ({tokenizer_source!r})" if tokenizer_source else ""
        raise UserError(
            f"the reward model's tokenizer{named} has {len(tokenizer)} tokens but the reward "
            f"model {source!r} embeds only {rows}: they do not belong together (ids past "
            f"{rows - 1} would index past the embedding).",
            where=WHERE,
            fix="use the tokenizer the reward model was trained with (saved beside it).")

