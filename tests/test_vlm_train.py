"""`longctx train` on image-bearing chats equals the model's own Hugging Face training.

A tiny Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3 or Gemma 4 and an offline processor
(tests/vlm_fixtures.py); a dozen records of one to three images each, packed into rows.
`longctx train` at sp 2 runs three optimizer steps; the reference trains a copy of the same
initial model on the rows `longctx train` read, each document through the model's own
`forward(pixel_values=..., labels=)`. The per-step losses and the final weights must agree,
and `final/` must load as the model's own class with its processor.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from longctx_cli.constants import IGNORE_INDEX
from tests.family_matrix import LOSS_TOL, WEIGHT_TOL, compare
from tests.train_helpers import run_longctx
from tests.vlm_fixtures import (
    QWEN2_5_VL,
    write_tiny_gemma3_processor,
    write_tiny_gemma4_processor,
    write_tiny_llava_processor,
    write_tiny_qwen_vl_processor,
)

STEPS = 3
IMAGE_ID, VIDEO_ID = 5, 6  # the fixture tokenizer's <|image_pad|>, <|video_pad|>
QWEN3_VL = {
    **{k: QWEN2_5_VL[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id")},
    "model_type": "qwen3_vl",
    "text_config": {
        **{k: v for k, v in QWEN2_5_VL["text_config"].items() if k != "rope_scaling"},
        "model_type": "qwen3_vl_text", "head_dim": 16,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True}},
    "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1]},
}

# Qwen3.5: gated delta-nets beside attention, Qwen3-VL's processor and tower (no deepstack).
QWEN3_5 = {
    **{k: QWEN3_VL[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id")},
    "model_type": "qwen3_5",
    "text_config": {
        **{k: v for k, v in QWEN3_VL["text_config"].items() if k != "rope_scaling"},
        "model_type": "qwen3_5_text", "head_dim": 32, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
                            "mrope_interleaved": True}},
    "vision_config": {k: v for k, v in QWEN3_VL["vision_config"].items()
                      if k != "deepstack_visual_indexes"},
}

# The reference's tower attention where the model's own eager and SDPA differ: Qwen3.5's
# tower gradients move by 3.5e-4 between the two at this seed (transformers' own code, both
# sides eager: 8e-6), and longctx runs every tower on SDPA (runtime/model.py).
TOWER_ATTENTION = {"qwen3_5": "sdpa"}


def _llava() -> dict:
    """tests/vlm_models.py's tiny LLaVA (16x16 images, 16 tokens each), with the fixture
    tokenizer's `<image>` id and room for its vocabulary."""
    from tests.vlm_models import _config

    config = json.loads(_config("llava").to_json_string(use_diff=True))
    config.pop("transformers_version", None)
    config["image_token_index"] = LLAVA_IMAGE_ID
    config["text_config"]["vocab_size"] = 448
    return config


