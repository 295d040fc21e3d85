"""One record -> one document: pixels per image and video, and each placeholder
expanded by the processor's own rule, labels kept off image tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import formats
from longctx_cli.data.vision.documents import IMAGE, TEXT, VIDEO, VisionDocument
from longctx_cli.data.vision.mistral import MistralCommonVision, encode_mistral_record
from longctx_cli.data.vision.processor import VisionProcessor, as_vision_processor, patch_dim
from longctx_cli.data.vision.records import collect_media, default_spec, record_messages
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from PIL import Image as PILImage


@dataclass
class _Encoded:
    """One image or video through the processor: its rows of `pixel_values`, one grid per
    tower input, and the text its placeholder becomes."""

    pixels: np.ndarray
    grids: list[tuple[int, int, int]]
    replacement: str


def _image_pixels(vp: VisionProcessor, image: PILImage.Image, where: str) -> _Encoded:
    """An image as the processor makes it, with the processor's own expansion of its
    placeholder (`replace_image_token`: the rule its `__call__` applies).

    Patched processors (Qwen-VL) give patch rows and a `[t, h, w]` patch grid. Whole-image
    ones give `[k, C, H, W]` (k > 1 for Gemma 3's pan-and-scan crops and for the tiles and
    thumbnail of SmolVLM and InternVL, each a tower input of its own; SmolVLM's come as one
    sample, `[1, k, C, H, W]`): each is stored as one row of C*H*W values, with grid
    `(0, H, W)`; the 0 says "a whole image, not a patch grid" (runtime/batches.py reads it
    back as one). Pixtral's keep each image at its own size: one is stored as H*W rows of
    its C channels (pixel by pixel, row-major), with grid `(0, H, W)`, so images of any size
    share a row. Gemma 4's give each image's patches padded to a fixed budget, with their
    (x, y): one is stored as its own patches only, with grid `(-1, h, w)` (see
    `_positioned_patches`). Mllama's cut each image into tiles padded to a fixed count: one is
    stored as that many rows of C*H*W values (its tiles, then zero tiles), with grid `(-2,
    aspect ratio id, own tiles)`.
    """
    out = vp.image_processor(images=[image], return_tensors="np", **vp.images_kwargs)
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    if pixels.ndim == 5:  # SmolVLM: [samples, tiles, C, H, W], one sample here
        pixels = pixels[0]
    mask = out.get("pixel_attention_mask")
    if mask is not None and not np.asarray(mask).all():
        raise UserError(  # the rows keep no mask: each tile must be whole
            "the image processor padded a tile of this image (its pixel_attention_mask has "
            "zeros); the rows hold whole tiles of one size only.", where=where,
            fix="keep the processor's `do_image_splitting` / `max_image_size` settings, "
            "which cut every image into whole tiles.")
    if vp.tiled:  # [1, 1, tiles, C, H, W]: the padded tiles as rows, grid (-2, id, own)
        ratio = int(np.asarray(out["aspect_ratio_ids"]).reshape(-1)[0])
        own = int(np.asarray(out["aspect_ratio_mask"]).reshape(-1).sum())
        pixels = pixels.reshape(pixels.shape[2], -1)
        grids = [(-2, ratio, own)]
    elif vp.positioned:
        pixels, grids = _positioned_patches(pixels[0], np.asarray(out["image_position_ids"])[0],
                                            where)
    elif vp.sized:
        height, width = (int(x) for x in np.asarray(out["image_sizes"])[0])
        channels = pixels.shape[1]
        grids = [(0, height, width)]
        pixels = pixels[0, :, :height, :width].reshape(channels, -1).T  # [H*W, C]
    elif vp.patched:
        # PaddleOCR-VL's patches come as [C, side, side]: stored as rows like the others
        # (its forward reshapes them back, runtime/vision.py).
        pixels = pixels.reshape(pixels.shape[0], -1)
        grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
        grids = [grid]
    else:
        if tuple(pixels.shape[1:]) != vp.image_shape:
            raise UserError(
                f"the image processor made a {'x'.join(map(str, pixels.shape[1:]))} image where "
                f"its others are {'x'.join(map(str, vp.image_shape))}; the rows hold one image "
                "size (the tower's).", where=where,
                fix="keep the processor's fixed size: `do_center_crop: true` with `crop_size` "
                "(CLIP) or a `size` with height and width in preprocessor_config.json.")
        grids = [(0, int(pixels.shape[2]), int(pixels.shape[3]))] * len(pixels)
        pixels = pixels.reshape(len(pixels), -1)
    try:
        replacement = str(vp.processor.replace_image_token(out, image_idx=0))
    except (AttributeError, NotImplementedError):
        if not vp.patched:
            raise UserError(
                f"the processor {type(vp.processor).__name__} does not say how it expands an "
                "image placeholder (no `replace_image_token`).", where=where,
                fix="use a LLaVA, Gemma 3, SmolVLM, InternVL or Qwen-VL processor with "
                "transformers >= 5.") from None
        merge = int(vp.image_processor.merge_size) ** 2
        replacement = vp.image_token * (int(np.prod(grids[0])) // merge)
    return _Encoded(np.ascontiguousarray(pixels), grids, replacement)  # type: ignore[arg-type]


def _positioned_patches(patches: np.ndarray, positions: np.ndarray, where: str
                        ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """One image's patches `[budget, patch_dim]` and their (x, y) `[budget, 2]` ((-1, -1) on
    padding), as Gemma 4's image processor gives them, stored as its real patches and the
    grid `(-1, h, w)`: the -1 says "patches in row-major order, patch i at (x, y) =
    (i % w, i // w)" (runtime/batches.py rebuilds the positions and the padding from it)."""
    real = positions[:, 0] >= 0
    count = int(real.sum())
    height = int(positions[:count, 1].max()) + 1 if count else 0
    width = int(positions[:count, 0].max()) + 1 if count else 0
    ys, xs = np.divmod(np.arange(count), max(width, 1))
    if (count == 0 or not real[:count].all() or real[count:].any() or height * width != count
            or not np.array_equal(positions[:count], np.stack([xs, ys], -1))):
        raise UserError(  # the rows keep the grid only: the positions must be its own
            "the image processor gave this image's patches positions that are not one "
            "row-major grid followed by padding; the rows rebuild each patch's (x, y) from "
            "its grid.", where=where,
            fix="use Gemma 4's own image processor (Gemma4ImageProcessor) unchanged.")
    return patches[:count], [(-1, height, width)]


def video_pixels(vp: VisionProcessor, frames: list[PILImage.Image]
                 ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Patches of a video given as frames, laid out as transformers' Qwen2-VL video
    processor lays them out, without torchvision.

    Every frame goes through the image processor (same resize, rescale and normalisation);
    an image's patch repeats its frame over the temporal axis, so keeping one copy per frame
    and stacking `temporal_patch_size` consecutive frames in its place gives the video patch
    (channel, time, row, column). The frame count is padded to a multiple of
    `temporal_patch_size` with the last frame, as the video processor pads it.
    """
    ip = vp.image_processor
    tps, ps = int(ip.temporal_patch_size), int(ip.patch_size)
    kwargs: dict[str, Any] = {"return_tensors": "np"}
    if vp.video_size:
        kwargs["size"] = dict(vp.video_size)
    out = ip(images=frames, **kwargs)
    grids = np.asarray(out["image_grid_thw"])
    _, gh, gw = (int(x) for x in grids[0])
    per_frame = np.asarray(out["pixel_values"], dtype=np.float32).reshape(
        len(frames), gh * gw, -1, tps, ps * ps)[:, :, :, 0]  # [frames, patches, C, ps*ps]
    if pad := -len(frames) % tps:
        per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)])
    t = per_frame.shape[0] // tps
    grouped = per_frame.reshape(t, tps, gh * gw, per_frame.shape[2], ps * ps)
    patches = grouped.transpose(0, 2, 3, 1, 4).reshape(t * gh * gw, -1)
    return np.ascontiguousarray(patches, dtype=np.float32), (t, gh, gw)




def encode_vision_record(
    record: dict[str, Any], processor: Any, where: str, *, base_dir: Path,
    spec: formats.FormatSpec | None = None,
) -> VisionDocument:
    """Tokenize one image-bearing chat record as the processor would, with chat labels.

    The conversation is rendered once with the chat template; targets are located on that
    text by `formats.chat_target_spans` (the text path's own rules: roles_to_train, the
    per-turn training flag, train_on_inputs, train_on_eos). Each vision placeholder is then
    expanded as the processor expands it (`replace_image_token`; a video: one token per
    merged patch, `grid t*h*w / merge_size**2`), the spans shifted with it, and the text
    tokenized once. Image and video tokens, and the markers around them, are never targets.

    `processor` is what `load_processor` returns or a bare Hugging Face processor; `spec`
    carries a dataset entry's chat options (defaults: train assistant turns and the end
    marker after each).
    """
    vp = as_vision_processor(processor)
    spec = spec or default_spec(vp)
    if isinstance(vp, MistralCommonVision):  # mistral-common's own tokens and images
        return encode_mistral_record(record, vp, where, base_dir=base_dir, spec=spec)
    if not spec.template:
        spec = replace(spec, template=vp.chat_template)
    tok = vp.tokenizer
    turns = record_messages(record, spec, where)
    media = collect_media(turns, vp, base_dir, where)
    text, spans = formats.chat_target_spans(tok, spec, turns, where)

    encoded, kinds, seconds = [], [], []
    for item in media:
        if item.kind == IMAGE:
            encoded.append(_image_pixels(vp, item.frames[0], where))
        else:
            refusal = vp.family.video_refusal if vp.family else None
            if refusal:
                raise UserError(
                    f"the record holds a video, which longctx does not prepare for "
                    f"{vp.family.name}: {refusal}.", where=where,
                    fix="drop the records with videos, or give a video's frames as images.")
            if vp.video_token is None or not vp.patched:
                raise UserError(
                    f"the record holds a video, and the {type(vp.processor).__name__} "
                    "processor takes images only.", where=where,
                    fix="pass the video's frames as image parts, or drop the record.")
            pv, grid = video_pixels(vp, item.frames)
            encoded.append(_Encoded(pv, [grid], vp.video_replacement(grid, item.fps,
                                                                     len(item.frames))))
            seconds.append(vp.image_processor.temporal_patch_size / item.fps)
        kinds.append(item.kind)
    expanded, spans = _expand(text, spans, kinds, [e.replacement for e in encoded], vp, where)
    ids, labels, _ = formats.encode_spans(tok, expanded, spans)

    feature = vp.feature_ids()
    kind_of = {token: kind for kind, token in feature.items()}
    types = [kind_of.get(t, TEXT) for t in ids]
    for kind, token in vp.feature_tokens.items():
        want = sum(e.replacement.count(token)
                   for e, k in zip(encoded, kinds, strict=True) if k == kind)
        have = types.count(kind)
        if have != want:
            raise UserError(
                f"the tokens hold {have} `{token}` token(s) but the processor's features fill "
                f"{want}; each would be paired with the wrong patch features.", where=where,
                fix=f"make sure the tokenizer has `{token}` as one special token and that no "
                "text in the record contains it (or another vision marker) literally.")
    # The markers around an image's tokens (and Gemma 3's placeholder, which stays as its
    # begin-of-image token) are the processor's, never something to predict.
    vocab = tok.get_vocab()
    never = {vocab[m] for m in vp.marker_tokens if m in vocab}
    if hasattr(vp.processor, "global_image_token"):  # SmolVLM's tile positions
        never |= {i for t, i in vocab.items() if re.fullmatch(r"<row_\d+_col_\d+>", t)}
    labels = [IGNORE_INDEX if ty != TEXT or t in never else lab
              for t, lab, ty in zip(ids, labels, types, strict=True)]
    pixel_values = (np.concatenate([e.pixels for e in encoded]) if encoded else
                    np.zeros((0, patch_dim(vp)), dtype=np.float32))
    grids = [g for e in encoded for g in e.grids]
    grid_kinds = [k for e, k in zip(encoded, kinds, strict=True) for _ in e.grids]
    return VisionDocument(ids, labels, types, pixel_values, grids, where, grid_kinds, seconds)


def _expand(text: str, spans: list[tuple[int, int]], kinds: list[int], replacements: list[str],
            vp: VisionProcessor, where: str) -> tuple[str, list[tuple[int, int]]]:
    """Each placeholder replaced by its media's expansion (`replacements[i]`: the feature
    token repeated, with Gemma 3's markers around it), and the target spans moved with the
    text.

    The placeholders found must be exactly the media collected, kind for kind, in order: a
    template that drops image parts, or text that contains a placeholder literally, would
    otherwise pair features with the wrong tokens.
    """
    tokens = {vp.image_token: IMAGE, **({vp.video_token: VIDEO} if vp.video_token else {})}
    found = [(m.start(), m.end(), tokens[m.group()])
             for m in re.finditer("|".join(re.escape(t) for t in tokens), text)]
    if [k for *_, k in found] != kinds:
        def describe(ks: list[int]) -> str:
            return f"{ks.count(IMAGE)} image(s) and {ks.count(VIDEO)} video(s)"

        names = "/".join(f"`{t}`" for t in tokens)
        raise UserError(
            f"the rendered conversation has placeholders for {describe([k for *_, k in found])}"
            f" but the record holds {describe(kinds)}, in that order; the image tokens would "
            "not match the processor's features.", where=where,
            fix=f"use the model's own chat template (it renders every image part as "
            f"`{vp.image_token}`), and keep {names} out of the record's text.")
    pieces, shifts, cursor, extra = [], [], 0, 0
    for (start, end, _), replacement in zip(found, replacements, strict=True):
        pieces += [text[cursor:start], replacement]
        extra += len(replacement) - (end - start)
        shifts.append((end, extra))
        cursor = end
    pieces.append(text[cursor:])

    def moved(pos: int) -> int:
        return pos + next((e for end, e in reversed(shifts) if end <= pos), 0)

    return "".join(pieces), [(moved(s), moved(e)) for s, e in spans]


def text_document(ids: list[int], labels: list[int], patch_dim: int, source: str
                  ) -> VisionDocument:
    """A text-only sample (another dataset type in a vision run) as a document."""
    return VisionDocument(list(ids), list(labels), [TEXT] * len(ids),
                          np.zeros((0, patch_dim), dtype=np.float32), [], source)


def encode_vision_prompt(record: dict[str, Any], processor: Any, where: str, *,
                         base_dir: Path) -> VisionDocument:
    """A generation prompt: the record's turns as training renders them, then the chat
    template's generation prompt (what `add_generation_prompt=True` appends)."""
    vp = as_vision_processor(processor)
    if isinstance(vp, MistralCommonVision):
        raise UserError("generating after images with `tokenizer_use_mistral_common: true` is "
                        "not supported: mistral-common's fine-tuning mode encodes finished "
                        "conversations only.", where=where,
                        fix="drop `tokenizer_use_mistral_common` to generate with the "
                        "model's processor.")
    doc = encode_vision_record(record, vp, where, base_dir=base_dir)
    tok, probe = vp.tokenizer, [{"role": "user", "content": "x"}]
    plain = tok.apply_chat_template(probe, tokenize=False, chat_template=vp.chat_template)
    full = tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                   chat_template=vp.chat_template)
    suffix = tok.encode(full[len(plain):], add_special_tokens=False)
    return replace(doc, input_ids=doc.input_ids + suffix,
                   labels=doc.labels + [IGNORE_INDEX] * len(suffix),
                   mm_token_type_ids=doc.mm_token_type_ids + [TEXT] * len(suffix))
