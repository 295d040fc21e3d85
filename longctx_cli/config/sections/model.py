"""The model section: where the weights, the config and the tokenizer come from, and the
dtype; and the rules the model's own config must pass (what longctx's attention and loss
compute must be what the model computes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from longctx_cli.config.sections.base import Section, StrictModel
from longctx_cli.config.shape import ModelShape, attention_softcap
from longctx_cli.errors import UserError
from longctx_cli.families import LINEARIZED_EXPERT_KEY, family
from longctx_cli.kernel_choice import ModelAttention
from longctx_cli.layout import Layout


class SpecialTokens(StrictModel):
    """Axolotl's `special_tokens:` mapping; each token must already be in the vocabulary."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    additional_special_tokens: list[str] | None = None


class ModelSection(Section):
    title = "model"

    base_model: str | None = Field(
        None, description="Hub id or local path of the model to fine-tune."
    )
    model_config_dict: dict[str, Any] | None = Field(
        None,
        alias="model_config",
        description="Inline model config (must contain `model_type`) to build a randomly "
        "initialised model instead of loading `base_model`; for tests and offline examples.",
    )
    reinit_weights: bool = Field(
        False,
        description="Start from random weights (drawn from `seed`) in `base_model`'s "
        "architecture and config, not its trained weights: pretraining from scratch.",
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer path or hub id (default: `base_model`), or `byte` for the "
        "built-in byte-level tokenizer that needs no files.",
    )
    overrides_of_model_config: dict[str, Any] | None = Field(
        None,
        description="Fields that replace the model config's own before the model is built "
        "(Axolotl's key), e.g. `{attention_dropout: 0.0}`; `validate`, the fidelity probe and "
        "training all use the overridden config.",
    )
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="Extend the model's context (Axolotl's key): `{type: yarn | linear | "
        "llama3, factor: N | auto, ...}` with the scaling's own fields (`beta_fast`, "
        "`low_freq_factor`, `original_max_position_embeddings`, ...). `factor: auto` is "
        "sequence_len / the model's native context, rounded up. Becomes the model config's "
        "`rope_parameters`, so validate, training and every saved config.json carry it; "
        "`dynamic` and `longrope` are refused (they depend on each forward's length).",
    )
    rope_theta: float | None = Field(
        None, gt=0,
        description="The RoPE base (Axolotl's key), replacing the model's own in "
        "`rope_parameters` (training and saved configs).",
    )
    trust_remote_code: bool = Field(
        False,
        description="Allow model/tokenizer code from the hub to run. Off unless you trust it.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Dtype of the model weights and compute (Axolotl's `bf16`/`fp16` map here).",
    )
    base_model_config: str | None = Field(
        None,
        description="Where to read the model's config.json if not beside `base_model`.",
    )
    revision_of_model: str | None = Field(
        None,
        description="The hub revision (branch, tag or commit) of `base_model` to load: its "
        "weights, its config (and `base_model_config`'s) and the tokenizer, when they come "
        "from the hub (Axolotl's key). Not with a local `base_model` folder, whose files have "
        "no revisions.",
    )
    special_tokens: SpecialTokens | None = Field(
        None,
        description="Tokenizer special tokens to set (bos_token, eos_token, pad_token, "
        "unk_token, additional_special_tokens); one the vocabulary lacks is added, as Axolotl "
        "does, and the embeddings grow with it (see `tokens`).",
    )
    tokens: list[str] | None = Field(
        None,
        description="Tokens to add to the tokenizer (Axolotl's key; after `special_tokens`, "
        "before `additional_special_tokens`, as Axolotl adds them). The model's embeddings "
        "(and an untied lm_head) are resized to the tokenizer's length by transformers' "
        "`resize_token_embeddings`, the new rows drawn from `seed` (or their mean, "
        "`mean_resizing_embeddings`), and trained; with `adapter`, list the embedding and "
        "lm_head modules in `lora_modules_to_save`.",
    )
    resize_token_embeddings_to_32x: bool = Field(
        False, description="Resize the embeddings to the tokenizer's length rounded up to a "
        "multiple of 32 (Axolotl's key; the extra rows are tokens no text produces).",
    )
    mean_resizing_embeddings: bool = Field(
        False, description="New embedding rows start at the mean of the old ones "
        "(transformers' `mean_resizing`), not drawn from `seed` (Axolotl's key and default).",
    )
    shrink_embeddings: bool = Field(
        False, description="Also resize embeddings that are larger than the tokenizer's "
        "length down to it (Axolotl's key): the rows past it are dropped.",
    )
    tokenizer_use_mistral_common: bool = Field(
        False,
        description="Tokenize with Mistral's own library (the `mistral-common` package, "
        "`pip install 'longctx[mistral]'`) through transformers' MistralCommonBackend: "
        "`tokenizer` (default `base_model`) holds its `tekken.json` or `tokenizer.model.v*`, "
        "and `chat_template` datasets are encoded by mistral-common itself (its fine-tuning "
        "mode), not rendered with a chat template. Text datasets only (`chat_template`, "
        "`completion`, `pretrain`), supervised fine-tuning only.",
    )
    tf32: bool | Literal["auto"] = Field(
        False, description="Allow TF32 matmuls on Ampere+ GPUs (`auto`: same as true)."
    )
    llama4_linearized_experts: bool = Field(
        False,
        description="Llama 4 (Axolotl's key): after loading, turn each MoE block's fused "
        "expert weights into one linear layer per expert and projection "
        "(`experts.gate_projs.N`, `up_projs.N`, `down_projs.N`), which LoRA can target and "
        "QLoRA quantizes (bitsandbytes loads the fused experts unquantized, so loading "
        "holds them in `dtype` until each block is quantized); the same model, and full "
        "exports are saved in the model's own "
        "layout (adapters on those layers load on a linearized model: `longctx eval`, "
        "`merge-lora`).",
    )

    @model_validator(mode="after")
    def _model_source(self) -> ModelSection:
        if self.base_model is None and self.model_config_dict is None:
            raise ValueError(
                "set `base_model` (hub id or local path) or `model_config` "
                "(an inline config with `model_type`)"
            )
        if self.model_config_dict is not None and not isinstance(
            self.model_config_dict.get("model_type"), str
        ):
            raise ValueError("`model_config` needs a `model_type` key naming the family, e.g. "
                             "`model_type: llama`")
        if self.revision_of_model is not None:
            if self.model_config_dict is not None:
                raise ValueError("`revision_of_model` picks a revision of `base_model` on the "
                                 "hub; an inline `model_config` has none: drop it")
            if Path(str(self.base_model)).expanduser().exists():
                # transformers reads a local folder as it is and ignores `revision`.
                raise ValueError(
                    f"`revision_of_model` = {self.revision_of_model!r} picks a hub revision, "
                    f"but `base_model` = {self.base_model!r} is a local folder, whose files "
                    "transformers loads as they are: drop `revision_of_model`, or give the "
                    "hub id as `base_model`")
        return self

    @property
    def may_resize_embeddings(self) -> bool:
        """The config changes the tokenizer's length or the rule of the embeddings' size, so
        the model's embeddings are fitted to the tokenizer (`runtime/model.py`)."""
        return bool(self.tokens or self.special_tokens or self.resize_token_embeddings_to_32x
                    or self.shrink_embeddings)

    def revision_kwargs(self, source: str | None) -> dict[str, str]:
        """`revision=` for a `from_pretrained` of `source` when it is the base model, its
        config or the tokenizer (as Axolotl passes it) and no local folder."""
        if self.revision_of_model is None or source is None or source == "byte":
            return {}
        if source not in (self.base_model, self.base_model_config, self.tokenizer_source):
            return {}
        if Path(source).expanduser().exists():
            return {}
        return {"revision": self.revision_of_model}

    @property
    def random_init(self) -> bool:
        """The weights are drawn from `seed`: an inline `model_config`, or `reinit_weights`."""
        return self.model_config_dict is not None or self.reinit_weights

    @property
    def tokenizer_source(self) -> str | None:
        return self.tokenizer or self.base_model


