"""Vision-language data: image-bearing chat records -> tokenized documents -> packed rows.

The model side (`runtime/vision.py`) merges image features into the embeddings of a whole
packed row and only then shards it, so everything it needs is decided here, once, per
document: the token ids with every image placeholder already expanded (one `<|image_pad|>`
per merged patch, exactly as the Hugging Face processor expands it), which tokens are
image or video tokens (`mm_token_type_ids`: Qwen2.5/3-VL's `get_rope_index` needs them and
silently falls back to 1-D positions without them), the pixel patches and grids of the
document's images in the order their placeholders appear, and labels that never make an
image token a target.

Each placeholder is expanded by the processor's own rule (`replace_image_token`: Qwen-VL's
one token per merged patch, LLaVA's one per tower patch, Gemma 3's begin/end-of-image
markers around a fixed count). Qwen-VL's pixels are patch rows with a `[t, h, w]` grid;
whole-image processors (LLaVA's CLIP, Gemma 3's SigLIP) give `[images, C, H, W]`, stored one
image per row with the grid `(0, H, W)` (see the Arrow layout below).

Records are the layouts Axolotl users have: `messages` whose `content` is a list of parts
(`{"type": "text", "text": ...}`, `{"type": "image", "path" | "url" | "image" | "base64":
...}`, `{"type": "video", "video": [frame paths]}`), and the older one with an `images`
(or `image`) column whose entries fill image parts without a source or `<image>` markers in
the text, in order. Nothing is fetched from the network: a `url` must be `file://`.

`image_size` and `image_resize_algorithm` do what Axolotl's do, before the processor sees
the image: an int pads the image to a square of that side keeping its aspect ratio (black
bars, `PIL.ImageOps.pad`), a pair resizes to exactly (width, height); the default filter is
bilinear. Axolotl applies them only to the column image; here every image and video frame
gets them, so a config means the same whichever layout the data uses.

Documents are packed first-fit-decreasing by `pack.ffd_bins`, the text packer's own
routine; a document never splits across rows, so an image is never cut.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import numpy as np

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import formats, pack
from longctx_cli.errors import UserError
from longctx_cli.families import IMAGE_ONLY_FAMILIES

if TYPE_CHECKING:
    from PIL import Image as PILImage

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values, as transformers' processors use them
# transformers' processors take a video given as frames to run at this rate when no fps is
# known (`VideoMetadata.sampled_fps`); Qwen2.5-VL turns it into `second_per_grid_ts`.
DEFAULT_VIDEO_FPS = 24.0
RESIZE_ALGORITHMS = ("bilinear", "bicubic", "lanczos")  # what Axolotl's schema accepts
IMAGE_MARKER = "<image>"  # LLaVA-style marker of where a column image goes
SOURCE_KEYS = ("path", "url", "image", "base64")  # Axolotl's keys of an image part's source


@dataclass
class VisionDocument:
    """One tokenized, image-bearing sample (a whole conversation), ready to pack.

    `pixel_values` and `image_grid_thw` hold the document's images *and* videos in the
    order their placeholders appear (Qwen's vision tower encodes both alike; a video's
    frames are its temporal axis); `media_kinds` says which each grid is, so the model side
    can hand transformers `image_grid_thw` and `video_grid_thw` apart.
    """

    input_ids: list[int]
    labels: list[int]
    mm_token_type_ids: list[int]
    pixel_values: np.ndarray  # [patches, patch_dim] float32
    image_grid_thw: list[tuple[int, int, int]]
    source: str  # "file:line" of the record, for errors
    media_kinds: list[int] = field(default_factory=list)  # per grid: IMAGE or VIDEO
    second_per_grid_ts: list[float] = field(default_factory=list)  # per video, in order

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def image_tokens(self) -> int:
        """Tokens that stand for image or video features (what an image costs in a row)."""
        return sum(1 for t in self.mm_token_type_ids if t != TEXT)

    @property
    def has_targets(self) -> bool:
        """False when no token is trained (the text path skips such records as "no target
        tokens"; the caller decides the same here)."""
        return any(label != IGNORE_INDEX for label in self.labels)


@dataclass
class VisionRow:
    """Packed documents of one training row.

    `position_ids` are the 1-D text positions, restarting at 0 per document: the model side
    reads document boundaries from them and computes mRoPE once per document. Per-document
    lists (`image_counts`, `sources`) are in row order, and each document's grids are
    consecutive in `image_grid_thw`, so grids `[sum(image_counts[:d]), ...)` are document d's.
    """

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    mm_token_type_ids: list[int]
    pixel_values: np.ndarray
    image_grid_thw: list[tuple[int, int, int]]
    media_kinds: list[int]
    second_per_grid_ts: list[float]
    image_counts: list[int]  # grids (images and videos) per document, in row order
    sources: list[str]


@dataclass
class VisionProcessor:
    """A Hugging Face processor plus the Axolotl resize keys, applied before it."""

    processor: Any
    image_size: int | tuple[int, int] | None = None  # int: padded square; pair: (w, h)
    resample: int = 2  # PIL.Image.Resampling.BILINEAR, Axolotl's default
    video_size: dict[str, int] | None = None  # the video processor's pixel budget, if any

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def image_processor(self) -> Any:
        return self.processor.image_processor

    @property
    def image_token(self) -> str:
        """The placeholder the chat template writes for an image (Gemma 3's is its
        begin-of-image token, expanded around the feature tokens)."""
        return getattr(self.processor, "image_token", None) or "<|image_pad|>"

    @property
    def video_token(self) -> str | None:
        """The placeholder of a video; None for processors that take no videos."""
        return getattr(self.processor, "video_token", None)

    @property
    def feature_tokens(self) -> dict[int, str]:
        """Per media kind, the token that stands for one feature in the expanded ids (the
        placeholder itself, except Gemma 3's: its tokenizer's `image_token`)."""
        image = getattr(self.tokenizer, "image_token", None) or self.image_token
        return {IMAGE: image, **({VIDEO: self.video_token} if self.video_token else {})}

    def feature_ids(self) -> dict[int, int]:
        """Per media kind, the id of its feature token (only those in the vocabulary)."""
        vocab = self.tokenizer.get_vocab()
        return {kind: vocab[token] for kind, token in self.feature_tokens.items()
                if token in vocab}

    def video_replacement(self, grid: tuple[int, int, int], fps: float, frames: int) -> str:
        """What a video's placeholder becomes: one token per merged patch or, for a processor
        that places frames by timestamps (Qwen3-VL), each temporal patch as its own run,
        `<t seconds>` then its tokens between the vision markers, as transformers' Qwen3-VL
        processor writes it (its `_calculate_timestamps`, frames `0..frames-1` at `fps`)."""
        ip = self.image_processor
        merge = int(ip.merge_size) ** 2
        token = str(self.video_token)
        timestamps = getattr(self.processor, "_calculate_timestamps", None)
        if timestamps is None:
            return token * (int(np.prod(grid)) // merge)
        per_frame = token * (int(grid[1]) * int(grid[2]) // merge)
        start, end = self.processor.vision_start_token, self.processor.vision_end_token
        times = timestamps(list(range(frames)), fps, int(ip.temporal_patch_size))
        return "".join(f"<{times[t]:.1f} seconds>{start}{per_frame}{end}"
                       for t in range(int(grid[0])))

    @property
    def patched(self) -> bool:
        """True for Qwen-VL's image processors (pixels as patch rows with a t*h*w grid);
        False for whole-image ones (LLaVA's CLIP, Gemma 3's SigLIP): `[images, C, H, W]`."""
        ip = self.image_processor
        return hasattr(ip, "temporal_patch_size") and hasattr(ip, "merge_size")

    @functools.cached_property
    def image_shape(self) -> tuple[int, ...]:
        """(C, H, W) of every image a whole-image processor makes (its fixed input size),
        read from what it makes of a blank image."""
        from PIL import Image

        out = self.image_processor(images=[Image.new("RGB", (32, 32))], return_tensors="np")
        return tuple(int(x) for x in np.asarray(out["pixel_values"]).shape[1:])

    @property
    def chat_template(self) -> str:
        return (getattr(self.processor, "chat_template", None)
                or getattr(self.tokenizer, "chat_template", None) or "")


# ---- loading the processor ---------------------------------------------------------------


def load_processor(
    path: str, *, image_size: int | Sequence[int] | None = None,
    image_resize_algorithm: str | None = None,
) -> VisionProcessor:
    """The processor in folder `path`, offline, with Axolotl's resize keys attached.

    `AutoProcessor` first. Qwen2/2.5/3-VL processors also build a video processor that
    needs torchvision; where that is missing (CPU installs), the same processor class is
    built without it from the folder's tokenizer, image processor and chat template, which
    is all the image path uses (videos given as frames go through the image processor's
    own resize and normalisation, then are grouped in time here).
    """
    size = _image_size(image_size)
    resample = _resample(image_resize_algorithm)
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"processor folder {path} does not exist.",
                        fix="point `processor_path` (or `base_model`) at a local folder "
                        "holding the model's processor files; nothing is downloaded here.")
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as first:  # noqa: BLE001 - every failure of the full processor gets the fallback
        try:
            processor = _image_only_processor(folder)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - the files are the user's; say which failed
            raise UserError(
                f"cannot load a processor from {path}: {first} (without a video processor: "
                f"{exc}).",
                fix="point it at a folder holding the model's tokenizer files, "
                "preprocessor_config.json and chat template, as saved by "
                "`processor.save_pretrained`.") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise UserError(f"{path} holds no image processor, so it is not a vision-language "
                        "model's processor.",
                        fix="use the folder of a vision-language model (Qwen2-VL, Qwen2.5-VL, "
                        "Qwen3-VL, LLaVA, Gemma 3) whose preprocessor_config.json and tokenizer "
                        "files are there.")
    return VisionProcessor(processor, size, resample, _video_size(folder, processor))


def _image_only_processor(folder: Path) -> Any:
    """The folder's Qwen-VL processor class without its video processor (see load_processor)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    config = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            config.update(json.loads((folder / name).read_text()))
    kind = str(config.get("processor_class", "")) + str(config.get("image_processor_type", ""))
    if not any(f.processor_marker in kind for f in IMAGE_ONLY_FAMILIES):
        names = [f.name for f in IMAGE_ONLY_FAMILIES]
        raise UserError(
            f"cannot build the processor in {folder} ({kind or 'no processor_class'}): longctx "
            f"prepares vision data for {', '.join(names[:-1])} and {names[-1]} processors.",
            fix="use a Qwen-VL model's folder, or install torchvision if the processor needs it.")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder),
                                                               local_files_only=True)
    template = getattr(tokenizer, "chat_template", None)
    for name in ("chat_template.jinja", "chat_template.json"):
        file = folder / name
        if file.is_file():
            text = file.read_text()
            template = json.loads(text)["chat_template"] if name.endswith("json") else text
            break
    video = folder / "video_preprocessor_config.json"  # Qwen3-VL's names its own class
    if video.is_file():
        kind += str(json.loads(video.read_text()).get("video_processor_type", ""))
    # A later family's processor names an earlier one's parts (Qwen3-VL's image processor is
    # Qwen2-VL's), so the last family whose marker the names hold is the folder's.
    base = [f.image_only_processor for f in IMAGE_ONLY_FAMILIES if f.processor_marker in kind][-1]
    return image_only_processor_class(base)(image_processor=image_processor,
                                            tokenizer=tokenizer, chat_template=template)


@functools.cache
def image_only_processor_class(base: str = "Qwen2_5_VLProcessor") -> Any:
    """transformers' processor class `base` (Qwen2.5-VL's, or Qwen3-VL's, which places video
    frames by timestamps) with no video processor attribute (built on first use, so that
    importing this module does not import transformers' models).

    ProcessorMixin reads a processor's parts from its `__init__` signature; dropping
    `video_processor` from it is what lets the class be built without torchvision. Its
    `__call__` (placeholder expansion, tokenizing, mm_token_type_ids) is transformers' own.
    """
    import transformers

    class ImageOnlyQwenVLProcessor(getattr(transformers, base)):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                     chat_template: str | None = None, **kwargs: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template,
                             **kwargs)

    return ImageOnlyQwenVLProcessor


def _video_size(folder: Path, processor: Any) -> dict[str, int] | None:
    """The video processor's pixel budget (Qwen's differs from the image one), read from the
    loaded video processor or, without one, from video_preprocessor_config.json."""
    video = getattr(processor, "video_processor", None)
    size = getattr(video, "size", None)
    if size is None and (folder / "video_preprocessor_config.json").is_file():
        config = json.loads((folder / "video_preprocessor_config.json").read_text())
        size = dict(config.get("size") or {})
        if config.get("min_pixels") is not None:
            size["shortest_edge"] = config["min_pixels"]
        if config.get("max_pixels") is not None:
            size["longest_edge"] = config["max_pixels"]
    if not size:
        return None
    size = dict(size)
    if size.get("shortest_edge") and size.get("longest_edge"):
        return {"shortest_edge": int(size["shortest_edge"]),
                "longest_edge": int(size["longest_edge"])}
    return None


def _image_size(value: int | Sequence[int] | None) -> int | tuple[int, int] | None:
    fix = ("write `image_size: 448` (padded to a 448x448 square, aspect ratio kept) or "
           "`image_size: [width, height]` (resized to exactly that), or leave it out.")
    if value is None:
        return None
    if isinstance(value, bool):
        raise UserError(f"`image_size` must be a number of pixels, found {value!r}.", fix=fix)
    if isinstance(value, int):
        if value < 1:
            raise UserError(f"`image_size` must be positive, found {value}.", fix=fix)
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    raise UserError(f"`image_size` must be an integer or a [width, height] pair, found "
                    f"{value!r}.", fix=fix)


def _resample(name: str | None) -> int:
    from PIL import Image

    if name is None:
        return int(Image.Resampling.BILINEAR)
    key = str(name).lower()
    if key not in RESIZE_ALGORITHMS:
        raise UserError(f"`image_resize_algorithm` {name!r} is not one of "
                        f"{', '.join(RESIZE_ALGORITHMS)}.",
                        fix="use bilinear (the default), bicubic or lanczos.")
    return int(getattr(Image.Resampling, key.upper()))


def _as_vision_processor(processor: Any) -> VisionProcessor:
    return processor if isinstance(processor, VisionProcessor) else VisionProcessor(processor)


# ---- images ------------------------------------------------------------------------------


def load_image(value: Any, *, key: str, base_dir: Path, where: str) -> PILImage.Image:
    """An RGB PIL image from one source value; errors are the user's, with file:line.

    Like transformers' `load_image` (EXIF orientation applied, converted to RGB), minus the
    network: paths (relative ones against the dataset file's folder), `file://` URLs,
    base64 (raw or a `data:` URI), `{"bytes" | "path"}` dicts as `datasets` stores images,
    and PIL images.
    """
    from PIL import Image, ImageOps

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        if value.get("bytes"):
            image = _open(io.BytesIO(value["bytes"]), "the image bytes", where)
        else:
            image = _open_path(str(value["path"]), base_dir, where)
    elif isinstance(value, str) and value:
        image = _open_string(value, key, base_dir, where)
    else:
        raise UserError(f"an image `{key}` must be a path, URL or base64 string, found "
                        f"{formats._kind(value)}.", where=where,
                        fix='write the image part as {"type": "image", "path": "img/1.png"}.')
    image = ImageOps.exif_transpose(image)
    return image.convert("RGB")


def _open_string(value: str, key: str, base_dir: Path, where: str) -> PILImage.Image:
    scheme = urlparse(value).scheme.lower() if "://" in value or value.startswith(
        "data:") else ""
    if scheme in ("http", "https"):
        raise UserError(
            f"image {value!r:.120} is a web address; longctx never downloads during "
            "preparation (it must run the same offline and on every rank).",
            where=where,
            fix="download the images next to the dataset and refer to them by `path` (relative "
            "paths are read from the dataset file's folder), or embed them as `base64`.")
    if scheme == "file":
        parsed = urlparse(value)
        return _open_path(unquote(parsed.netloc + parsed.path), base_dir, where)
    if scheme == "data" or key == "base64":
        payload = value.split(",", 1)[1] if scheme == "data" else value
        try:
            raw = base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError):
            raise UserError("the image's base64 text does not decode.", where=where,
                            fix="store the image file's bytes base64-encoded (or as a "
                            "`data:image/png;base64,...` URI).") from None
        return _open(io.BytesIO(raw), "the base64 image", where)
    if scheme:
        raise UserError(f"image URL scheme `{scheme}` is not supported ({value!r:.120}).",
                        where=where, fix="use a local `path` or a `file://` URL.")
    return _open_path(value, base_dir, where)


def _open_path(value: str, base_dir: Path, where: str) -> PILImage.Image:
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if not path.is_file():
        raise UserError(
            f"image file {path} does not exist (the record names {value!r}).", where=where,
            fix=f"relative image paths are read from the dataset file's folder ({base_dir}); "
            "correct the path, copy the image there, or remove the record.")
    return _open(path, str(path), where)


def _open(source: Any, name: str, where: str) -> PILImage.Image:
    from PIL import Image

    try:
        image = Image.open(source)
        image.load()  # decode now: a truncated file fails here, not inside the processor
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise UserError(f"{name} is not an image PIL can read ({exc}).", where=where,
                        fix="replace the file with a valid PNG/JPEG/WebP image, or remove the "
                        "record.") from None
    return image


def resize_like_axolotl(image: PILImage.Image, size: int | tuple[int, int] | None,
                        resample: int) -> PILImage.Image:
    """Axolotl's `image_size`: an int pads to a black-barred square keeping the aspect ratio,
    a (width, height) pair resizes to exactly that; None leaves the image alone."""
    from PIL import ImageOps

    if size is None:
        return image
    if isinstance(size, tuple):
        return image.resize(size, resample)
    return ImageOps.pad(image, (size, size), method=resample, color=(0, 0, 0))


# ---- records -> messages -----------------------------------------------------------------


@dataclass
class _Media:
    kind: int  # IMAGE or VIDEO
    frames: list[PILImage.Image]  # one for an image
    fps: float = DEFAULT_VIDEO_FPS


def _default_spec(vp: VisionProcessor) -> formats.FormatSpec:
    from longctx_cli.data.chat_templates import END_OF_TURN

    tok = vp.tokenizer
    markers = [m for m in (*END_OF_TURN.values(), tok.eos_token) if m and m in tok.get_vocab()]
    return formats.FormatSpec("chat_template", template=vp.chat_template,
                              end_markers=tuple(dict.fromkeys(markers)))


def _parts(content: Any, n: int, where: str) -> list[dict[str, Any]]:
    """A turn's content as a list of parts (a string is one text part, as in Axolotl)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise UserError(f"turn {n}: `content` must be a string or a list of parts, found "
                        f"{formats._kind(content)}.", where=where,
                        fix='write content as [{"type": "text", "text": "..."}, {"type": '
                        '"image", "path": "..."}].')
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise UserError(f"turn {n}, part {k}: a part must be an object with a `type`, "
                            f"found {part!r:.80}.", where=where,
                            fix='give every part a type: "text", "image" or "video".')
        if part["type"] not in ("text", "image", "video"):
            raise UserError(f"turn {n}, part {k}: unknown part type {part['type']!r}.",
                            where=where, fix='use "text", "image" or "video".')
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise UserError(f"turn {n}, part {k}: a text part needs a string `text`.",
                            where=where, fix='write {"type": "text", "text": "..."}.')
        parts.append({k2: v for k2, v in part.items() if v is not None})
    return parts


def _split_markers(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text parts cut at `<image>` markers, each marker becoming an image part to fill."""
    out = []
    for part in parts:
        if part["type"] != "text" or IMAGE_MARKER not in part["text"]:
            out.append(part)
            continue
        pieces = part["text"].split(IMAGE_MARKER)
        for i, piece in enumerate(pieces):
            if i:
                out.append({"type": "image"})
            if piece:
                out.append({"type": "text", "text": piece})
    return out


def _has_source(part: dict[str, Any]) -> bool:
    return any(part.get(k) is not None for k in SOURCE_KEYS)


def _column_images(record: dict[str, Any]) -> list[Any] | None:
    for key in ("images", "image"):
        value = record.get(key)
        if value is None:
            continue
        return list(value) if isinstance(value, (list, tuple)) else [value]
    return None


def _messages(record: dict[str, Any], spec: formats.FormatSpec, where: str
              ) -> list[formats.Turn]:
    """The record's turns with part-list content, column images placed, training decided."""
    field_name = spec.messages_field
    value = record.get(field_name)
    if value is None and field_name == "messages" and isinstance(record.get("conversations"),
                                                                 list):
        value = record["conversations"]  # ShareGPT layout: from/value
    if not isinstance(value, list) or not value:
        raise UserError(f"field `{field_name}` must be a non-empty list of turns.", where=where,
                        fix='write it as [{"role": "user", "content": [{"type": "image", '
                        '"path": "a.png"}, {"type": "text", "text": "..."}]}, ...].')
    role_keys = (spec.mappings.get("role", "role"), "from")
    content_keys = (spec.mappings.get("content", "content"), "value")
    known = set(spec.roles.values()) | {"system", "user", "assistant", "tool"}
    column = _column_images(record)
    turns: list[formats.Turn] = []
    for n, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise UserError(f"turn {n} of `{field_name}` is {formats._kind(raw)}, not a "
                            "mapping.", where=where, fix="write each turn as a JSON object.")
        source_role = next((raw[k] for k in role_keys if raw.get(k) is not None), None)
        content = next((raw[k] for k in content_keys if raw.get(k) is not None), None)
        if not isinstance(source_role, str) or content is None:
            raise UserError(f"turn {n} of `{field_name}` needs a string role and a content.",
                            where=where, fix="give every turn `role` and `content`.")
        role = spec.roles.get(source_role, source_role)
        if role not in known:
            raise UserError(f"turn {n} has unknown role {source_role!r}.", where=where,
                            fix=f"use one of {', '.join(sorted(known))}, or map it with "
                            "`roles:`.")
        parts = _parts(content, n, where)
        if column is not None:
            parts = _split_markers(parts)
        flag = next((raw[k] for k in spec.training_keys if raw.get(k) is not None), None)
        if flag is not None and not isinstance(flag, bool):
            raise UserError(f"turn {n}: the training flag must be true/false, found "
                            f"{flag!r:.40}.", where=where, fix="write true or false.")
        train = flag if flag is not None else (spec.train_on_inputs
                                               or role in spec.roles_to_train)
        turns.append(formats.Turn(role, parts, train))  # type: ignore[arg-type]
    if column is not None:
        _place_column_images(turns, column, where)
    return turns


def _place_column_images(turns: list[formats.Turn], images: list[Any], where: str) -> None:
    """Fill image parts without a source (and `<image>` markers) with the column's images in
    order; with no such slot, append them to the first user turn (where Axolotl puts its)."""
    slots = [p for t in turns for p in t.content if p["type"] == "image"  # type: ignore[union-attr]
             and not _has_source(p)]
    sourced = [p for t in turns for p in t.content if p["type"] == "image"  # type: ignore[union-attr]
               and _has_source(p)]
    if not slots and sourced:
        # Exported datasets often carry both: appending the column would repeat the images.
        raise UserError(
            f"the record's messages name their own {len(sourced)} image(s) and it also has an "
            f"`images` column of {len(images)}; longctx cannot tell whether the column repeats "
            "them.", where=where,
            fix="drop the `images` column (or the sources in the image parts) from the data.")
    if not slots:
        target = next((t for t in turns if t.role == "user"), turns[0])
        target.content.extend({"type": "image"} for _ in images)  # type: ignore[union-attr]
        slots = [p for p in target.content if p["type"] == "image"  # type: ignore[union-attr]
                 and not _has_source(p)]
    if len(slots) != len(images):
        raise UserError(
            f"the record's `images` column holds {len(images)} image(s) but its messages "
            f"have {len(slots)} place(s) for them (image parts without a source, or "
            f"`{IMAGE_MARKER}` markers).", where=where,
            fix="give one image part (or marker) per column image, in order, or none at all "
            "(then every image goes at the end of the first user turn).")
    for slot, image in zip(slots, images, strict=True):
        slot["image"] = image


def _collect_media(turns: list[formats.Turn], vp: VisionProcessor, base_dir: Path,
                   where: str) -> list[_Media]:
    """Every image and video of the conversation, loaded and resized, in rendering order.
    Image parts get a string stand-in for their source, so the template sees a plain part."""
    media: list[_Media] = []
    for t in turns:
        for part in t.content:  # type: ignore[union-attr]
            if part["type"] == "image":
                key = next((k for k in SOURCE_KEYS if part.get(k) is not None), None)
                if key is None:
                    raise UserError(
                        "an image part has no source (`path`, `url`, `image` or `base64`) and "
                        "the record has no `images` column to fill it.", where=where,
                        fix='write {"type": "image", "path": "img/1.png"}, or add the images '
                        "as an `images` list.")
                image = load_image(part[key], key=key, base_dir=base_dir, where=where)
                media.append(_Media(IMAGE, [resize_like_axolotl(image, vp.image_size,
                                                                vp.resample)]))
                if not isinstance(part[key], str):  # a PIL image or bytes: the template needs
                    part[key] = f"<image {len(media)}>"  # only to see that there is one
            elif part["type"] == "video":
                media.append(_video(part, vp, base_dir, where))
    return media


def _video(part: dict[str, Any], vp: VisionProcessor, base_dir: Path, where: str) -> _Media:
    frames = part.get("video", part.get("frames", part.get("path")))
    if isinstance(frames, str) or not isinstance(frames, list) or not frames:
        raise UserError(
            "a video part must list its frames as image paths "
            f"(found {formats._kind(frames)}); video files are not decoded here.", where=where,
            fix='extract the frames (e.g. with ffmpeg) and write {"type": "video", "video": '
            '["f/0001.jpg", "f/0002.jpg", ...]}.')
    loaded = [resize_like_axolotl(load_image(f, key="video", base_dir=base_dir, where=where),
                                  vp.image_size, vp.resample) for f in frames]
    first = loaded[0].size
    if any(f.size != first for f in loaded):
        from PIL import Image

        # A video's frames are one tensor to the video processor: one size for all.
        loaded = [f if f.size == first else f.resize(first, Image.Resampling.BICUBIC)
                  for f in loaded]
    fps = part.get("fps", DEFAULT_VIDEO_FPS)
    if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps <= 0:
        raise UserError(f"a video's `fps` must be a positive number, found {fps!r}.",
                        where=where, fix="write the rate the frames were sampled at, e.g. 2.")
    part["video"] = [str(f) for f in frames]
    return _Media(VIDEO, loaded, float(fps))


# ---- pixels ------------------------------------------------------------------------------


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
    ones give `[k, C, H, W]` (k > 1 only for Gemma 3's pan-and-scan crops, each a tower
    input of its own): each is stored as one row of C*H*W values, with grid `(0, H, W)`; the
    0 says "a whole image, not a patch grid" (runtime/batches.py reads it back as one).
    """
    out = vp.image_processor(images=[image], return_tensors="np")
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    if vp.patched:
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
                fix="use a LLaVA, Gemma 3 or Qwen-VL processor with transformers >= 5.") from None
        merge = int(vp.image_processor.merge_size) ** 2
        replacement = vp.image_token * (int(np.prod(grids[0])) // merge)
    return _Encoded(pixels, grids, replacement)  # type: ignore[arg-type]


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


# ---- one record -> one document ----------------------------------------------------------


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
    vp = _as_vision_processor(processor)
    spec = spec or _default_spec(vp)
    if not spec.template:
        spec = replace(spec, template=vp.chat_template)
    tok = vp.tokenizer
    turns = _messages(record, spec, where)
    media = _collect_media(turns, vp, base_dir, where)
    text, spans = formats.chat_target_spans(tok, spec, turns, where)

    encoded, kinds, seconds = [], [], []
    for item in media:
        if item.kind == IMAGE:
            encoded.append(_image_pixels(vp, item.frames[0], where))
        else:
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
    markers = ("<|vision_start|>", "<|vision_end|>", vp.image_token,
               getattr(tok, "boi_token", None), getattr(tok, "eoi_token", None))
    vocab = tok.get_vocab()
    never = {vocab[m] for m in markers if m and m in vocab}
    labels = [IGNORE_INDEX if ty != TEXT or t in never else lab
              for t, lab, ty in zip(ids, labels, types, strict=True)]
    pixel_values = (np.concatenate([e.pixels for e in encoded]) if encoded else
                    np.zeros((0, _patch_dim(vp)), dtype=np.float32))
    grids = [g for e in encoded for g in e.grids]
    grid_kinds = [k for e, k in zip(encoded, kinds, strict=True) for _ in e.grids]
    return VisionDocument(ids, labels, types, pixel_values, grids, where, grid_kinds, seconds)


def _patch_dim(vp: VisionProcessor) -> int:
    if not vp.patched:  # one row per whole image
        return int(np.prod(vp.image_shape))
    ip = vp.image_processor
    return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2


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


# ---- packing -----------------------------------------------------------------------------


def check_fits(doc: VisionDocument, sequence_len: int) -> None:
    """A document longer than a row cannot be trained: it is never split (an image cut
    between rows would lose its features' other half), so say what makes it long."""
    if len(doc) <= sequence_len:
        return
    raise UserError(
        f"this conversation is {len(doc):,} tokens, more than sequence_len {sequence_len:,}; "
        f"{doc.image_tokens:,} of them are image/video tokens for {len(doc.image_grid_thw)} "
        "image(s)/video(s), and a document with images is never split across rows.",
        where=doc.source,
        fix="shrink the images (`image_size`, or a smaller `max_pixels` in the processor's "
        "preprocessor_config.json: fewer patches per image), send fewer frames per video, or "
        "raise `sequence_len`.")


def pack_vision_documents(docs: list[VisionDocument], sequence_len: int) -> list[VisionRow]:
    """Rows of whole documents, first-fit-decreasing (the text packer's `ffd_bins`).

    Each row carries its documents' tokens, positions restarting at 0 per document, and the
    documents' pixels and grids concatenated in the row's document order, so the i-th
    image in the row's tokens is the i-th grid and the i-th block of `pixel_values`.
    """
    for doc in docs:
        check_fits(doc, sequence_len)
    return [vision_row([docs[i] for i in bin_])
            for bin_ in pack.ffd_bins([len(d) for d in docs], sequence_len)]


def vision_row(members: Sequence[VisionDocument]) -> VisionRow:
    """One row of `members`, in that order (`prepare` packs in chunks with this, so its rows
    are exactly `pack_vision_documents`')."""
    row = pack.make_row((d.input_ids, d.labels, list(range(len(d)))) for d in members)
    pixels = [d.pixel_values for d in members if len(d.pixel_values)]
    return VisionRow(
        input_ids=row["input_ids"], labels=row["labels"], position_ids=row["position_ids"],
        mm_token_type_ids=[t for d in members for t in d.mm_token_type_ids],
        pixel_values=(np.concatenate(pixels) if pixels else
                      np.zeros((0, members[0].pixel_values.shape[-1]), dtype=np.float32)),
        image_grid_thw=[g for d in members for g in d.image_grid_thw],
        media_kinds=[k for d in members for k in d.media_kinds],
        second_per_grid_ts=[s for d in members for s in d.second_per_grid_ts],
        image_counts=[len(d.image_grid_thw) for d in members],
        sources=[d.source for d in members])


# ---- the Arrow layout of documents and rows (prepare's samples file and the cache) ---------
#
# Rows of a vision run hold, besides the text columns, the row's pixel patches flattened
# (`pixel_values`, `pixel_dim` wide), one [t, h, w] grid per image/video in row order, the
# kind of each (1 image, 2 video) and each video's seconds per temporal patch. A whole-image
# processor's image (LLaVA, Gemma 3) is one row of C*H*W values with the grid (0, H, W): no
# patch grid has t = 0, so the trainer reads these back as `[images, C, H, W]`. Which tokens
# are vision tokens is not stored: it is `input_ids == image/video feature token id`, exactly
# what `mm_token_type_ids` was computed from.

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "pixel_values", "pixel_dim",
               "image_grid_thw", "media_kinds", "second_per_grid_ts")
# The intermediate documents keep their vision-token types and source (for errors).
DOC_COLUMNS = ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "pixel_dim",
               "image_grid_thw", "media_kinds", "second_per_grid_ts", "source")


def _arrow_types() -> dict[str, Any]:
    import pyarrow as pa

    return {"input_ids": pa.list_(pa.int32()), "labels": pa.list_(pa.int32()),
            "position_ids": pa.list_(pa.int32()), "mm_token_type_ids": pa.list_(pa.int8()),
            "pixel_values": pa.list_(pa.float32()), "pixel_dim": pa.int32(),
            "image_grid_thw": pa.list_(pa.list_(pa.int32())), "media_kinds": pa.list_(pa.int8()),
            "second_per_grid_ts": pa.list_(pa.float32()), "source": pa.string()}


def features(columns: Sequence[str]) -> Any:
    """`datasets.Features` of `columns` (ROW_COLUMNS or DOC_COLUMNS)."""
    from datasets import Features, List, Value

    kinds = {"input_ids": List(Value("int32")), "labels": List(Value("int32")),
             "position_ids": List(Value("int32")), "mm_token_type_ids": List(Value("int8")),
             "pixel_values": List(Value("float32")), "pixel_dim": Value("int32"),
             "image_grid_thw": List(List(Value("int32"))), "media_kinds": List(Value("int8")),
             "second_per_grid_ts": List(Value("float32")), "source": Value("string")}
    return Features({c: kinds[c] for c in columns})


def _pixels_array(blocks: Sequence[np.ndarray]) -> Any:
    """list<float32> of flattened pixel blocks, built from one buffer (no Python floats)."""
    import pyarrow as pa

    sizes = np.array([b.size for b in blocks], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = (np.concatenate([b.reshape(-1) for b in blocks]) if blocks else
            np.zeros(0)).astype(np.float32, copy=False)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat)).cast(
        pa.list_(pa.float32()))


