"""Vision-language models under sequence parallelism: merge first, then shard.

Every rank of an SP group holds the same packed row: its token ids, its images, and the
1-D text positions that restart at each document. A VLM's forward is rebuilt from the
model's own pieces so that each rank computes only its slice:

1. **The tower split by images.** The row's images are cut into contiguous runs balanced
   by patch count, one run per rank. Each rank encodes whole images only (these encoders
   never attend across images, so this is exact; SmolVLM's and InternVL's tiles are the
   images here, each a tower input of its own), and the features are all-gathered.
   The gather's backward sums the gradients over the group, so each rank's tower
   receives the gradient of the features it produced. (Gemma 4's tower takes each image's
   own patches with their (x, y), padded to the row's most: padding is masked out.)
2. **Merge.** A rank embeds its own tokens and writes into the image-placeholder slots the
   features of exactly those image tokens. An image cut by a shard boundary gives each
   side its own tokens' features. A shard without images writes nothing. Gemma 4 embeds
   the placeholders as the pad token first, as its own forward does (its per-layer input
   embeddings read that token there).
3. **Positions.** Rotary positions come from the model's own rule, per document of the
   whole row (`get_rope_index` for 3-D mRoPE), then are sliced like the tokens. Document
   boundaries come from the text positions, never from the 3-D ones.
4. **Deepstack** (Qwen3-VL): the tower's intermediate features are gathered the same way
   and handed to the language model with this shard's visual-token mask.
5. **Both-ways images** (Gemma 3 on every layer; Gemma 4 with `use_bidirectional_attention:
   vision` on its sliding-window layers only): the row's image runs go on `sp_meta`, which
   only Ulysses computes (parallel/attention.py).

6. **Cross-attended images** (Mllama): nothing is merged. The gathered tower states are the
   keys of the text model's cross-attention layers on every rank, with each document's
   processor mask rows of the rank's own tokens (`cross_attention_rows`);
   parallel/cross_attention.py computes those layers locally.

The language model then runs with the SP attention on `sp_meta`, as a text model does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longctx_cli.config.sections.vision import refuse_unless_rebuilt
from longctx_cli.data.vision.documents import IMAGE, VIDEO
from longctx_cli.errors import UserError
from longctx_cli.families import (
    VISION_MODULE_NAMES,
    VisionFamily,
    image_attention,
    vision_family,
)
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import (
    ShardedBatch,
    SPMeta,
    padded_row,
    shard_batch,
    slice_sequence,
)
from longctx_cli.runtime.cache_kwargs import cache_kwargs


@dataclass
class VisionInputs:
    """The images and videos of one packed row, in row order (the same on every rank).

    `pixel_values`: the processor's output for the row's media, concatenated. For the
    Qwen-VL families it is `[patches, patch_dim]` with `image_grid_thw` `[items, 3]` giving
    each item's patch grid (a video's frames on its first axis) and `kinds` each item's kind
    (IMAGE or VIDEO; None: all images), `seconds_per_grid` each video's time per temporal
    patch; for fixed-size towers (LLaVA) `[images, C, H, W]`; for towers of any image size
    (Pixtral) `[images, C, H, W]` zero-padded to the largest, with `image_sizes` `[images, 2]`
    each image's own (height, width) in pixels; for towers of positioned patches (Gemma 4)
    `[images, patches, patch_dim]` padded to the most, with `patch_positions`
    `[images, patches, 2]` each patch's (x, y), (-1, -1) on padding; for tiled towers whose
    states are cross-attended (Mllama) `[images, tiles, C, H, W]` padded to the processor's
    tile count, with `aspect_ratio_ids` `[images]` and `tile_mask` `[images, tiles]` (its
    `aspect_ratio_mask`: 1 on each image's own tiles).
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None = None
    kinds: tuple[int, ...] | None = None
    seconds_per_grid: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None
    patch_positions: torch.Tensor | None = None
    aspect_ratio_ids: torch.Tensor | None = None
    tile_mask: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        """Items (images and videos)."""
        if self.image_grid_thw is not None:
            return int(self.image_grid_thw.shape[0])
        return int(self.pixel_values.shape[0])

    def kind_of(self) -> tuple[int, ...]:
        return self.kinds if self.kinds is not None else (IMAGE,) * self.num_images

    def patches_per_image(self) -> list[int]:
        """Each item's rows of `pixel_values` (the tower's work for it); an image of its own
        size: its pixels (its patches times the square of the patch side)."""
        if self.image_grid_thw is not None:
            return [int(n) for n in self.image_grid_thw.prod(-1).tolist()]
        if self.image_sizes is not None:
            return [int(n) for n in self.image_sizes.prod(-1).tolist()]
        if self.patch_positions is not None:  # its patches that are not padding
            return [int(n) for n in (self.patch_positions[..., 0] >= 0).sum(-1).tolist()]
        return [1] * self.num_images

    def to(self, device: torch.device) -> VisionInputs:
        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return VisionInputs(self.pixel_values.to(device), moved(self.image_grid_thw),
                            self.kinds, moved(self.seconds_per_grid), moved(self.image_sizes),
                            moved(self.patch_positions), moved(self.aspect_ratio_ids),
                            moved(self.tile_mask))

    def subset(self, first: int, last: int) -> VisionInputs:
        """Items `[first, last)` only."""
        if self.image_sizes is not None:  # cropped to these images' largest: the padding
            sizes = self.image_sizes[first:last]  # beyond it is zeros no patch reads
            height, width = (int(x) for x in sizes.amax(0).tolist()) if len(sizes) else (0, 0)
            return VisionInputs(self.pixel_values[first:last, :, :height, :width],
                                image_sizes=sizes)
        if self.patch_positions is not None:  # the row's padded patch count kept: the
            return VisionInputs(self.pixel_values[first:last],  # pooler's slots depend on it
                                patch_positions=self.patch_positions[first:last])
        if self.tile_mask is not None:  # Mllama: each image's tiles with their layout
            return VisionInputs(self.pixel_values[first:last],
                                aspect_ratio_ids=self.aspect_ratio_ids[first:last],
                                tile_mask=self.tile_mask[first:last])
        if self.image_grid_thw is None:
            return VisionInputs(self.pixel_values[first:last])
        counts, kinds = self.patches_per_image(), self.kind_of()
        start, end = sum(counts[:first]), sum(counts[:last])
        seconds = None
        if self.seconds_per_grid is not None:
            before = sum(k == VIDEO for k in kinds[:first])
            seconds = self.seconds_per_grid[before:before + sum(
                k == VIDEO for k in kinds[first:last])]
        return VisionInputs(self.pixel_values[start:end], self.image_grid_thw[first:last],
                            kinds[first:last] if self.kinds is not None else None, seconds)

    def only(self, kind: int) -> VisionInputs | None:
        """The items of one kind, in order (None if there are none)."""
        kinds = self.kind_of()
        wanted = [i for i, k in enumerate(kinds) if k == kind]
        if not wanted:
            return None
        counts = self.patches_per_image()
        starts = [0, *itertools.accumulate(counts)]
        pixels = torch.cat([self.pixel_values[starts[i]:starts[i] + counts[i]] for i in wanted])
        return VisionInputs(pixels, self.image_grid_thw[wanted], (kind,) * len(wanted),
                            self.seconds_per_grid if kind == VIDEO else None)


@dataclass
class WholeRow:
    """The whole padded row a rank needs beside its slice: token ids, 1-D text positions
    (restarting at each document) and the row's images."""

    input_ids: torch.Tensor
    text_positions: torch.Tensor
    images: VisionInputs | None


def with_vision(batch: ShardedBatch, input_ids: torch.Tensor, position_ids: torch.Tensor,
                images: VisionInputs | None, pad_token_id: int = 0) -> ShardedBatch:
    """`batch` (this rank's slice of the row) carrying the whole row's vision part, padded
    as `shard_batch` padded the slice."""
    ids, text = input_ids.reshape(-1), position_ids.reshape(-1)
    ids, text = padded_row(ids, text, batch.sp_meta.total_len - ids.numel(), pad_token_id)
    return replace(batch, vision=WholeRow(ids, text, images))


def rebuilt_family(model: nn.Module) -> VisionFamily:
    """The record of a VLM this module can train exactly, or a user error."""
    refuse_unless_rebuilt(model.config)
    return vision_family(str(model.config.model_type))


def image_runs(types: torch.Tensor, cu_host: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Global `[start, end)` of each run of consecutive image tokens of a row, cut at
    document bounds: the blocks whose tokens Gemma 3 lets see each other both ways (its own
    mask groups maximal runs of image tokens the same way)."""
    image = types == IMAGE
    first = torch.zeros_like(image)  # a document's first token continues no run
    first[list(cu_host[:-1])] = True
    last = torch.zeros_like(image)
    last[[b - 1 for b in cu_host[1:]]] = True
    before = torch.cat([image.new_zeros(1), image[:-1]]) & ~first
    after = torch.cat([image[1:], image.new_zeros(1)]) & ~last
    starts = (image & ~before).nonzero().flatten().tolist()
    ends = (image & ~after).nonzero().flatten().add(1).tolist()
    return tuple(zip(starts, ends, strict=True))


def cross_attention_rows(input_ids: torch.Tensor, cu_host: tuple[int, ...],
                         tile_mask: torch.Tensor, image_token_id: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mllama's cross-attention mask of a whole row, as its own forward of each document
    alone computes it: `(allowed [T, images, tiles], seen [T], keep [T])`, bool.

    Per document, the mask its processor writes (transformers' own
    `get_cross_attention_token_mask` and `convert_sparse_cross_attention_mask_to_dense`: from
    an image's `<|image|>` token on, the image's own tiles), over the document's own images.
    `seen`: the token attends to some tile (the model's `full_text_row_masked_out_mask`). A
    token that sees none attends to every tile of its document's images, padding tiles too,
    as the model's mask, zeroed on such rows, lets it. `keep`: the document has images (the
    model's forward of a document without any skips its cross-attention layers).
    """
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    images, tiles = tile_mask.shape
    total = input_ids.numel()
    allowed = torch.zeros(total, images, tiles, dtype=torch.bool)
    keep = torch.zeros(total, dtype=torch.bool)
    seen = torch.zeros(total, dtype=torch.bool)
    ids = input_ids.tolist()
    first = 0
    for start, end in itertools.pairwise(cu_host):
        doc = ids[start:end]
        count = doc.count(image_token_id)
        if not count:
            continue
        if first + count > images:
            raise UserError(
                f"the row's documents hold more <|image|> tokens than its {images} images.",
                where="datasets", fix="prepare the data again with this model's processor "
                "(one <|image|> token per image).")
        own = tile_mask[first:first + count].sum(-1).tolist()
        dense = convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(doc, image_token_id)], [own], tiles, len(doc))
        rows = torch.from_numpy(dense[0]).bool()
        blind = ~rows.flatten(1).any(-1)
        seen[start:end] = ~blind
        rows[blind] = True  # the model's zeroed mask: every tile of the document's images
        allowed[start:end, first:first + count] = rows
        keep[start:end] = True
        first += count
    if first != images:
        raise UserError(
            f"the row holds {images} images but {first} <|image|> tokens.", where="datasets",
            fix="prepare the data again with this model's processor (one <|image|> token per "
            "image).")
    allowed[~keep] = True  # no softmax over nothing: their output is zeroed (`keep`)
    device = input_ids.device
    return allowed.to(device), seen.to(device), keep.to(device)


