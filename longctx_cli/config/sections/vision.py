"""The vision section: the processor that reads image-bearing records, and the tower's
part of the plan (its size, how its images are split, its memory).

A vision-language model's tower encodes whole images, one contiguous run of the row's
images per rank of the SP group (runtime/vision.py), so its activations are split by
images, not by tokens. Its size is read from the model's `vision_config`; the memory is a
rough bound for a row made only of image tokens (the most tower work a row can hold).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from longctx_cli.config.sections.base import Section
from longctx_cli.config.shape import is_vision_language
from longctx_cli.config.units import DTYPE_BYTES, format_count, format_gib
from longctx_cli.errors import UserError
from longctx_cli.families import (
    PREPARED_FAMILIES,
    VISION_FAMILIES,
    image_attention,
    vision_family,
)
from longctx_cli.families import family as family_record
from longctx_cli.layout import Layout


class VisionSection(Section):
    title = "model"  # docs/vlm.md explains these keys

    processor_type: str | None = Field(
        None,
        description="Vision-language models: load the processor (image processor, tokenizer, "
        "chat template) from `processor_path` or `base_model` with transformers' "
        "AutoProcessor, offline. Set it (as Axolotl does) to train on image-bearing records. "
        "A processor class name (`Qwen2VLProcessor`) is accepted too: the folder's processor "
        "must be of that class.",
    )
    processor_path: str | None = Field(
        None,
        description="Folder of the processor's files when they are not beside `base_model` "
        "(e.g. with `model_config`). Relative paths are read from the config's folder.",
    )
    image_size: int | tuple[int, int] | None = Field(
        None,
        description="Resize every image before the processor, as Axolotl does: an int pads it "
        "to that square keeping its aspect ratio; `[width, height]` stretches it.",
    )
    image_resize_algorithm: Literal["bilinear", "bicubic", "lanczos"] = Field(
        "bilinear", description="The resampling filter `image_size` resizes with.",
    )
    images_per_row: int | None = Field(
        None, ge=1,
        description="Llama 3.2 Vision: the most images one row holds, for `validate`'s memory "
        "estimate (every rank holds every image's states; each image is one token, so the "
        "row's length does not bound them). `longctx preprocess` prints the most in a row. "
        "Unset: one.",
    )
    freeze_mm_modules: bool = Field(
        False,
        description="Vision-language models: freeze the vision tower and the projector; only "
        "the language model trains (full fine-tune), or only its adapters (with `adapter`).",
    )

    @field_validator("processor_type")
    @classmethod
    def _known_processor(cls, value: str | None) -> str | None:
        if value in (None, "AutoProcessor"):
            return value
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

        if value not in set(PROCESSOR_MAPPING_NAMES.values()):
            raise ValueError(f"`{value}` is not a processor class transformers has; write "
                             "`AutoProcessor` (the class the model's folder names)")
        return value

    @property
    def trains_images(self) -> bool:
        """The run reads image-bearing records through a processor (`processor_type`): a
        model with its own causal LM (Gemma 3) then trains as a vision-language model."""
        return bool(self.processor_type)


# Values a tower block keeps per patch and hidden unit for its backward (inputs of the norms,
# q/k/v, attention output, MLP in/out), and what the patch embedding and the merger keep once:
# measured on Qwen2.5-VL-7B's tower width by benchmarks/vlm_tower_memory.py (23.7 per layer in
# float32, 25.8 in bfloat16, whose norms and rotary step compute in float32; 5.9-6.9 outside).
SAVED_PER_HIDDEN = 26
SAVED_OUTSIDE_LAYERS = 7
ADAM_BYTES_PER_WEIGHT = 8  # two float32 moments


@dataclass(frozen=True)
class TowerRun:
    """What the tower's memory depends on besides its shape: the run's dtype, whether the
    tower trains, the row's tokens and recomputation."""

    dtype: str
    frozen: bool  # freeze_mm_modules
    adapter: str | None
    row_tokens: int
    checkpointed: bool  # gradient_checkpointing
    images_per_row: int = 1  # a cross-attended tower's (`images_per_row`)
    # LoRA on the cross-attention layers' k_proj and v_proj (each adapted or not), its rank
    # and whether its dropout is on.
    adapted_kv: tuple[bool, bool] = (False, False)
    lora_r: int = 0
    lora_dropout: bool = False


def shuffle_scale(hf_config: Any) -> int:
    """Patches per image token along each side of a tiled family's pixel shuffle
    (`tower: shuffled`): SmolVLM's `scale_factor`, the inverse of InternVL's
    `downsample_ratio`."""
    if getattr(hf_config, "scale_factor", None):
        return int(hf_config.scale_factor)
    return round(1 / float(hf_config.downsample_ratio))