def _table(items: Sequence[VisionDocument | VisionRow], columns: Sequence[str]) -> Any:
    import pyarrow as pa

    types = _arrow_types()
    data = {
        "input_ids": [x.input_ids for x in items], "labels": [x.labels for x in items],
        "position_ids": [getattr(x, "position_ids", None) for x in items],
        "mm_token_type_ids": [x.mm_token_type_ids for x in items],
        "pixel_dim": [int(x.pixel_values.shape[-1]) for x in items],
        "image_grid_thw": [[list(g) for g in x.image_grid_thw] for x in items],
        "media_kinds": [x.media_kinds for x in items],
        "second_per_grid_ts": [x.second_per_grid_ts for x in items],
        "source": [getattr(x, "source", None) for x in items],
    }
    arrays = [_pixels_array([x.pixel_values for x in items]) if c == "pixel_values"
              else pa.array(data[c], type=types[c]) for c in columns]
    return pa.Table.from_arrays(arrays, schema=pa.schema([(c, types[c]) for c in columns]))


def rows_table(rows: Sequence[VisionRow]) -> Any:
    """The cache's columns (ROW_COLUMNS) of `rows`, as a pyarrow Table."""
    return _table(rows, ROW_COLUMNS)


def docs_table(docs: Sequence[VisionDocument]) -> Any:
    """`docs` as prepare's intermediate samples (DOC_COLUMNS), a pyarrow Table."""
    return _table(docs, DOC_COLUMNS)


