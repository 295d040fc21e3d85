"""`longctx merge-lora` and `longctx eval` on a vision-language model equal the model's own.

One LoRA run on a tiny Qwen2.5-VL (the tower frozen, so without adapters) at sp 2: one
optimizer step, then the in-training evaluation on held-out image chats (`eval_datasets`),
and a resumable `checkpoint-1`. Against that run:

* `longctx merge-lora` writes a folder that loads as `Qwen2_5_VLForConditionalGeneration`
  with the run's processor, whose forward with images equals the base with peft's unmerged
  adapter (float32);
* `longctx eval` at sp 2 gives, as the held-out loss, the token-weighted mean of each
  document's own Hugging Face `forward(pixel_values=..., labels=)` through base + adapter, on
  the rows `longctx eval` read; so does the in-training `eval_loss` after that same step.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from longctx_cli.constants import IGNORE_INDEX
from tests.train_helpers import run_longctx
from tests.vlm_fixtures import QWEN2_5_VL, write_tiny_qwen_vl_processor

IMAGE_ID = 5  # the fixture tokenizer's <|image_pad|>
ANSWERS = ("The image is a red square.", "A cat.", "What is in the picture? A cat.")
# float32: W x + B (A x) and (W + B A) x round differently (logits of a few units here).
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _records(path: Path, images: Path, count: int, seed: int) -> None:
    """`count` chats of one to three images (of three sizes) and an answer each."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    images.mkdir(exist_ok=True)
    with path.open("w") as out:
        for i in range(count):
            parts: list[dict] = []
            for k in range(1 + i % 3):
                side = (28, 56, 84)[(i + k) % 3]
                pixels = torch.randint(0, 256, (side, 56, 3), generator=gen, dtype=torch.uint8)
                name = f"{path.stem}_{i}_{k}.png"
                Image.fromarray(pixels.numpy()).save(images / name)
                parts.append({"type": "image", "path": f"{images.name}/{name}"})
            parts.append({"type": "text", "text": "Describe this image."})
            message = [{"role": "user", "content": parts},
                       {"role": "assistant", "content": ANSWERS[(i + seed) % 3]}]
            out.write(json.dumps({"messages": message}) + "\n")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """The folder of one LoRA run at sp 2 (config `run.yaml`, outputs under `run/`)."""
    from tests.train_helpers import train

    tmp = tmp_path_factory.mktemp("vlm_eval_merge")
    write_tiny_qwen_vl_processor(tmp / "processor", 14, "Qwen2_5_VLProcessor")
    _records(tmp / "train.jsonl", tmp / "img", 8, seed=0)
    _records(tmp / "held_out.jsonl", tmp / "img", 9, seed=1)
    config = {
        "model_config": QWEN2_5_VL, "processor_type": "AutoProcessor",
        "processor_path": str(tmp / "processor"), "tokenizer": str(tmp / "processor"),
        "dtype": "float32", "seed": 3,
        "datasets": [{"path": str(tmp / "train.jsonl"), "type": "chat_template"}],
        "eval_datasets": [{"path": str(tmp / "held_out.jsonl"), "type": "chat_template"}],
        "sequence_len": 256, "sample_packing": True,
        "dataset_prepared_path": str(tmp / "prepared"), "attention_kernel": "torch",
        "sequence_parallel_degree": 2, "micro_batch_size": 1,
        "gradient_accumulation_steps": 1, "max_steps": 1, "eval_steps": 1, "save_steps": 1,
        # One step of Adam moves every adapter weight by about the learning rate.
        "learning_rate": 5e-2, "lr_scheduler": "constant", "warmup_steps": 0,
        "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"],
        "freeze_mm_modules": True, "eval_tasks": ["position_loss"],
        "output_dir": str(tmp / "run"), "logging_steps": 1, "collective_timeout_s": 120,
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(config))
    train(tmp / "run.yaml", 2)
    return tmp


def _documents(row: dict) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """A cached row's documents, each with the model's own image inputs."""
    ids, pos, labels = (torch.tensor(row[k]) for k in ("input_ids", "position_ids", "labels"))
    pixels = torch.tensor(row["pixel_values"]).view(-1, row["pixel_dim"])
    grids = torch.tensor(row["image_grid_thw"], dtype=torch.long).view(-1, 3)
    starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
    docs, item, patch = [], 0, 0
    for a, b in itertools.pairwise(starts):
        types = (ids[a:b] == IMAGE_ID).long()
        count = sum(1 for kind, _ in itertools.groupby(types.tolist()) if kind)
        kwargs: dict = {}
        if count:
            n = int(grids[item:item + count].prod(-1).sum())
            kwargs = {"pixel_values": pixels[patch:patch + n],
                      "image_grid_thw": grids[item:item + count], "mm_token_type_ids": types[None]}
            item, patch = item + count, patch + n
        docs.append((ids[a:b], labels[a:b], kwargs))
    assert item == len(grids) and patch == len(pixels)
    return docs


