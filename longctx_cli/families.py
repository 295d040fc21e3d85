"""What longctx knows of a model family, one record per model type: the text traits code
branches on and, for a vision-language family, how its forward, processor and probe work.

A leaf module (it imports nothing of longctx_cli): config, data, runtime and the checks read
the same records. A model type without a record has no trait (`family` returns a blank one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# How a vision-language family's rotary positions work: `mrope` 3-D positions `[3, T]` from
# the model's `get_rope_index` over each document's image grids; `text` the 1-D text ones.
Positions = Literal["mrope", "text"]
# How its image tokens attend: `causal` as text; `both_ways` within each image (a
# bidirectional block inside the causal mask); `sliding_both_ways` so on its sliding-window
# layers only, causally on the others, where the text config sets
# `use_bidirectional_attention: vision` (Gemma 4; causally everywhere otherwise: see
# `image_attention`); `prefix` the image and the prompt after it both ways (a prefix LM,
# which longctx does not compute).
ImageAttention = Literal["causal", "both_ways", "sliding_both_ways", "prefix"]
# The tower's input, as its processor lays pixels out: `patches` rows of patches with a
# `[t, h, w]` grid per item (videos too); `images` whole images `[images, C, H, W]`, all of
# the tower's one size; `sized` whole images each at its own size, zero-padded to the row's
# largest, with their `image_sizes` `[images, 2]` (height, width: Pixtral); `positioned` each
# image's patches as rows `[images, patches, patch_dim]` padded to the row's most, with each
# patch's (x, y) in `image_position_ids` `[images, patches, 2]`, (-1, -1) on padding (Gemma 4);
# `tiled` each image's tiles padded to the processor's `max_image_tiles`, `[images, tiles, C,
# H, W]`, with its `aspect_ratio_ids` `[images]` and `aspect_ratio_mask` `[images, tiles]`.
Pixels = Literal["patches", "images", "sized", "positioned", "tiled"]
# How the tower turns patches into image tokens, which is how the probe shrinks it: `merged`
# a patch tower of `depth` blocks whose merger joins patches (Qwen-VL); `pooled` a fixed-size
# tower pooled to `mm_tokens_per_image` tokens (Gemma 3); `per_patch` a fixed-size tower with
# one token per patch (CLIP/SigLIP towers, LLaVA); `sized` a patch tower of any image size
# whose projector merges `spatial_merge_size`**2 patches per token (Pixtral, Mistral 3);
# `shuffled` a fixed-size tower over each image's tiles (a thumbnail among them), each tile
# its own tower input, whose connector pixel-shuffles `scale` x `scale` patches into one
# token (SmolVLM, InternVL); `position_pooled` a patch tower of any image size whose pooler
# averages `pooling_kernel_size`**2 patches per token by their (x, y) (Gemma 4);
# `cross_attended` a fixed-size tower over each image's tiles, whose every patch of every tile
# (its class token too) is a key of the text model's cross-attention layers (Mllama).
Tower = Literal["merged", "pooled", "per_patch", "sized", "shuffled", "position_pooled",
                "cross_attended"]


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family's forward, processor and probe, as longctx rebuilds them."""

    name: str  # as the messages name it
    positions: Positions
    images_attend: ImageAttention
    pixels: Pixels
    tower: Tower
    modules: tuple[str, ...]  # the tower's and projector's attributes on the inner model
    # A video is one run of placeholders (False) or one run per temporal patch, each after
    # its timestamp (True: Qwen3-VL).
    timestamped_video: bool = False
    # Built without its video processor where torchvision is missing (data/vision): the
    # text of the folder's processor class names that marks the family, and the class.
    processor_marker: str | None = None
    image_only_processor: str | None = None
    prepared: bool = True  # `longctx preprocess` builds and tests its processor's rows
    # mRoPE's (t, h, w) sections where the config names none (the model's own default).
    mrope_section: tuple[int, ...] | None = None
    # The PIL image processor built with `image_only_processor` (its own resize rule).
    image_processor_pil: str = "Qwen2VLImageProcessorPil"
    # Its videos are refused (data and runtime): why. None: videos train as images do.
    video_refusal: str | None = None
    # The tokens its processor writes around an image's tokens (never targets).
    image_markers: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>")
    # Its tower takes each patch as `[channels, patch, patch]` pixels (PaddleOCR-VL's), not
    # as one flat row: runtime/vision.py reshapes the row's patches before the tower.
    square_patches: bool = False
    # The language model's attribute on the inner model (SmolVLM's is `text_model`).
    language: str = "language_model"
    # `get_image_features` takes the tiles as one sample, `[1, tiles, C, H, W]` (SmolVLM,
    # which drops all-zero tiles as batch padding), not `[tiles, C, H, W]`.
    tiles_as_sample: bool = False
    # Its forward embeds the placeholders as the text pad token before writing the features
    # over them (Gemma 4: its per-layer input embeddings read that token's row there).
    placeholders_as_pad: bool = False

    @property
    def rebuilt(self) -> bool:
        """Whether runtime/vision.py rebuilds its forward under SP (a prefix LM: no)."""
        return self.images_attend != "prefix"