def docs_from_table(table: Any) -> list[VisionDocument]:
    """The documents of a DOC_COLUMNS table (what `docs_table` wrote)."""
    column = table.column("pixel_values").combine_chunks()
    # `values` and `offsets` index the same child array whatever the list array's own
    # offset (`flatten()` starts at its first value, so it pairs with offsets from 0 only).
    flat = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    dims = table.column("pixel_dim").to_pylist()
    get = {c: table.column(c).to_pylist() for c in DOC_COLUMNS
           if c not in ("pixel_values", "pixel_dim")}
    return [VisionDocument(
        input_ids=get["input_ids"][i], labels=get["labels"][i],
        mm_token_type_ids=get["mm_token_type_ids"][i],
        pixel_values=np.asarray(flat[offsets[i]:offsets[i + 1]], dtype=np.float32
                                ).reshape(-1, dims[i]),
        image_grid_thw=[tuple(g) for g in get["image_grid_thw"][i]],  # type: ignore[misc]
        source=get["source"][i], media_kinds=get["media_kinds"][i],
        second_per_grid_ts=get["second_per_grid_ts"][i]) for i in range(table.num_rows)]


def text_document(ids: list[int], labels: list[int], patch_dim: int, source: str
                  ) -> VisionDocument:
    """A text-only sample (another dataset type in a vision run) as a document."""
    return VisionDocument(list(ids), list(labels), [TEXT] * len(ids),
                          np.zeros((0, patch_dim), dtype=np.float32), [], source)


