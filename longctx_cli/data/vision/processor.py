"""The processor of a vision run: loading it offline (without torchvision where
need be), Axolotl's resize keys, where a config's processor is, what identifies
it (the cache fingerprint) and what a checkpoint saves of it."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from longctx_cli.data.vision.documents import IMAGE, VIDEO
from longctx_cli.errors import UserError
from longctx_cli.families import IMAGE_ONLY_FAMILIES, MARKED_FAMILIES, VisionFamily

RESIZE_ALGORITHMS = ("bilinear", "bicubic", "lanczos")  # what Axolotl's schema accepts


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
    def family(self) -> VisionFamily | None:
        """The family whose processor this is, where its record names one (Qwen-VL, GLM)."""
        return processor_family(self.processor)

    @property
    def image_markers(self) -> tuple[str, ...]:
        """The tokens the processor writes around an image's tokens (Qwen's by default)."""
        family = self.family
        return family.image_markers if family else VisionFamily.image_markers

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

    @property
    def sized(self) -> bool:
        """True for image processors that keep each image at its own size and say it in
        `image_sizes` (Pixtral's): whole images, but not all of one shape."""
        return "image_sizes" in getattr(self.image_processor, "model_input_names", ())

    @property
    def positioned(self) -> bool:
        """True for image processors that give each image's patches with their (x, y) in
        `image_position_ids`, padded to a fixed patch budget (Gemma 4's)."""
        return "image_position_ids" in getattr(self.image_processor, "model_input_names", ())

    @property
    def tiled(self) -> bool:
        """True for image processors that cut each image into tiles padded to a fixed count,
        with its `aspect_ratio_ids` and `aspect_ratio_mask` (Mllama's)."""
        return "aspect_ratio_ids" in getattr(self.image_processor, "model_input_names", ())

    @property
    def marker_tokens(self) -> tuple[str, ...]:
        """The tokens the processor writes around or between an image's feature tokens
        (never targets): the family's image markers (Qwen-VL's vision start and end, GLM's
        begin and end of image), Gemma 3's begin and end of image, Pixtral's row breaks and
        image end, SmolVLM's marker around each image and tile and its thumbnail's, InternVL's
        `<img>` and `</img>` (SmolVLM's `<row_r_col_c>` tile positions: `tile_position_ids`)."""
        tok = self.tokenizer
        return tuple(m for m in (
            *self.image_markers, self.image_token,
            getattr(tok, "boi_token", None), getattr(tok, "eoi_token", None),
            *(getattr(self.processor, key, None) for key in (
                "image_break_token", "image_end_token", "fake_image_token",
                "global_image_token", "start_image_token", "end_image_token"))) if m)

    @functools.cached_property
    def image_shape(self) -> tuple[int, ...]:
        """(C, H, W) of every image a whole-image processor makes (its fixed input size),
        read from what it makes of a blank image."""
        from PIL import Image

        out = self.image_processor(images=[Image.new("RGB", (32, 32))], return_tensors="np",
                                   **self.images_kwargs)
        return tuple(int(x) for x in np.asarray(out["pixel_values"]).shape[-3:])

    @property
    def images_kwargs(self) -> dict[str, Any]:
        """What the processor's own `__call__` passes its image processor by default (its
        `images_kwargs`: SmolVLM's tile rows and columns, InternVL's tiles, Gemma 3's
        pan-and-scan off, Pixtral's merged-patch size), so that an image alone is processed
        as the processor does it."""
        given = dict(getattr(self.processor, "images_kwargs", None) or {})
        given.pop("return_tensors", None)
        if self.sized and hasattr(self.processor, "spatial_merge_size"):
            # Pixtral's resizes to multiples of a merged patch (`patch_size *
            # spatial_merge_size`, its `_process_images`), not of its image processor's own.
            given["patch_size"] = (int(self.processor.patch_size)
                                   * int(self.processor.spatial_merge_size))
        return given

    @property
    def chat_template(self) -> str:
        return (getattr(self.processor, "chat_template", None)
                or getattr(self.tokenizer, "chat_template", None) or "")




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
            if "torchvision" in str(first).lower():  # Pixtral's processor module imports it
                raise UserError(
                    f"cannot load the processor in {path}: transformers' "
                    f"{_processor_class(folder)} needs torchvision, which is not installed.",
                    fix="install the torchvision build that matches your torch "
                    "(`pip install torchvision`), as transformers asks.") from None
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
                        "Qwen3-VL, LLaVA, Gemma 3, Gemma 4, Mistral 3, GLM-4.6V, SmolVLM, "
                        "Llama 3.2 Vision, "
                        "InternVL) "
                        "whose preprocessor_config.json and tokenizer files are there.")
    return VisionProcessor(processor, size, resample, _video_size(folder, processor))


