"""A tiny Qwen2.5-VL-style processor written to a folder, offline (no hub, no torchvision).

Tests of the vision data path need a real Hugging Face processor to compare against: the
image processor is transformers' own `Qwen2VLImageProcessorPil` with a small pixel budget
(images of a few dozen patches), the tokenizer a byte-level BPE trained here on a few lines
that carries Qwen's chat and vision special tokens, and the chat template renders image and
video parts the way Qwen2.5-VL's does (`<|vision_start|><|image_pad|><|vision_end|>`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _load_example():
    """examples/vlm_images.py, which writes a processor's files (one place for that layout
    and for Qwen's special tokens)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "vlm_images.py"
    spec = importlib.util.spec_from_file_location("vlm_images", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _load_example()
# The special tokens of Qwen2-VL/2.5-VL's tokenizer that the data path relies on.
VISION_SPECIALS, CHAT_SPECIALS = EXAMPLE.VISION_SPECIALS, EXAMPLE.CHAT_SPECIALS

# Qwen2.5-VL's template, in the same shape: a default system turn when none is given, string
# content as is, list content part by part, images and videos as vision placeholders.
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = ["system\nYou are a helpful assistant.", "user\nDescribe this image.",
          "assistant\nThe image is a red square.", "What is in the picture? A cat."]


def tiny_tokenizer():
    """A byte-level BPE (any text encodes) with Qwen's chat and vision specials."""
    return EXAMPLE.train_tokenizer(CORPUS * 20, 400, CHAT_SPECIALS, VISION_SPECIALS,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")


def write_tiny_qwen_vl_processor(folder: str | Path, patch_size: int = 14,
                                 processor_class: str = "Qwen2_5_VLProcessor") -> Path:
    """Write the processor's files to `folder` as a Qwen2.5-VL checkpoint lays them out
    (tokenizer files, preprocessor_config.json, chat_template.jinja, processor_config.json
    naming `processor_class`): `AutoProcessor.from_pretrained(folder)` loads it where
    torchvision is installed, `longctx_cli.data.vision.load_processor(folder)` everywhere.
    Qwen3-VL's processor: `patch_size=16, processor_class="Qwen3VLProcessor"` (its images
    are patched and expanded as Qwen2.5-VL's, with 16-pixel patches)."""
    from transformers import Qwen2VLImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Merged patches of 2 x patch_size pixels, at most 16 per image: with 14-pixel patches a
    # 56x84 image becomes a 4x6 patch grid and 6 image tokens.
    side = 2 * patch_size
    EXAMPLE.save_qwen_vl_processor(
        folder, tiny_tokenizer(),
        Qwen2VLImageProcessorPil(patch_size=patch_size, min_pixels=side * side,
                                 max_pixels=side * side * 16),
        QWEN_VL_TEMPLATE, processor_class)
    return folder


# A tiny Qwen2.5-VL whose token ids are the fixture tokenizer's (<|vision_start|> 3,
# <|vision_end|> 4, <|image_pad|> 5, <|video_pad|> 6) and whose tower takes its 14-pixel patches.
QWEN2_5_VL = {
    "model_type": "qwen2_5_vl", "image_token_id": 5, "video_token_id": 6,
    "vision_start_token_id": 3, "vision_end_token_id": 4,
    "text_config": {
        "model_type": "qwen2_5_vl_text", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 448, "max_position_embeddings": 2048, "initializer_range": 0.2,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0},
    "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
}


# ---- LLaVA ---------------------------------------------------------------------------------

LLAVA_SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2, as the tiny models' configs have them
LLAVA_IMAGE_TOKEN = "<image>"  # id 3
# LLaVA-1.5's template in the same shape (`USER: <image>\ntext ASSISTANT: ...`), with string
# content as is and the end of sequence after each answer, as fine-tuning data has it.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_tiny_llava_processor(folder: str | Path, image_side: int = 16, patch_size: int = 4
                               ) -> Path:
    """A LLaVA processor's files in `folder`, offline: CLIP's image processor (resize the
    short side to `image_side`, centre-crop a square of it), a byte-level tokenizer with
    `<image>` as one token, LLaVA-1.5's processor settings (the tower's CLS feature dropped:
    one image token per patch, `(image_side / patch_size) ** 2` of them) and chat template.
    `AutoProcessor.from_pretrained(folder)` loads it as a `LlavaProcessor`."""
    from transformers import CLIPImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        [c.replace("\n", ": ") for c in CORPUS] * 20, 400, LLAVA_SPECIALS,
        (LLAVA_IMAGE_TOKEN,), pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    images = CLIPImageProcessorPil(size={"shortest_edge": image_side},
                                   crop_size={"height": image_side, "width": image_side})
    EXAMPLE.save_processor(folder, tokenizer, images, LLAVA_TEMPLATE, "LlavaProcessor",
                           "CLIPImageProcessor", patch_size=patch_size,
                           vision_feature_select_strategy="default",
                           num_additional_image_tokens=1, image_token=LLAVA_IMAGE_TOKEN)
    return folder


# ---- Gemma 3 -------------------------------------------------------------------------------

GEMMA3_SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
# The image tokens, as Gemma 3's tokenizer names them (its `boi_token`, `eoi_token`,
# `image_token` attributes): the template writes the first, the processor expands it.
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}
# Gemma 3's template in the same shape: <bos>, turns between <start_of_turn>/<end_of_turn>, the
# assistant written `model`, an image part as its begin-of-image token.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_tiny_gemma3_processor(folder: str | Path, image_side: int = 32,
                                image_seq_length: int = 16) -> Path:
    """A Gemma 3 processor's files in `folder`, offline: its image processor at
    `image_side` square pixels, a byte-level tokenizer with Gemma's turn and image tokens, and
    `image_seq_length` soft tokens per image (the model's `mm_tokens_per_image`).
    `AutoProcessor.from_pretrained(folder)` loads it as a `Gemma3Processor`."""
    from transformers import Gemma3ImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        CORPUS * 20, 400, GEMMA3_SPECIALS, tuple(GEMMA3_IMAGE_TOKENS.values()),
        pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        extra_special_tokens=dict(GEMMA3_IMAGE_TOKENS))
    images = Gemma3ImageProcessorPil(size={"height": image_side, "width": image_side})
    EXAMPLE.save_processor(folder, tokenizer, images, GEMMA3_TEMPLATE, "Gemma3Processor",
                           "Gemma3ImageProcessor", image_seq_length=image_seq_length)
    return folder