# Dataset types whose text a mistral-common tokenizer encodes (a chat by mistral-common's own
# encoding, a text as its plain tokens).
MISTRAL_COMMON_TYPES = ("chat_template", "completion", "pretrain")


def check_mistral_common(model: ModelSection, data: Any, rl: str | None,
                         trains_images: bool) -> None:
    """What `tokenizer_use_mistral_common: true` cannot go with; raises ValueError naming it.

    mistral-common encodes conversations itself and cannot add or rename tokens, so nothing
    that renders a chat template or edits the vocabulary can use it. A vision run
    (`trains_images`) takes it: mistral-common encodes the images too
    (data/vision/mistral.py)."""
    if not model.tokenizer_use_mistral_common:
        return
    entries = [*data.datasets, *data.eval_datasets, *(data.pretraining_dataset or [])]
    other = next((e.type for e in entries if e.type not in MISTRAL_COMMON_TYPES), None)
    template = next((t for t in (data.chat_template, *(e.chat_template for e in entries))
                     if t not in (None, "tokenizer_default")), None)
    refused = (
        ("`tokenizer: byte`", "the byte tokenizer is not a mistral-common one")
        if model.tokenizer == "byte" else
        ("`special_tokens`", "mistral-common's special tokens are fixed by its file")
        if model.special_tokens is not None else
        (f"`rl: {rl}`", "preference pairs and prompts are rendered with a chat template")
        if rl else
        (f"`chat_template: {template}`", "mistral-common encodes the chat in its own format")
        if template else
        (f"dataset `type: {other}`", "mistral-common encodes "
         f"{', '.join(MISTRAL_COMMON_TYPES)} datasets only")
        if other else
        ("`field_thinking`", "longctx passes turns to mistral-common as text, not thinking "
         "chunks")
        if any(e.field_thinking for e in entries) else None)
    if refused:
        raise ValueError(f"`tokenizer_use_mistral_common: true` with {refused[0]} is not "
                         f"supported: {refused[1]}; drop one of them")


