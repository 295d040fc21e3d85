"""The fidelity probe: does longctx train exactly the model the user loads?

An attention implementation receives many per-family features (sliding windows per layer,
softcapping, sinks, scalings), and `XForCausalLM.forward` may transform logits after
`lm_head`. A family that longctx reproduces incompletely would train silently as a different
model, and SP parity tests cannot see it (sp=1 is wrong in the same way). So, before the first
step and in `longctx validate`, we build a tiny random model of the *same family* from the
user's model config -- same attention and logit features, shrunk sizes, windows shorter than
the probe row -- and compute one packed row both ways:

- the model's own Hugging Face forward (`attn_implementation="eager"`), one document at a
  time with `labels=` (its own loss), token-weighted over the documents;
- longctx's path at sp=1 (the `longctx_sp` attention, our head and summed loss), exactly as
  the trainer computes it.

Loss and every parameter gradient must agree to `TOLERANCE` (fp32, relative). Any difference
-- or a family that cannot be shrunk and run generically -- is a `UserError` naming the model
type and what differs. Nothing here names a family: a family transformers adds later is either
exact or refused.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longctx_cli.config.sections.vision import refuse_unless_rebuilt, shuffle_scale
from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.errors import UserError
from longctx_cli.families import Tower, family, vision_family

TOLERANCE = 1e-4
# Where only gradients miss TOLERANCE while the forward agrees, the probe measures the
# model's own float noise (its own training of the same documents as one padded batch against
# its per-document training) and accepts a gradient within NOISE_FACTOR times that noise on
# the same parameter, never beyond NOISE_CAP.
NOISE_FACTOR = 3.0
NOISE_CAP = 1e-3
PROBE_DOCS = (13, 24, 1, 26)  # 64 tokens; the one-token document has no target
PROBE_VOCAB = 128
PROBE_HEAD_DIM = 16
PROBE_WINDOW = 6  # shorter than every multi-token probe document
PROBE_MAMBA_CHUNK = 8  # Mamba2 scan chunks: the probe's documents span several
PROBE_CAP = 1.0  # softcaps above this barely bend a tiny model's values: shrink to stay active
PROBE_INIT_RANGE = 0.2  # weights large enough that logits and scores are O(1), features visible
PROBE_EXPERTS = 4
PROBE_INTERMEDIATE = 64
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERT_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k",
                     "top_k_experts")
# Layers before this index are dense, the rest MoE (DeepSeek): kept so the probe has both.
_FIRST_MOE_LAYER_KEYS = ("first_k_dense_replace",)
_DROP_KEYS = (
    "quantization_config", "_name_or_path", "dtype", "torch_dtype", "transformers_version"
)
# Sizes a config derives from its hidden size but saves too: dropped so that the shrunk
# config derives them again (its saved values would win over the derivation).
_DERIVED_KEYS = {"zamba2": ("attention_hidden_size", "attention_head_dim", "kv_channels")}
_FIX = (
    "train this model where it is computed exactly (plain Hugging Face training without "
    "sequence parallelism), pick a family that docs/families.md lists as exact, or -- if you "
    "accept training a different model than the one you load -- set `fidelity_probe: false`."
)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe checked and how close longctx came to the model's own training."""

    model_type: str
    layers: int
    features: tuple[str, ...]
    loss_rel_error: float
    worst_gradient: str
    worst_gradient_rel_error: float
    gradients_checked: int
    seconds: float
    # Set when a gradient passed only within the model's own float noise: that noise at the
    # worst gradient (see NOISE_FACTOR).
    own_noise: float | None = None
    row: str = ""  # what the probe trained, when not the text probe's packed row

    def summary(self) -> str:
        features = ", ".join(self.features) or "no attention/logit features"
        tolerance = f"tolerance {TOLERANCE:g}"
        if self.own_noise is not None:
            tolerance += (
                f"; `{self.worst_gradient}` passed within the model's own float noise: its own "
                f"training of the same documents as one padded batch differs from its "
                f"per-document training there by {self.own_noise:.1e}, and up to "
                f"{NOISE_FACTOR:g}x that (at most {NOISE_CAP:g}) is accepted")
        return (
            f"passed: tiny random `{self.model_type}` ({self.layers} layers; {features}), "
            f"{self.row or f'packed {sum(PROBE_DOCS)}-token row of {len(PROBE_DOCS)} documents'}"
            f": loss rel. err "
            f"{self.loss_rel_error:.1e}, {self.gradients_checked} parameter gradients worst "
            f"{self.worst_gradient_rel_error:.1e} ({tolerance}) against the model's "
            f"own eager forward(labels=) ({self.seconds:.1f}s)"
        )


# ---- shrinking ----------------------------------------------------------------------------


def _shrink_rope_lists(value: Any, old_half: int, new_half: int) -> Any:
    """Per-frequency rope lists (e.g. longrope factors) have rotary_dim / 2 entries."""
    if isinstance(value, dict):
        return {k: _shrink_rope_lists(v, old_half, new_half) for k, v in value.items()}
    if isinstance(value, list) and len(value) == old_half and old_half != new_half:
        return value[:new_half]
    return value


def _layer_count(fields: dict[str, Any], layers: int, shared: int = 0) -> int:
    """Enough leading layers to include every layer type and every layer with overrides of
    its own (`per_layer_config`), at least two; with `shared` layers that reuse an earlier
    layer's keys and values (Gemma 3n, Gemma 4), that many again."""
    types = fields.get("layer_types") or fields.get("layers_block_type")  # the latter: Nemotron-H
    n = 2
    if isinstance(types, list) and types:
        distinct = set(types)
        n = max(n, next(k for k in range(1, len(types) + 1) if set(types[:k]) == distinct))
    overrides: dict[str, int] = {}  # each distinct override, first layer holding it
    for index, override in sorted((int(k), v) for k, v in
                                  (fields.get("per_layer_config") or {}).items()):
        overrides.setdefault(repr(sorted(override.items())), index)
    n = max([n, *(index + 1 for index in overrides.values())])
    return min(layers, 2 * n if shared else n)


# Sizes some configs name otherwise than `intermediate_size` (transformers' attribute_map
# covers the common names: GPT-2's `n_embd`, MPT's `d_model`, ...).
_INTERMEDIATE_KEYS = ("ffn_hidden_size", "expert_ffn_hidden_size", "n_inner", "ffn_dim",
                      "d_ff", "ffn_intermediate_size")
# Experts that compute nothing (LongCat-Flash's zero experts), counted beside the real ones.
_EXTRA_EXPERT_KEYS = ("zero_expert_num",)
PROBE_MAX_PARAMETERS = 60_000_000  # a tiny copy larger than this was not shrunk
# MLP width of a tiny copy whose MLP keeps only each token's top units (Gemma 3n's activation
# sparsity: the top 5%): wide enough that float rounding moves few units across the cutoff.
PROBE_SPARSE_INTERMEDIATE = 1024