def patch_dim(processor: Any) -> int:
    """Width of one row of pixel_values: a patch (3 * temporal_patch_size * patch_size**2) for
    the Qwen-VL processors, a whole image (C * H * W) for LLaVA's and Gemma 3's."""
    return _patch_dim(_as_vision_processor(processor))


# ---- a config's processor, and what identifies it ------------------------------------------

# Bump when the meaning of a cached vision row changes. 2: Qwen3-VL videos as timestamped
# runs per temporal patch (rows cached before would train ids its processor never writes).
VISION_VERSION = 2


def processor_folder(config: Any) -> str:
    """Where `config`'s processor is: `processor_path` (a relative one beside the config
    when it is there, as trl.reward_funcs models are found, else as given), else
    `base_model`."""
    if config.vision.processor_path:
        given = Path(config.vision.processor_path).expanduser()
        beside = Path(config.source_dir or ".") / given
        return str(beside if not given.is_absolute() and beside.is_dir() else given)
    if config.model.base_model:
        return str(config.model.base_model)
    raise UserError("`processor_type` is set but there is no folder to load the processor "
                    "from: `base_model` is not set.", where="processor_path",
                    fix="set `processor_path:` to the folder of the model's processor files "
                    "(preprocessor_config.json, tokenizer files, chat template).")