# ---- the model's own config: what longctx must compute as the model does ------------------

# The names transformers' families give the dropout on attention probabilities.
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob",
                          "attn_dropout")


def attention_dropout(shape: ModelShape) -> tuple[str, float] | None:
    """The key and value of the model's dropout on attention probabilities, None without."""
    for key in ATTENTION_DROPOUT_KEYS:
        p = shape.config_value(key)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            return key, float(p)
    return None


def check_attention_dropout(shape: ModelShape, layout: Layout,
                            prefix_sharing: bool = False) -> None:
    """Attention dropout acts on whole rows of probabilities: longctx applies it where a rank
    holds every key of its queries (sp 1, Ulysses; `parallel/dropout.py`) and refuses the
    layouts and options under which it would train another model."""
    found = attention_dropout(shape)
    if found is None:
        return
    key, p = found
    off = f"`overrides_of_model_config: {{{key}: 0.0}}`"
    if layout.sp > 1 and layout.mode != "ulysses":
        raise UserError(
            f"`sequence_parallel_mode: {layout.mode}` at sp {layout.sp} cannot apply the "
            f"model's {key} = {p:g}: dropout drops attention probabilities of whole rows, and "
            f"{layout.mode} splits each row's keys across ranks, each rank merging its "
            "blocks' softmax; so it would train a different model than the one you load. "
            "Ulysses holds whole rows of its heads on each rank and applies it as the model "
            f"does; or train without attention dropout: {off}.",
            where="sequence_parallel_mode", key="sequence_parallel_mode",
            fix="set `sequence_parallel_mode: ulysses`.")
    if layout.tp > 1:
        raise UserError(
            f"`tensor_parallel_size` = {layout.tp} cannot apply the model's {key} = {p:g}: "
            "every TP rank draws its heads' dropout masks from the same random state, so "
            "heads on different ranks would share masks, which the model never does.",
            where="tensor_parallel_size",
            fix=f"set `tensor_parallel_size: 1` (sequence_parallel_mode ulysses splits the "
            f"heads and applies the dropout), or add {off}.")
    if prefix_sharing:
        raise UserError(
            f"`prefix_sharing: true` cannot run with the model's {key} = {p:g}: the model "
            "draws its prompt's attention dropout once per answer, a shared prompt is "
            "computed, and dropped, once.", where="prefix_sharing",
            fix=f"set `prefix_sharing: false`, or add {off}.")