def _shrunk_heads(heads: int, kv: int) -> tuple[int, int]:
    """(heads, KV heads) of the tiny copy: at most 2 KV heads, the GQA ratio kept up to 4."""
    new_kv = min(kv, 2)
    return new_kv * min(max(1, heads // kv), 4), new_kv


def shrink_config(model_config: Any) -> Any:
    """A tiny config of the same class with the same attention and logit features.

    Sizes shrink (hidden, heads keeping GQA, layers keeping each layer type, vocab, experts);
    windows and attention chunks shrink below the probe's documents and softcaps to values a
    tiny model reaches, so each feature is active; scalings, multipliers and sinks stay as
    they are. Every head dim (``head_dim`` and the ``*_head_dim`` of multi-head latent
    attention: q/k without and with rotary, v) and latent rank (``*_lora_rank``) shrinks by
    one factor, so their ratios (q/k vs v head dim) stay; expert groups (``n_group``,
    ``topk_group``) shrink with the experts, and dense-then-MoE stacks keep both kinds.
    Keys are read under the config's own names (its ``attribute_map``), and layers that
    differ (``per_layer_config``) shrink alike, one of each kept.
    """
    fields = model_config.to_dict()
    for key in (*_DROP_KEYS, *_DERIVED_KEYS.get(fields.get("model_type", ""), ())):
        fields.pop(key, None)
    names = dict(getattr(type(model_config), "attribute_map", None) or {})

    def key_of(standard: str) -> str:  # the config's own name of a standard field
        return names.get(standard, standard)

    if family(str(fields.get("model_type", ""))).attention_free:
        return type(model_config).from_dict(_shrunk_scans_only(fields))
    heads = int(fields.get(key_of("num_attention_heads")) or 0)
    hidden = int(fields.get(key_of("hidden_size")) or 0)
    # Nemotron-H derives its layer count from its list of layer kinds (a property, not a field).
    layers = int(fields.get(key_of("num_hidden_layers"))
                 or getattr(model_config, "num_hidden_layers", 0) or 0)
    if not heads or not hidden or not layers:
        raise ValueError("the config has no num_attention_heads / hidden_size / num_hidden_layers")
    kv = int(fields.get(key_of("num_key_value_heads")) or heads)
    new_heads, new_kv = _shrunk_heads(heads, kv)
    old_head_dim = int(fields.get(key_of("head_dim")) or hidden // heads)
    factor = PROBE_HEAD_DIM / old_head_dim
    rotary = float(fields.get("partial_rotary_factor") or 1.0)
    old_half, new_half = int(old_head_dim * rotary) // 2, int(PROBE_HEAD_DIM * rotary) // 2
    if isinstance(fields.get("qk_rope_head_dim"), int):  # MLA: rotary on its own q/k part
        old_half = fields["qk_rope_head_dim"] // 2
        new_half = _scaled_dim(fields["qk_rope_head_dim"], factor) // 2
    fields.update({
        key_of("num_attention_heads"): new_heads,
        key_of("num_key_value_heads"): new_kv,
        key_of("hidden_size"): new_heads * PROBE_HEAD_DIM,
        key_of("vocab_size"): PROBE_VOCAB,
        "initializer_range": PROBE_INIT_RANGE,
    })
    if key_of("head_dim") in fields:
        fields[key_of("head_dim")] = PROBE_HEAD_DIM
    shared = fields.get("num_kv_shared_layers")
    new_layers = _layer_count(fields, layers, shared if isinstance(shared, int) else 0)
    if isinstance(shared, int) and shared:
        fields["num_kv_shared_layers"] = new_layers // 2  # the second half reuses the first's
    layer_keys = {key_of("num_hidden_layers"), "num_hidden_layers"}
    sparse = any(fields.get("activation_sparsity_pattern") or [])
    sizes = dict(old_half=old_half, new_half=new_half, factor=factor, layers=layers,
                 new_layers=new_layers,
                 intermediate=PROBE_SPARSE_INTERMEDIATE if sparse else PROBE_INTERMEDIATE)
    for key, value in list(fields.items()):
        if key in layer_keys and isinstance(value, int) and not isinstance(value, bool):
            fields[key] = new_layers
        else:
            fields[key] = _shrunk_value(key, value, **sizes)
    overrides = fields.get("per_layer_config")
    if isinstance(overrides, dict):
        fields["per_layer_config"] = {
            index: _shrunk_layer(override, sizes, key_of)
            for index, override in overrides.items() if int(index) < new_layers}
    _shrink_expert_groups(fields)
    _shrink_layer_periods(fields)
    _shrink_mamba(fields)
    for key in _FIRST_MOE_LAYER_KEYS:
        if isinstance(fields.get(key), int) and fields[key] > 0:
            fields[key] = min(fields[key], new_layers - 1)
    return type(model_config).from_dict(fields)


def _shrunk_value(key: str, value: Any, *, old_half: int, new_half: int, factor: float,
                  layers: int, new_layers: int, intermediate: int) -> Any:
    """One field of the config, shrunk as `shrink_config` says (unchanged if no rule)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and len(value) == layers:  # per-layer lists: layer_types ...
        if key.endswith("intermediate_size") or key in _INTERMEDIATE_KEYS:
            return [intermediate] * new_layers  # ... and Gemma 3n's MLP widths
        return value[:new_layers]
    if isinstance(value, int):
        if key.startswith("vocab_size"):  # Gemma 3n/4's per-layer input embeddings too
            return PROBE_VOCAB
        if key == "hidden_size_per_layer_input":
            return PROBE_HEAD_DIM
        if key.endswith("intermediate_size") or key in _INTERMEDIATE_KEYS:
            return intermediate
        if key in _EXPERT_COUNT_KEYS:
            return min(value, PROBE_EXPERTS)
        if key in _EXTRA_EXPERT_KEYS:
            return min(value, 2)
        if key in _EXPERT_TOPK_KEYS:
            return min(value, 2)
        if (key.endswith("_head_dim") or key.endswith("_lora_rank")
                or key == "rotary_dim") and value > 0:  # rotary_dim: GPT-J, CodeGen
            return _scaled_dim(value, factor)
        if key.endswith("_token_id") and value >= PROBE_VOCAB:
            return PROBE_VOCAB - 1
    if key.endswith("_token_id") and isinstance(value, list):
        return [t if t < PROBE_VOCAB else PROBE_VOCAB - 1 for t in value]
    if ("window" in key or key == "attention_chunk_size") and isinstance(value, int) and (
        "layers" not in key and "pattern" not in key
    ):
        return min(value, PROBE_WINDOW)
    if ("softcap" in key or "soft_cap" in key) and isinstance(value, (int, float)):
        return min(float(value), PROBE_CAP) if value else value
    if ("dropout" in key or "jitter" in key or key.endswith("pdrop")) and isinstance(
            value, float):
        return 0.0  # randomness would make the two sides differ for no fault of ours
    if key.startswith("rope") and isinstance(value, dict):
        return _shrink_rope_lists(value, old_half, new_half)
    return value


def _shrunk_layer(override: dict[str, Any], sizes: dict[str, Any],
                  key_of: Any) -> dict[str, Any]:
    """One layer's own fields (`per_layer_config`), shrunk as the config's are: its heads
    keep their GQA ratio, its head dims scale by the config's factor."""
    out = {key: _shrunk_value(key, value, **sizes) for key, value in override.items()}
    heads_key, kv_key = key_of("num_attention_heads"), key_of("num_key_value_heads")
    if isinstance(override.get(heads_key), int):
        heads = override[heads_key]
        out[heads_key], new_kv = _shrunk_heads(heads, int(override.get(kv_key) or heads))
        if kv_key in override:
            out[kv_key] = new_kv
    if isinstance(override.get(key_of("head_dim")), int):
        out[key_of("head_dim")] = _scaled_dim(override[key_of("head_dim")], sizes["factor"])
    return out


def _shrink_layer_periods(fields: dict[str, Any]) -> None:
    """Jamba: attention every ``attn_layer_period`` layers at ``attn_layer_offset``, Mamba
    elsewhere, and experts likewise. The tiny copy keeps a Mamba layer, then attention and
    experts on its last layer."""
    layers = fields.get("num_hidden_layers")
    for kind in ("attn", "expert"):
        if isinstance(fields.get(f"{kind}_layer_period"), int) and isinstance(layers, int):
            fields[f"{kind}_layer_period"], fields[f"{kind}_layer_offset"] = layers, layers - 1


def _shrink_mamba(fields: dict[str, Any]) -> None:
    """Mamba2 mixers (Bamba, Granite 4 hybrids, Nemotron-H, Falcon-H1, Zamba2): at most 4 heads
    whose inner width matches the shrunk hidden size where the config ties them
    (``mamba_expand``; the configs check it), one group, a small state and scan chunks
    shorter than the probe's documents, so the chunked scan carries its state across chunks."""
    heads_key = next((k for k in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
                      if isinstance(fields.get(k), int)), None)
    if heads_key is None:
        return
    heads = fields[heads_key] = min(fields[heads_key], 4)
    if fields.get("attn_layer_indices"):  # Bamba: attention at these layers, Mamba2 elsewhere
        fields["attn_layer_indices"] = [fields["num_hidden_layers"] - 1]
    expand = fields.get("mamba_expand")
    for key in ("mamba_d_head", "mamba_head_dim", "mamba_headdim"):
        if isinstance(fields.get(key), int):
            fields[key] = (int(expand * fields["hidden_size"]) // heads
                           if isinstance(expand, (int, float)) and not fields.get("mamba_d_ssm")
                           else PROBE_HEAD_DIM)
    if isinstance(fields.get("mamba_d_ssm"), int):
        fields["mamba_d_ssm"] = heads * fields.get("mamba_d_head", PROBE_HEAD_DIM)
    for key, most in (("mamba_n_groups", 1), ("n_groups", 1), ("mamba_ngroups", 1),
                      ("mamba_d_state", 8),
                      ("ssm_state_size", 8), ("mamba_chunk_size", PROBE_MAMBA_CHUNK),
                      ("chunk_size", PROBE_MAMBA_CHUNK)):
        if isinstance(fields.get(key), int) and not isinstance(fields[key], bool):
            fields[key] = min(fields[key], most)


# The tiny copy of a model without attention (Mamba, Mamba2, Falcon-Mamba): hidden size,
# SSM state and Mamba2 heads.
PROBE_SCAN_HIDDEN = 32
PROBE_SCAN_STATE = 8
PROBE_SCAN_HEADS = 4


def _shrunk_scans_only(fields: dict[str, Any]) -> dict[str, Any]:
    """A model of scans only: hidden 32, 2 layers, a small state, the expansion kept (the
    inner width follows it), Mamba2's 4 heads in one group with scan chunks shorter than the
    probe's documents (so the chunked scan carries its state across chunks)."""
    expand = fields.get("expand") or 2
    inner = int(expand * PROBE_SCAN_HIDDEN)
    fields.update(hidden_size=PROBE_SCAN_HIDDEN, num_hidden_layers=2, vocab_size=PROBE_VOCAB,
                  initializer_range=PROBE_INIT_RANGE)
    if isinstance(fields.get("layer_types"), list):
        fields["layer_types"] = fields["layer_types"][:2]
    if isinstance(fields.get("intermediate_size"), int):
        fields["intermediate_size"] = inner
    for key, most in (("state_size", PROBE_SCAN_STATE), ("time_step_rank", PROBE_SCAN_STATE),
                      ("n_groups", 1), ("chunk_size", PROBE_MAMBA_CHUNK)):
        if isinstance(fields.get(key), int):
            fields[key] = min(fields[key], most)
    if isinstance(fields.get("num_heads"), int):  # Mamba2: heads x head dim = inner width
        fields["num_heads"] = PROBE_SCAN_HEADS
        fields["head_dim"] = inner // PROBE_SCAN_HEADS
    return fields


def _scaled_dim(value: int, factor: float) -> int:
    """A head dim or latent rank times ``factor``, even (rotary halves it), at least 2."""
    return max(2, 2 * round(value * factor / 2))


def _shrink_expert_groups(fields: dict[str, Any]) -> None:
    """Group-limited routing (DeepSeek: experts in ``n_group`` groups, a token's experts from
    its ``topk_group`` best groups, each group scored by its top two) on the shrunk experts:
    as many groups of at least two experts as fit, the same share of them selected."""
    experts = next((fields[k] for k in _EXPERT_COUNT_KEYS if isinstance(fields.get(k), int)),
                   None)
    groups, chosen = fields.get("n_group"), fields.get("topk_group")
    if not experts or not isinstance(groups, int) or groups < 1:
        return
    new = max(g for g in range(1, min(groups, experts) + 1)
              if experts % g == 0 and (experts // g >= 2 or g == 1))
    fields["n_group"] = new
    if isinstance(chosen, int):
        fields["topk_group"] = max(1, min(new, round(chosen * new / groups)))


def active_features(tiny: Any) -> tuple[str, ...]:
    """The attention/logit features switched on in a (tiny) config, for the report."""
    from longctx_cli.runtime.head import LogitTransform

    text = tiny.get_text_config() if hasattr(tiny, "get_text_config") else tiny
    found = []
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if window and (types is None or any("sliding" in t for t in types)):
        where = ""
        if types:
            where = f" on {sum('sliding' in t for t in types)}/{len(types)} layers"
        found.append(f"sliding window {window}{where}")
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk and types and "chunked_attention" in types:
        found.append(f"chunked attention {chunk} on "
                     f"{sum(t == 'chunked_attention' for t in types)}/{len(types)} layers")
    qk = getattr(text, "qk_head_dim", None)
    v_dim = getattr(text, "v_head_dim", None)
    if qk and v_dim and qk != v_dim:
        found.append(f"latent attention (q/k head dim {qk}, v head dim {v_dim})")
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap:
        found.append(f"attention softcap {cap:g}")
    head = LogitTransform.from_config(tiny)
    if not head.is_identity:
        found.append(f"head: {head.describe()}")
    experts = next((getattr(text, k) for k in _EXPERT_COUNT_KEYS if getattr(text, k, None)), None)
    if experts:
        found.append(f"MoE {experts} experts")
    return tuple(found)


# ---- the two computations -----------------------------------------------------------------


def _probe_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from longctx_cli.constants import IGNORE_INDEX

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, PROBE_VOCAB, (sum(PROBE_DOCS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in PROBE_DOCS])
    labels = ids.clone()
    labels[pos == 0] = IGNORE_INDEX  # the trainer's data convention
    return ids, pos, labels


def _documents(ids: torch.Tensor) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for n in PROBE_DOCS:
        bounds.append((start, start + n))
        start += n
    return bounds


def _reference(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's own training loss: its forward(labels=) per document, token-weighted.

    Returns (loss, final hidden states, logits), hidden/logits concatenated over documents.
    """
    from longctx_cli.runtime.head import decoder_of

    dtype = next(model.parameters()).dtype
    total, count, hidden, logits = ids.new_zeros((), dtype=dtype), 0, [], []
    decoder = decoder_of(model)
    for start, end in _documents(ids):
        doc = ids[start:end][None]
        with torch.no_grad():
            hidden.append(decoder(input_ids=doc, use_cache=False).last_hidden_state[0])
        if end - start < 2:  # no target: the model's mean loss would be 0/0
            logits.append(model(input_ids=doc, use_cache=False).logits[0].detach().to(dtype))
            continue
        out = model(input_ids=doc, labels=doc, use_cache=False)
        logits.append(out.logits[0].detach().to(dtype))
        total = total + out.loss.to(dtype) * (end - start - 1)
        count += end - start - 1
    return total / count, torch.cat(hidden), torch.cat(logits)


def _own_padded_batch_errors(reference: Any, tiny: Any, ids: torch.Tensor, floor: float,
                             trust_remote_code: bool) -> dict[str, float] | None:
    """The model's own float noise, per parameter: its training of the probe's documents as
    one right-padded batch (attention_mask, the same token-weighted loss) against its
    per-document training (``reference``, gradients already computed). None when the model
    cannot run a padded batch."""
    from longctx_cli.constants import IGNORE_INDEX

    docs = _documents(ids)
    width = max(end - start for start, end in docs)
    batch = ids.new_zeros((len(docs), width))
    labels = ids.new_full((len(docs), width), IGNORE_INDEX)
    for row, (start, end) in enumerate(docs):
        batch[row, :end - start] = labels[row, :end - start] = ids[start:end]
    try:
        model = _build(tiny, "eager", trust_remote_code)
        model.load_state_dict(reference.state_dict())
        model(input_ids=batch, attention_mask=(labels != IGNORE_INDEX).long(), labels=labels,
              use_cache=False).loss.backward()
    except Exception:  # the padded batch is only a yardstick; without it nothing is accepted
        return None
    own = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {n: _grad_error(own[n], p.grad, floor) for n, p in reference.named_parameters()
            if p.grad is not None and n in own}


def gradient_floor(ref_grads: Any) -> float:
    """The smallest size a gradient error is measured against: a small share of the whole
    gradient (a gradient whose exact value is zero, such as a k_proj bias's, is pure float
    noise on both sides, so noise cannot refuse a model)."""
    return 1e-3 * float(torch.cat([g.double().flatten() for g in ref_grads]).norm())


def _grad_error(grad: torch.Tensor, ref_grad: torch.Tensor, floor: float) -> float:
    return (float((grad.double() - ref_grad.double()).norm())
            / max(float(ref_grad.double().norm()), floor, 1e-30))


def _longctx(model: Any, ids: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """longctx's sp=1 path, as the trainer computes it: (loss, hidden, logits)."""
    from longctx_cli.parallel.mesh import ParallelState
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.loss import lm_loss_sum, valid_token_count
    from longctx_cli.runtime.model import decoder_and_head, sp_hidden_states

    batch = shard_batch(ids, pos, labels, ParallelState())
    decoder, head = decoder_and_head(model)
    hidden = sp_hidden_states(decoder, batch)
    loss = lm_loss_sum(head, hidden, batch.shift_labels) / valid_token_count(batch.shift_labels)
    with torch.no_grad():
        logits = head(hidden)
    return loss, hidden.detach(), logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.norm() > 0 else float(a.norm())


def _refuse(model_type: str, what: str) -> UserError:
    return UserError(
        f"the fidelity probe refuses model type `{model_type}`: {what} longctx would train a "
        "different model than the one you load, so training is refused.",
        where="base_model",
        fix=_FIX,
    )


def _unchecked(model_type: str, what: str) -> UserError:
    """The probe itself failed before anything was compared: say so, blame nobody."""
    return UserError(
        f"the fidelity probe could not check model type `{model_type}`: {what}. This is a "
        "limit of longctx's probe (it builds and runs a tiny copy of the family itself), not "
        "a finding about the model or about longctx's attention: whether longctx trains this "
        "family exactly is unknown, so training is refused unless you choose to go on "
        "unchecked.",
        where="fidelity_probe",
        fix="set `fidelity_probe: false` to train without the check (docs/families.md lists "
        "the families CI proves exact; a family not listed there is trained unverified).",
    )


def run_probe(model_config: Any, trust_remote_code: bool = False, images: bool = False,
              linearized: bool = False) -> ProbeResult:
    """Compare longctx's sp=1 training computation with the model's own; raise UserError on
    any difference; `images`: the run trains with them (`processor_type`); `linearized`:
    longctx's side linearizes the experts (`llama4_linearized_experts`), its gradients
    mapped back to the model's own fused parameters. Leaves the global RNG state as it
    found it."""
    from longctx_cli.config.shape import is_vision_language

    if is_vision_language(model_config, images):
        return run_vision_probe(model_config)
    started = time.perf_counter()
    model_type = str(getattr(model_config, "model_type", "") or type(model_config).__name__)
    with torch.random.fork_rng(devices=[]):
        try:
            causal = _causal_lm_config(model_config)
            _refuse_timm_tower(model_type, causal)
            # A multimodal class that is its own causal LM (Gemma 3) trains its language
            # model on text: the tiny copy keeps the class, its parts shrunk.
            tiny = (shrink_vision_config(causal, images=False) if _is_wrapper(causal)
                    else shrink_config(causal))
        except UserError:
            raise
        except Exception as e:  # any config class may reject our shrunk fields
            raise _unchecked(model_type, "longctx's own shrinking of the config to a tiny "
                             f"model failed ({type(e).__name__}: {_first_line(e)})") from None
        return _compare(model_type, tiny, trust_remote_code, started, linearized)


def _refuse_timm_tower(model_type: str, config: Any) -> None:
    """A multimodal model whose vision tower is a timm backbone (Gemma 3n's MobileNetV5,
    named by `vision_config.architecture`) has no size fields a tiny copy could shrink."""
    import importlib.util

    architecture = getattr(getattr(config, "vision_config", None), "architecture", None)
    if not isinstance(architecture, str):
        return
    missing = ("; timm is not installed here, and transformers builds the tower with it"
               if importlib.util.find_spec("timm") is None else "")
    raise UserError(
        f"model type `{model_type}` builds its vision tower as the timm backbone "
        f"`{architecture}` (`vision_config.architecture`), whose sizes timm fixes: the "
        f"fidelity probe cannot build a tiny copy of it{missing}. The tower trains nothing "
        "on text, and longctx does not rebuild this family's image forward, so whether "
        "longctx trains the whole model exactly is unchecked and training is refused.",
        where="fidelity_probe",
        fix=f"train its language model alone (`model_config` set to the config's "
        f"`text_config`, model type `{config.get_text_config().model_type}`, which the "
        "probe checks), or set `fidelity_probe: false` to train without the check.")


def _is_wrapper(config: Any) -> bool:
    """A multimodal config holding its text part as a sub-config (with or without towers;
    an audio tower alone: Voxtral)."""
    return (hasattr(config, "get_text_config")
            and (hasattr(config, "vision_config") or hasattr(config, "audio_config"))
            and config.get_text_config() is not config)


def _causal_lm_config(model_config: Any) -> Any:
    """The config transformers builds this model's causal LM from: a multimodal wrapper's
    text config where its causal LM is the text model alone (Qwen3.5), else the config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = (model_config.get_text_config() if hasattr(model_config, "get_text_config")
            else model_config)
    if text is model_config or type(model_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return model_config
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    return text if isinstance(text, causal_lm.config_class) else model_config


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _parameters_on_meta(tiny: Any, trust_remote_code: bool) -> int | None:
    """The tiny copy's parameter count, built on the meta device (no memory); None when it
    does not build there (the real build then reports why)."""
    from longctx_cli.config.shape import causal_lm_class

    try:
        with torch.device("meta"):
            model = causal_lm_class(tiny).from_config(copy.deepcopy(tiny),
                                                      trust_remote_code=trust_remote_code)
    except Exception:  # the eager build below names what failed
        return None
    return sum(p.numel() for p in model.parameters())


def _build(tiny: Any, attn: str, trust_remote_code: bool) -> Any:
    from longctx_cli.config.shape import causal_lm_class

    torch.manual_seed(0)
    # A copy each: from_config records the attention implementation on the config object.
    model = causal_lm_class(tiny).from_config(
        copy.deepcopy(tiny), attn_implementation=attn, dtype=torch.float32,
        trust_remote_code=trust_remote_code,
    )
    return without_dropout(model.train())


def without_dropout(model: Any) -> Any:
    """`model` with every dropout at p = 0: the probe judges the computation, and two
    training forwards draw different masks (Phi-3's and GPT-2's residual dropout layers; the
    rates layers keep as numbers: Seed-OSS's `attention_dropout`, passed to the attention
    function in training, and its `residual_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


# Layers that mix tokens outside attention, by the words of the class names transformers
# gives them: state-space scans (JambaMambaMixer, NemotronHMamba2Mixer, FalconH1Mixer), linear
# attention (Qwen3NextGatedDeltaNet, MiniMaxLightningAttention), short convolutions
# (Lfm2ShortConv), recurrences (RWKV, xLSTM, RecurrentGemma). Whole words: GptOssMLP is no SSM.
_TOKEN_MIXER_WORDS = frozenset({"Mamba", "Mamba2", "Mixer", "Delta", "Conv", "Lightning",
                                "Rwkv", "RWKV", "Recurrent", "Lstm", "LSTM", "Ssm", "SSM"})
_CLASS_WORD = re.compile(r"[A-Z]+(?![a-z])\d*|[A-Z][a-z]+\d*|[a-z]+\d*|\d+")


def _mixes_tokens(module: Any, family: str = "") -> bool:
    """A Conv1d, or a class whose name (less the family's prefix: RecurrentGemmaRMSNorm is a
    norm) names a scan, a recurrence, a convolution or linear attention."""
    if isinstance(module, torch.nn.Conv1d):
        return True
    words = _CLASS_WORD.findall(type(module).__name__.removeprefix(family))
    pairs = set(zip(words, words[1:], strict=False))
    return bool(_TOKEN_MIXER_WORDS.intersection(words)) or ("Linear", "Attention") in pairs


def token_mixers(model: Any, covered: bool = False) -> dict[str, list[int]]:
    """`layer part (its class)` -> the decoder layers holding it, for every part of a decoder
    layer that mixes tokens outside attention: a convolution over the sequence, or a module
    named as a scan, a recurrence or linear attention is. Empty for pure-attention models.

    Parts longctx runs exactly (`parallel.token_mixing.COVERED`) are listed only with
    ``covered=True``; otherwise only the ones it would have to refuse."""
    from longctx_cli.parallel.token_mixing import mixer_kind
    from longctx_cli.runtime.head import decoder_of

    family = re.sub(r"(For[A-Z]\w*|Model)$", "", type(model).__name__)  # Jamba, Mamba2, ...

    def holds_covered(module: Any) -> bool:
        return any(mixer_kind(m) is not None for m in module.modules())

    def mixes_uncovered(module: Any) -> bool:
        # A covered mixer is run exactly; a module that only wraps covered ones (Zamba2's
        # Mamba decoder layer inside its hybrid layer) is named like a mixer but is none.
        if mixer_kind(module) is not None:
            return False
        if any(mixes_uncovered(child) for child in module.children()):
            return True
        return _mixes_tokens(module, family) and not holds_covered(module)

    found: dict[str, list[int]] = {}
    for index, layer in enumerate(getattr(decoder_of(model), "layers", [])):
        for name, module in layer.named_children():
            if holds_covered(module) if covered else mixes_uncovered(module):
                found.setdefault(f"`{name}` ({type(module).__name__})", []).append(index)
    return found


def _mixer_refusal(model_type: str, mixers: dict[str, list[int]]) -> UserError:
    parts = "; ".join(f"{part} in layer{'s' if len(at) > 1 else ''} "
                      f"{', '.join(map(str, at))}" for part, at in mixers.items())
    return _refuse(model_type, (
        f"its decoder layers mix tokens outside attention: {parts}. longctx runs only "
        f"{_covered_list()} exactly across ranks and packed documents; these layers (scans, "
        "recurrences, convolutions over the sequence) would run across document boundaries "
        "and restart at rank boundaries;"))


def _covered_list() -> str:
    from longctx_cli.parallel.token_mixing import COVERED

    return "the token mixers " + ", ".join(COVERED)


def _bypasses_interface(error: BaseException) -> bool:
    """The model's own code never reached longctx's attention: it computes attention itself
    (the SP guard found no call: Bloom's ALiBi attention), or looks the implementation up in
    its own table (GPT-Neo, Falcon: a KeyError on longctx's name)."""
    from longctx_cli.parallel.attention import ATTN_IMPLEMENTATION

    if isinstance(error, KeyError):
        return ATTN_IMPLEMENTATION in str(error)
    return isinstance(error, UserError) and "did not call the sequence-parallel" in str(error)


def _compare(model_type: str, tiny: Any, trust_remote_code: bool, started: float,
             linearized: bool = False) -> ProbeResult:
    from longctx_cli.parallel.attention import ATTN_IMPLEMENTATION, register_sp_attention
    from longctx_cli.parallel.meta_relay import relay_sp_meta
    from longctx_cli.parallel.token_mixing import attach_token_mixing
    from longctx_cli.runtime.experts import fused_expert_state, linearize_experts

    features = active_features(tiny) + (("experts linearized",) if linearized else ())
    described = f"a tiny `{model_type}` ({', '.join(features) or 'no special features'})"
    ids, pos, labels = _probe_row()
    size = _parameters_on_meta(tiny, trust_remote_code)
    if size is not None and size > PROBE_MAX_PARAMETERS:
        raise _unchecked(model_type, f"longctx's shrinking left {size:,} parameters in the "
                         "tiny copy (its config names some of its sizes in keys the probe "
                         "does not shrink), too many to run here")
    try:
        reference = _build(tiny, "eager", trust_remote_code)
        mixers = token_mixers(reference)
        if not mixers:
            ref_loss, ref_hidden, ref_logits = _reference(reference, ids)
            ref_loss.backward()
    except Exception as e:
        raise _unchecked(model_type, f"longctx's tiny copy of it ({described}, built from "
                         "the probe's shrunk config) failed to build or run in the model's "
                         "own eager forward, the reference the probe compares against "
                         f"({type(e).__name__}: {_first_line(e)})") from None
    if mixers:  # named before any comparison: it could only report a loss difference
        raise _mixer_refusal(model_type, mixers)
    register_sp_attention()
    try:
        ours = _build(tiny, ATTN_IMPLEMENTATION, trust_remote_code)
        if ours.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(f"the model did not accept attn_implementation "
                               f"{ATTN_IMPLEMENTATION!r}")
        ours.load_state_dict(reference.state_dict())
        if linearized:  # after loading the reference's (fused) weights
            linearize_experts(ours)
        attach_token_mixing(ours)
        relay_sp_meta(ours)
        loss, hidden, logits = _longctx(ours, ids, pos, labels)
        loss.backward()
    except Exception as e:
        if _bypasses_interface(e):
            raise _refuse(model_type, "its attention does not dispatch through transformers' "
                          "AttentionInterface (the family computes attention in its own code, "
                          "or picks it from its own table of implementations), so longctx's "
                          "sequence-parallel attention would never run;") from None
        raise _refuse(model_type, f"longctx's path failed on {described} "
                      f"({type(e).__name__}: {_first_line(e)});") from None

    loss, ref_loss = float(loss.detach()), float(ref_loss.detach())
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    if linearized:  # each expert's linear gradients, back in the fused parameters' layout
        grads = fused_expert_state(grads)
    if grads.keys() != ref_grads.keys():
        only_ref = sorted(ref_grads.keys() - grads.keys())
        only_ours = sorted(grads.keys() - ref_grads.keys())
        side = (f"the model's own forward uses {', '.join(only_ref[:4])} but longctx's "
                "computation never does" if only_ref else
                f"longctx's computation uses {', '.join(only_ours[:4])} but the model's own "
                "forward does not")
        raise _refuse(model_type, f"on {described}, {side} (no gradient on one side).")
    floor = gradient_floor(ref_grads.values())
    grad_errs = {n: _grad_error(grads[n], ref_grads[n], floor) for n in ref_grads}
    worst = max(grad_errs, key=grad_errs.__getitem__)
    noise: float | None = None  # the model's own noise at `worst`, when it was needed
    hidden_err, logits_err = _rel(hidden, ref_hidden), _rel(logits, ref_logits)
    forward_agrees = (math.isfinite(loss_err) and loss_err <= TOLERANCE
                      and hidden_err <= TOLERANCE and logits_err <= TOLERANCE)
    if forward_agrees and not grad_errs[worst] <= TOLERANCE:
        own = _own_padded_batch_errors(reference, tiny, ids, floor, trust_remote_code)
        if own is not None and all(
                err <= max(TOLERANCE, min(NOISE_FACTOR * own.get(n, 0.0), NOISE_CAP))
                for n, err in grad_errs.items()):
            noise = own.get(worst, 0.0)
    bad = not math.isfinite(loss_err) or loss_err > TOLERANCE or not (
        grad_errs[worst] <= TOLERANCE or noise is not None)
    if bad:
        if hidden_err > TOLERANCE:
            where = (f"the decoder's hidden states already differ (rel. err {hidden_err:.1e}): "
                     "an attention or layer feature longctx does not reproduce")
        elif logits_err > TOLERANCE:
            where = (f"the hidden states agree but the logits differ (rel. err "
                     f"{logits_err:.1e}): a transform after lm_head that longctx's head does "
                     "not apply")
        else:
            where = "forward outputs agree but the loss or gradients differ"
        raise _refuse(model_type, (
            f"on {described}, a packed {sum(PROBE_DOCS)}-token row through longctx (sp=1) gives "
            f"a loss {loss_err:.1e} relative away from the model's own forward(labels=), and "
            f"the gradient of `{worst}` differs by {grad_errs[worst]:.1e} (tolerance "
            f"{TOLERANCE:g}); {where}."))
    return ProbeResult(
        model_type=model_type,
        layers=int(getattr(tiny.get_text_config(), "num_hidden_layers", 0)),
        features=features,
        loss_rel_error=loss_err,
        worst_gradient=worst,
        worst_gradient_rel_error=grad_errs[worst],
        gradients_checked=len(grad_errs),
        seconds=time.perf_counter() - started,
        own_noise=noise,
    )


def check_fidelity(config: Any, hf_config: Any = None) -> str:
    """Run the probe on the run's model config (`hf_config`, else read from `config`);
    UserError on a difference. Returns the line the start-up log prints.

    A pass is remembered (`verdict_path`) for the same model config, longctx source and torch
    and transformers versions, which decide it alone; a failure is never remembered, and
    models with remote code (which can change under the same config) are probed every time."""
    if not config.run.fidelity_probe:
        return "skipped (`fidelity_probe: false`): exactness against the model is not checked"
    if hf_config is None:
        from longctx_cli.config.model_shape import read_model_config

        hf_config = read_model_config(config).transformers_config()
    images, linearized = config.trains_images, config.model.llama4_linearized_experts
    path = None if config.model.trust_remote_code else verdict_path(hf_config, images,
                                                                    linearized)
    if path is not None and path.is_file():
        return f"{path.read_text()}; remembered from an earlier probe of this model config"
    summary = run_probe(hf_config, config.model.trust_remote_code, images,
                        linearized).summary()
    if path is not None:
        _remember(path, summary)
    return summary


@functools.cache
def _source_digest() -> str:
    """The digest of longctx's own source files, read once per process."""
    import hashlib

    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def verdict_path(hf_config: Any, images: bool = False, linearized: bool = False) -> Path:
    """Where a pass of the probe on this model config is remembered: a file named by the
    digest of the config, whether it trains with images or linearized experts, longctx's
    source files and the library versions."""
    import hashlib
    import os

    import transformers

    digest = hashlib.sha256()
    for part in (hf_config.to_json_string(use_diff=False), torch.__version__,
                 transformers.__version__, _source_digest(), "images" * images,
                 "linearized" * linearized):
        digest.update(part.encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "longctx" / "fidelity" / f"{digest.hexdigest()[:32]}.txt"


def _remember(path: Path, summary: str) -> None:
    """Write atomically (every rank may write the same verdict); a cache that cannot be
    written only costs the probe next time."""
    import os

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(summary)
        os.replace(tmp, path)
    except OSError:
        pass


# ---- vision-language models -----------------------------------------------------------
# A tiny copy (the text part shrunk as above, the tower cut to two layers, small images)
# trains a packed row of three documents: two images, none, one. longctx's rebuilt forward
# (runtime/vision.py: tower, merge, mRoPE per document, the SP attention) must give the
# loss and every gradient (tower, projector, language model) of each document's own
# forward(labels=).

# Text runs and images (as patch grids t, h, w) of the probe's three documents.
_VISION_DOCUMENTS = ((5, (1, 4, 4), 4, (1, 2, 4), 3), (7,), (2, (1, 4, 2), 4))


def shrink_vision_config(model_config: Any, images: bool = True) -> Any:
    """A tiny copy of a multimodal config: the text part as `fidelity.shrink_config` shrinks
    it, a two-layer tower with small images, a one-layer audio tower (Gemma 3n, Gemma 4),
    and, with `images`, the multimodal token ids inside the tiny vocabulary (a text probe
    leaves them outside it, where its random text never names one, as a text run's data
    does not). A part the config leaves out (Gemma 4's default has no towers) stays out."""
    tiny = copy.deepcopy(model_config)
    text = shrink_config(model_config.get_text_config())
    vision = getattr(tiny, "vision_config", None)  # Voxtral: an audio tower only
    if vision is not None:
        _shrink_tower(tiny, vision, text)
    if getattr(tiny, "audio_config", None) is not None:
        _shrink_audio(tiny.audio_config)
    tiny.text_config = text
    if not images:
        return tiny
    vocab = text.vocab_size
    named = ("image_token_id", "video_token_id", "vision_start_token_id",
             "vision_end_token_id", "boi_token_index", "eoi_token_index")
    # Then any other multimodal token the wrapper names (Gemma 4's boi/eoi/audio tokens).
    others = sorted(k for k, v in tiny.to_diff_dict().items() if k not in named
                    and isinstance(v, int) and v >= vocab
                    and (k.endswith("_token_id") or k.endswith("_token_index")))
    for offset, key in enumerate((*named, *others)):
        if getattr(tiny, key, None) is not None:
            setattr(tiny, key, vocab - 1 - offset)
    return tiny


def _shrink_tower(tiny: Any, vision: Any, text: Any) -> None:
    """The tower cut to two layers with images of a few patches (see `Tower`)."""
    tower = _tower(tiny)
    if tower == "merged" and not hasattr(vision, "depth"):  # a SigLIP-style patch tower
        vision.num_hidden_layers, vision.num_attention_heads = 2, 2  # PaddleOCR-VL's, whose
        vision.hidden_size, vision.intermediate_size = 32, PROBE_INTERMEDIATE  # projector
        _shrink_mrope(text, tiny)  # merges its patches
    elif tower == "merged":  # Qwen-VL towers
        vision.depth = 2
        if hasattr(vision, "fullatt_block_indexes"):
            vision.fullatt_block_indexes = [1]
        if hasattr(vision, "deepstack_visual_indexes"):
            vision.deepstack_visual_indexes = [0, 1]
        vision.num_heads = 2  # blocks 32 wide, in two heads of 16
        if hasattr(vision, "out_hidden_size"):
            vision.hidden_size, vision.intermediate_size = 32, PROBE_INTERMEDIATE
            vision.out_hidden_size = text.hidden_size
        else:  # Qwen2-VL: blocks `embed_dim` wide, the merger writes `hidden_size`
            vision.embed_dim = 32
            vision.hidden_size = text.hidden_size
        _shrink_mrope(text, tiny)
    elif tower == "sized":  # Pixtral: two blocks 32 wide, its images a few patches a side
        vision.num_hidden_layers, vision.num_attention_heads = 2, 2
        vision.hidden_size, vision.head_dim = 32, 16
        vision.intermediate_size = PROBE_INTERMEDIATE
    elif tower == "position_pooled":  # Gemma 4: two blocks 32 wide, 2 x 2 patches pooled
        vision.num_hidden_layers, vision.hidden_size = 2, 32
        vision.num_attention_heads = vision.num_key_value_heads = 2
        vision.head_dim, vision.intermediate_size = 16, PROBE_INTERMEDIATE
        vision.pooling_kernel_size = 2  # the probe's grids are 4 x 4, 2 x 4 and 4 x 2
    elif tower == "cross_attended":  # Mllama: tiles of 2 x 2 patches; one cross layer
        vision.num_hidden_layers, vision.num_global_layers = 2, 1
        vision.hidden_size, vision.attention_heads = 32, 2
        vision.intermediate_size, vision.intermediate_layers_indices = PROBE_INTERMEDIATE, [0, 1]
        vision.vision_output_dim = 3 * vision.hidden_size  # the last state and two layers'
        vision.image_size = 2 * vision.patch_size
        text.num_hidden_layers, text.cross_attention_layers = 3, [1]
    elif tower == "pooled":  # Gemma 3: 4 x 4 patches pooled to 2 x 2
        vision.num_hidden_layers = 2
        vision.image_size = 4 * vision.patch_size
        tiny.mm_tokens_per_image = 4
    elif tower == "shuffled":  # SmolVLM, InternVL: tiles shuffled to 2 x 2 tokens each
        vision.num_hidden_layers = 2
        side = 2 * shuffle_scale(tiny) * _side(vision.patch_size)
        vision.image_size = side if isinstance(vision.image_size, int) else (side, side)
    else:  # CLIP/SigLIP-style towers: two layers, images of 2 x 2 patches
        vision.num_hidden_layers = 2
        vision.image_size = 2 * vision.patch_size


def _side(size: Any) -> int:
    """A square image's or patch's side (InternVL names both as (height, width))."""
    return int(size if isinstance(size, int) else size[0])


def _shrink_mrope(text: Any, tiny: Any) -> None:
    """mRoPE's (t, h, w) sections split the rotary half of a head: they shrink with the head
    dim, each kept at least 1, summing to the tiny head's rotary half (the family's own
    default where the config names none; GLM-4.6V rotates half of each head,
    `partial_rotary_factor` 0.5 in its rope parameters). A partial rotary (Qwen3.5's quarter
    of each head) rotates only its part; where that part of the tiny head is too small for a
    frequency per axis it grows to the smallest that has one (still partial), so that the
    probe's image positions move every axis."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    family = vision_family(str(getattr(tiny, "model_type", "")))
    sections = rope.get("mrope_section") or (family.mrope_section if family else None)
    if not sections:
        return
    rotary = float(rope.get("partial_rotary_factor")
                   or getattr(text, "partial_rotary_factor", None) or 1.0)
    if int(PROBE_HEAD_DIM * rotary) // 2 < len(sections):
        rotary = 2 * len(sections) / PROBE_HEAD_DIM
        rope["partial_rotary_factor"] = rotary
    half = int(PROBE_HEAD_DIM * rotary) // 2
    scaled = [max(1, s * half // sum(sections)) for s in sections]
    scaled[0] += half - sum(scaled)  # the rounding's remainder on the temporal section
    rope["mrope_section"] = scaled
    text.rope_parameters = rope


def _shrink_audio(audio: Any) -> None:
    """An audio tower of one layer and two heads (it trains nothing on text or images, but
    is built with the model)."""
    for key, value in (("num_hidden_layers", 1), ("conf_num_hidden_layers", 1),
                       ("num_attention_heads", 2), ("conf_num_attention_heads", 2),
                       ("hidden_size", 32)):
        if hasattr(audio, key):
            setattr(audio, key, value)


def _tower(model_config: Any) -> Tower:
    """How the tower of `model_config` makes image tokens: its family's record, else read
    from its config (a multimodal class that is its own causal LM without a record)."""
    family = vision_family(str(getattr(model_config, "model_type", "")))
    if family is not None:
        return family.tower
    if hasattr(model_config.vision_config, "depth"):
        return "merged"
    return "pooled" if getattr(model_config, "mm_tokens_per_image", None) else "per_patch"


def _vision_row(tiny: Any) -> tuple[Any, ...]:
    """The probe's packed row and, per document, what the model's own forward takes."""
    from longctx_cli.runtime.vision import patch_width

    gen = torch.Generator().manual_seed(0)
    vision = tiny.vision_config
    image_id = tiny.image_token_id
    start = getattr(tiny, "vision_start_token_id", getattr(tiny, "boi_token_index", None))
    end = getattr(tiny, "vision_end_token_id", getattr(tiny, "eoi_token_index", None))
    sized = _tower(tiny) == "sized"  # each image (1, h, w) patches at its own size
    tiled = _tower(tiny) == "shuffled"
    positioned = _tower(tiny) == "position_pooled"  # each image's h * w patches, (x, y)
    cross = _tower(tiny) == "cross_attended"  # one token per image, its tiles apart
    flat = _tower(tiny) not in ("merged", "sized", "position_pooled", "cross_attended")
    ids, labels, pos, docs, all_pixels, all_grids = [], [], [], [], [], []
    for spec in _VISION_DOCUMENTS:
        d_ids, d_pixels, d_grids = [], [], []
        for part in spec:
            if isinstance(part, int):
                d_ids += torch.randint(8, image_id - 8, (part,), generator=gen).tolist()
                continue
            if cross:  # 2 or 3 tiles, zero-padded to the tower's tile count
                tiles = part[1] * part[2] // 8 + 1
                side, most = int(vision.image_size), int(vision.max_num_tiles)
                pixels = torch.zeros(1, most, 3, side, side)
                pixels[0, :tiles] = torch.randn(tiles, 3, side, side, generator=gen)
                d_pixels.append(pixels)
                d_grids.append(tiles)
                d_ids.append(image_id)
                continue
            if positioned:
                _, h, w = part
                d_pixels.append(torch.rand(h * w, patch_width(vision), generator=gen))
                d_grids.append(part)
                count = h * w // vision.pooling_kernel_size**2
            elif sized:
                _, h, w = part
                d_pixels.append(torch.randn(1, 3, h * vision.patch_size, w * vision.patch_size,
                                            generator=gen))
                count = h * w // tiny.spatial_merge_size**2
            elif tiled:  # an image of tiles and its thumbnail, a few tokens each
                side, tiles = _side(vision.image_size), part[1] * part[2] // 8 + 1
                d_pixels.append(torch.randn(tiles, 3, side, side, generator=gen))
                count = tiles * (side // _side(vision.patch_size) // shuffle_scale(tiny)) ** 2
            elif flat:
                side = vision.image_size
                d_pixels.append(torch.randn(1, 3, side, side, generator=gen))
                count = (getattr(tiny, "mm_tokens_per_image", None)
                         or (side // vision.patch_size) ** 2)
            else:
                rows = part[0] * part[1] * part[2]
                d_pixels.append(torch.randn(rows, patch_width(vision), generator=gen))
                d_grids.append(part)
                count = rows // vision.spatial_merge_size**2
            d_ids += [x for x in (start,) if x is not None] + [image_id] * count
            d_ids += [x for x in (end,) if x is not None]
        d = torch.tensor(d_ids)
        d_labels = torch.where(d >= image_id - 5, IGNORE_INDEX, d)
        images = ((_tiled_inputs(d_pixels, d_grids, vision) if cross else
                   _probe_inputs(d_pixels, d_grids, flat, sized, positioned))
                  if d_pixels else None)
        docs.append((d, d_labels, images))
        ids.append(d)
        labels.append(d_labels)
        pos.append(torch.arange(len(d)))
        all_pixels += d_pixels
        all_grids += d_grids
    images = (_tiled_inputs(all_pixels, all_grids, vision) if cross else
              _probe_inputs(all_pixels, all_grids, flat, sized, positioned))
    return torch.cat(ids), torch.cat(pos), torch.cat(labels), images, docs


def _tiled_inputs(pixels: list[torch.Tensor], tiles: list[int], vision: Any) -> Any:
    """Mllama's tower inputs: each image's tiles `[images, tiles, C, H, W]`, the aspect ratio
    `(1, tiles)` of each (its id: its index among the supported ones, plus 1) and its tiles'
    mask."""
    from longctx_cli.runtime.vision import VisionInputs

    ratios = [list(r) for r in vision.supported_aspect_ratios]
    mask = torch.zeros(len(tiles), int(vision.max_num_tiles), dtype=torch.long)
    for i, n in enumerate(tiles):
        mask[i, :n] = 1
    return VisionInputs(torch.cat(pixels), aspect_ratio_ids=torch.tensor(
        [ratios.index([1, n]) + 1 for n in tiles]), tile_mask=mask)


def _probe_inputs(pixels: list[torch.Tensor], grids: list, flat: bool, sized: bool,
                  positioned: bool = False) -> Any:
    """The tower's inputs of some probe images: patch rows with their grids, whole images,
    or (`sized`) images of their own sizes zero-padded to the largest, with `image_sizes`;
    positioned patches (Gemma 4) as the rows read them back (runtime/batches.py)."""
    from longctx_cli.runtime.batches import media_inputs
    from longctx_cli.runtime.vision import VisionInputs

    if positioned:  # stored as the grid (-1, h, w), read back padded with their (x, y)
        return media_inputs(torch.cat(pixels), [(-1, h, w) for _, h, w in grids], [], [])

    if sized:
        top, side = max(p.shape[-2] for p in pixels), max(p.shape[-1] for p in pixels)
        padded = torch.cat([torch.nn.functional.pad(
            p, (0, side - p.shape[-1], 0, top - p.shape[-2])) for p in pixels])
        return VisionInputs(padded, image_sizes=torch.tensor(
            [list(p.shape[-2:]) for p in pixels]))
    return VisionInputs(torch.cat(pixels), None if flat else torch.tensor(grids))


def _own_vision_training(model: Any, docs: list, image_id: int) -> float:
    """Each document through the model's own forward, weighted by its targets."""
    counts = [int((lab[1:] != IGNORE_INDEX).sum()) for _, lab, _ in docs]
    total = 0.0
    for (ids, lab, images), n in zip(docs, counts, strict=True):
        kwargs: dict[str, Any] = {}
        if images is not None and images.tile_mask is not None:  # Mllama: its processor's
            from transformers.models.mllama.processing_mllama import (  # cross-attention mask
                convert_sparse_cross_attention_mask_to_dense,
                get_cross_attention_token_mask,
            )

            tiles = images.tile_mask.shape[1]
            mask = convert_sparse_cross_attention_mask_to_dense(
                [get_cross_attention_token_mask(ids.tolist(), image_id)],
                [images.tile_mask.sum(-1).tolist()], tiles, len(ids))
            kwargs.update(pixel_values=images.pixel_values[None],
                          aspect_ratio_ids=images.aspect_ratio_ids[None],
                          aspect_ratio_mask=images.tile_mask[None],
                          cross_attention_mask=torch.from_numpy(mask))
        elif images is not None:
            kwargs["pixel_values"] = images.pixel_values
            family = vision_family(model.config.model_type)
            if images.image_sizes is not None:  # Pixtral: each image at its own size
                kwargs["image_sizes"] = images.image_sizes
            if family is not None and family.square_patches:  # as its processor makes
                side = model.config.vision_config.patch_size  # them: [n, C, side, side]
                kwargs["pixel_values"] = images.pixel_values.reshape(
                    images.pixel_values.shape[0], -1, side, side)
            if family is not None and family.tiles_as_sample:  # SmolVLM: [1, tiles, ...]
                kwargs["pixel_values"] = images.pixel_values[None]
            if images.image_grid_thw is not None:
                kwargs.update(image_grid_thw=images.image_grid_thw,
                              mm_token_type_ids=(ids == image_id).long()[None])
            if images.patch_positions is not None:  # Gemma 4: each patch's (x, y)
                kwargs.update(image_position_ids=images.patch_positions,
                              mm_token_type_ids=(ids == image_id).long()[None])
        if vision_family(model.config.model_type).images_attend == "both_ways":  # Gemma 3
            kwargs["token_type_ids"] = (ids == image_id).long()[None]
        loss = model(input_ids=ids[None], labels=lab[None], **kwargs).loss * (n / sum(counts))
        loss.backward()
        total += float(loss.detach())
    return total


def _own_padded_vision_errors(reference: Any, tiny: Any, docs: list, floor: float
                              ) -> dict[str, float] | None:
    """The model's own float noise with images, per parameter: its training of the probe's
    documents as one right-padded batch (attention_mask, every document's images, the same
    token-weighted loss) against its per-document training (``reference``, gradients already
    computed). None for a family without patch grids or if the batch fails to run."""
    from longctx_cli.runtime.vision import VisionInputs

    if _tower(tiny) != "merged":
        return None
    width = max(len(ids) for ids, _, _ in docs)
    batch = torch.zeros((len(docs), width), dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE_INDEX)
    mask = torch.zeros_like(batch)  # right padding: each row's real tokens first
    for row, (ids, lab, _) in enumerate(docs):
        batch[row, :len(ids)], labels[row, :len(ids)], mask[row, :len(ids)] = ids, lab, 1
    images = [m for _, _, m in docs if m is not None]
    media = VisionInputs(torch.cat([m.pixel_values for m in images]),
                         torch.cat([m.image_grid_thw for m in images]))
    try:
        model = _build_vision(tiny, "eager")
        model.load_state_dict(reference.state_dict())
        model(input_ids=batch, attention_mask=mask, labels=labels, use_cache=False,
              pixel_values=media.pixel_values, image_grid_thw=media.image_grid_thw,
              mm_token_type_ids=(batch == tiny.image_token_id).long()).loss.backward()
    except Exception:  # only a yardstick; without it nothing is accepted
        return None
    own = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {n: _grad_error(own[n], p.grad, floor) for n, p in reference.named_parameters()
            if p.grad is not None and n in own}


def _build_vision(tiny: Any, attn: str) -> Any:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        copy.deepcopy(tiny), dtype=torch.float32,
        attn_implementation={"": attn, "text_config": attn, "vision_config": "sdpa"}).train()
    projector = getattr(model.model, "multi_modal_projector", None)
    if hasattr(projector, "mm_input_projection_weight"):  # Gemma 3's starts at zero, which
        with torch.no_grad():  # would leave the tower without a gradient to compare
            projector.mm_input_projection_weight.normal_(0, 0.2)
    if _tower(tiny) == "cross_attended":  # Mllama's gates start at zero, which would hide
        with torch.no_grad():  # its cross attention and the tower's tile embeddings
            for name, p in model.named_parameters():
                if name.endswith(("gate", "gate_attn", "gate_ffn")):
                    p.uniform_(0.5, 1.5)
    return without_dropout(model)


def run_vision_probe(model_config: Any) -> Any:
    """Compare longctx's sp=1 VLM training computation with the model's own (see doc)."""
    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.parallel.mesh import ParallelState
    from longctx_cli.parallel.meta_relay import relay_sp_meta
    from longctx_cli.parallel.token_mixing import attach_token_mixing
    from longctx_cli.runtime.head import model_head
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.vision import VisionLanguageForward

    started = time.perf_counter()
    model_type = str(model_config.model_type)
    refuse_unless_rebuilt(model_config)
    with torch.random.fork_rng(devices=[]):
        try:
            tiny = shrink_vision_config(model_config)
            ids, pos, labels, images, docs = _vision_row(tiny)
            reference = _build_vision(tiny, "eager")
            ref_loss = _own_vision_training(reference, docs, tiny.image_token_id)
        except Exception as e:
            raise _unchecked(model_type, "longctx's tiny copy of it failed to build or run "
                             f"in the model's own forward ({type(e).__name__}: {e})") from None
        try:
            ours = _build_vision(tiny, register_sp_attention())
            ours.load_state_dict(reference.state_dict())
            attach_token_mixing(ours)  # as build_model does: Qwen3.5's delta-nets per document
            relay_sp_meta(ours)
            vlm = VisionLanguageForward(ours)
            batch = vlm.shard(ids, pos, labels, images, ParallelState())
            count = sum(int((lab[1:] != IGNORE_INDEX).sum()) for _, lab, _ in docs)
            head = model_head(ours.get_output_embeddings(), ours.config)
            loss = lm_loss_sum(head, vlm.hidden_states(batch), batch.shift_labels) / count
            loss.backward()
        except UserError:
            raise
        except Exception as e:
            raise _refuse(model_type, f"longctx's path failed on a tiny copy "
                          f"({type(e).__name__}: {e});") from None
    loss_err = abs(float(loss.detach()) - ref_loss) / abs(ref_loss)
    zero = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    ref_grads = {n: p.grad if p.grad is not None else zero[n]
                 for n, p in reference.named_parameters()}
    grads = {n: p.grad if p.grad is not None else zero[n] for n, p in ours.named_parameters()}
    floor = gradient_floor(ref_grads.values())
    errors = {n: _grad_error(grads[n], g, floor) for n, g in ref_grads.items()}
    worst = max(errors, key=errors.__getitem__)
    noise: float | None = None  # the model's own noise at `worst`, when it was needed
    if loss_err <= TOLERANCE and not errors[worst] <= TOLERANCE:
        # A scan in float32 chunks (Qwen3.5's delta-net) moves its own gradients as much
        # when its batch changes: accepted within a few times the model's own noise.
        own = _own_padded_vision_errors(reference, tiny, docs, floor)
        if own is not None and all(
                err <= max(TOLERANCE, min(NOISE_FACTOR * own.get(n, 0.0), NOISE_CAP))
                for n, err in errors.items()):
            noise = own.get(worst, 0.0)
    if not (loss_err <= TOLERANCE and (errors[worst] <= TOLERANCE or noise is not None)):
        raise _refuse(model_type, (
            f"on a tiny copy with images, a packed row through longctx (sp=1) gives a loss "
            f"{loss_err:.1e} relative away from the model's own forward(labels=), and the "
            f"gradient of `{worst}` differs by {errors[worst]:.1e} (tolerance {TOLERANCE:g})."))
    return ProbeResult(
        model_type=model_type, layers=int(tiny.text_config.num_hidden_layers),
        features=(f"images: tower split by {'tiles' if _tower(tiny) == 'shuffled' else 'images'}"
                  + (", cross-attended by each rank's tokens" if _tower(tiny) == "cross_attended"
                     else ", merged, then sharded"),),
        loss_rel_error=loss_err, worst_gradient=worst,
        worst_gradient_rel_error=errors[worst], gradients_checked=len(errors),
        seconds=time.perf_counter() - started, own_noise=noise,
        row=f"packed row of {len(_VISION_DOCUMENTS)} documents with 3 images")