def _items_of_runs(grids: torch.Tensor, runs: int) -> int:
    """How many of these videos (grids `[t, h, w]`, in order) `runs` frame runs make up:
    a Qwen3-VL video is one run per temporal patch."""
    frames = itertools.accumulate(int(t) for t in grids[:, 0].tolist())
    for count, total in enumerate(frames, start=1):
        if total == runs:
            return count
    raise UserError(
        f"a document holds {runs} video frame runs that do not make up whole videos: Qwen3-VL "
        "writes one run per temporal patch, each after its timestamp, and these rows were "
        "prepared by a processor that does not.", where="processor_path",
        fix="point `processor_path` (or `base_model`) at the model's own processor folder "
        "(its processor_class is Qwen3VLProcessor) and prepare the data again.")


def split_images(patches: list[int], parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous runs of images `[first, last)` with balanced patch counts.

    Runs are contiguous so the gathered features come back in row order; a run may be
    empty when there are fewer images than ranks.
    """
    total = sum(patches)
    bounds, acc, image = [0], 0, 0
    for part in range(1, parts):
        target = total * part / parts
        # Take images while the run's end stays nearer the target than stopping would.
        while image < len(patches) and acc + patches[image] / 2 <= target:
            acc += patches[image]
            image += 1
        bounds.append(image)
    bounds.append(len(patches))
    return list(itertools.pairwise(bounds))


def patch_width(vision: Any) -> int:
    """Pixel values per patch of a patch tower's config: channels x frames x side^2 (a
    SigLIP-style tower, PaddleOCR-VL's, names its channels `num_channels` and takes one
    frame)."""
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    return int(channels * getattr(vision, "temporal_patch_size", 1) * vision.patch_size**2)


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """The tower and projector of a VLM (what `freeze_mm_modules` freezes); [] for text."""
    inner = getattr(model, "model", None)
    return [getattr(inner, n) for n in VISION_MODULE_NAMES
            if isinstance(getattr(inner, n, None), nn.Module)]


class _GatherFeatures(torch.autograd.Function):
    """All-gather rows of different counts over a group; backward sums the gradients over
    the group and returns this rank's rows (each rank's tower gets the gradient of every
    shard's use of its features)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group: Any):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start:start + ctx.counts[ctx.rank]], None, None, None