def attention_dropout_notes(shape: ModelShape, layout: Layout, sequence_len: int,
                            sinks_or_images: bool) -> list[str]:
    """What applies the model's attention dropout in training, and what it holds where the
    scores of a document are kept whole (every path but flash-attn's and PyTorch's op)."""
    found = attention_dropout(shape)
    if found is None:
        return []
    key, p = found
    fused = {"flash": "flash-attn 2's dropout_p", "torch_flash": "PyTorch's flash op's "
             "dropout_p"}.get(layout.kernel)
    if fused and layout.sp == 1 and not sinks_or_images and attention_softcap(shape) is None:
        return [f"attention dropout ({key} = {p:g}) in training, as the model applies it: "
                f"{fused}; none in eval."]
    heads = shape.num_attention_heads // (layout.tp * layout.sp)
    scores = heads * sequence_len**2 * 12  # fp32 probabilities and product, the mask
    return [f"attention dropout ({key} = {p:g}) in training, as the model applies it: each "
            f"document's {heads} heads' scores are held whole (about "
            f"{scores / 2**30:.2f} GiB per layer for a {sequence_len}-token document, not "
            "in the estimate above); none in eval."
            + ("" if layout.kernel in ("flash", "torch_flash") else
               " attention_kernel flash or torch_flash at sp 1 drops inside the kernel.")]


def check_linearized_experts(enabled: bool, shape: ModelShape, load_in_8bit: bool,
                             quantize_moe_experts: bool = False) -> None:
    """`llama4_linearized_experts` needs a family whose fused experts longctx linearizes,
    and quantizes them in 4 bits only (QLoRA), as linear layers (not as fused weights)."""
    if enabled and quantize_moe_experts:
        raise UserError(
            "`llama4_linearized_experts: true` with `quantize_moe_experts: true`: the "
            "linearized experts are linear layers, which QLoRA quantizes itself; the fused "
            "weights `quantize_moe_experts` packs no longer exist once they are linearized.",
            where="quantize_moe_experts",
            fix="remove `quantize_moe_experts` (the linearized experts are quantized in 4 bits "
            "under `load_in_4bit` already), or `llama4_linearized_experts`.")
    if enabled and load_in_8bit:
        raise UserError(
            "`llama4_linearized_experts: true` with `load_in_8bit: true`: longctx quantizes "
            "the linearized experts in 4 bits only (QLoRA), so they would stay unquantized.",
            where="load_in_8bit",
            fix="use `load_in_4bit: true` (`adapter: qlora`), or no quantization.")
    if enabled and family(shape.model_type).fused_experts is None:
        raise UserError(
            f"`llama4_linearized_experts: true`, but model type `{shape.model_type}` has no "
            "fused experts longctx linearizes (Llama 4's `Llama4TextExperts`).",
            where="llama4_linearized_experts",
            fix="remove `llama4_linearized_experts`, or train a Llama 4 model.")


