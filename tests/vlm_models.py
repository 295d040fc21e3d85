"""Tiny vision-language models and packed image rows, and their own HF training step.

`tiny_vlm(family, attn)` builds a small random model of each family longctx trains (same
seed, same weights, whatever the attention); `image_row(family)` packs three documents:
two images (one of them cut by shard boundaries at sp 2 and 4), a text-only document, and
one more image, with 1-D text positions restarting at each document.
`own_vlm_step` is the reference: each document through the model's own forward with
`labels=`, weighted by its share of the row's target tokens, gradients summed.
"""

from __future__ import annotations

import torch

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.runtime.vision import IMAGE, VIDEO, VisionInputs

VOCAB = 200
IMAGE_ID, VIDEO_ID, START_ID, END_ID = 190, 191, 192, 193
PATCH, MERGE, TEMPORAL = 4, 2, 2
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3")
# Qwen3.5 and its MoE (tests/test_vlm_qwen3_5.py): gated delta-nets beside attention.
QWEN3_5 = ("qwen3_5", "qwen3_5_moe")
# The families that write a video as one run per temporal patch, each after its timestamp.
TIMESTAMPED = ("qwen3_vl", *QWEN3_5)
# Families with fixed-size images `[n, 3, side, side]` and a fixed token count per image.
FLAT = {"llava": (16, (16 // PATCH) ** 2), "gemma3": (40, 25)}
# Gemma 3 pools 10 x 10 patches to 25 tokens (the count puts a shard boundary inside an
# image under Ulysses); its sliding layers see 6 tokens back, fewer than an image holds.
GEMMA3_WINDOW = 6
# Mistral 3 (a Pixtral tower): images at their own sizes, (h, w) patches each, merged 2 x 2
# into tokens laid out as its processor lays them: each row of tokens ends in [IMG_BREAK]
# (here START_ID), the last one in [IMG_END] (END_ID) instead. Its first image is cut by
# the shard boundary at sp 2 (contiguous, zigzag and Ulysses slices alike).
SIZED = ("mistral3",)
SIZED_DOCUMENTS = (
    (40, (1, 8, 6), 3, (1, 2, 2), 4),
    (24,),
    (3, (1, 6, 4), 6),
)
# Tiled families (SmolVLM, InternVL): tiles of a fixed side, pixel-shuffled 2 x 2 into 9
# tokens each; an image grid `(t, h, w)` of the rows below stands for `h * w // 5 + 1` tiles
# here (the thumbnail counted): 10, 1 and 5 tiles, marked as their processors mark tiles, so
# that at sp 2 the middle of the row falls inside a tile of the first image.
TILED = {"smolvlm": (24, 9), "internvl": (24, 9)}
TILED_FAMILIES = tuple(TILED)
# Gemma 4: each image its own (h, w) patches with their (x, y), padded to the row's most, 2 x 2
# of them pooled into a token; its sliding layers see 6 tokens back, fewer than its first
# image holds. `gemma4` sets `use_bidirectional_attention: vision` (its images attend both
# ways on the sliding layers), `gemma4_causal` leaves it unset (causal images); `gemma4_moe`
# is Gemma 4 26B-A4B's shape: experts beside each dense MLP, no per-layer inputs.
GEMMA4 = {"gemma4": {"use_bidirectional_attention": "vision"},
          "gemma4_causal": {"use_bidirectional_attention": None},
          "gemma4_moe": {"use_bidirectional_attention": "vision", "enable_moe_block": True,
                         "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
                         "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0}}
GEMMA4_POOL = 2
# 37 + 9 + 10 = 56 tokens: the first image is tokens 13-28, so the contiguous halves'
# boundary (28) and the zigzag ring's first rank change (14) both fall inside it.
GEMMA4_DOCUMENTS = ((12, (1, 8, 8), 2, (1, 2, 2), 2), (9,), (3, (1, 4, 2), 3))
# Mllama (Llama 3.2 Vision): one <|image|> token per image, its tiles (of 4 at most, 8 x 8
# pixels, 2 x 2 patches and a class token each) the keys of the text model's cross-attention
# layer (its second of three). An image is `("tiles", n)`. The first document's text before
# its first image sees no tile (the model's zeroed mask: it attends to all of them), its
# second image's rows run past the middle of the row (the sp 2 boundary, 31); the second
# document has no image (its own forward skips the cross-attention layer); the third holds
# two images in a row (both seen from the first's token on, as its processor groups them).
MLLAMA_TILES, MLLAMA_SIDE = 4, 8
MLLAMA_DOCUMENTS = ((5, ("tiles", 2), 20, ("tiles", 1), 8), (12,),
                    (3, ("tiles", 3), ("tiles", 4), 10))
MLLAMA_RATIOS = {1: 1, 2: 2, 3: 3, 4: 6}  # tiles -> id of (1, 1), (1, 2), (1, 3), (2, 2)


def _config(family: str):
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2048,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                               out_hidden_size=64, patch_size=PATCH, spatial_merge_size=MERGE,
                               temporal_patch_size=TEMPORAL, window_size=16,
                               fullatt_block_indexes=[1]),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
            vision_end_token_id=END_ID)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                               patch_size=PATCH, spatial_merge_size=MERGE,
                               temporal_patch_size=TEMPORAL),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
            vision_end_token_id=END_ID)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig(
            text_config={**text, "head_dim": 16,
                         "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}},
            vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                               out_hidden_size=64, patch_size=PATCH, spatial_merge_size=MERGE,
                               temporal_patch_size=TEMPORAL, num_position_embeddings=64,
                               deepstack_visual_indexes=[0, 1]),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
            vision_end_token_id=END_ID)
    if family in ("glm4v", "glm4v_moe", "glm46v"):
        import transformers

        # GLM-4.xV rotates half of each head (16 wide: 4 rotary pairs in (t, h, w) sections);
        # GLM-4.5V's layers after the first are MoE (4 experts, 2 per token, one shared).
        moe = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   n_shared_experts=1, first_k_dense_replace=1)
        name = {"glm4v": "Glm4vConfig", "glm4v_moe": "Glm4vMoeConfig",
                "glm46v": "Glm46VConfig"}[family]
        return getattr(transformers, name)(
            text_config={**text, **(moe if family == "glm4v_moe" else {}), "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                "partial_rotary_factor": 0.5}},
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                               out_hidden_size=64, patch_size=PATCH, spatial_merge_size=MERGE,
                               temporal_patch_size=TEMPORAL, image_size=8 * PATCH),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, image_start_token_id=START_ID,
            image_end_token_id=END_ID)
    if family == "paddleocr_vl":
        from transformers import PaddleOCRVLConfig

        # A SigLIP-style tower of one-frame patches; its projector merges 2 x 2 of them.
        return PaddleOCRVLConfig(
            text_config={**text, "head_dim": 16, "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
            vision_config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                               num_attention_heads=2, patch_size=PATCH,
                               spatial_merge_size=MERGE, image_size=8 * PATCH),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
            vision_end_token_id=END_ID)
    if family in QWEN3_5:
        from transformers import AutoConfig

        # Gated delta-net layers beside attention (partial rotary: a quarter of each head),
        # a Qwen3-VL-like tower without deepstack; the MoE swaps the MLPs for experts.
        text_35 = {**text, "head_dim": 32, "linear_conv_kernel_dim": 4,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "layer_types": ["linear_attention", "full_attention"],
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5,
                                       "mrope_section": [3, 3, 2], "mrope_interleaved": True}}
        if family == "qwen3_5_moe":
            text_35 |= {"num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
        return AutoConfig.for_model(
            family, text_config=text_35,
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                               out_hidden_size=64, patch_size=PATCH, spatial_merge_size=MERGE,
                               temporal_patch_size=TEMPORAL, num_position_embeddings=64),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
            vision_end_token_id=END_ID)
    if family == "llava":
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

        return LlavaConfig(
            vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           image_size=16, patch_size=PATCH),
            text_config=LlamaConfig(**text), image_token_id=IMAGE_ID,
            vision_feature_layer=-1, vision_feature_select_strategy="default")
    if family == "gemma3":
        from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

        side, tokens = FLAT["gemma3"]
        return Gemma3Config(
            text_config=Gemma3TextConfig(
                **{**text, "head_dim": 16}, query_pre_attn_scalar=16,
                sliding_window=GEMMA3_WINDOW,
                layer_types=["sliding_attention", "full_attention"]),
            vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             image_size=side, patch_size=PATCH),
            mm_tokens_per_image=tokens, image_token_index=IMAGE_ID,
            boi_token_index=START_ID, eoi_token_index=END_ID)
    if family in GEMMA4:
        from transformers import Gemma4Config

        # Four layers (sliding, full, sliding, full), the full ones wider (its per-layer
        # config) with keys as values, the last reusing the second's keys and values (one
        # shared layer only: the third's keys read the second's image outputs, so whether a
        # full layer's images attend both ways shows in the loss), and per-layer input
        # embeddings that cover the image token's id (placeholders must embed as pad).
        return Gemma4Config(
            text_config={**text, "head_dim": 8, "num_hidden_layers": 4,
                         "layer_types": ["sliding_attention", "full_attention"] * 2,
                         "sliding_window": GEMMA3_WINDOW,
                         "per_layer_config": {"1": {"head_dim": 16}, "3": {"head_dim": 16}},
                         "attention_k_eq_v": True, "num_kv_shared_layers": 1,
                         "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
                         **GEMMA4[family]},
            vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                               patch_size=PATCH, pooling_kernel_size=GEMMA4_POOL,
                               position_embedding_size=16, initializer_range=0.2),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, boi_token_id=START_ID,
            eoi_token_id=END_ID, audio_token_id=194, boa_token_id=195, eoa_token_index=196)
    if family == "mistral3":
        from transformers import Mistral3Config

        return Mistral3Config(
            text_config={**text, "model_type": "mistral", "head_dim": 16,
                         "sliding_window": None},
            vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                               patch_size=PATCH, image_size=8 * PATCH),
            image_token_index=IMAGE_ID, spatial_merge_size=MERGE, vision_feature_layer=-1)
    if family == "smolvlm":
        from transformers import LlamaConfig, SmolVLMConfig, SmolVLMVisionConfig

        side, _ = TILED[family]
        return SmolVLMConfig(
            vision_config=SmolVLMVisionConfig(hidden_size=32, intermediate_size=48,
                                              num_hidden_layers=2, num_attention_heads=2,
                                              image_size=side, patch_size=PATCH),
            text_config=LlamaConfig(**text), scale_factor=2, image_token_id=IMAGE_ID)
    if family == "internvl":
        from transformers import InternVLConfig, InternVLVisionConfig, Qwen2Config

        side, _ = TILED[family]
        return InternVLConfig(
            vision_config=InternVLVisionConfig(hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=2,
                                               image_size=side, patch_size=PATCH),
            text_config=Qwen2Config(**text), downsample_ratio=0.5, image_token_id=IMAGE_ID,
            image_seq_length=TILED[family][1])
    if family == "mllama":
        from transformers import MllamaConfig

        return MllamaConfig(
            vision_config=dict(hidden_size=16, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=2, intermediate_size=32, vision_output_dim=48,
                               image_size=MLLAMA_SIDE, patch_size=PATCH,
                               max_num_tiles=MLLAMA_TILES, intermediate_layers_indices=[0, 1],
                               initializer_range=0.2),
            text_config={**text, "num_hidden_layers": 3, "cross_attention_layers": [1]},
            image_token_index=IMAGE_ID)
    raise ValueError(family)


