"""Image I/O: an image part's source (path, file URL, base64, PIL image) opened, and
Axolotl's `image_size` resize."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from longctx_cli.data import formats
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from PIL import Image as PILImage


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