@dataclass(frozen=True)
class Family:
    """One model type: the traits code branches on (all off for a model type not listed)."""

    model_type: str
    # Some layers mix tokens outside attention, which parallel/token_mixing.py runs exactly
    # (its COVERED classes; tests/test_token_mixing.py checks the two agree). `validate`
    # builds such a model on the meta device to describe them; for other model types its
    # plan needs neither torch nor transformers.
    mixes_tokens: bool = False
    # No attention layer at all: every layer is a covered scan (Mamba, Mamba2, Falcon-Mamba).
    # Its shape has no heads; a row is split into contiguous (or zigzag) shards along which
    # the scans pass their state, never a stripe, and no attention kernel or TP applies.
    attention_free: bool = False
    # A model of recurrences only that longctx cannot split over ranks: why (the refusal).
    recurrence_refusal: str | None = None
    # The decoder layers' own norms (the layer's direct children) are all Llama-style
    # RMSNorms, which training runs through the lean RMSNorm (runtime/memory_savers.py,
    # checked against transformers 5.24's code): the memory estimate then counts no float32
    # copy of a norm's input. Only families of tests/family_matrix.py, where
    # tests/test_lean_norm.py checks this against the built models; any other model type is
    # estimated as if its norms kept their float32 copies (conservative).
    lean_norms: bool = False
    # Its transformers `base_model_tp_plan` is colwise/rowwise only and its decoder layers
    # hold nothing but attention, MLP and norms (what the TP-sp plan shards exactly).
    tensor_parallel: bool = False
    vision: VisionFamily | None = None
    # Takes images, but runtime/vision.py does not rebuild its forward: why (the refusal).
    vision_refusal: str | None = None
    # A multimodal family whose `...ForConditionalGeneration` runs a text row exactly as its
    # language model does (no image or audio input: its towers are never called), where
    # transformers registers no causal LM for it: longctx loads that class (transformers'
    # multimodal-LM mapping) as its causal LM and trains it on text, as Gemma 3's (which
    # transformers registers itself).
    trains_text: bool = False
    # The class of its MoE blocks' fused experts, whose `gate_up_proj` `[experts, hidden,
    # 2 x inner]` (gate, then up) and `down_proj` `[experts, inner, hidden]`
    # `llama4_linearized_experts` turns into one linear per expert (runtime/experts.py).
    fused_experts: str | None = None
    # Its attention layer hands q, k and v to the attention function spent, each a projection
    # of its own memory (parallel/attention.py `attention_inputs_spent` shows the first on
    # the layer's source; tests/test_memory_account.py checks both on the built models): a
    # Ulysses all-to-all writes the head layout over them, and the memory estimate counts no
    # second copy. Off (a copy counted) for any other model type.
    spent_qkv: bool = False