def run_tokenizer(config: Any) -> tuple[Any, Any]:
    """The tokenizer a run reads with, and what is saved beside its weights (in `final/`, a
    checkpoint, a merged model): a vision-language run's processor's tokenizer and its
    processor files (`ProcessorFiles`), else the run's tokenizer for both. Train, eval,
    generate and merge-lora read through this one rule."""
    from longctx_cli.data.tokenizer import load_tokenizer

    if not config.trains_images:
        tok = load_tokenizer(config)
        return tok, tok
    processor = load_config_processor(config)
    return processor.tokenizer, ProcessorFiles(processor, processor_folder(config))


def load_config_processor(config: Any) -> VisionProcessor:
    """The processor of a vision run, with the config's special_tokens, a pad token and a
    chat template on its tokenizer (so `chat_template: tokenizer_default` means the
    processor's own template, as for a text model's tokenizer)."""
    from longctx_cli.data.tokenizer import apply_special_tokens, ensure_pad_token

    vp = load_processor(processor_folder(config), image_size=config.vision.image_size,
                        image_resize_algorithm=config.vision.image_resize_algorithm)
    tok = vp.tokenizer
    if not isinstance(getattr(tok, "chat_template", None), str) and vp.chat_template:
        tok.chat_template = vp.chat_template
    apply_special_tokens(tok, config)
    ensure_pad_token(tok)
    return vp


