"""A vision run with `tokenizer_use_mistral_common: true`: each record's tokens and pixels are
mistral-common's own (`encode_chat_completion` with image chunks), as Axolotl's
Mistral3Processor gets them.

mistral-common's ImageEncoder resizes each image to multiples of a merged patch
(`image_patch_size * spatial_merge_size`, longest edge at most `max_image_size`), normalises
it, and lays its tokens out as rows of [IMG] broken by [IMG_BREAK], ended by [IMG_END]: the
layout Mistral 3's own forward reads (`image_sizes` from each array's shape). A document
stores each image as Pixtral's do (H*W rows of its C channels, grid `(0, H, W)`), so the
trainer reads them back as `pixel_values` and `image_sizes`, and trains through the same
mistral3 path. Targets are located on ids by `mistral_tokenizer.chat_ids` (the text path's
mistral-common rule).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import formats
from longctx_cli.data.mistral_tokenizer import chat_ids
from longctx_cli.data.vision.documents import IMAGE, TEXT, VisionDocument
from longctx_cli.data.vision.processor import VisionProcessor
from longctx_cli.data.vision.records import collect_media, record_messages
from longctx_cli.errors import UserError


@dataclass
class MistralCommonVision(VisionProcessor):
    """A mistral-common tokenizer (transformers' MistralCommonBackend) in the processor's
    place: `processor` is that tokenizer, its image encoder the image processor."""

    @property
    def tokenizer(self) -> Any:
        return self.processor

    @property
    def image_processor(self) -> Any:
        """mistral-common's ImageEncoder (its `image_config` and `special_ids`)."""
        return self.processor.tokenizer.instruct_tokenizer.image_encoder

    @property
    def image_token(self) -> str:
        return "[IMG]"

    @property
    def video_token(self) -> str | None:
        return None

    @property
    def feature_tokens(self) -> dict[int, str]:
        return {IMAGE: "[IMG]"}

    def feature_ids(self) -> dict[int, int]:
        return {IMAGE: int(self.image_processor.special_ids.img)}

    @property
    def patched(self) -> bool:
        return False

    @property
    def sized(self) -> bool:
        return True  # each image keeps its own size (a multiple of a merged patch)

    @property
    def image_kwargs(self) -> dict[str, Any]:
        return {}

    @property
    def marker_tokens(self) -> tuple[str, ...]:
        return ("[IMG]", "[IMG_BREAK]", "[IMG_END]")

    @property
    def image_shape(self) -> tuple[int, ...]:
        return (3,)  # RGB channels: one row of pixel_values per pixel

    @property
    def chat_template(self) -> str:
        return ""  # mistral-common encodes the chat itself

    def marker_ids(self) -> set[int]:
        ids = self.image_processor.special_ids
        return {int(ids.img), int(ids.img_break), int(ids.img_end)}

    def fingerprint(self) -> dict[str, Any]:
        """What decides the documents besides the tokenizer: the image config."""
        config = self.image_processor.image_config
        return {"class": "mistral-common", "image_patch_size": config.image_patch_size,
                "max_image_size": config.max_image_size,
                "spatial_merge_size": config.spatial_merge_size}


def mistral_common_vision(tok: Any, image_size: Any, resample: int, source: str
                          ) -> MistralCommonVision:
    """The run's mistral-common tokenizer as its processor; one whose file has no image
    config (`"image"` in tekken.json) cannot encode images, and says so."""
    encoder = getattr(tok.tokenizer.instruct_tokenizer, "image_encoder", None)
    if encoder is None:
        raise UserError(
            f"the mistral-common tokenizer of {source!r} has no image config, so it cannot "
            "encode images.", where="tokenizer",
            fix="point `tokenizer` at the vision model's tokenizer file (its tekken.json has "
            "an `image` section), or drop `tokenizer_use_mistral_common`.")
    return MistralCommonVision(tok, image_size, resample)


def check_model_agrees(tok: Any, model_config: Any) -> None:
    """mistral-common's image tokens and patch size (of the run's tokenizer `tok`) must be the
    model's: its [IMG] id is the model's `image_token_index`, its patch and merge sizes the
    tower's and the projector's; otherwise features would fill other tokens or patches."""
    kind = getattr(model_config, "model_type", None)
    if kind != "mistral3":  # the one family whose rows carry images of their own sizes here
        raise UserError(
            f"`tokenizer_use_mistral_common: true` with images trains Mistral 3 models "
            f"(model type `mistral3`) only, and this model is `{kind}`: longctx feeds "
            "mistral-common's images (each at its own size, with `image_sizes`) to Mistral 3's "
            "forward alone.", where="tokenizer_use_mistral_common",
            fix="drop `tokenizer_use_mistral_common` to read the records with the model's "
            "processor.")
    encoder = tok.tokenizer.instruct_tokenizer.image_encoder
    ids, image = encoder.special_ids, encoder.image_config
    vision = getattr(model_config, "vision_config", None)
    pairs = (("[IMG] id", int(ids.img), getattr(model_config, "image_token_id",
                                                  getattr(model_config, "image_token_index",
                                                          None))),
             ("image_patch_size", image.image_patch_size, getattr(vision, "patch_size", None)),
             ("spatial_merge_size", image.spatial_merge_size,
              getattr(model_config, "spatial_merge_size", None)))
    for name, mine, model in pairs:
        if model is not None and int(model) != int(mine):
            raise UserError(
                f"mistral-common's {name} is {mine} but the model's is {model}: the image "
                "features would not match the tokens mistral-common lays out for them.",
                where="tokenizer",
                fix="use the tokenizer file of the same model (its tekken.json), or drop "
                "`tokenizer_use_mistral_common`.")


@dataclass
class _Message:
    """A turn as mistral-common takes it, with the turn's training flag."""

    train: bool
    content: dict[str, Any]

    def message(self) -> dict[str, Any]:
        return self.content


def _png(image: Any) -> str:
    """An image as a base64 PNG (lossless: mistral-common decodes the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def encode_mistral_record(record: dict[str, Any], vp: MistralCommonVision, where: str, *,
                          base_dir: Path, spec: formats.FormatSpec) -> VisionDocument:
    """One record's document from mistral-common's `encode_chat_completion`: its ids, its
    images (pixels and sizes), and targets on the trained turns' tokens (never an image's)."""
    turns = record_messages(record, spec, where)
    if any(p["type"] == "video" for t in turns for p in t.content):  # type: ignore[union-attr]
        raise UserError("the record holds a video; mistral-common encodes images only.",
                        where=where, fix="pass the video's frames as image parts.")
    media = iter(collect_media(turns, vp, base_dir, where))  # loaded, resized, in order
    messages = []
    for t in turns:
        parts = [{"type": "text", "text": p["text"]} if p["type"] == "text"
                 else {"type": "image", "base64": _png(next(media).frames[0])}
                 for p in t.content]  # type: ignore[union-attr]
        # A text-only turn is one string, as the text path gives it to mistral-common.
        content: Any = ("".join(p["text"] for p in parts)
                        if all(p["type"] == "text" for p in parts) else parts)
        messages.append(_Message(t.train, {**t.extra, "role": t.role, "content": content}))
    tok = vp.tokenizer
    ids, labels, _ = chat_ids(tok, spec.train_on_eos, messages, where)  # type: ignore[arg-type]
    out = tok.apply_chat_template([m.content for m in messages], tokenize=True,
                                  return_dict=True)
    if list(out["input_ids"]) != ids:  # one encoding: the same ids both times
        raise UserError("mistral-common encoded the conversation two ways.", where=where,
                        fix="report this record.")
    images = [np.asarray(a, dtype=np.float32) for a in out.get("pixel_values", [])]
    image_id, never = vp.feature_ids()[IMAGE], vp.marker_ids()
    types = [IMAGE if t == image_id else TEXT for t in ids]
    merged = vp.image_processor.image_config.image_patch_size * \
        vp.image_processor.image_config.spatial_merge_size
    want = sum((a.shape[1] // merged) * (a.shape[2] // merged) for a in images)
    if types.count(IMAGE) != want:
        raise UserError(
            f"the tokens hold {types.count(IMAGE)} [IMG] token(s) but mistral-common's "
            f"images fill {want}.", where=where,
            fix="keep `[IMG]` and the other image markers out of the record's text.")
    labels = [IGNORE_INDEX if t in never else lab for t, lab in zip(ids, labels, strict=True)]
    # Pixtral's layout: each image as its H*W pixels (row-major), one row of C channels each.
    pixels = (np.concatenate([a.reshape(a.shape[0], -1).T for a in images]) if images
              else np.zeros((0, 3), dtype=np.float32))
    grids = [(0, int(a.shape[1]), int(a.shape[2])) for a in images]
    return VisionDocument(ids, labels, types, np.ascontiguousarray(pixels), grids, where,
                          [IMAGE] * len(grids), [])