_QWEN_VL = dict(positions="mrope", images_attend="causal", pixels="patches", tower="merged",
                modules=("visual",))
# GLM-4.1V/4.5V/4.6V's processors write a video as one image-token run per temporal patch,
# each between image markers and followed by its timestamp as text, the whole inside video
# markers (the ids carry no video token: `mm_token_type_ids` marks the runs inside them).
_GLM_VIDEO = (
    "its processor writes a video as image tokens (`<|image|>`) between `<|begin_of_video|>` and "
    "`<|end_of_video|>`, one run per temporal patch after its timestamp taken from the video's "
    "frame metadata, and its video processor samples frames by its own rule: longctx prepares "
    "neither that layout nor those frames, and without them a video's tokens would read as "
    "images")
_GLM_VL = dict(_QWEN_VL, mrope_section=(8, 12, 12), video_refusal=_GLM_VIDEO,
               image_markers=("<|begin_of_image|>", "<|end_of_image|>"))
_FIXED_TOWER = dict(pixels="images", modules=("vision_tower", "multi_modal_projector"))

_RECORDS = (
    # Vision-language families, in the order the messages list them.
    Family("qwen2_vl", vision=VisionFamily(
        "Qwen2-VL", **_QWEN_VL, processor_marker="Qwen2VL", mrope_section=(16, 24, 24),
        image_only_processor="Qwen2_5_VLProcessor")),
    Family("qwen2_5_vl", vision=VisionFamily(
        "Qwen2.5-VL", **_QWEN_VL, processor_marker="Qwen2_5_VL", mrope_section=(16, 24, 24),
        image_only_processor="Qwen2_5_VLProcessor")),
    Family("qwen3_vl", vision=VisionFamily(
        "Qwen3-VL", **_QWEN_VL, timestamped_video=True, processor_marker="Qwen3VL",
        mrope_section=(24, 20, 20),
        image_only_processor="Qwen3VLProcessor")),
    # GLM-4.1V, GLM-4.5V (MoE text) and GLM-4.6V: one forward (Glm46VModel is Glm4vModel),
    # GLM-4.5V's processor GLM-4.1V's.
    Family("glm4v", vision=VisionFamily("GLM-4.1V", **_GLM_VL, processor_marker="Glm4v",
                                        image_only_processor="Glm4vProcessor",
                                        image_processor_pil="Glm4vImageProcessorPil")),
    Family("glm4v_moe", vision=VisionFamily("GLM-4.5V", **_GLM_VL)),
    Family("glm46v", vision=VisionFamily("GLM-4.6V", **_GLM_VL, processor_marker="Glm46V",
                                         image_only_processor="Glm46VProcessor",
                                         image_processor_pil="Glm46VImageProcessorPil")),
    # A SigLIP-style patch tower whose projector merges each image's 2 x 2 patches.
    Family("paddleocr_vl", vision=VisionFamily(
        "PaddleOCR-VL", positions="mrope", images_attend="causal", pixels="patches",
        tower="merged", modules=("visual", "projector"), mrope_section=(16, 24, 24),
        square_patches=True, processor_marker="PaddleOCRVL",
        image_markers=("<|IMAGE_START|>", "<|IMAGE_END|>"), video_refusal=(
            "PaddleOCR-VL takes images only: its model has no `get_video_features` and its "
            "processor no video processor"))),
    # Qwen3.5 and its MoE: gated delta-net layers beside attention (the text records' trait),
    # a Qwen3-VL tower without deepstack, Qwen3-VL's processor (timestamped video frames).
    Family("qwen3_5", mixes_tokens=True, vision=VisionFamily(
        "Qwen3.5", **_QWEN_VL, timestamped_video=True, processor_marker="Qwen3VL",
        mrope_section=(11, 11, 10), image_only_processor="Qwen3VLProcessor")),
    Family("qwen3_5_moe", mixes_tokens=True, vision=VisionFamily(
        "Qwen3.5-MoE", **_QWEN_VL, timestamped_video=True, processor_marker="Qwen3VL",
        mrope_section=(11, 11, 10), image_only_processor="Qwen3VLProcessor")),
    Family("llava", vision=VisionFamily(
        "LLaVA", positions="text", images_attend="causal", tower="per_patch", **_FIXED_TOWER)),
    Family("gemma3", vision=VisionFamily(
        "Gemma 3", positions="text", images_attend="both_ways", tower="pooled",
        **_FIXED_TOWER)),
    Family("smolvlm", vision=VisionFamily(
        "SmolVLM", positions="text", images_attend="causal", pixels="images",
        tower="shuffled", modules=("vision_model", "connector"), language="text_model",
        tiles_as_sample=True, processor_marker="SmolVLM",
        image_only_processor="SmolVLMProcessor")),
    Family("internvl", vision=VisionFamily(
        "InternVL", positions="text", images_attend="causal", tower="shuffled",
        processor_marker="InternVL", image_only_processor="InternVLProcessor",
        **_FIXED_TOWER)),
    Family("paligemma", vision=VisionFamily(
        "PaliGemma", positions="text", images_attend="prefix", tower="per_patch",
        prepared=False, **_FIXED_TOWER)),
    # Pixtral's tower attends within each image only (a block-diagonal mask, 2-D rotary
    # positions restarting per image): split by whole images, it is exact.
    Family("mistral3", trains_text=True, lean_norms=True, vision=VisionFamily(
        "Mistral 3", positions="text", images_attend="causal", pixels="sized", tower="sized",
        modules=("vision_tower", "multi_modal_projector"))),
    # Gemma 4: a tower over each image's own patches (2-D positions, attending within the
    # image only), pooled by position; its images attend both ways on sliding layers only.
    Family("gemma4", vision=VisionFamily(
        "Gemma 4", positions="text", images_attend="sliding_both_ways", pixels="positioned",
        tower="position_pooled", modules=("vision_tower", "embed_vision"),
        processor_marker="Gemma4", image_only_processor="Gemma4Processor",
        image_markers=(),  # its begin/end of image: the tokenizer's `boi_token`, `eoi_token`
        placeholders_as_pad=True, video_refusal=(
            "Gemma 4's video frames go through `get_video_features` with their own position "
            "ids and frame counts, which the VLM path does not pass"))),
    # Llama 3.2 Vision: one `<|image|>` token per image and no features merged; its text
    # model's cross-attention layers read the tower's states (runtime/vision.py).
    Family("mllama", vision=VisionFamily(
        "Llama 3.2 Vision", positions="text", images_attend="cross", pixels="tiled",
        tower="cross_attended", modules=("vision_model", "multi_modal_projector"),
        processor_marker="Mllama", image_markers=())),
    # Vision-language families runtime/vision.py does not rebuild, each with the reason.
    Family("gemma4_unified", vision_refusal=(
        "Gemma 4 unified has no vision tower: it embeds each image's raw patches with their "
        "2-D position ids (`image_position_ids`) straight into the text model, whose image "
        "tokens attend both ways (`use_bidirectional_attention: vision`): the VLM path "
        "merges a tower's features only (Gemma 4's tower is rebuilt; these raw patch "
        "embeddings are not)")),
    Family("gemma3n", vision_refusal=(
        "Gemma 3n's vision tower is a timm MobileNetV5 backbone and it also takes audio "
        "(`input_features`, its audio tower); the VLM path rebuilds neither tower, and longctx "
        "has no audio inputs at all")),
    Family("llama4", fused_experts="Llama4TextExperts", vision_refusal=(
        "Llama 4's processor cuts each image into tiles plus a global view, with tile "
        "separator tokens, and its forward applies the projector to the tower's "
        "pixel-shuffled features itself (not in `get_image_features`): the VLM path lays out "
        "and merges neither")),
    # An audio-language family: its text rows through its own class (longctx has no audio
    # inputs; `processor_type` takes image processors only).
    Family("voxtral", trains_text=True, lean_norms=True, spent_qkv=True),
    # Text families, by model type.
    Family("apertus", lean_norms=True, spent_qkv=True),
    Family("arcee", lean_norms=True, spent_qkv=True),
    Family("bamba", mixes_tokens=True, lean_norms=True, spent_qkv=True),
    Family("deepseek_v2", lean_norms=True),
    Family("deepseek_v3", lean_norms=True),
    Family("exaone4", lean_norms=True, spent_qkv=True),
    Family("falcon_h1", mixes_tokens=True, lean_norms=True, spent_qkv=True),
    Family("falcon_mamba", mixes_tokens=True, attention_free=True, lean_norms=True),
    Family("glm4", lean_norms=True, spent_qkv=True),
    Family("glm4_moe", lean_norms=True, spent_qkv=True),
    Family("glm4_moe_lite", lean_norms=True),
    Family("granite", lean_norms=True, spent_qkv=True),
    Family("granitemoehybrid", mixes_tokens=True, lean_norms=True, spent_qkv=True),
    Family("hunyuan_v1_dense", lean_norms=True, spent_qkv=True),
    Family("jamba", mixes_tokens=True, lean_norms=True, spent_qkv=True),
    Family("kimi_linear", mixes_tokens=True, lean_norms=True),
    Family("lara_mini", mixes_tokens=True),
    Family("lfm2", mixes_tokens=True, lean_norms=True, spent_qkv=True),
    Family("lfm2_moe", mixes_tokens=True, lean_norms=True, spent_qkv=True),
    Family("lfm3", mixes_tokens=True),
    Family("llama", lean_norms=True, tensor_parallel=True, spent_qkv=True),
    Family("llama4_text", fused_experts="Llama4TextExperts", spent_qkv=True),
    Family("mamba", mixes_tokens=True, attention_free=True, lean_norms=True),
    Family("mamba2", mixes_tokens=True, attention_free=True, lean_norms=True),
    Family("mimo_v2_flash", lean_norms=True, spent_qkv=True),
    Family("minimax_m2", lean_norms=True, spent_qkv=True),
    Family("ministral", lean_norms=True, spent_qkv=True),
    Family("ministral3", lean_norms=True, spent_qkv=True),
    Family("mistral", lean_norms=True, tensor_parallel=True, spent_qkv=True),
    Family("mistral4", lean_norms=True),
    Family("mixtral", lean_norms=True, spent_qkv=True),
    Family("nemotron_h", mixes_tokens=True, spent_qkv=True),
    Family("olmo_hybrid", mixes_tokens=True, spent_qkv=True),
    Family("phi3", lean_norms=True),
    Family("qwen2", lean_norms=True, tensor_parallel=True, spent_qkv=True),
    Family("qwen3", lean_norms=True, tensor_parallel=True, spent_qkv=True),
    Family("qwen3_5_moe_text", mixes_tokens=True, spent_qkv=True),
    Family("qwen3_5_text", mixes_tokens=True, spent_qkv=True),
    Family("qwen3_moe", lean_norms=True, spent_qkv=True),
    Family("qwen3_next", mixes_tokens=True, spent_qkv=True),
    Family("rwkv", recurrence_refusal=(
        "its time mixing (`RwkvSelfAttention`: the WKV recurrence and a token shift) keeps its "
        "state in the model's own `state` list, not in transformers' cache interface through "
        "which longctx hands a rank the state at its first token, and longctx does not cover "
        "the layer, so no rank could continue a document another rank began")),
    Family("seed_oss", lean_norms=True, spent_qkv=True),
    Family("smollm3", lean_norms=True, spent_qkv=True),
    Family("xlstm", recurrence_refusal=(
        "its mLSTM blocks take their (C, n, m) state as an argument and return the new one "
        "beside their output (the model threads them through its own xLSTMCache), outside "
        "transformers' cache interface through which longctx hands a rank the state at its "
        "first token, and longctx does not cover the block, so no rank could continue a "
        "document another rank began")),
    Family("zamba2", mixes_tokens=True, lean_norms=True, spent_qkv=True),
)
FAMILIES: dict[str, Family] = {f.model_type: f for f in _RECORDS}
# The linear layers `llama4_linearized_experts` gives a fused experts module, one of each per
# expert (`<experts>.gate_projs.<e>`, ...): runtime/experts.py's `LinearizedExperts`.
LINEARIZED_EXPERT_LINEARS = ("gate_projs", "up_projs", "down_projs")
# A linearized expert's weight as a state dict (or a checkpoint saved so) names it.
LINEARIZED_EXPERT_KEY = re.compile(
    r"^(?P<experts>.+)\.(?P<proj>gate|up|down)_projs\.(?P<e>\d+)\.weight$")