def linearized_checkpoint_error(key: str, base_model: str) -> UserError:
    """The refusal of a checkpoint saved with linearized experts (Axolotl's
    `...-Linearized-...` models; `key` one of its linearized weights): transformers would
    leave the model's own experts at their random initialisation."""
    return UserError(
        f"`base_model` = {base_model!r} holds linearized expert weights (e.g. `{key}`), not "
        "the model's own fused experts (`gate_up_proj`, `down_proj`), so its experts would "
        "be loaded as random weights. longctx loads the model's own layout and linearizes it "
        "itself (`llama4_linearized_experts`).",
        where="base_model",
        fix="use the original checkpoint (e.g. meta-llama/Llama-4-Scout-17B-16E-Instruct) with "
        "`llama4_linearized_experts: true` (and `load_in_4bit: true` to quantize it), or "
        "convert this one back to the fused layout first (Axolotl's `delinearize-llama4`).")


def check_linearized_checkpoint(base_model: str | None) -> None:
    """Refuse, before anything loads, a base model saved with linearized experts, where its
    weight names are on this machine (a local folder, or the Hub cache): the index of a
    sharded checkpoint, else the header of its one weights file. Elsewhere the loader's
    check refuses it (runtime/experts.py)."""
    names = _checkpoint_weight_names(base_model) if base_model else []
    key = next((k for k in sorted(names) if LINEARIZED_EXPERT_KEY.match(k)), None)
    if key is not None:
        raise linearized_checkpoint_error(key, base_model)


def _checkpoint_weight_names(base_model: str) -> list[str]:
    """The weight names of `base_model`'s safetensors checkpoint, read without a download
    ([] where none is on this machine or it cannot be read)."""
    import json
    from pathlib import Path

    from huggingface_hub import try_to_load_from_cache
    from safetensors import SafetensorError, safe_open

    def local(name: str) -> Path | None:
        if Path(base_model).is_dir():
            return Path(base_model) / name if (Path(base_model) / name).is_file() else None
        try:
            cached = try_to_load_from_cache(base_model, name)
        except ValueError:  # not a Hub id either: the plan reports the model's config
            return None
        return Path(cached) if isinstance(cached, str) else None

    try:
        if (index := local("model.safetensors.index.json")) is not None:
            return list(json.loads(index.read_text()).get("weight_map", {}))
        if (weights := local("model.safetensors")) is not None:
            with safe_open(str(weights), "pt") as f:
                return list(f.keys())
    except (OSError, ValueError, SafetensorError):
        return []  # unreadable here: the loader reports it
    return []


def check_router_aux_loss(shape: ModelShape) -> None:
    """A mixture-of-experts config with `output_router_logits: true` makes the model's own
    training add `router_aux_loss_coef` x the load-balancing loss to the language-model loss;
    longctx trains the language-model loss alone, so such a config is refused."""
    coef = shape.config_value("router_aux_loss_coef")
    if shape.config_value("output_router_logits") is True and (
            not isinstance(coef, (int, float)) or coef > 0):
        raise UserError(
            "the model's config has output_router_logits: true, with which its own training "
            f"adds router_aux_loss_coef ({coef}) x the router load-balancing loss to the loss; "
            "longctx trains the language-model loss alone, so it would train differently "
            "from the model's own training.",
            where="overrides_of_model_config",
            fix="add `overrides_of_model_config: {output_router_logits: false}` to train with "
            "the language-model loss alone (the routers still learn through it).",
        )


def check_sparse_attention(shape: ModelShape) -> None:
    """DeepSeek sparse attention (DeepSeek V3.2 and V4, GLM-5's DSA, dots3): a learned
    indexer picks each query's top `index_topk` keys, and the layer reads the model's own
    [tokens, tokens] mask to score them. longctx's attention computes every causal key of
    the document on each rank's slice and builds no such mask, so it cannot run the indexer
    (and a document longer than `index_topk` would attend to keys the model masks)."""
    topk = shape.config_value("index_topk")
    if not topk:
        return
    raise UserError(
        f"model type `{shape.model_type}` uses sparse attention: an indexer picks each "
        f"query's top {topk} keys from the layer's full [tokens, tokens] attention mask. "
        "longctx's sequence-parallel attention builds no such mask and attends to every "
        "causal key of a document, so it cannot run the indexer and would train a "
        "different model.", where="base_model",
        fix="train this model without sequence parallelism (plain Hugging Face training), "
        "or pick a family docs/families.md lists as exact (DeepSeek V3's dense attention is "
        "one).")