def images_attend_both_ways(vision: VisionSection, hf_config: Any) -> bool:
    """A run whose image tokens attend to each other both ways in some layers (Gemma 3 with
    images; Gemma 4 with images and `use_bidirectional_attention: vision`)."""
    return vision.trains_images and image_attention(hf_config) in ("both_ways",
                                                                   "sliding_both_ways")


@dataclass(frozen=True)
class VisionTower:
    """The shape of a VLM's tower, from its config."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    merge: int  # patches per image token along each side (1: one token per patch)
    images_attend: str | None = None  # how its image tokens attend (`image_attention`)
    # A cross-attended tower's patches per image, its tiles' and their class tokens; 0 where
    # an image's patches are bounded by its tokens.
    patches_per_image: int = 0

    @classmethod
    def of(cls, hf_config: Any) -> VisionTower | None:
        """The tower of `hf_config`, or None for a text model."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            return None
        layers = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", 1)
        hidden = getattr(vision, "hidden_size", None) or getattr(vision, "embed_dim", 0)
        model_type = str(getattr(hf_config, "model_type", ""))
        family = vision_family(model_type)
        # Mistral 3 names its patch merger's size on the wrapper, not on Pixtral's config.
        merge = int(getattr(vision, "spatial_merge_size", None)
                    or getattr(hf_config, "spatial_merge_size", 1) or 1)
        if family is not None and family.tower == "pooled":  # Gemma 3 pools patches to tokens
            side = int(vision.image_size) // int(vision.patch_size)
            merge = max(1, side // math.isqrt(int(hf_config.mm_tokens_per_image)))
        elif family is not None and family.tower == "shuffled":  # SmolVLM, InternVL
            merge = shuffle_scale(hf_config)
        elif family is not None and family.tower == "position_pooled":  # Gemma 4
            merge = int(vision.pooling_kernel_size)
        per_image = 0
        if family is not None and family.tower == "cross_attended":  # Mllama
            layers += int(vision.num_global_layers)  # its global encoder after the local one
            per_image = CrossAttendedImages.of(hf_config).keys_per_image
        return cls(
            model_type=model_type,
            layers=int(layers), hidden=int(hidden),
            intermediate=int(getattr(vision, "intermediate_size", 4 * hidden) or 4 * hidden),
            merge=merge, images_attend=image_attention(hf_config), patches_per_image=per_image,
        )

    @property
    def parameters(self) -> int:
        """Attention (4 h^2) and a gated MLP (3 h i) per layer: a rough count."""
        return self.layers * (4 * self.hidden**2 + 3 * self.hidden * self.intermediate)

    def patches_per_rank(self, row_tokens: int, sp: int, images: int = 1) -> int:
        """Patches a rank encodes when the whole row is image tokens; a cross-attended
        tower's, of its run of the row's `images` (whole images per rank)."""
        if self.patches_per_image:
            return -(-images // sp) * self.patches_per_image
        return -(-row_tokens * self.merge**2 // sp)

    def activation_bytes(self, patches: int, dtype_bytes: int, frozen: bool = False,
                         checkpointed: bool = False) -> int:
        """Bytes the tower keeps for backward while encoding `patches` patches: nothing when
        frozen (no weight of it trains, so autograd records none of it); with activation
        checkpointing each layer's input, and one layer recomputed at a time."""
        if frozen:
            return 0
        per_layer = 1 if checkpointed else SAVED_PER_HIDDEN
        recomputed = SAVED_PER_HIDDEN if checkpointed else 0
        units = self.layers * per_layer + recomputed + SAVED_OUTSIDE_LAYERS
        return patches * self.hidden * units * dtype_bytes

    def memory(self, run: TowerRun, layout: Layout) -> tuple[int, int]:
        """(weights + gradients + optimizer state, saved activations) bytes per rank."""
        b = DTYPE_BYTES[run.dtype]
        trained = not run.frozen and run.adapter is None
        weights = self.parameters * (b + (b + ADAM_BYTES_PER_WEIGHT if trained else 0))
        if layout.fsdp:
            weights //= layout.dp_shard * layout.sp
        patches = self.patches_per_rank(run.row_tokens, layout.sp, run.images_per_row)
        return weights, self.activation_bytes(patches, b, run.frozen, run.checkpointed)


@dataclass(frozen=True)
class CrossAttendedImages:
    """Mllama: what each rank holds of the row's images for the text model's cross-attention
    layers (runtime/vision.py `_cross_attended`, parallel/cross_attention.py).

    Every rank holds the projected tower states of every image of the row, `keys` =
    images x tiles x (patches + class token), each of the text model's hidden size (the input
    k_proj and v_proj keep). Each cross-attention layer keeps, per key, k_norm's input (below
    float32 its float32 upcast) and output, the keys and values SDPA takes (expanded to the
    query heads under GQA), and the mask SDPA turns from booleans into the compute dtype,
    [local tokens, keys]. LoRA on k_proj or v_proj keeps its float32 input (below float32, or
    after dropout) and lora_A's output. Checkpointed layers keep none of that but the boolean
    mask (their input), and rebuild one layer's in backward. Measured by
    tests/test_vlm_mllama_memory.py.
    """

    keys_per_image: int
    layers: int  # cross-attention layers
    hidden: int  # the text model's
    kv_dim: int
    q_dim: int
    kv_heads: int
    first_layer: int = 0  # the first cross-attention layer's index (its module's name)

    @classmethod
    def of(cls, hf_config: Any) -> CrossAttendedImages | None:
        """Those of `hf_config`, or None when its tower is not cross-attended."""
        family = vision_family(str(getattr(hf_config, "model_type", "")))
        if family is None or family.tower != "cross_attended":
            return None
        vision, text = hf_config.vision_config, hf_config.text_config
        side = int(vision.image_size) // int(vision.patch_size)
        heads, kv_heads = int(text.num_attention_heads), int(text.num_key_value_heads)
        head_dim = int(text.hidden_size) // heads  # as the cross-attention layer takes it
        layers = list(text.cross_attention_layers or ())
        return cls(keys_per_image=int(vision.max_num_tiles) * (side * side + 1),
                   layers=len(layers), hidden=int(text.hidden_size),
                   kv_dim=kv_heads * head_dim, q_dim=heads * head_dim, kv_heads=kv_heads,
                   first_layer=int(layers[0]) if layers else 0)

    def layer_bytes_per_key(self, run: TowerRun) -> int:
        """Bytes one cross-attention layer keeps for backward per image key, its mask's
        column aside: what autograd saves depends on what trains."""
        b = DTYPE_BYTES[run.dtype]
        text_trains = run.adapter is None  # the layer's own weights, k_norm's too
        total = 2 * max(self.q_dim, self.kv_dim) * b  # the keys and values SDPA takes
        if text_trains or run.adapted_kv[0]:  # the keys need a gradient
            total += self.kv_dim * 4 + self.kv_heads * 4  # k_norm's float32 input, rsqrt
        if text_trains:
            total += self.kv_dim * b  # k_norm's output, for its weight's gradient
        # lora_A's float32 input, a new tensor below float32 or after dropout (whose mask
        # is not kept: the states need no gradient under an adapter), and its output.
        copy = 4 if b != 4 or run.lora_dropout else 0
        return total + sum(adapted * (self.hidden * copy + run.lora_r * 4)
                           for adapted in run.adapted_kv)

    def memory(self, run: TowerRun, layout: Layout) -> tuple[int, int, int]:
        """Bytes per rank: (the states, what the cross-attention layers keep of them, both
        through the loss and the backward; what the backward adds: a recomputed layer's and
        the states' gradient when the tower trains).

        The states outlive the forward when k_proj and v_proj save them (their weights
        train; float32 LoRA without dropout saves them as its input too) or when the layers
        are checkpointed (their input, for the recomputation)."""
        b = DTYPE_BYTES[run.dtype]
        keys = run.images_per_row * self.keys_per_image
        local = -(-run.row_tokens // layout.sp)
        text_trains = run.adapter is None
        saved = text_trains or run.checkpointed or (
            any(run.adapted_kv) and b == 4 and not run.lora_dropout)
        states = keys * self.hidden * b
        mask = local * keys * b  # SDPA's, in the compute dtype
        layer = keys * self.layer_bytes_per_key(run) + mask
        kept = local * keys if run.checkpointed else self.layers * layer  # bool mask: 1 byte
        tower_trains = text_trains and not run.frozen  # the states' gradient
        backward = (layer if run.checkpointed else 0) + (states if tower_trains else 0)
        return states if saved else 0, kept, backward

    def adapted_kv(self, targets: list[str] | str | None) -> tuple[bool, bool]:
        """Whether `lora_target_modules` adapts a cross-attention layer's k_proj and its
        v_proj, matched as peft does (a string in full as a regex, a list by name suffix)."""
        def adapted(name: str) -> bool:
            if targets == "all-linear":
                return True
            if isinstance(targets, str):
                return re.fullmatch(targets, name) is not None
            return any(name == t or name.endswith(f".{t}") for t in targets or ())
        layer = f"model.language_model.layers.{self.first_layer}.cross_attn"
        return adapted(f"{layer}.k_proj"), adapted(f"{layer}.v_proj")


def refuse_unless_rebuilt(model_config: Any) -> None:
    """Refuse a VLM family longctx does not rebuild, with the true reason."""
    model_type = str(getattr(model_config, "model_type", ""))
    family = vision_family(model_type)
    if family is not None and family.images_attend == "prefix":
        raise UserError(
            f"model type `{model_type}` lets its image and the prompt after it attend to each "
            "other in both directions (a prefix LM). longctx's sequence-parallel attention "
            "does not compute that mask, so it would train a different model.",
            where="base_model",
            fix="train this model without longctx, or pick a vision-language family longctx "
            f"trains exactly ({', '.join(VISION_FAMILIES)}).")
    if family is None or not family.rebuilt:
        record = family_record(model_type)
        why = record.vision_refusal
        text = "drop `processor_type` to train its text rows (exact), " if record.trains_text \
            else ""
        raise UserError(
            f"model type `{model_type}` takes images, but longctx does not rebuild its "
            "forward under sequence parallelism (the tower, the merge of image features and "
            f"its positions){f': {why}' if why else ''}, so it cannot train it exactly.",
            where="base_model",
            fix=f"{text}pick one of {', '.join(VISION_FAMILIES)}, or train without longctx.")


def check_vision(vision: VisionSection, hf_config: Any, layout: Layout, streamed: bool,
                 rl: str | None, model_type: str = "") -> VisionTower | None:
    """The rules of a vision-language run (UserError on the first broken one); its tower.
    `streamed`: the run reads a `pretraining_dataset`; `rl`: its preference or RL method;
    `model_type`: the model's (its shape knows it where no transformers config was read)."""
    if not vision.processor_type:
        # What only the processor reads would be ignored without it.
        given = [key for key, unset in (("processor_path", None), ("image_size", None),
                                        ("image_resize_algorithm", "bilinear"),
                                        ("images_per_row", None))
                 if getattr(vision, key) != unset]
        if given:
            raise UserError(
                f"`{given[0]}` is set without `processor_type`, so no processor would read it "
                "and the records would be tokenized as text.", where=given[0],
                fix="add `processor_type: AutoProcessor` to train on image-bearing records, "
                f"or remove `{given[0]}`.")
    elif streamed:
        raise UserError(
            "`pretraining_dataset` streams text rows; it has no images for `processor_type`.",
            where="pretraining_dataset",
            fix="list image-bearing records under `datasets` (type: chat_template), or drop "
            "`processor_type`.")
    if not is_vision_language(hf_config, images=vision.trains_images):
        if vision.processor_type and getattr(hf_config, "audio_config", None) is not None:
            kind = getattr(hf_config, "model_type", model_type)
            raise UserError(
                f"`processor_type: {vision.processor_type}` reads audio records, and audio "
                f"inputs are not supported: longctx trains model type `{kind}` on its text "
                "rows only (its audio tower and the merge of audio features are not rebuilt "
                "under sequence parallelism).", where="processor_type",
                fix="remove `processor_type` to train the text rows of the dataset, or train "
                "audio with plain Hugging Face training.")
        for key in ("processor_type", "freeze_mm_modules"):
            if getattr(vision, key):
                raise UserError(
                    f"`{key}` is set, but the model longctx trains has no vision tower (model type "
                    f"`{model_type or getattr(hf_config, 'model_type', '?')}`).", where=key,
                    fix=f"remove `{key}`, or use a vision-language model.")
        return None
    refuse_unless_rebuilt(hf_config)  # before reading a tower longctx has no rules for
    tower = VisionTower.of(hf_config)
    if vision.images_per_row is not None and not tower.patches_per_image:
        raise UserError(
            f"`images_per_row` sizes the images of a cross-attended tower (Llama 3.2 Vision); "
            f"model type `{tower.model_type}` merges its images into the row's tokens, so the "
            "row's length already bounds them and the key would change nothing.",
            where="images_per_row", fix="remove `images_per_row`.")
    if layout.tp > 1:
        raise UserError(
            "vision-language models do not run under tensor parallelism here: the tower and "
            "the merge of its features are not split over a TP group.",
            where="tensor_parallel_size", fix="use `tensor_parallel_size: 1`.")
    if images_attend_both_ways(vision, hf_config) and layout.sp > 1 and layout.mode != "ulysses":
        where = (" on its sliding-window layers (`use_bidirectional_attention: vision` in its "
                 "text config)" if tower.images_attend == "sliding_both_ways" else "")
        raise UserError(
            f"model type `{tower.model_type}` lets the tokens of one image attend to each other "
            f"in both directions{where}. `sequence_parallel_mode: {layout.mode}` runs a "
            "ring, whose ranks each hold part of every document's keys and compute causal "
            "segments only, so it would train a different model.",
            where="sequence_parallel_mode",
            fix="set `sequence_parallel_mode: ulysses`: after its all-to-all each rank holds "
            "the whole row for some heads and applies the model's own mask.")
    if vision.processor_type and not vision_family(tower.model_type).prepared:
        raise UserError(
            f"`processor_type` with model type `{tower.model_type}`: longctx prepares image "
            f"rows with the processors of {', '.join(PREPARED_FAMILIES)} only so far (this "
            "family's forward is exact; its processor's rows are not tested).",
            where="processor_type",
            fix=f"use a model of {', '.join(PREPARED_FAMILIES)}, or train on text only.")
    if rl is not None:
        raise UserError(
            f"`rl: {rl}` on a vision-language model: longctx trains these with the "
            "causal-LM loss only so far (no preference or GRPO rows with images).",
            where="rl", fix="drop `rl` to fine-tune on image-bearing chats.")
    return tower


def plan_rows(tower: VisionTower, run: TowerRun, layout: Layout) -> list[tuple[str, str]]:
    """The plan's rows about the tower (the `model` section)."""
    weights, saved = tower.memory(run, layout)
    patches = tower.patches_per_rank(run.row_tokens, layout.sp)
    trains = ("frozen (`freeze_mm_modules`)" if run.frozen else
              "base weights frozen; LoRA adapters where `lora_target_modules` match its "
              "layers' names (`freeze_mm_modules: true` keeps them out)"
              if run.adapter is not None else "trained")
    unit = ("whole tiles (each image's tiles and thumbnail are tower inputs of their own)"
            if vision_family(tower.model_type).tower == "shuffled" else "whole images")
    split = (f"{unit}, one run of the row's {unit.split()[1]} per rank of each SP group of "
             f"{layout.sp}; features all-gathered" if layout.sp > 1 else unit)
    both_ways = tower.images_attend in ("both_ways", "sliding_both_ways")
    layers = ("its sliding-window layers (causal in the others)"
              if tower.images_attend == "sliding_both_ways" else "every layer")
    attention = ([("image attention", f"both ways within each image on {layers}, the "
                   "model's own mask: Ulysses attends over the whole row per head; a fused "
                   "kernel takes each image as one block, except in sliding-window layers "
                   "(the tiled path)")]
                 if both_ways else [])
    images = run.images_per_row
    row = (f"{images} image{'s' if images != 1 else ''} per row" if tower.patches_per_image
           else "a row of only image tokens")
    return [
        *attention,
        ("vision tower", f"{tower.layers} layers, hidden {tower.hidden}, "
                         f"~{format_count(tower.parameters)} parameters, {trains}"),
        ("tower splits by", split),
        ("tower memory", f"{format_gib(weights + saved)} per rank at most: weights and state "
                         f"{format_gib(weights)}, activations {format_gib(saved)} for {row} "
                         f"({patches:,} patches per rank)"),
    ]


def cross_rows(cross: CrossAttendedImages, run: TowerRun, layout: Layout, tiles: int,
               assumed: bool) -> list[tuple[str, str]]:
    """The plan's row about the images every rank holds for cross attention (Mllama);
    `assumed`: `images_per_row` is unset."""
    states, kept, backward = cross.memory(run, layout)
    images = run.images_per_row
    count = (f"{images} image{'s' if images != 1 else ''} per row"
             + (" (assumed: set `images_per_row`)" if assumed else " (`images_per_row`)"))
    layers = (f"their boolean mask; each of the {cross.layers} layers rebuilds its keys, "
              "values and mask in its backward" if run.checkpointed else
              f"keys, values and mask of {cross.layers} layers")
    held = (f"states {format_gib(states)}" if states else
            "states freed after the forward (nothing that trains keeps them)")
    return [("image states", f"{count} x {tiles} tiles x {cross.keys_per_image // tiles:,} "
             f"patches, on every rank: {held}, kept by the cross-attention layers "
             f"{format_gib(kept)} ({layers}); {format_gib(backward)} more in backward")]