def tiny_vlm(family: str, attn: str, config=None) -> torch.nn.Module:
    """The family's `...ForConditionalGeneration`, float32, seeded; `attn`: the language
    model's attention (the tower keeps sdpa); `config`: another than `_config(family)`."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        config or _config(family), attn_implementation={"text_config": attn,
                                                        "vision_config": "sdpa", "": attn},
        dtype=torch.float32)
    if family == "gemma3":  # its projection starts at zero, which would hide the tower
        with torch.no_grad():
            weight = model.model.multi_modal_projector.mm_input_projection_weight
            weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    if family == "mllama":  # its gates start at zero, which would hide the cross attention
        with torch.no_grad():  # and the tower's tile and position embeddings
            gen = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if name.endswith("gate") or name.endswith(("gate_attn", "gate_ffn")):
                    p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model.train()


def _image(family: str, grid: tuple[int, int, int], gen: torch.Generator
           ) -> tuple[torch.Tensor, int]:
    """Random pixels of one image and its placeholder count."""
    t, h, w = grid
    if family in SIZED:  # [1, 3, H, W] at its own size, and its [IMG]/[IMG_BREAK] layout
        row = [IMAGE_ID] * (w // MERGE) + [START_ID]
        layout = row * (h // MERGE)
        layout[-1] = END_ID
        return torch.randn(1, 3, h * PATCH, w * PATCH, generator=gen), layout
    if family in TILED:  # the image's tiles, its thumbnail last
        side, tokens = TILED[family]
        tiles = h * w // 5 + 1
        return torch.randn(tiles, 3, side, side, generator=gen), tokens * tiles
    if family in FLAT:
        side, tokens = FLAT[family]
        return torch.randn(1, 3, side, side, generator=gen), tokens
    if family in GEMMA4:  # [1, h * w, patch_dim] patches in rows, (x, y) kept by _inputs
        return torch.rand(1, h * w, 3 * PATCH * PATCH, generator=gen), h * w // GEMMA4_POOL**2
    rows = t * h * w
    frames = 1 if family in SQUARE_PATCHES else TEMPORAL  # PaddleOCR-VL: one-frame patches
    return torch.randn(rows, 3 * frames * PATCH * PATCH, generator=gen), rows // MERGE**2


# Families whose tower takes each patch as [3, PATCH, PATCH] pixels (their rows reshaped).
SQUARE_PATCHES = ("paddleocr_vl",)


# Documents: text runs (lengths) and images (grids), in order.
DOCUMENTS = (
    (15, (1, 8, 6), 7, (1, 2, 2), 4),  # shard boundaries cut an image of every family
    (24,),  # long enough that at sp 4 some rank's slice holds text only
    (3, (1, 6, 4), 6),
)
# The Qwen-VL rows also hold a video: 2 temporal patches of 4 x 4, 8 tokens, a second and a
# half per temporal patch, in a document with an image after it. Qwen3-VL writes each
# temporal patch as its own run after a timestamp (here 2 text tokens), inside the
# template's markers, as transformers' Qwen3VLProcessor expands a video.
VIDEO_DOCUMENT = (3, ("video", (2, 4, 4)), 5, (1, 2, 2), 2)
# Shorter text around it for Qwen3-VL, whose timestamps lengthen the video: the row keeps the
# others' length, so a shard boundary still cuts an image.
QWEN3_VL_VIDEO_DOCUMENT = (1, ("video", (2, 4, 4)), 1, (1, 2, 2), 1)
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", *TIMESTAMPED)
SECONDS_PER_GRID = 1.5


def image_row(family: str, seed: int = 0, specs: tuple | None = None):
    """`(input_ids, position_ids, labels, media, documents)` of one packed row (of `specs`,
    laid out as DOCUMENTS is; by default DOCUMENTS and the family's video document);
    `documents`: per document its ids, labels and media, for the reference."""
    if family == "mllama":
        return _mllama_row(seed, specs or MLLAMA_DOCUMENTS)
    gen = torch.Generator().manual_seed(seed)
    ids, pos, labels, pixels, grids, kinds, docs = [], [], [], [], [], [], []
    video = QWEN3_VL_VIDEO_DOCUMENT if family in TIMESTAMPED else VIDEO_DOCUMENT
    if specs is None:
        specs = (SIZED_DOCUMENTS if family in SIZED else GEMMA4_DOCUMENTS if family in GEMMA4
                 else DOCUMENTS + ((video,) if family in VIDEO_FAMILIES else ()))
    for spec in specs:
        d_ids, d_labels, d_pixels, d_grids, d_kinds = [], [], [], [], []
        for part in spec:
            if isinstance(part, int):
                run = torch.randint(3, IMAGE_ID - 10, (part,), generator=gen).tolist()
                d_ids += run
                d_labels += run
                continue
            kind, grid = (VIDEO, part[1]) if part[0] == "video" else (IMAGE, part)
            pix, n = _image(family, grid, gen)
            d_pixels.append(pix)
            d_grids.append(grid)
            d_kinds.append(kind)
            block = [START_ID, *[VIDEO_ID if kind == VIDEO else IMAGE_ID] * n, END_ID] \
                if isinstance(n, int) else n  # Mistral 3's tokens are its own layout
            if family in TILED:  # each tile after its marker (a text token), as processors
                per_tile = TILED[family][1]  # write <row_i_col_j> or <img>
                markers = torch.randint(3, IMAGE_ID - 10, (n // per_tile,), generator=gen)
                block = [START_ID, *(t for m in markers.tolist()
                                     for t in [m, *[IMAGE_ID] * per_tile]), END_ID]
            if kind == VIDEO and family in TIMESTAMPED:
                frame = [START_ID, *[VIDEO_ID] * (n // grid[0]), END_ID]
                stamps = torch.randint(3, IMAGE_ID - 10, (grid[0], 2), generator=gen).tolist()
                block = [START_ID, *(t for stamp in stamps for t in stamp + frame), END_ID]
            d_ids += block
            d_labels += [IGNORE_INDEX] * len(block)
        ids += d_ids
        labels += d_labels
        pos += list(range(len(d_ids)))
        pixels += d_pixels
        grids += d_grids
        kinds += d_kinds
        docs.append((torch.tensor(d_ids), torch.tensor(d_labels),
                     _inputs(d_pixels, d_grids, d_kinds, family)))
    media = _inputs(pixels, grids, kinds, family)
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(labels), media, docs)


def _mllama_row(seed: int, specs: tuple):
    """`image_row` of Mllama: each image one <|image|> token and its tiles, padded to
    MLLAMA_TILES with zeros (as its processor pads them), with their aspect ratio ids and
    masks."""
    gen = torch.Generator().manual_seed(seed)
    ids, pos, labels, tiles, docs = [], [], [], [], []
    for spec in specs:
        d_ids, d_labels, d_tiles = [], [], []
        for part in spec:
            if isinstance(part, int):
                run = torch.randint(3, IMAGE_ID - 10, (part,), generator=gen).tolist()
                d_ids, d_labels = d_ids + run, d_labels + run
                continue
            d_tiles.append(part[1])
            d_ids.append(IMAGE_ID)
            d_labels.append(IGNORE_INDEX)
        pixels = torch.zeros(len(d_tiles), MLLAMA_TILES, 3, MLLAMA_SIDE, MLLAMA_SIDE)
        for i, n in enumerate(d_tiles):
            pixels[i, :n] = torch.randn(n, 3, MLLAMA_SIDE, MLLAMA_SIDE, generator=gen)
        media = _mllama_inputs(pixels, d_tiles) if d_tiles else None
        docs.append((torch.tensor(d_ids), torch.tensor(d_labels), media))
        ids, labels, tiles = ids + d_ids, labels + d_labels, tiles + d_tiles
        pos += list(range(len(d_ids)))
    media = _mllama_inputs(torch.cat([m.pixel_values for _, _, m in docs if m is not None]),
                           tiles)
    return torch.tensor(ids), torch.tensor(pos), torch.tensor(labels), media, docs


def _mllama_inputs(pixels: torch.Tensor, tiles: list[int]) -> VisionInputs:
    mask = torch.zeros(len(tiles), MLLAMA_TILES, dtype=torch.long)
    for i, n in enumerate(tiles):
        mask[i, :n] = 1
    return VisionInputs(pixels, aspect_ratio_ids=torch.tensor([MLLAMA_RATIOS[n] for n in tiles]),
                        tile_mask=mask)


def mllama_cross_mask(ids: torch.Tensor, tile_mask: torch.Tensor) -> torch.Tensor:
    """A document's `cross_attention_mask` `[1, T, images, tiles]` by the rule its processor
    documents: from an image's token on, up to the next image token that does not follow it
    at once (else to the end), that image's own tiles."""
    at = (ids == IMAGE_ID).nonzero().flatten().tolist()
    mask = torch.zeros(1, len(ids), len(at), MLLAMA_TILES, dtype=torch.long)
    for j, start in enumerate(at):
        k = j
        while k + 1 < len(at) and at[k + 1] == at[k] + 1:  # the image tokens right after it
            k += 1
        end = at[k + 1] if k + 1 < len(at) else len(ids)
        mask[0, start:end, j] = tile_mask[j]
    return mask


def _inputs(pixels: list[torch.Tensor], grids: list, kinds: list[int],
            family: str) -> VisionInputs | None:
    if not pixels:
        return None
    if family in SIZED:  # zero-padded to the largest, as its image processor pads a batch
        height = max(p.shape[-2] for p in pixels)
        width = max(p.shape[-1] for p in pixels)
        padded = torch.cat([torch.nn.functional.pad(
            p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in pixels])
        return VisionInputs(padded, image_sizes=torch.tensor(
            [[p.shape[-2], p.shape[-1]] for p in pixels]))
    if family in FLAT or family in TILED:
        return VisionInputs(torch.cat(pixels))
    if family in GEMMA4:  # padded to the most patches, (-1, -1) the padding's (x, y)
        most = max(p.shape[1] for p in pixels)
        rows, xy = [], []
        for p, (_, h, w) in zip(pixels, grids, strict=True):
            rows.append(torch.nn.functional.pad(p, (0, 0, 0, most - p.shape[1])))
            y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            own = torch.stack([x.flatten(), y.flatten()], -1)
            xy.append(torch.cat([own, own.new_full((most - h * w, 2), -1)])[None])
        return VisionInputs(torch.cat(rows), patch_positions=torch.cat(xy))
    videos = kinds.count(VIDEO)
    return VisionInputs(torch.cat(pixels), torch.tensor(grids), tuple(kinds),
                        torch.full((videos,), SECONDS_PER_GRID) if videos else None)


def own_vlm_step(model: torch.nn.Module, docs) -> float:
    """The model's own training on the row's documents: loss, gradients left in `.grad`."""
    targets = [int((labels[1:] != IGNORE_INDEX).sum()) for _, labels, _ in docs]
    count = sum(targets)
    total = 0.0
    for (ids, labels, media), n in zip(docs, targets, strict=True):
        kwargs = {}
        if model.config.model_type == "gemma3":  # what makes its image tokens bidirectional
            kwargs["token_type_ids"] = (ids == IMAGE_ID).long()[None]
        if media is not None and media.tile_mask is not None:  # Mllama: tiles, cross-attended
            kwargs.update(pixel_values=media.pixel_values[None],
                          aspect_ratio_ids=media.aspect_ratio_ids[None],
                          aspect_ratio_mask=media.tile_mask[None],
                          cross_attention_mask=mllama_cross_mask(ids, media.tile_mask))
        elif media is not None and media.patch_positions is not None:  # Gemma 4
            kwargs.update(pixel_values=media.pixel_values,
                          image_position_ids=media.patch_positions,
                          mm_token_type_ids=(ids == IMAGE_ID).long()[None])
        elif media is not None and media.image_sizes is not None:
            kwargs.update(pixel_values=media.pixel_values, image_sizes=media.image_sizes)
        elif media is not None and media.image_grid_thw is None:
            kwargs["pixel_values"] = media.pixel_values
            if model.config.model_type == "smolvlm":  # a sample's tiles [1, tiles, C, H, W]
                kwargs["pixel_values"] = media.pixel_values[None]
        elif media is not None:
            images, videos = media.only(IMAGE), media.only(VIDEO)
            if images is not None:
                pixels = images.pixel_values
                if model.config.model_type in SQUARE_PATCHES:  # as its processor makes them
                    pixels = pixels.reshape(pixels.shape[0], 3, PATCH, PATCH)
                kwargs.update(pixel_values=pixels, image_grid_thw=images.image_grid_thw)
            if videos is not None:
                kwargs.update(pixel_values_videos=videos.pixel_values,
                              video_grid_thw=videos.image_grid_thw)
                if model.config.model_type == "qwen2_5_vl":
                    kwargs["second_per_grid_ts"] = videos.seconds_per_grid
            kwargs["mm_token_type_ids"] = ((ids == IMAGE_ID).long()
                                           + 2 * (ids == VIDEO_ID).long())[None]
        loss = model(input_ids=ids[None], labels=labels[None], **kwargs).loss * (n / count)
        loss.backward()
        total += float(loss.detach())
    return total