# ---- Gemma 4 -------------------------------------------------------------------------------

# Gemma 4's image and audio tokens, as its tokenizer names them (its processor reads all six:
# the template writes `image_token`, the processor puts `boi_token`/`eoi_token` around its run).
GEMMA4_MEDIA_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>",
                       "image_token": "<|image|>", "boa_token": "<|audio>",
                       "eoa_token": "<audio|>", "audio_token": "<|audio|>"}
# Gemma 3's template shape with Gemma 4's image placeholder.
GEMMA4_TEMPLATE = GEMMA3_TEMPLATE.replace("<start_of_image>", "<|image|>")


def write_tiny_gemma4_processor(folder: str | Path, patch_size: int = 2, pooling: int = 2,
                                max_soft_tokens: int = 70) -> Path:
    """A Gemma 4 processor's files in `folder`, offline: its PIL image processor (each image
    resized, aspect kept, to at most `max_soft_tokens` pooled tokens of `pooling` x `pooling`
    patches of `patch_size` pixels), a byte-level tokenizer with Gemma's turn tokens and its
    media tokens. Without torchvision `load_processor` builds it as an image-only
    `Gemma4Processor` (its own needs a video processor)."""
    from transformers import Gemma4ImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        CORPUS * 20, 400, GEMMA3_SPECIALS, tuple(GEMMA4_MEDIA_TOKENS.values()),
        pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        extra_special_tokens=dict(GEMMA4_MEDIA_TOKENS))
    images = Gemma4ImageProcessorPil(patch_size=patch_size, pooling_kernel_size=pooling,
                                     max_soft_tokens=max_soft_tokens)
    EXAMPLE.save_processor(folder, tokenizer, images, GEMMA4_TEMPLATE, "Gemma4Processor",
                           "Gemma4ImageProcessor", image_seq_length=max_soft_tokens)
    return folder


# ---- Llama 3.2 Vision (Mllama) --------------------------------------------------------------

MLLAMA_SPECIALS = ("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")
MLLAMA_IMAGE_TOKEN = "<|image|>"