def check_query_position_scaling(shape: ModelShape, layout: Layout, sequence_len: int,
                                 micro_batch_size: int, split_by: str | None) -> None:
    """Llama 4's attention temperature tuning scales its NoPE layers' queries by
    ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`` of ``i = arange(input length)``,
    the token's index in the forward's input. Under SP a rank's input is its slice; the SP
    attention puts back the scale of each token's index in its row of the model's own
    training (``parallel.attention.true_temperature``), which it knows where each dataset
    row is one such row (the causal-LM loss). `split_by` names the objective that splits a
    dataset row into rows longctx does not track (pairs, KTO examples, GRPO groups): it is
    refused once an index reaches ``floor_scale - 1`` (below that every scale is 1)."""
    if split_by is None or not shape.config_value("attn_temperature_tuning"):
        return
    floor = shape.config_value("floor_scale")
    no_rope = shape.config_value("no_rope_layers")  # no_rope_layers[i] = 1: layer i has RoPE
    if not floor or (isinstance(no_rope, list) and all(no_rope)):
        return
    per_rank = -(-micro_batch_size * sequence_len // layout.sp)
    if max(per_rank, sequence_len) < floor:
        return
    raise UserError(
        f"the model's NoPE layers scale queries by the token's index in the forward's input "
        f"(attn_temperature_tuning, floor_scale = {floor}), and with sequence_len "
        f"{sequence_len} and {per_rank} tokens per rank that index reaches floor_scale: "
        "longctx puts back each token's index in its row of the model's own training for "
        f"the causal-LM loss, but `{split_by}` splits each dataset row into rows there "
        "(a pair's or a group's sequences) that longctx does not track, so it would train "
        "a different model than the one you load.",
        where="sequence_len",
        fix=f"with `{split_by}`, keep sequence_len and the tokens per rank below {floor}, "
        "or add `overrides_of_model_config: {attn_temperature_tuning: false}` to train "
        "the model without temperature tuning.",
    )


def model_attention(shape: ModelShape | None) -> ModelAttention:
    """The model's attention as the kernel choice sees it (nothing known without a shape).

    ``head_dim`` is what a flash kernel computes on: the larger of the q/k and the value head
    dims (multi-head latent attention pads the smaller side, see ``latent_head_dims``)."""
    if shape is None:
        return ModelAttention()
    dims = latent_head_dims(shape)
    return ModelAttention(head_dim=max(dims) if dims else shape.head_dim,
                          softcap=attention_softcap(shape) is not None,
                          sinks=shape.attention_sinks, window=shape.sliding_window,
                          chunked=chunked_attention(shape))


def latent_head_dims(shape: ModelShape) -> tuple[int, int] | None:
    """(q/k head dim, value head dim) of multi-head latent attention (DeepSeek: q/k =
    ``qk_nope_head_dim + qk_rope_head_dim``, v = ``v_head_dim``), or None when they are one."""
    nope, rope, v = (shape.config_value(k) for k in
                     ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if not all(isinstance(x, int) and x > 0 for x in (nope, rope, v)):
        return None
    return (nope + rope, v) if nope + rope != v else None


def chunked_attention(shape: ModelShape) -> bool:
    """Some layer attends within chunks (Llama 4: `attention_chunk_size`, layer type
    `chunked_attention`)."""
    types = shape.config_value("layer_types")
    return bool(shape.config_value("attention_chunk_size")) and (
        types is None or "chunked_attention" in types)


def context_note(shape: ModelShape, sequence_len: int) -> list[str]:
    """The plan's note on a row longer than the model's native context."""
    if shape.max_position_embeddings and sequence_len > shape.max_position_embeddings:
        return [
            f"sequence_len {sequence_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}: positions past it are ones the model never saw; "
            "`rope_scaling: {type: yarn, factor: auto}` extends the context to sequence_len "
            "(docs/context.md)."
        ]
    return []