def family(model_type: str) -> Family:
    """The record of `model_type` (a blank one, every trait off, if longctx has none)."""
    return FAMILIES.get(model_type) or Family(model_type)


def vision_family(model_type: str) -> VisionFamily | None:
    """The vision-language record of `model_type`, or None."""
    return family(model_type).vision


# The model types of a trait, read from the records (for messages and the tests).
HYBRID_MODEL_TYPES = frozenset(t for t, f in FAMILIES.items() if f.mixes_tokens)
ATTENTION_FREE_MODEL_TYPES = frozenset(t for t, f in FAMILIES.items() if f.attention_free)
LEAN_NORM_MODEL_TYPES = frozenset(t for t, f in FAMILIES.items() if f.lean_norms)
SPENT_QKV_MODEL_TYPES = frozenset(t for t, f in FAMILIES.items() if f.spent_qkv)
TP_FAMILIES = tuple(t for t, f in FAMILIES.items() if f.tensor_parallel)
# Vision-language families whose forward runtime/vision.py rebuilds ...
VISION_FAMILIES = tuple(t for t, f in FAMILIES.items() if f.vision and f.vision.rebuilt)
# ... those whose processor's rows `longctx preprocess` builds and tests ...
PREPARED_FAMILIES = tuple(t for t in VISION_FAMILIES if FAMILIES[t].vision.prepared)
# ... and those whose image tokens attend to each other both ways. Only Ulysses computes it:
# after its all-to-all a rank holds the whole row for some heads, while a ring's ranks each
# hold a part of every document's keys.
# (Gemma 4's on its sliding layers, where its config asks for it: `image_attention`.)
BIDIRECTIONAL_IMAGE_FAMILIES = tuple(
    t for t in VISION_FAMILIES
    if FAMILIES[t].vision.images_attend in ("both_ways", "sliding_both_ways"))


def image_attention(hf_config: object) -> ImageAttention | None:
    """How the image tokens of a model of this config attend (None: not a rebuilt VLM):
    its family's rule, where Gemma 4's both-ways images are its text config's choice
    (`use_bidirectional_attention: vision`; causal otherwise)."""
    record = vision_family(str(getattr(hf_config, "model_type", "")))
    if record is None or record.images_attend != "sliding_both_ways":
        return None if record is None else record.images_attend
    text = getattr(hf_config, "text_config", None) or hf_config
    both = getattr(text, "use_bidirectional_attention", None) == "vision"
    return "sliding_both_ways" if both else "causal"


# Every family's tower and projector attribute names (what `freeze_mm_modules` freezes).
VISION_MODULE_NAMES = tuple(dict.fromkeys(
    name for f in FAMILIES.values() if f.vision for name in f.vision.modules))
# The vision families whose processor classes carry a marker in their names ...
MARKED_FAMILIES = tuple(
    f.vision for f in FAMILIES.values() if f.vision and f.vision.processor_marker)
# ... and those whose processor is built without torchvision where it is missing.
IMAGE_ONLY_FAMILIES = tuple(f for f in MARKED_FAMILIES if f.image_only_processor)