def write_tiny_mllama_processor(folder: str | Path, tile: int = 8, tiles: int = 4) -> Path:
    """A Llama 3.2 Vision processor's files in `folder`, offline: its PIL image processor
    (each image resized to fit a canvas of at most `tiles` tiles of `tile` pixels, padded,
    cut into tiles, padded to `tiles` of them), a byte-level tokenizer with Llama 3's turn
    tokens and `<|image|>`, and longctx's `llama3_2_vision` chat template.
    `AutoProcessor.from_pretrained(folder)` loads it as a `MllamaProcessor`."""
    from transformers import MllamaImageProcessorPil

    from longctx_cli.data.chat_templates import TEMPLATES

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        CORPUS * 20, 400, MLLAMA_SPECIALS, (MLLAMA_IMAGE_TOKEN,),
        pad_token="<|finetune_right_pad_id|>", bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>")
    images = MllamaImageProcessorPil(size={"height": tile, "width": tile},
                                     max_image_tiles=tiles)
    EXAMPLE.save_processor(folder, tokenizer, images, TEMPLATES["llama3_2_vision"],
                           "MllamaProcessor", "MllamaImageProcessor")
    return folder


# ---- records and the processors' own encodings, shared by the data tests -------------------


def make_image(folder: Path, name: str, size: tuple[int, int], seed: int) -> Path:
    """A noisy RGB image (every patch different), saved as PNG; size is (width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def conversation() -> dict:
    """Two user turns with three images (img/a.png, img/b.png, img/c.png) and two answers."""
    return {"messages": [
        {"role": "user", "content": [
            {"type": "image", "path": "img/a.png"},
            {"type": "text", "text": "Describe this image."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
        {"role": "user", "content": [
            {"type": "text", "text": "And these?"},
            {"type": "image", "path": "img/b.png"},
            {"type": "image", "path": "img/c.png"}]},
        {"role": "assistant", "content": "A cat."},
    ]}


def hf_chat(vp, messages: list, base: Path, **kwargs):
    """The processor's own `apply_chat_template(tokenize=True)` (it loads the images, their
    paths taken relative to `base`)."""
    import copy

    messages = copy.deepcopy(messages)
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if "path" in part:
                part["path"] = str(base / part["path"])
    return vp.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_tensors="np", **kwargs)


def user_turn_trained(vp, base: Path, where: str, answers: str):
    """`conversation()` (images under `base`) trains exactly its assistant turns, which decode
    to `answers`; with its user turn marked `training` the user's text is trained too. Returns
    that second record, for the family's own check that no image token is a target."""
    import copy

    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.data import vision

    doc = vision.encode_vision_record(conversation(), vp, where, base_dir=base)
    targets = [t for t, lab in zip(doc.input_ids, doc.labels, strict=True)
               if lab != IGNORE_INDEX]
    assert vp.tokenizer.decode(targets) == answers
    record = copy.deepcopy(conversation())
    record["messages"][0]["training"] = True
    doc = vision.encode_vision_record(record, vp, where, base_dir=base)
    trained = vp.tokenizer.decode([lab for lab in doc.labels if lab != IGNORE_INDEX])
    assert "Describe this image." in trained
    return doc


def assert_generation_prompt_is_the_processors(vp, base: Path, where: str) -> None:
    """longctx's generation prompt of the first turn of `conversation()` (images under `base`)
    has the ids and pixels of the processor's own `apply_chat_template` with
    `add_generation_prompt`."""
    import numpy as np

    from longctx_cli.data import vision

    first = {"messages": conversation()["messages"][:1]}
    doc = vision.encode_vision_prompt(first, vp, where, base_dir=base)
    ref = hf_chat(vp, first["messages"], base, add_generation_prompt=True)
    assert doc.input_ids == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(doc.pixel_values.reshape(ref["pixel_values"].shape),
                                  ref["pixel_values"])


# ---- Mistral 3 (Pixtral's processor) -------------------------------------------------------

PIXTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")  # ids 0 .. 4
# Its image tokens, ids 5, 6, 7: an image placeholder becomes rows of [IMG] (one per merged
# patch), each row ended by [IMG_BREAK], the last by [IMG_END] instead.
PIXTRAL_IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Mistral's template in the same shape: <s>, user turns in [INST] ... [/INST] (an image part
# as [IMG]), each answer followed by </s>.
PIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "[/INST]{% else %}{{ message['content'] if message['content'] is string else "
    "message['content'][0]['text'] }}</s>{% endif %}{% endfor %}"
)