def gather_features(local: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Every rank's features in rank order (differentiable); `local` alone at sp 1."""
    if state.layout.sp == 1:
        return local
    # On the features' device: an NCCL group takes no host tensors.
    counts = [torch.zeros(1, dtype=torch.long, device=local.device)
              for _ in range(state.layout.sp)]
    dist.all_gather(counts, torch.tensor([local.shape[0]], device=local.device),
                    group=state.sp_group)
    return _GatherFeatures.apply(local, [int(c) for c in counts], state.sp_rank, state.sp_group)


class VisionLanguageForward:
    """The forward of one VLM family, rebuilt from the model's own pieces (see module doc).

    `model` is the `...ForConditionalGeneration` (unwrapped from peft); the methods read
    its `model.visual` / `model.vision_tower` (SmolVLM's `vision_model`),
    `get_image_features`, `get_rope_index` and `language_model` (SmolVLM's `text_model`), so
    the model's own code computes every piece.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.family = rebuilt_family(model)
        self.inner = model.model  # the ...Model holding the tower and the language model
        config = model.config
        self.image_token_id = int(config.image_token_id)
        # What decoding adds to a new token's text position (set by each prefill).
        self.decode_offset = 0
        self.video_token_id = getattr(config, "video_token_id", None)

    @property
    def language_model(self) -> nn.Module:
        return getattr(self.inner, self.family.language)

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`mm_token_type_ids` of a row: 1 on image placeholders, 2 on video ones."""
        types = (input_ids == self.image_token_id).long() * IMAGE
        if self.video_token_id is not None:
            types += (input_ids == self.video_token_id).long() * VIDEO
        return types

    def encode(self, media: VisionInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Features `[tokens, hidden]` of `media` in row order, and the deepstack levels."""
        if self.family.pixels == "sized":  # Pixtral: each image at its own size
            return self._encode_sized(media), []
        if self.family.pixels == "tiled":  # Mllama: each image's tiles, cross-attended
            out = self.inner.vision_model(
                pixel_values=media.pixel_values[None],
                aspect_ratio_ids=media.aspect_ratio_ids[None],
                aspect_ratio_mask=media.tile_mask[None]).last_hidden_state
            states = self.inner.multi_modal_projector(out)  # [1, images, tiles, patches, h]
            return states.reshape(media.num_images, -1, states.shape[-1]), []
        if self.family.pixels == "positioned":  # Gemma 4: patches with their (x, y)
            out = self.inner.get_image_features(media.pixel_values, media.patch_positions,
                                                return_dict=True)
            return torch.cat(out.pooler_output), []
        if self.family.pixels == "images":
            config = self.model.config
            # LLaVA picks a tower layer and drops its class token; Gemma 3 pools the last.
            choice = {key: getattr(config, key) for key in ("vision_feature_layer",
                      "vision_feature_select_strategy") if hasattr(config, key)}
            pixels = media.pixel_values
            if self.family.tiles_as_sample:  # SmolVLM: the tiles as one sample's images
                pixels = pixels[None]
            # A tiled family's image is several rows here (its tiles, then its thumbnail),
            # each encoded on its own: their towers never attend across tiles.
            out = self.inner.get_image_features(pixel_values=pixels, **choice,
                                                return_dict=True)
            return torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output]), []
        # One tower call for the rank's images and videos together, in row order: these
        # families' get_video_features is the same tower call on the videos' patches (a
        # video's frames are its grid's first axis), and under FSDP2 every rank must call
        # the tower the same number of times.
        pixels = media.pixel_values
        if self.family.square_patches:  # each row is one patch's [channels, side, side]
            side = int(self.model.config.vision_config.patch_size)
            pixels = pixels.reshape(pixels.shape[0], -1, side, side)
        out = self.inner.get_image_features(pixels, media.image_grid_thw, return_dict=True)
        deep = [torch.cat(level) for level in (getattr(out, "deepstack_features", None) or [])]
        return torch.cat(out.pooler_output), deep

    def _encode_sized(self, media: VisionInputs) -> torch.Tensor:
        """Features of images at their own sizes (Mistral 3's Pixtral tower and patch merger).

        transformers' `get_image_features` squeezes the batch axis off the merged features,
        which for a call of one token in all also drops the token axis; a rank whose run of
        images makes one token (a small image alone) encodes a blank image beside it and
        keeps its own token (the tower never attends across images, so this is exact).
        """
        side = self.model.config.vision_config.patch_size * int(
            self.model.config.spatial_merge_size)
        tokens = int((media.image_sizes // side).prod(-1).sum())
        pixels, sizes = media.pixel_values, media.image_sizes
        if tokens == 1:
            pixels = torch.cat([pixels, torch.zeros_like(pixels[:1])])
            sizes = torch.cat([sizes, sizes[:1]])
        out = self.inner.get_image_features(pixel_values=pixels, image_sizes=sizes,
                                            return_dict=True)
        return torch.cat(out.pooler_output)[:tokens]

    def positions(self, input_ids: torch.Tensor, types: torch.Tensor,
                  text_positions: torch.Tensor, media: VisionInputs | None,
                  cu_host: tuple[int, ...]) -> torch.Tensor:
        """Rotary positions of a full padded row (`types`: its `token_types`): `[3, T]` for
        mRoPE families, computed per document by the model's `get_rope_index`; `[1, T]` (the
        text positions) otherwise."""
        if self.family.positions != "mrope":
            return text_positions[None]
        images = media.only(IMAGE) if media is not None else None
        videos = media.only(VIDEO) if media is not None else None
        seen = {IMAGE: 0, VIDEO: 0}
        parts = []
        for start, end in itertools.pairwise(cu_host):
            doc_types = types[start:end]
            # Each item is one run of placeholders (the processor brackets it), except a
            # Qwen3-VL video: one run per temporal patch, each after its timestamp.
            runs = [kind for kind, _ in itertools.groupby(doc_types.tolist()) if kind]
            kwargs: dict[str, Any] = {}
            for kind, items, key in ((IMAGE, images, "image_grid_thw"),
                                     (VIDEO, videos, "video_grid_thw")):
                count = runs.count(kind)
                if count and items is None:
                    raise UserError(
                        f"a document holds {'video' if kind == VIDEO else 'image'} tokens but "
                        "the row has no such media.", where="datasets",
                        fix="keep each record's images and videos with it, and keep vision "
                        "tokens such as <|video_pad|> out of text records.")
                if count and kind == VIDEO and self.family.timestamped_video:
                    count = _items_of_runs(items.image_grid_thw[seen[kind]:], count)
                if count:
                    first = seen[kind]
                    kwargs[key] = items.image_grid_thw[first:first + count]
                    if kind == VIDEO and items.seconds_per_grid is not None:
                        kwargs["second_per_grid_ts"] = items.seconds_per_grid[
                            first:first + count]
                    seen[kind] += count
            pos, _ = self.inner.get_rope_index(
                input_ids[None, start:end], mm_token_type_ids=doc_types[None], **kwargs)
            parts.append(pos[:, 0])
        return torch.cat(parts, dim=1)

    def shard(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
              images: VisionInputs | None, state: ParallelState, pad_token_id: int = 0
              ) -> ShardedBatch:
        """This rank's slice of a packed row, carrying the whole row's vision part."""
        batch = shard_batch(input_ids, position_ids, labels, state, pad_token_id)
        return with_vision(batch, input_ids, position_ids, images, pad_token_id)

    @property
    def config(self) -> Any:
        """The language model's config (what a KV cache is built from)."""
        return self.language_model.config

    def hidden_states(self, batch: ShardedBatch, cache: Any = None) -> torch.Tensor:
        """Hidden states `[local_tokens, hidden]` of this rank's slice of the row (`batch`);
        `cache` keeps this rank's keys and values (a prefill for decoding).

        A batch without a vision part (a text-only row) runs on its own slice alone.
        """
        if self.family.images_attend == "cross" and (cache is None or (
                batch.vision is not None and batch.vision.images is not None)):
            return self._cross_attended(batch, cache)
        if batch.vision is None:
            return self._text_only(batch, cache)
        row = batch.vision
        device = batch.input_ids.device
        full_ids, images = row.input_ids.to(device), row.images
        types = self.token_types(full_ids)
        n_tokens = int((types != 0).sum())
        self._refuse_videos(images)
        if n_tokens and (images is None or not images.num_images):
            raise UserError(
                f"the row holds {n_tokens} image or video tokens but no media.",
                where="datasets",
                fix="keep each record's images with it (the `images` column or image parts), "
                "and keep vision tokens such as <|image_pad|> out of text records.")
        full_positions = self.positions(full_ids, types, row.text_positions.to(device), images,
                                        batch.sp_meta.cu_host)
        # What decoding after this row (one prompt, then padding) adds to a token's text
        # position: mRoPE's next position is the prompt's largest plus one, as in the
        # model's own `generate` (its rope deltas).
        end = batch.sp_meta.cu_host[1]
        self.decode_offset = int(full_positions[:, :end].max()) + 1 - end
        meta = batch.sp_meta
        attend = image_attention(self.model.config)
        if attend in ("both_ways", "sliding_both_ways"):
            # The row's image runs, read from its whole ids: only this class knows them.
            meta.bidirectional = image_runs(types, meta.cu_host)
            meta.bidirectional_sliding_only = attend == "sliding_both_ways"
        state = meta.ctx
        local_ids = batch.input_ids.reshape(-1)
        local_index = slice_sequence(torch.arange(full_ids.numel(), device=device), state)
        visual = types[local_index] != 0
        merged, kwargs, zero = None, {}, None
        if not n_tokens:  # before the language model: every rank calls the tower first
            zero = self._tower_zero(device)
        if images is not None and images.num_images:
            images = images.to(device)
            features, deep = self._encode_split(images, state)
            if features.shape[0] != n_tokens:
                raise UserError(
                    f"the row holds {n_tokens} image and video tokens, but its media give "
                    f"{features.shape[0]} features.",
                    where="datasets",
                    fix="prepare the data again with this model's processor (each image's "
                    "placeholder count must match its features).")
            ordinal = torch.cumsum(types != 0, 0) - 1  # media-token index of each token
            wanted = ordinal[local_index][visual]
            merged = features[wanted]
            if deep:
                kwargs.update(visual_pos_masks=visual[None],
                              deepstack_visual_embeds=[level[wanted].to(merged.dtype)
                                                       for level in deep])
        local_positions = slice_sequence(full_positions, state, dim=1)[:, None, :]
        hidden = self._language_model(local_ids, local_positions, meta, kwargs, visual, merged,
                                      cache)
        return hidden if zero is None else hidden + zero

    def _cross_attended(self, batch: ShardedBatch, cache: Any = None) -> torch.Tensor:
        """Mllama: this rank's tokens through the text model, whose cross-attention layers
        attend from them to the tower states of the whole row's images (all-gathered after
        the tower ran on each rank's run of images), with the mask rows of this rank's
        tokens (`cross_attention_rows`). A row without images runs those layers on a blank
        image with every token's output zeroed (its own forward skips them; every rank
        still calls them, as FSDP2 gathers their weights collectively)."""
        if cache is not None:
            raise UserError(
                f"decoding after images with {self.family.name}: its cross-attention layers' "
                "image keys are not kept in longctx's KV cache.", where="datasets",
                fix="evaluate or generate on text prompts, or with transformers' own `generate`.")
        meta, device = batch.sp_meta, batch.input_ids.device
        self.decode_offset = 0
        row = batch.vision
        images = row.images if row is not None else None
        full_ids = row.input_ids.to(device) if row is not None else batch.input_ids.reshape(-1)
        n_tokens = int((full_ids == self.image_token_id).sum())
        if images is None or not images.num_images:
            if n_tokens and row is not None:
                raise UserError(
                    f"the row holds {n_tokens} image tokens but no images.", where="datasets",
                    fix="keep each record's images with it, and keep <|image|> out of text "
                    "records.")
            states, _ = self.encode(self._blank(device))
            local = meta.local_len
            allowed = torch.ones(local, 1, self._tiles(), dtype=torch.bool,
                                 device=device)  # output zeroed: any key will do
            seen = keep = torch.zeros(local, dtype=torch.bool, device=device)
        else:
            images = images.to(device)
            states, _ = self._encode_split(images, meta.ctx)
            full = cross_attention_rows(full_ids, meta.cu_host, images.tile_mask,
                                        self.image_token_id)
            index = slice_sequence(torch.arange(full_ids.numel(), device=device), meta.ctx)
            allowed, seen, keep = (t[index] for t in full)
        patches = states.shape[1] // allowed.shape[-1]  # per tile, its class token too
        mask = allowed.repeat_interleave(patches, dim=-1).reshape(1, 1, allowed.shape[0], -1)
        dtype = self.language_model.get_input_embeddings().weight.dtype
        meta.cross_rows = keep.to(dtype)  # kept: checkpointed layers recompute in backward
        hidden = self.language_model(
            input_ids=batch.input_ids.reshape(1, -1), position_ids=batch.position_ids,
            sp_meta=meta, cross_attention_states=states, cross_attention_mask=mask,
            full_text_row_masked_out_mask=seen.to(dtype)[None, None, :, None],
            use_cache=False).last_hidden_state
        if not meta.went_through_sp:
            raise UserError(
                "the language model's attention layers did not call the sequence-parallel "
                "attention, so each rank would attend only to its own slice.",
                where="base_model", fix="use a VLM whose language model dispatches through "
                "transformers' AttentionInterface.")
        return hidden.reshape(-1, hidden.shape[-1])

    def _tiles(self) -> int:
        """Tiles per image of a tiled tower's input (Mllama's `max_num_tiles`)."""
        return int(self.model.config.vision_config.max_num_tiles)

    def _refuse_videos(self, media: VisionInputs | None) -> None:
        """A video in a row of a family whose videos longctx does not train: the reason."""
        why = self.family.video_refusal
        if why and media is not None and VIDEO in media.kind_of():
            raise UserError(
                f"the row holds a video, which longctx does not train for "
                f"{self.family.name}: {why}.", where="datasets",
                fix="drop the records with videos, or give a video's frames as images.")

    def _text_only(self, batch: ShardedBatch, cache: Any = None) -> torch.Tensor:
        """A row without images: mRoPE's three axes all take the text positions."""
        positions = batch.position_ids.reshape(1, 1, -1)
        if self.family.positions == "mrope":
            positions = positions.expand(3, 1, -1)
        zero = self._tower_zero(batch.input_ids.device)  # the tower first, as on every rank
        self.decode_offset = 0
        return self._language_model(batch.input_ids.reshape(-1), positions, batch.sp_meta, {},
                                    cache=cache) + zero

    def _language_model(self, local_ids: torch.Tensor, positions: torch.Tensor,
                        meta: SPMeta, kwargs: dict[str, Any],
                        visual: torch.Tensor | None = None,
                        features: torch.Tensor | None = None, cache: Any = None
                        ) -> torch.Tensor:
        """The language model on this rank's tokens, with `features` written into the
        embeddings of its `visual` tokens. The merge happens in a hook on the embedding, so
        that it runs inside the language model's forward: under FSDP2 the embedding's weight
        is gathered there."""
        if self.family.positions != "mrope":
            positions = positions[0]
        embedding = self.language_model.get_input_embeddings()
        hook = None
        if features is not None:
            if self.family.placeholders_as_pad:  # as the model's own forward embeds them
                local_ids = torch.where(visual, int(self.config.pad_token_id), local_ids)
            elif self.image_token_id >= embedding.num_embeddings:  # a placeholder past the
                local_ids = torch.where(visual, 0, local_ids)  # vocabulary (as the model does)
            mask = visual[None, :, None]
            hook = embedding.register_forward_hook(
                lambda module, args, out: out.masked_scatter(mask, features.to(out.dtype)))
        try:
            hidden = self.language_model(
                input_ids=local_ids[None], position_ids=positions, sp_meta=meta,
                **cache_kwargs(self.language_model, cache), **kwargs,
            ).last_hidden_state
        finally:
            if hook is not None:
                hook.remove()
        if not meta.went_through_sp:
            raise UserError(
                "the language model's attention layers did not call the sequence-parallel "
                "attention, so each rank would attend only to its own slice.",
                where="base_model", fix="use a VLM whose language model dispatches through "
                "transformers' AttentionInterface.")
        return hidden.reshape(-1, hidden.shape[-1])

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, sp_meta: Any,
                cache: Any = None, use_cache: bool = True) -> Any:
        """One decode step after a prefill by `hidden_states`: new text tokens `[n, 1]` at
        text positions `position_ids`, which mRoPE shifts by the prompt's offset on all
        three axes (the model's own rule for text after its vision tokens)."""
        positions = position_ids + self.decode_offset
        if self.family.positions == "mrope":
            positions = positions[None].expand(3, -1, -1)
        return self.language_model(input_ids=input_ids, position_ids=positions, sp_meta=sp_meta,
                                   **cache_kwargs(self.language_model, cache))

    __call__ = forward

    def _blank(self, device: torch.device) -> VisionInputs:
        """The smallest input the tower takes: one merged patch of zeros (one blank image
        for fixed-size towers)."""
        vision = self.model.config.vision_config
        if self.family.pixels == "positioned":  # one pooled token: k x k patches at (x, y)
            side = int(vision.pooling_kernel_size)
            grid = torch.arange(side, device=device)
            xy = torch.stack(torch.meshgrid(grid, grid, indexing="xy"), -1).reshape(1, -1, 2)
            return VisionInputs(torch.zeros(1, side * side, patch_width(vision), device=device),
                                patch_positions=xy)
        if self.family.pixels == "patches":
            merge = vision.spatial_merge_size
            width = patch_width(vision)
            return VisionInputs(torch.zeros(merge * merge, width, device=device),
                                torch.tensor([[1, merge, merge]], device=device))
        dtype = next(getattr(self.inner, self.family.modules[0]).parameters()).dtype
        if self.family.pixels == "tiled":  # one image of one tile (aspect ratio 1 x 1)
            side, tiles = int(vision.image_size), self._tiles()
            mask = torch.zeros(1, tiles, dtype=torch.long, device=device)
            mask[:, 0] = 1
            return VisionInputs(torch.zeros(1, tiles, 3, side, side, device=device, dtype=dtype),
                                aspect_ratio_ids=torch.ones(1, dtype=torch.long, device=device),
                                tile_mask=mask)
        if self.family.pixels == "sized":  # one merged token: merge x merge patches
            side = vision.patch_size * int(self.model.config.spatial_merge_size)
            return VisionInputs(torch.zeros(1, 3, side, side, device=device, dtype=dtype),
                                image_sizes=torch.tensor([[side, side]], device=device))
        side = vision.image_size  # InternVL's is (height, width)
        height, width = (side, side) if isinstance(side, int) else side
        return VisionInputs(torch.zeros(1, 3, height, width, device=device, dtype=dtype))

    def _tower_zero(self, device: torch.device) -> torch.Tensor:
        """A zero that depends on every tower weight, from a blank input. Every rank calls
        the tower once per forward, media or not: FSDP2 gathers its weights collectively
        over ranks, and gradients summed over data-parallel ranks must exist on each."""
        features, deep = self.encode(self._blank(device))
        return sum((d.sum() for d in deep), features.sum()) * 0

    def _encode_split(self, images: VisionInputs, state: ParallelState
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Encode this rank's run of images and gather every rank's features in order."""
        first, last = split_images(images.patches_per_image(), state.layout.sp)[state.sp_rank]
        if first == last:  # no item of this row is this rank's: the tower runs on nothing
            features, deep = self.encode(self._blank(images.pixel_values.device))
            zero = sum((d.sum() for d in deep), features.sum()) * 0
            features, deep = features[:0] + zero, [d[:0] + zero for d in deep]
        else:
            features, deep = self.encode(images.subset(first, last))
        if not deep:
            return gather_features(features, state), []
        width = features.shape[-1]
        joined = gather_features(torch.cat([features, *deep], dim=-1), state)
        levels = joined.split(width, dim=-1)
        return levels[0], list(levels[1:])