def _processor_class(folder: Path) -> str:
    """The processor class a folder's config files name (for messages)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            given = json.loads((folder / name).read_text()).get("processor_class")
            if given:
                return str(given)
    return "processor"


def processor_family(processor: Any) -> VisionFamily | None:
    """The family whose processor class `processor` is or extends (by the marker its record
    names in the class names; the last such record, as a later family's names hold an
    earlier one's), or None."""
    names = [c.__name__ for c in type(processor).__mro__]
    found = [f for f in MARKED_FAMILIES if any(f.processor_marker in n for n in names)]
    return found[-1] if found else None


def _image_only_processor(folder: Path) -> Any:
    """The folder's processor class without its video processor, with the family's own PIL
    image processor (see load_processor)."""
    import inspect

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    config, settings = {}, {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            config.update(json.loads((folder / name).read_text()))
    if (folder / "processor_config.json").is_file():  # the processor's own (image_seq_len)
        settings = json.loads((folder / "processor_config.json").read_text())
    kind = str(config.get("processor_class", "")) + str(config.get("image_processor_type", ""))
    if not any(f.processor_marker in kind for f in IMAGE_ONLY_FAMILIES):
        names = [f.name for f in IMAGE_ONLY_FAMILIES]
        raise UserError(
            f"cannot build the processor in {folder} ({kind or 'no processor_class'}): longctx "
            f"prepares vision data for {', '.join(names[:-1])} and {names[-1]} processors.",
            fix="use the folder of one of those models, or install torchvision if the "
            "processor needs it.")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
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
    family = [f for f in IMAGE_ONLY_FAMILIES if f.processor_marker in kind][-1]
    cls = image_only_processor_class(family.image_only_processor)
    if family.positions == "mrope":
        # Each family's image processor resizes by its own rule (GLM-4.6V's budget counts
        # two frames), so the family's class, not Qwen's.
        image_processor = getattr(transformers, family.image_processor_pil).from_pretrained(
            str(folder), local_files_only=True)
    else:  # transformers picks the PIL backend where torchvision is missing
        image_processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    own = {name for c in cls.__mro__[:2] for name in inspect.signature(c.__init__).parameters}
    extra = {k: v for k, v in settings.items()
             if k in own and k not in ("image_processor", "tokenizer", "video_processor",
                                       "feature_extractor", "chat_template", "self",
                                       "kwargs")}
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
               **extra)


@functools.cache
def image_only_processor_class(base: str = "Qwen2_5_VLProcessor") -> Any:
    """transformers' processor class `base` (Qwen2.5-VL's, Qwen3-VL's, which places video
    frames by timestamps, GLM-4.6V's, SmolVLM's, InternVL's or Gemma 4's, which also takes
    no audio feature extractor here) with no video processor
    attribute (built on first use, so that importing this module does not import
    transformers' models).

    ProcessorMixin reads a processor's parts from its `__init__` signature; dropping
    `video_processor` from it is what lets the class be built without torchvision. Its
    `__call__` (placeholder expansion, tokenizing, mm_token_type_ids) is transformers' own.
    """
    import transformers
    from transformers.processing_utils import ProcessorMixin

    parent = getattr(transformers, base)
    if base == "SmolVLMProcessor":
        class ImageOnlySmolVLMProcessor(parent):
            image_only_base = base

            def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                         image_seq_len: int = 169, chat_template: str | None = None,
                         **kwargs: Any):
                # SmolVLMProcessor's own attributes, as its __init__ sets them; that
                # __init__ also requires num2words, which only its video prompts use.
                self.fake_image_token = getattr(tokenizer, "fake_image_token",
                                                "<fake_token_around_image>")
                self.image_token = getattr(tokenizer, "image_token", "<image>")
                self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
                self.end_of_utterance_token = getattr(tokenizer, "end_of_utterance_token",
                                                      "<end_of_utterance>")
                self.global_image_token = getattr(tokenizer, "global_image_token",
                                                  "<global-img>")
                self.image_seq_len = image_seq_len
                self.video_token = getattr(tokenizer, "video_token", "<video>")
                ProcessorMixin.__init__(self, image_processor, tokenizer,
                                        chat_template=chat_template, **kwargs)

            def apply_chat_template(self, conversation: Any, chat_template: str | None = None,
                                    **kwargs: Any) -> Any:
                # SmolVLM's own adds its video processor's frame defaults: there is none.
                return ProcessorMixin.apply_chat_template(self, conversation, chat_template,
                                                          **kwargs)

        return ImageOnlySmolVLMProcessor

    if base == "Gemma4Processor":
        class ImageOnlyGemma4Processor(parent):
            image_only_base = base

            def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                         chat_template: str | None = None, image_seq_length: int = 280,
                         audio_seq_length: int = 750, audio_ms_per_token: int = 40,
                         **kwargs: Any):
                # Gemma4Processor's own attributes, as its __init__ sets them; that __init__
                # also takes an audio feature extractor and a video processor (torchvision).
                self.image_seq_length = image_seq_length
                self.image_token_id = tokenizer.image_token_id
                self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
                self.image_token = tokenizer.image_token
                tokenizer.add_special_tokens({"additional_special_tokens": ["<|video|>"]})
                self.video_token = "<|video|>"  # as its own adds it (videos are refused)
                self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
                self.audio_seq_length = audio_seq_length
                self.audio_ms_per_token = audio_ms_per_token
                for name in ("audio_token_id", "audio_token", "boa_token", "eoa_token"):
                    setattr(self, name, getattr(tokenizer, name, None))
                ProcessorMixin.__init__(self, image_processor, tokenizer,
                                        chat_template=chat_template, **kwargs)

        return ImageOnlyGemma4Processor

    class ImageOnlyProcessor(parent):
        image_only_base = base

        def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                     chat_template: str | None = None, **kwargs: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template,
                             **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{base}"
    return ImageOnlyProcessor


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


