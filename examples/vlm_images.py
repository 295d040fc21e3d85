"""Write the data of the vision-language example (`examples/tiny_vlm.yaml`), offline.

    python examples/vlm_images.py examples/data/vlm

Each record shows a row of labelled images (`A:` then an image, `B:` then an image, ...).
One of them is red, the others have other colours; the question asks which one is red,
and the answer is its label. The model must look at every image of the row and copy the
label in front of the red one.

The folder gets `train.jsonl`, `test.jsonl`, one image per colour (`images/`) and a tiny
processor: Qwen2.5-VL's image processor with a small pixel budget (a 28x28 image is one
image token) and a byte-level tokenizer trained here, with Qwen's chat and vision tokens.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LABELS = "ABCDEFGHIJKLMNOPQRSTUVWX"  # one token each, up to 24 images a record
COLOURS = {
    "red": (210, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210),
    "yellow": (230, 210, 40), "purple": (140, 50, 170), "orange": (240, 140, 30),
}
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-VL's chat template in the same shape: image parts become vision placeholders.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TARGET = "red"
QUESTION = "Which one is red?"


def write_processor(folder: Path) -> None:
    """Tokenizer, image processor and chat template, as a Qwen2.5-VL checkpoint has them."""
    from transformers import Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    # Labels and the question only: every label stays a token of its own.
    tokenizer = train_tokenizer([f"user\n{QUESTION}", "assistant\n", "system\n"] * 10, 300,
                                CHAT_SPECIALS, VISION_SPECIALS, eos_token="<|im_end|>",
                                pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28)
    save_qwen_vl_processor(folder, tokenizer, images, TEMPLATE)


def train_tokenizer(corpus: list[str], vocab_size: int, specials: tuple[str, ...],
                    extra_specials: tuple[str, ...], **tokens: object):
    """A byte-level BPE (any text encodes) trained on `corpus`, with `specials` then
    `extra_specials` as single tokens (ids 0, 1, ... in that order); `tokens` names the
    tokenizer's special-token attributes (eos_token=..., extra_special_tokens=...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[*specials, *extra_specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw,
                                   additional_special_tokens=list(extra_specials), **tokens)


def save_qwen_vl_processor(folder: Path, tokenizer, image_processor, template: str,
                           processor_class: str = "Qwen2_5_VLProcessor") -> None:
    """The files of a Qwen-VL processor, laid out as its checkpoints have them."""
    save_processor(folder, tokenizer, image_processor, template, processor_class,
                   "Qwen2VLImageProcessor")


def save_processor(folder: Path, tokenizer, image_processor, template: str,
                   processor_class: str, image_processor_type: str, **processor_config) -> None:
    """A processor's files as its checkpoints lay them out: tokenizer files,
    preprocessor_config.json naming the image processor (the class name without its
    backend suffix, as the hub's files have it), processor_config.json naming the processor
    class and its own settings, chat_template.jinja."""
    tokenizer.save_pretrained(str(folder))
    image_processor.save_pretrained(str(folder))
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config.update(image_processor_type=image_processor_type, processor_class=processor_class)
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    (folder / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class, **processor_config}, indent=2))
    (folder / "chat_template.jinja").write_text(template)


def record(rng: random.Random, count: int) -> tuple[dict, str]:
    """One record of `count` labelled images, one of them red (each colour is one file,
    `images/<colour>.png`)."""
    others = sorted(set(COLOURS) - {TARGET})
    answer = rng.randrange(count)
    parts: list[dict] = []
    for i in range(count):
        colour = TARGET if i == answer else rng.choice(others)
        parts += [{"type": "text", "text": f"{LABELS[i]}:"},
                  {"type": "image", "path": f"images/{colour}.png"}]
    parts.append({"type": "text", "text": QUESTION})
    label = LABELS[answer]
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": label}]}, label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--train", type=int, default=1200, help="training records")
    parser.add_argument("--test", type=int, default=100, help="held-out records")
    parser.add_argument("--images", type=int, default=16, help="images per record (<= 24)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    from PIL import Image

    images = args.folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    for colour, rgb in COLOURS.items():
        Image.new("RGB", (28, 28), rgb).save(images / f"{colour}.png")
    write_processor(args.folder / "processor")
    for split, n in (("train", args.train), ("test", args.test)):
        with open(args.folder / f"{split}.jsonl", "w") as out:
            for _ in range(n):
                out.write(json.dumps(record(rng, args.images)[0]) + "\n")
    print(f"wrote {args.train} + {args.test} records of {args.images} images to {args.folder}")


if __name__ == "__main__":
    main()