def write_tiny_pixtral_processor(folder: str | Path, longest_edge: int = 40,
                                 patch_size: int = 4, merge: int = 2) -> Path:
    """A Mistral 3 processor's files in `folder`, offline: Pixtral's image processor (each
    image resized to fit `longest_edge`, to multiples of a merged patch, `patch_size *
    merge` pixels), a byte-level tokenizer with Mistral's turn tokens and the three image
    tokens, and its chat template. `AutoProcessor.from_pretrained(folder)` loads it as a
    `PixtralProcessor`."""
    from transformers import PixtralImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        [c.replace("\n", " ") for c in CORPUS] * 20, 400, PIXTRAL_SPECIALS,
        PIXTRAL_IMAGE_TOKENS, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    images = PixtralImageProcessorPil(size={"longest_edge": longest_edge},
                                      patch_size={"height": patch_size, "width": patch_size})
    EXAMPLE.save_processor(folder, tokenizer, images, PIXTRAL_TEMPLATE, "PixtralProcessor",
                           "PixtralImageProcessor", patch_size=patch_size,
                           spatial_merge_size=merge)
    return folder


# ---- GLM-4.6V --------------------------------------------------------------------------------

GLM_SPECIALS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")
GLM_VISION_SPECIALS = ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>",
                       "<|begin_of_video|>", "<|end_of_video|>", "<|video|>")
# GLM-4.6V's template in the same shape: `[gMASK]<sop>`, each turn after its role token, an
# image part as `<|begin_of_image|><|image|><|end_of_image|>` (its processor expands the
# `<|image|>`), a video part between the video markers.
GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tiny_glm46v_processor(folder: str | Path, version: str = "Glm46V") -> Path:
    """A GLM-4.6V processor's files in `folder`, offline: transformers' own
    `Glm46VImageProcessorPil` with a budget of at most 16 merged patches of 28 pixels (its
    budget counts the two frames of a temporal patch), a byte-level tokenizer with GLM's chat
    and vision tokens, GLM's template shape. `longctx_cli.data.vision.load_processor(folder)`
    builds its `Glm46VProcessor` without the video processor (which needs torchvision).
    `version="Glm4v"`: GLM-4.1V's (and GLM-4.5V's) classes instead."""
    import transformers

    image_class = getattr(transformers, f"{version}ImageProcessorPil")

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    corpus = [c.replace("system\n", "<|system|>\n") for c in CORPUS] * 20
    tokenizer = EXAMPLE.train_tokenizer(corpus, 400, GLM_SPECIALS, GLM_VISION_SPECIALS,
                                        eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    frame = 28 * 28 * 2  # one merged patch of both frames
    images = image_class(size={"shortest_edge": frame, "longest_edge": frame * 16},
                         patch_size=14, merge_size=2, temporal_patch_size=2)
    EXAMPLE.save_processor(folder, tokenizer, images, GLM_TEMPLATE, f"{version}Processor",
                           f"{version}ImageProcessor")
    return folder


# ---- PaddleOCR-VL ------------------------------------------------------------------------

PADDLE_SPECIALS = ("<unk>", "<s>", "</s>", "<|begin_of_sentence|>", "<|end_of_sentence|>")
PADDLE_IMAGE_TOKENS = {"image_token": "<|IMAGE_PLACEHOLDER|>"}
# PaddleOCR-VL's template in the same shape: `User:`/`Assistant:` turns, an image part as
# `<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>` (its processor expands the middle one).
PADDLE_TEMPLATE = (
    "<|begin_of_sentence|>{% for message in messages %}"
    "{{ 'User: ' if message['role'] == 'user' else 'Assistant: ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}<|end_of_sentence|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def write_tiny_paddleocr_vl_processor(folder: str | Path) -> Path:
    """A PaddleOCR-VL processor's files in `folder`, offline: transformers' own
    `PaddleOCRVLImageProcessorPil` (one-frame 14-pixel patches, at most 16 merged patches of
    28 pixels), a byte-level tokenizer naming `<|IMAGE_PLACEHOLDER|>` its `image_token`, and
    its template's shape. `AutoProcessor.from_pretrained(folder)` loads it (it has no video
    processor)."""
    from transformers import PaddleOCRVLImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        CORPUS * 20, 400, PADDLE_SPECIALS,
        ("<|IMAGE_START|>", "<|IMAGE_END|>", *PADDLE_IMAGE_TOKENS.values()),
        bos_token="<s>", eos_token="</s>", pad_token="<unk>",
        extra_special_tokens=dict(PADDLE_IMAGE_TOKENS))
    images = PaddleOCRVLImageProcessorPil(size={"shortest_edge": 28 * 28,
                                                "longest_edge": 28 * 28 * 16})
    EXAMPLE.save_processor(folder, tokenizer, images, PADDLE_TEMPLATE, "PaddleOCRVLProcessor",
                           "PaddleOCRVLImageProcessor")
    return folder


# ---- SmolVLM -------------------------------------------------------------------------------

SMOLVLM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<end_of_utterance>")  # ids 0, 1, 2
# Its image tokens: the placeholder (one per feature), the marker around each image and
# before each tile, the thumbnail's marker, and one marker per tile position (ids 3, 4, ...).
SMOLVLM_IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>",
                        *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)))