def _gemma3() -> dict:
    """tests/vlm_models.py's tiny Gemma 3 (sliding layers of 6 tokens) at the fixture
    processor's 32x32 images pooled to 16 tokens, with its tokenizer's image token ids.
    Its projection starts at zero, as the model's own init makes it, so the tower gets no
    gradient at the first step on either side (test_vlm_runtime.py checks the tower's)."""
    from tests.vlm_models import _config

    config = json.loads(_config("gemma3").to_json_string(use_diff=True))
    config.pop("transformers_version", None)
    config.update(image_token_index=GEMMA3_IMAGE_ID, boi_token_index=5, eoi_token_index=6,
                  mm_tokens_per_image=FLAT_IMAGES["gemma3"][2])
    config["vision_config"]["image_size"] = FLAT_IMAGES["gemma3"][1]
    config["text_config"].update(vocab_size=448, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return config


def _gemma4() -> dict:
    """tests/vlm_models.py's tiny Gemma 4 (sliding and wider full layers, a KV-shared one,
    per-layer inputs, images both ways on the sliding layers) at the fixture processor's
    2-pixel patches pooled 2 x 2, with its tokenizer's image token ids and room for its
    vocabulary (and its images' patch positions, up to 22 along a side)."""
    from tests.vlm_models import _config

    config = json.loads(_config("gemma4").to_json_string(use_diff=True))
    config.pop("transformers_version", None)
    config.update(image_token_id=GEMMA4_IMAGE_ID, boi_token_id=5, eoi_token_id=6)
    config["vision_config"].update(patch_size=2, pooling_kernel_size=2,
                                   position_embedding_size=32)
    config["text_config"].update(vocab_size=448, vocab_size_per_layer_input=448,
                                 bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return config


VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")  # their records hold a video too
LLAVA_IMAGE_ID = 3  # the LLaVA fixture tokenizer's <image>
GEMMA3_IMAGE_ID = 7  # the Gemma 3 fixture tokenizer's <image_soft_token>
GEMMA4_IMAGE_ID = 7  # the Gemma 4 fixture tokenizer's <|image|>
# Fixed-size images: per family the image token id, the side, and the tokens per image.
FLAT_IMAGES = {"llava": (LLAVA_IMAGE_ID, 16, 16), "gemma3": (GEMMA3_IMAGE_ID, 32, 16)}
# Per family: the model, and its processor's patch size and class (tests/vlm_fixtures.py).
FAMILIES = {"qwen2_5_vl": (QWEN2_5_VL, 14, "Qwen2_5_VLProcessor"),
            "qwen3_vl": (QWEN3_VL, 16, "Qwen3VLProcessor"),
            "qwen3_5": (QWEN3_5, 16, "Qwen3VLProcessor"),
            "llava": (_llava(), 4, "LlavaProcessor"),
            "gemma3": (_gemma3(), 4, "Gemma3Processor"),
            "gemma4": (_gemma4(), 2, "Gemma4Processor")}


def _setup(tmp: Path, family: str) -> Path:
    from PIL import Image

    _, patch, processor_class = FAMILIES[family]
    if family == "llava":
        write_tiny_llava_processor(tmp / "processor", FLAT_IMAGES["llava"][1], patch)
    elif family == "gemma3":
        write_tiny_gemma3_processor(tmp / "processor", *FLAT_IMAGES["gemma3"][1:])
    elif family == "gemma4":
        write_tiny_gemma4_processor(tmp / "processor", patch)
    else:
        write_tiny_qwen_vl_processor(tmp / "processor", patch, processor_class)
    gen = torch.Generator().manual_seed(0)
    (tmp / "img").mkdir()
    with open(tmp / "data.jsonl", "w") as out:
        for i in range(12):
            parts = []
            for k in range(1 + i % 3):
                side = (28, 56, 84)[(i + k) % 3]
                pixels = torch.randint(0, 256, (side, 56, 3), generator=gen, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(tmp / "img" / f"{i}_{k}.png")
                parts.append({"type": "image", "path": f"img/{i}_{k}.png"})
            if i % 4 == 3 and family in VIDEO_FAMILIES:  # a video of 3 frames (padded to 4)
                frames = []
                for f in range(3):
                    pixels = torch.randint(0, 256, (56, 56, 3), generator=gen,
                                           dtype=torch.uint8)
                    Image.fromarray(pixels.numpy()).save(tmp / "img" / f"{i}_v{f}.png")
                    frames.append(f"img/{i}_v{f}.png")
                parts.append({"type": "video", "video": frames, "fps": 2})
            parts.append({"type": "text", "text": "Describe this image."})
            answer = ("The image is a red square.", "A cat.")[i % 2]
            out.write(json.dumps({"messages": [{"role": "user", "content": parts},
                                               {"role": "assistant", "content": answer}]}) + "\n")
    return tmp


def _config(tmp: Path, name: str, family: str, **layout: Any) -> Path:
    config = {
        "model_config": FAMILIES[family][0], "processor_type": "AutoProcessor",
        "processor_path": str(tmp / "processor"), "tokenizer": str(tmp / "processor"),
        "dtype": "float32", "seed": 3,
        "datasets": [{"path": str(tmp / "data.jsonl"), "type": "chat_template"}],
        "sequence_len": 256, "sample_packing": True,
        "dataset_prepared_path": str(tmp / "prepared"), "attention_kernel": "torch",
        "micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": STEPS,
        "learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_steps": 0,
        "adam_epsilon": 1e-6, "output_dir": str(tmp / name), "logging_steps": 1,
        "val_set_size": 0, "collective_timeout_s": 120, **layout,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _documents(row: dict, family: str) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """A cached row's documents, each with the model's own image and video inputs."""
    if family in FLAT_IMAGES:
        return _flat_documents(row, family)
    if family == "gemma4":
        return _positioned_documents(row)
    ids, pos, labels = (torch.tensor(row[k]) for k in ("input_ids", "position_ids", "labels"))
    pixels = torch.tensor(row["pixel_values"]).view(-1, row["pixel_dim"])
    grids = torch.tensor(row["image_grid_thw"], dtype=torch.long).view(-1, 3)
    kinds, seconds = list(row["media_kinds"]), list(row["second_per_grid_ts"])
    types = (ids == IMAGE_ID).long() + 2 * (ids == VIDEO_ID).long()
    starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
    docs, item, patch, video = [], 0, 0, 0
    for a, b in itertools.pairwise(starts):
        runs = [kind for kind, _ in itertools.groupby(types[a:b].tolist()) if kind]
        if family in ("qwen3_vl", "qwen3_5"):  # a video: a run per temporal patch, one item
            runs = _whole_videos(runs, grids[item:])
        kwargs: dict = {}
        for kind, key, grid_key in ((1, "pixel_values", "image_grid_thw"),
                                    (2, "pixel_values_videos", "video_grid_thw")):
            own = [item + i for i, k in enumerate(runs) if k == kind]
            if not own:
                continue
            assert all(kinds[i] == kind for i in own)
            offsets = [patch + int(grids[item:i].prod(-1).sum()) for i in own]
            kwargs[key] = torch.cat([pixels[o:o + int(grids[i].prod())]
                                     for o, i in zip(offsets, own, strict=True)])
            kwargs[grid_key] = grids[own]
            if kind == 2 and family == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = torch.tensor(seconds[video:video + len(own)])
                video += len(own)
        if runs:
            kwargs["mm_token_type_ids"] = types[a:b][None]
            patch += int(grids[item:item + len(runs)].prod(-1).sum())
            item += len(runs)
        docs.append((ids[a:b], labels[a:b], kwargs))
    assert item == len(grids) and patch == len(pixels)
    return docs


def _whole_videos(runs: list[int], grids: torch.Tensor) -> list[int]:
    """A Qwen3-VL document's runs with each video's temporal-patch runs taken as one item."""
    out, i = [], 0
    for grid in grids:
        if i == len(runs):
            break
        out.append(runs[i])
        i += int(grid[0]) if runs[i] == 2 else 1
    assert i == len(runs), (runs, grids)
    return out


def _flat_documents(row: dict, family: str) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """A cached LLaVA or Gemma 3 row's documents with their `pixel_values` `[images, 3, H,
    W]`: each image is one row of the stored pixels and a fixed count of image tokens in the
    text. Gemma 3's also take `token_type_ids`, which make its image tokens bidirectional."""
    image_id, side, per_image = FLAT_IMAGES[family]
    ids, pos, labels = (torch.tensor(row[k]) for k in ("input_ids", "position_ids", "labels"))
    assert row["image_grid_thw"] == [[0, side, side]] * len(row["image_grid_thw"])
    pixels = torch.tensor(row["pixel_values"]).view(-1, 3, side, side)
    starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
    docs, image = [], 0
    for a, b in itertools.pairwise(starts):
        tokens = int((ids[a:b] == image_id).sum())
        assert tokens % per_image == 0
        count = tokens // per_image
        kwargs = {"pixel_values": pixels[image:image + count]} if count else {}
        if family == "gemma3":
            kwargs["token_type_ids"] = (ids[a:b] == image_id).long()[None]
        docs.append((ids[a:b], labels[a:b], kwargs))
        image += count
    assert image == len(pixels)
    return docs


def _positioned_documents(row: dict) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """A cached Gemma 4 row's documents with the model's own inputs: each image's patches
    (grid `(-1, h, w)`, row-major) padded to the document's most, their (x, y) as
    `image_position_ids` ((-1, -1) on padding), and `mm_token_type_ids`, which make its
    image tokens attend both ways on the sliding layers."""
    ids, pos, labels = (torch.tensor(row[k]) for k in ("input_ids", "position_ids", "labels"))
    pixels = torch.tensor(row["pixel_values"]).view(-1, row["pixel_dim"])
    grids = [tuple(g) for g in row["image_grid_thw"]]
    assert all(t == -1 for t, _, _ in grids)
    patches = list(pixels.split([h * w for _, h, w in grids])) if grids else []
    starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
    docs, image = [], 0
    for a, b in itertools.pairwise(starts):
        types = (ids[a:b] == GEMMA4_IMAGE_ID).long()
        count = int((types.diff(prepend=types.new_zeros(1)) == 1).sum())  # its image runs
        kwargs: dict = {}
        if count:
            own = range(image, image + count)
            most = max(len(patches[i]) for i in own)
            rows, xy = [], []
            for i in own:
                _, h, w = grids[i]
                y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
                mine = torch.stack([x.flatten(), y.flatten()], -1)
                rows.append(torch.nn.functional.pad(patches[i], (0, 0, 0, most - h * w)))
                xy.append(torch.cat([mine, mine.new_full((most - h * w, 2), -1)]))
            kwargs = {"pixel_values": torch.stack(rows), "image_position_ids": torch.stack(xy),
                      "mm_token_type_ids": types[None]}
        docs.append((ids[a:b], labels[a:b], kwargs))
        image += count
    assert image == len(grids)
    return docs


def _reference(config_path: Path, family: str) -> dict[str, Any]:
    """The model's own training on the rows `longctx train` read at each step."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from longctx_cli.config import load_config
    from longctx_cli.data.prepare import prepare
    from longctx_cli.train.optim import make_optimizer
    from longctx_cli.train.schedule import DataPosition

    config = load_config(config_path)
    rows = prepare(config).train
    position = DataPosition(config, 1, rows, None)
    torch.manual_seed(config.training.seed)  # longctx's random init draws from the same seed
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(**FAMILIES[family][0]), dtype=torch.float32,
        attn_implementation={"": "eager", "text_config": "eager",
                             "vision_config": TOWER_ATTENTION.get(family, "eager")}).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, params)
    losses, images, videos, runs = [], 0, 0, 0
    for step in range(STEPS):
        table, indices = position.step_rows(step)
        docs = [d for i in indices for d in _documents(table[i], family)]
        targets = [int((lab[1:] != IGNORE_INDEX).sum()) for _, lab, _ in docs]
        total = 0.0
        for (ids, lab, kwargs), n in zip(docs, targets, strict=True):
            images += len(kwargs.get("image_grid_thw", kwargs.get("pixel_values", ())))
            if family == "gemma3" and "pixel_values" in kwargs:  # its image tokens both ways
                runs += int((kwargs["token_type_ids"].diff() == 1).sum())
            if family == "gemma4" and "pixel_values" in kwargs:  # both ways on sliding layers
                runs += len(kwargs["pixel_values"])
            videos += len(kwargs.get("video_grid_thw", ()))
            loss = model(input_ids=ids[None], labels=lab[None], **kwargs).loss * (n / sum(targets))
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, config.training.max_grad_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    assert images >= 3  # the steps trained on images, not only text
    assert videos >= 1 or family not in VIDEO_FAMILIES, videos  # and on a video
    # ... and on Gemma 3's (Gemma 4's) both-ways images
    assert runs >= 3 or family not in ("gemma3", "gemma4"), runs
    weights = {k: v.detach().double().numpy() for k, v in model.named_parameters()}
    return {"losses": losses, "weights": weights}


@pytest.fixture(scope="module")
def trained_on(tmp_path_factory) -> Any:
    """Per family, once: the data folder and the model's own training on it."""
    made: dict[str, tuple[Path, dict]] = {}

    def get(family: str) -> tuple[Path, dict]:
        if family not in made:
            tmp = _setup(tmp_path_factory.mktemp(f"vlm_train_{family}"), family)
            made[family] = (tmp, _reference(_config(tmp, "reference", family), family))
        return made[family]
    return get


LAYOUTS = {
    "ring_sp2": {"sequence_parallel_degree": 2, "ring_attn_func": "batch_ring"},
    # FSDP2 with checkpointing: the tower and projector are groups of their own, gathered
    # when the rebuilt forward calls them; the merge runs inside the language model's forward.
    "ulysses_sp2_fsdp": {"sequence_parallel_degree": 2, "sequence_parallel_mode": "ulysses",
                         "fsdp": True, "gradient_checkpointing": True},
}


@pytest.mark.parametrize("family, layout", [("qwen2_5_vl", "ring_sp2"),
                                            ("qwen2_5_vl", "ulysses_sp2_fsdp"),
                                            ("qwen3_vl", "ring_sp2"),
                                            ("qwen3_5", "ring_sp2"),
                                            ("llava", "ring_sp2"),
                                            ("gemma3", "ulysses_sp2_fsdp"),
                                            ("gemma4", "ulysses_sp2_fsdp")])
def test_train_at_sp2_equals_the_models_own_training(trained_on: Any, family: str,
                                                     layout: str) -> None:
    from transformers import AutoModelForImageTextToText

    setup, reference = trained_on(family)
    config = _config(setup, layout, family, **LAYOUTS[layout])
    result = run_longctx("train", str(config), "--nproc-per-node", "2", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    final = setup / layout / "final"
    losses = [json.loads(line)["loss"] for line in (setup / layout / "metrics.jsonl")
              .read_text().splitlines() if line.strip() and "loss" in json.loads(line)]
    # final/ loads as the model's own class (transformers maps its saved names back).
    loaded = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32)
    assert type(loaded).__name__ == type(AutoModelForImageTextToText.from_config(
        loaded.config)).__name__ == {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                     "qwen3_vl": "Qwen3VLForConditionalGeneration",
                                     "qwen3_5": "Qwen3_5ForConditionalGeneration",
                                     "llava": "LlavaForConditionalGeneration",
                                     "gemma3": "Gemma3ForConditionalGeneration",
                                     "gemma4": "Gemma4ForConditionalGeneration"}[family]
    run = {"losses": losses, "weights": {k: v.detach().double().numpy()
                                         for k, v in loaded.named_parameters()}}
    assert len(losses) == STEPS
    got = compare(run, reference)
    assert got["loss"] < LOSS_TOL and got["weights"] < WEIGHT_TOL, got
    saved = json.loads((final / "processor_config.json").read_text())
    assert saved["processor_class"] == FAMILIES[family][2]