def processor_fingerprint(vp: VisionProcessor) -> dict[str, Any]:
    """What of a loaded processor decides the documents, besides its tokenizer (fingerprinted
    as a text run's): the image processor's settings, the template, the video budget."""
    import hashlib

    import PIL

    def short(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    ip = vp.image_processor
    settings = ip.to_dict() if hasattr(ip, "to_dict") else vars(ip)
    return {"class": type(vp.processor).__name__, "image_processor": type(ip).__name__,
            "settings": short(json.dumps(settings, sort_keys=True, default=str)),
            "chat_template": short(vp.chat_template), "video_size": vp.video_size,
            "tokens": [vp.image_token, vp.video_token], "version": VISION_VERSION,
            "pillow": PIL.__version__}  # its resize filters make the pixels


# ---- the records of a dataset entry, and the files they name --------------------------------


def entry_records(source: Any, entry: Any, cache_dir: str | None, seed: int
                  ) -> tuple[int, Any]:
    """(number of records, iterator of (record index, record, folder its relative image
    paths are read from)) of one dataset entry, after its `shards` selection.

    JSON files are read line by line, not by `datasets`: a conversation whose `content` is
    a string in one turn and a list of parts in another is one Arrow column of two types,
    which `datasets` refuses. Other sources go through `load.load_records`.
    """
    from longctx_cli.data import load

    if source.kind == "files" and source.builder == "json":
        load.prescan(source)
        counts, files = [], []
        for f in source.files:
            lines = source.line_numbers.get(f)
            counts.append(len(lines) if lines is not None else len(_json_array(f)))
            files.append(f)
        total = sum(counts)
        keep = _shard(total, entry, seed)

        def from_json() -> Any:
            i = 0
            for f in files:
                records = (_jsonl(f) if source.line_numbers.get(f) is not None
                           else iter(_json_array(f)))
                for record in records:
                    if keep is None or i in keep:
                        yield i, record, f.parent
                    i += 1

        return (total if keep is None else len(keep)), from_json()
    records = load.load_records(source, entry, cache_dir=cache_dir)
    base = (source.files[0].parent if source.kind == "files" and source.files
            else Path(source.label) if source.kind == "disk" else Path("."))
    keep = _shard(len(records), entry, seed)
    order = range(len(records)) if keep is None else sorted(keep)
    return len(order), ((i, records[i], base) for i in order)


def _shard(total: int, entry: Any, seed: int) -> set[int] | None:
    """The record indices of the entry's shard, as the text path picks them."""
    if entry.shards is None:
        return None
    order = np.random.default_rng(seed).permutation(total)
    return {int(i) for i in np.array_split(order, entry.shards)[entry.shards_idx]}


def _jsonl(f: Path) -> Any:
    with open(f, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def _json_array(f: Path) -> list[Any]:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError:  # JSON Lines saved as .json
        return list(_jsonl(f))
    return data if isinstance(data, list) else [data]


def referenced_files(record: Any, base_dir: Path) -> list[Path]:
    """Every local file a record's strings name (paths, as `load_image` resolves them, and
    file:// URLs), for the cache's fingerprint: a changed image must rebuild the cache even
    where its path stays. Any string that names an existing file counts, so no source key
    is missed; a stray match only hashes one more file."""
    found: list[Path] = []

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, list):
            for v in value:
                visit(v)
        elif isinstance(value, str) and 0 < len(value) < 4096 and "\n" not in value:
            text = value
            if text.lower().startswith("file://"):
                parsed = urlparse(text)
                text = unquote(parsed.netloc + parsed.path)
            elif "://" in text or text.startswith("data:"):
                return
            try:
                path = Path(text).expanduser()
                path = path if path.is_absolute() else base_dir / path
                if path.is_file():
                    found.append(path)
            except (OSError, ValueError):
                return

    visit(record)
    return found


class ProcessorFiles:
    """What a vision-language checkpoint saves beside its weights: the processor's files
    (tokenizer, image processor, chat template), under the processor class the model's own
    folder names, so `AutoProcessor.from_pretrained` loads them as it loads the original.
    (Without torchvision, `load_processor` builds an image-only subclass; that name must not
    reach the checkpoint.)"""

    def __init__(self, processor: VisionProcessor, source: str | Path):
        self.processor = processor.processor
        self.source = Path(source)

    def original_class(self, name: str) -> str:
        """The `processor_class` the source folder's `name` file gives (else the class the
        image-only one extends)."""
        path = self.source / name
        if path.is_file():
            given = json.loads(path.read_text()).get("processor_class")
            if given:
                return str(given)
        return type(self.processor).__bases__[0].__name__

    def save_pretrained(self, folder: str | Path) -> None:
        self.processor.save_pretrained(str(folder))
        if type(self.processor).__name__ != "ImageOnlyQwenVLProcessor":
            return
        for name in ("processor_config.json", "preprocessor_config.json"):
            path = Path(folder) / name
            if path.is_file():
                saved = json.loads(path.read_text())
                if "processor_class" in saved:
                    saved["processor_class"] = self.original_class(name)
                    path.write_text(json.dumps(saved, indent=2) + "\n")


def encode_vision_prompt(record: dict[str, Any], processor: Any, where: str, *,
                         base_dir: Path) -> VisionDocument:
    """A generation prompt: the record's turns as training renders them, then the chat
    template's generation prompt (what `add_generation_prompt=True` appends)."""
    vp = _as_vision_processor(processor)
    doc = encode_vision_record(record, vp, where, base_dir=base_dir)
    tok, probe = vp.tokenizer, [{"role": "user", "content": "x"}]
    plain = tok.apply_chat_template(probe, tokenize=False, chat_template=vp.chat_template)
    full = tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                   chat_template=vp.chat_template)
    suffix = tok.encode(full[len(plain):], add_special_tokens=False)
    return replace(doc, input_ids=doc.input_ids + suffix,
                   labels=doc.labels + [IGNORE_INDEX] * len(suffix),
                   mm_token_type_ids=doc.mm_token_type_ids + [TEXT] * len(suffix))


def with_absolute_paths(record: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """`record` with every relative image or frame path made absolute against `base_dir`
    (a prompt file read elsewhere than where it lies keeps its images)."""
    def fix(value: Any) -> Any:
        if isinstance(value, str) and value and not value.startswith(("data:", "file:", "http")):
            path = Path(value).expanduser()
            return str(path if path.is_absolute() else base_dir / path) if (
                (base_dir / path).exists() or path.exists()) else value
        return value

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (walk(v) if k not in ("path", "image", "video") else
                        [fix(x) for x in v] if isinstance(v, list) else fix(v))
                    if k != "text" else v for k, v in node.items()}
        if isinstance(node, list):
            return [walk(x) for x in node]
        return node

    out = walk(record)
    if isinstance(out.get("images"), list):
        out["images"] = [fix(x) for x in out["images"]]
    return out