def _adapter_on_base(final: Path) -> Any:
    """The run's base with its adapter, unmerged (peft's own forward)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(
        final / "base_model", dtype=torch.float32, attn_implementation="eager")
    return PeftModel.from_pretrained(base, str(final)).eval()


def _held_out_docs(setup: Path) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    from longctx_cli.config import load_config
    from longctx_cli.data.prepare import prepare

    rows = prepare(load_config(setup / "run.yaml")).eval
    assert rows is not None
    return [doc for row in rows for doc in _documents(row)]


def test_merge_lora_of_a_vlm_loads_as_its_class_and_equals_the_adapter(lora_run: Path) -> None:
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from longctx_cli.data.vision import load_processor

    final, merged_dir = lora_run / "run" / "final", lora_run / "merged"
    result = run_longctx("merge-lora", str(lora_run / "run.yaml"), "--checkpoint", str(final),
                         "--output", str(merged_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AutoModelForImageTextToText" in result.stderr
    merged = AutoModelForImageTextToText.from_pretrained(
        merged_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(merged).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not any("lora" in name for name, _ in merged.named_parameters())
    # The processor as final/ holds it: the model's own class, the same tokenizer and images.
    saved = json.loads((merged_dir / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2_5_VLProcessor"
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (merged_dir / name).read_text() == (final / name).read_text(), name
    record = json.loads((lora_run / "held_out.jsonl").read_text().splitlines()[2])
    image = lora_run / record["messages"][0]["content"][0]["path"]
    texts = []
    for folder in (merged_dir, final):
        processor = load_processor(str(folder)).processor
        texts.append(processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"],
                               images=[Image.open(image)],
                               return_tensors="pt"))
    assert torch.equal(texts[0]["input_ids"], texts[1]["input_ids"])
    assert torch.equal(texts[0]["pixel_values"], texts[1]["pixel_values"])

    want = _adapter_on_base(final)
    base_tower = want.get_base_model().model.visual.state_dict()
    for name, value in merged.model.visual.state_dict().items():  # the frozen tower, as it was
        torch.testing.assert_close(value, base_tower[name], rtol=0, atol=0)
    # Every weight is peft's own merge of the adapter into the base (same arithmetic).
    peft_merged = _adapter_on_base(final).merge_and_unload().state_dict()
    mine = merged.state_dict()
    assert mine.keys() == peft_merged.keys()
    for name, value in mine.items():
        torch.testing.assert_close(value, peft_merged[name], rtol=0, atol=0)
    docs = [d for d in _held_out_docs(lora_run) if d[2]]
    assert len(docs) >= 3
    moved = 0.0
    with torch.no_grad():
        for ids, _, kwargs in docs:
            got = merged(input_ids=ids[None], **kwargs).logits
            adapter = want(input_ids=ids[None], **kwargs).logits
            torch.testing.assert_close(got, adapter, **TOL)
            with want.disable_adapter():
                base = want(input_ids=ids[None], **kwargs).logits
            moved = max(moved, float((adapter - base).abs().max()))
    assert moved > 1e-2  # the adapter changed the model: the merge is not a no-op


def _own_held_out_loss(setup: Path) -> tuple[float, int, int]:
    """Token-weighted loss of each held-out document's own forward through base + adapter;
    its target tokens; the images they hold."""
    model = _adapter_on_base(setup / "run" / "final")
    loss_sum, targets, images = 0.0, 0, 0
    with torch.no_grad():
        for ids, labels, kwargs in _held_out_docs(setup):
            n = int((labels[1:] != IGNORE_INDEX).sum())
            if n:
                loss = model(input_ids=ids[None], labels=labels[None], **kwargs).loss
                loss_sum, targets = loss_sum + float(loss) * n, targets + n
            images += len(kwargs.get("image_grid_thw", ()))
    return loss_sum / targets, targets, images


def test_eval_of_a_vlm_at_sp2_equals_the_models_own_loss(lora_run: Path) -> None:
    result = run_longctx("eval", str(lora_run / "run.yaml"), "--checkpoint",
                         str(lora_run / "run" / "final"), "--nproc-per-node", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((lora_run / "run" / "eval" / "position_loss.json").read_text())
    got = report["models"][0]
    want, targets, images = _own_held_out_loss(lora_run)
    assert images >= 6 and targets >= 20, (images, targets)
    assert got["tokens"] == targets
    assert got["overall_loss"] == pytest.approx(want, rel=1e-5)
    # The run's own evaluation after its one step (the weights of final/) says the same.
    metrics = [json.loads(line) for line in
               (lora_run / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    eval_losses = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert eval_losses == [pytest.approx(want, rel=1e-5)]


@pytest.mark.slow  # the default run covers eval of final/ above
def test_eval_of_a_vlm_checkpoint_and_text_tasks(lora_run: Path) -> None:
    """The resumable checkpoint-1 (a DCP state of model + adapter) scores what final/ does,
    and the text-only evaluations (passkey grid, RULER) run through the language model."""
    run = lora_run / "run"
    result = run_longctx(
        "eval", str(lora_run / "run.yaml"), "--checkpoint", str(run / "checkpoint-1"),
        "--nproc-per-node", "2", "--eval-tasks", "[passkey, position_loss]",
        "--eval-context-lengths", "[200]", "--eval-depths", "[0.5]",
        "--eval-samples-per-cell", "2", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    eval_dir = run / "eval"
    got = json.loads((eval_dir / "position_loss.json").read_text())["models"][0]
    want, targets, _ = _own_held_out_loss(lora_run)
    assert got["tokens"] == targets
    assert got["overall_loss"] == pytest.approx(want, rel=1e-5)
    assert (eval_dir / "passkey.json").is_file()
    # RULER decodes from the ranks' key-value shards; its shortest task needs longer rows.
    result = run_longctx(
        "eval", str(lora_run / "run.yaml"), "--checkpoint", str(run / "final"),
        "--nproc-per-node", "2", "--eval-tasks", "[niah_single_1]", "--sequence-len", "512",
        "--eval-context-lengths", "[450]", "--eval-samples-per-cell", "2", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (eval_dir / "ruler.json").is_file()