def as_vision_processor(processor: Any) -> VisionProcessor:
    return processor if isinstance(processor, VisionProcessor) else VisionProcessor(processor)


def _patch_dim(vp: VisionProcessor) -> int:
    if vp.sized:  # one row per pixel, its channels (images of any size)
        return int(vp.image_shape[0])
    if vp.positioned:  # one row per patch (Gemma 4's)
        return 3 * int(vp.image_processor.patch_size) ** 2
    if not vp.patched:  # one row per whole image
        return int(np.prod(vp.image_shape))
    ip = vp.image_processor
    return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2


def patch_dim(processor: Any) -> int:
    """Width of one row of pixel_values: a patch (3 * temporal_patch_size * patch_size**2) for
    the Qwen-VL processors, a whole image (C * H * W) for LLaVA's and Gemma 3's, one pixel's
    channels (C) for Pixtral's, whose images each keep their own size, a patch
    (3 * patch_size**2) for Gemma 4's."""
    return _patch_dim(as_vision_processor(processor))



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


def processor_fingerprint(vp: VisionProcessor) -> dict[str, Any]:
    """What of a loaded processor decides the documents, besides its tokenizer (fingerprinted
    as a text run's): the image processor's settings, the template, the video budget."""
    import hashlib

    import PIL

    def short(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    if hasattr(vp, "fingerprint"):  # mistral-common's image encoder (data/vision/mistral.py)
        return {**vp.fingerprint(), "version": VISION_VERSION}
    ip = vp.image_processor
    settings = ip.to_dict() if hasattr(ip, "to_dict") else vars(ip)
    return {"class": type(vp.processor).__name__, "image_processor": type(ip).__name__,
            "settings": short(json.dumps(settings, sort_keys=True, default=str)),
            "chat_template": short(vp.chat_template), "video_size": vp.video_size,
            "tokens": [vp.image_token, vp.video_token], "version": VISION_VERSION,
            "pillow": PIL.__version__}  # its resize filters make the pixels


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
        if getattr(type(self.processor), "image_only_base", None) is None:
            return
        for name in ("processor_config.json", "preprocessor_config.json"):
            path = Path(folder) / name
            if path.is_file():
                saved = json.loads(path.read_text())
                if "processor_class" in saved:
                    saved["processor_class"] = self.original_class(name)
                    path.write_text(json.dumps(saved, indent=2) + "\n")
