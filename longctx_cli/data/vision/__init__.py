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
image per row with the grid `(0, H, W)` (see the Arrow layout below); tiling ones (SmolVLM,
InternVL) store each image's tiles and thumbnail so, one tower input per row.

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

The package, by concern: documents.py (documents, rows, packing, the Arrow layout),
processor.py (loading and identifying the processor), images.py (image I/O), records.py
(record parsing, a dataset entry's records), tokens.py (a record's tokens and pixels). The
processor of a run, with the run's special tokens, is data/tokenizer.py's
`load_config_processor`.
"""

from longctx_cli.data.tokenizer import load_config_processor
from longctx_cli.data.vision.documents import (
    DOC_COLUMNS,
    IMAGE,
    ROW_COLUMNS,
    TEXT,
    VIDEO,
    VisionDocument,
    VisionRow,
    check_fits,
    docs_from_table,
    docs_table,
    features,
    pack_vision_documents,
    rows_table,
    vision_row,
)
from longctx_cli.data.vision.images import load_image, resize_like_axolotl
from longctx_cli.data.vision.processor import (
    RESIZE_ALGORITHMS,
    VISION_VERSION,
    ProcessorFiles,
    VisionProcessor,
    image_only_processor_class,
    load_processor,
    patch_dim,
    processor_fingerprint,
    processor_folder,
)
from longctx_cli.data.vision.records import (
    DEFAULT_VIDEO_FPS,
    entry_records,
    referenced_files,
    with_absolute_paths,
)
from longctx_cli.data.vision.tokens import (
    encode_vision_prompt,
    encode_vision_record,
    text_document,
    video_pixels,
)

__all__ = [
    "DEFAULT_VIDEO_FPS", "DOC_COLUMNS", "IMAGE", "RESIZE_ALGORITHMS", "ROW_COLUMNS", "TEXT",
    "VIDEO", "VISION_VERSION", "ProcessorFiles", "VisionDocument", "VisionProcessor",
    "VisionRow", "check_fits", "docs_from_table", "docs_table", "encode_vision_prompt",
    "encode_vision_record", "entry_records", "features", "image_only_processor_class",
    "load_config_processor", "load_image", "load_processor", "pack_vision_documents",
    "patch_dim", "processor_fingerprint", "processor_folder", "referenced_files",
    "resize_like_axolotl", "rows_table", "text_document", "video_pixels", "vision_row",
    "with_absolute_paths",
]