# SmolVLM's template in the same shape: `<|im_start|>User:<image>text<end_of_utterance>\n`.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def write_tiny_smolvlm_processor(folder: str | Path, tile: int = 16, patch_size: int = 4,
                                 scale_factor: int = 2, longest_edge: int = 48) -> Path:
    """A SmolVLM processor's files in `folder`, offline: its image processor splitting each
    image into `tile`-pixel tiles (at most `longest_edge` pixels a side) plus a thumbnail, a
    byte-level tokenizer with its image and tile tokens, and `image_seq_len` tokens per tile
    (`(tile / patch_size) ** 2 / scale_factor ** 2`, the model's pixel shuffle).
    `AutoProcessor.from_pretrained(folder)` loads it as a `SmolVLMProcessor` where
    torchvision and num2words are installed; `load_processor` everywhere."""
    from transformers import SmolVLMImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        [c.replace("\n", ": ") for c in CORPUS] * 20, 400, SMOLVLM_SPECIALS,
        SMOLVLM_IMAGE_TOKENS, pad_token="<|endoftext|>", bos_token="<|im_start|>",
        eos_token="<end_of_utterance>")
    images = SmolVLMImageProcessorPil(do_image_splitting=True,
                                      size={"longest_edge": longest_edge},
                                      max_image_size={"longest_edge": tile})
    EXAMPLE.save_processor(folder, tokenizer, images, SMOLVLM_TEMPLATE, "SmolVLMProcessor",
                           "SmolVLMImageProcessor",
                           image_seq_len=(tile // patch_size) ** 2 // scale_factor**2)
    return folder


# ---- InternVL ------------------------------------------------------------------------------

INTERNVL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
# Its image tokens as its tokenizer names them: `<img>` and `</img>` around each image, one
# `<IMG_CONTEXT>` per feature (what the template writes for an image), and its video token.
INTERNVL_IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                         "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
# InternVL's template in the same shape: ChatML turns, an image part as `<IMG_CONTEXT>\n`.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'video' %}<video>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_internvl_processor(folder: str | Path, tile: int = 16,
                                  image_seq_length: int = 4, max_patches: int = 6) -> Path:
    """An InternVL processor's files in `folder`, offline: GOT-OCR2's image processor
    cropping each image into up to `max_patches` tiles of `tile` pixels (the grid nearest its
    aspect ratio) plus a thumbnail, a byte-level tokenizer with its image tokens, and
    `image_seq_length` `<IMG_CONTEXT>` tokens per tile (the model's pixel-shuffled tokens).
    `AutoProcessor.from_pretrained(folder)` loads it as an `InternVLProcessor` where
    torchvision is installed (its video processor); `load_processor` everywhere."""
    from transformers import GotOcr2ImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = EXAMPLE.train_tokenizer(
        CORPUS * 20, 400, INTERNVL_SPECIALS, tuple(INTERNVL_IMAGE_TOKENS.values()),
        pad_token="<|endoftext|>", eos_token="<|im_end|>",
        extra_special_tokens=dict(INTERNVL_IMAGE_TOKENS))
    images = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile},
                                      crop_to_patches=True, max_patches=max_patches)
    EXAMPLE.save_processor(folder, tokenizer, images, INTERNVL_TEMPLATE, "InternVLProcessor",
                           "GotOcr2ImageProcessor", image_seq_length=image_seq_length)
    return folder
