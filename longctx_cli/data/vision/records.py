"""Record parsing: a record's turns and their media in placeholder order (both
Axolotl layouts), the records of a dataset entry and the files they name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import numpy as np

from longctx_cli.data import formats
from longctx_cli.data.vision.documents import IMAGE, VIDEO
from longctx_cli.data.vision.images import load_image, resize_like_axolotl
from longctx_cli.data.vision.processor import VisionProcessor
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from PIL import Image as PILImage

# transformers' processors take a video given as frames to run at this rate when no fps is
# known (`VideoMetadata.sampled_fps`); Qwen2.5-VL turns it into `second_per_grid_ts`.
DEFAULT_VIDEO_FPS = 24.0
IMAGE_MARKER = "<image>"  # LLaVA-style marker of where a column image goes
SOURCE_KEYS = ("path", "url", "image", "base64")  # Axolotl's keys of an image part's source




@dataclass
class _Media:
    kind: int  # IMAGE or VIDEO
    frames: list[PILImage.Image]  # one for an image
    fps: float = DEFAULT_VIDEO_FPS


def default_spec(vp: VisionProcessor) -> formats.FormatSpec:
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


def record_messages(record: dict[str, Any], spec: formats.FormatSpec, where: str
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


def collect_media(turns: list[formats.Turn], vp: VisionProcessor, base_dir: Path,
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
