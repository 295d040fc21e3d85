"""A Mistral 3 vision run with `tokenizer_use_mistral_common: true`: each record's ids,
targets and pixels are mistral-common's own `encode_chat_completion` (its ImageEncoder
resizes, normalises and lays out [IMG]/[IMG_BREAK]/[IMG_END]), and a prepared row trains as
`Mistral3ForConditionalGeneration(input_ids=, pixel_values=, image_sizes=, labels=)` on
exactly those tokens and pixels, at sp 1 and sp 2.

The tokenizer is the Tekken file mistral-common ships (tekken_240911.json, the only one of
its data files with an image config), declared v7, its vocabulary cut to 2,000 ids (1,000
control tokens, then the first 1,000 byte-level ranks: every text still encodes) and its
image config made tiny (4-pixel patches merged 2 x 2, images at most 40 pixels), so the
model stays small. Encoding images needs OpenCV (mistral-common's `[opencv]` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

mistral_common = pytest.importorskip("mistral_common")
pytest.importorskip("cv2")  # mistral-common's ImageEncoder resizes with OpenCV

from longctx_cli.constants import IGNORE_INDEX as IGN  # noqa: E402
from tests.vlm_fixtures import conversation, make_image  # noqa: E402

PATCH, MERGE, VOCAB = 4, 2, 2000
TEKKEN = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
WHERE = "d.jsonl:1"


def write_tekken(folder: Path) -> Path:
    """The tiny Tekken tokenizer with an image config (see the module doc)."""
    data = json.loads(TEKKEN.read_text())
    data["config"].update(version="v7", default_vocab_size=VOCAB)
    data["vocab"] = data["vocab"][:VOCAB - data["config"]["default_num_special_tokens"]]
    data["config"]["num_vocab_tokens"] = len(data["vocab"])
    data["image"] = {"image_patch_size": PATCH, "max_image_size": 40,
                     "spatial_merge_size": MERGE}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tekken.json").write_text(json.dumps(data))
    return folder


def _config(tmp_path: Path, **top):
    from longctx_cli.config.load import config_from_dict

    return config_from_dict({
        "model_config": {"model_type": "mistral3"}, "tokenizer": str(tmp_path / "tok"),
        "tokenizer_use_mistral_common": True, "processor_type": "AutoProcessor",
        "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 512,
        "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "chat_template"}], **top})


@pytest.fixture()
def setup(tmp_path):
    from longctx_cli.data.tokenizer import load_config_processor

    write_tekken(tmp_path / "tok")
    # Two sizes and aspect ratios: resized to 24x32 (then 16x16, 16x40) pixels.
    make_image(tmp_path, "img/a.png", (30, 20), 1)
    make_image(tmp_path, "img/b.png", (16, 16), 2)
    make_image(tmp_path, "img/c.png", (50, 18), 3)
    config = _config(tmp_path)
    return config, load_config_processor(config), tmp_path


def _reference(folder: Path, record: dict, base: Path):
    """mistral-common's own encoding of the record (images as ImageChunks of the files),
    and labels marking each assistant message's own tokens."""
    from mistral_common.protocol.instruct.chunk import ImageChunk, TextChunk
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from PIL import Image

    mt = MistralTokenizer.from_file(str(folder / "tekken.json"), mode=ValidationMode.finetuning)
    messages = []
    for m in record["messages"]:
        parts = m["content"] if isinstance(m["content"], list) else [
            {"type": "text", "text": m["content"]}]
        if m["role"] == "assistant":
            messages.append(AssistantMessage(content="".join(p["text"] for p in parts)))
            continue
        messages.append(UserMessage(content=[
            TextChunk(text=p["text"]) if p["type"] == "text"
            else ImageChunk(image=Image.open(base / p["path"])) for p in parts]))
    out = mt.encode_chat_completion(ChatCompletionRequest(messages=messages))
    labels, at = [IGN] * len(out.tokens), 0
    last_user = max(n for n, m in enumerate(record["messages"]) if m["role"] == "user")
    for n, message in enumerate(messages):
        if isinstance(message, AssistantMessage):
            own = mt.instruct_tokenizer.encode_assistant_message(
                message, is_before_last_user_message=n < last_user)
            at = next(i for i in range(at, len(out.tokens))
                      if out.tokens[i:i + len(own)] == own)
            labels[at:at + len(own)] = own
            at += len(own)
    return out.tokens, labels, out.images


def test_a_record_is_mistral_commons_own_encoding(setup):
    from longctx_cli.data import vision
    from longctx_cli.runtime.batches import media_inputs

    config, vp, base = setup
    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=base)
    ids, labels, images = _reference(base / "tok", conversation(), base)
    assert doc.input_ids == ids and doc.labels == labels
    assert vp.tokenizer.decode([t for t in labels if t != IGN]) == "A red square.</s>A cat.</s>"
    media = media_inputs(torch.from_numpy(doc.pixel_values), doc.image_grid_thw,
                         doc.media_kinds, doc.second_per_grid_ts)
    assert [tuple(s) for s in media.image_sizes.tolist()] == [(24, 32), (16, 16), (16, 40)]
    for n, image in enumerate(images):
        h, w = image.shape[1:]
        np.testing.assert_array_equal(media.pixel_values[n, :, :h, :w].numpy(), image)
    # One [IMG] per merged patch, rows broken by [IMG_BREAK], each image ended by [IMG_END].
    img, brk, end = 10, 12, 13
    assert doc.input_ids.count(img) == 12 + 4 + 10 == doc.image_tokens
    assert doc.input_ids.count(end) == 3 and doc.input_ids.count(brk) == 2 + 1 + 1


def _model_config(vp):
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
                     "num_key_value_heads": 2, "vocab_size": VOCAB, "sliding_window": None,
                     "pad_token_id": 11},
        vision_config={"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16,
                       "patch_size": PATCH, "image_size": 64},
        image_token_index=vp.feature_ids()[1], spatial_merge_size=MERGE)


def _build(vp, attn: str):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(
        _model_config(vp), dtype=torch.float32,
        attn_implementation={"": attn, "text_config": attn, "vision_config": "sdpa"}).train()


def _prepared_rows(vp, base: Path, records: list[dict]):
    """The records' documents packed into rows, in the cache's Arrow layout (what the
    trainer reads back)."""
    from datasets import Dataset

    from longctx_cli.data import vision

    docs = [vision.encode_vision_record(r, vp, f"d.jsonl:{i + 1}", base_dir=base)
            for i, r in enumerate(records)]
    return Dataset(vision.rows_table(vision.pack_vision_documents(docs, 512)))


def _own(vp, base: Path, records: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mistral3ForConditionalGeneration on mistral-common's own tokens and images, one call
    per record; the loss is the mean over all their targets (the row's)."""
    model = _build(vp, "eager")
    refs = [_reference(base / "tok", r, base) for r in records]
    count = sum(sum(t != IGN for t in labels[1:]) for _, labels, _ in refs)
    total = 0.0
    for ids, labels, images in refs:
        n = sum(t != IGN for t in labels[1:])
        kwargs = {}
        if images:
            h = max(i.shape[1] for i in images)
            w = max(i.shape[2] for i in images)
            pixels = np.zeros((len(images), 3, h, w), dtype=np.float32)
            for k, i in enumerate(images):
                pixels[k, :, :i.shape[1], :i.shape[2]] = i
            kwargs = {"pixel_values": torch.from_numpy(pixels),
                      "image_sizes": torch.tensor([i.shape[1:] for i in images])}
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]),
                     **kwargs).loss * n / count
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                   for n, p in model.named_parameters()}


def _longctx(vp, rows, state) -> tuple[float, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.runtime.batches import collate_images
    from longctx_cli.runtime.head import model_head
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.vision import VisionLanguageForward

    model = _build(vp, register_sp_attention())
    vlm = VisionLanguageForward(model)
    row = rows[0]
    media = collate_images(rows.select([0]))
    labels = torch.tensor(row["labels"])
    batch = vlm.shard(torch.tensor(row["input_ids"]), torch.tensor(row["position_ids"]),
                      labels, media, state)
    head = model_head(model.get_output_embeddings(), model.config)
    count = int((labels != IGN).sum())  # each document's first token is never a target
    loss = lm_loss_sum(head, vlm.hidden_states(batch), batch.shift_labels) / count
    loss.backward()
    value = loss.detach().clone()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}
    if state.layout.sp > 1:
        dist.all_reduce(value, group=state.sp_group)
        for g in grads.values():
            dist.all_reduce(g, group=state.sp_group)
    return float(value), grads


RECORDS_TEXT = {"messages": [{"role": "user", "content": "Say hi."},
                             {"role": "assistant", "content": "Hi there."}]}


def _compare(vp, base: Path, state) -> dict[str, float]:
    records = [conversation(), RECORDS_TEXT]
    rows = _prepared_rows(vp, base, records)
    assert len(rows) == 1
    loss, grads = _longctx(vp, rows, state)
    ref_loss, ref_grads = _own(vp, base, records)
    floor = 1e-4 * max(float(g.norm()) for g in ref_grads.values())
    err = max(float((grads[n] - g).norm()) / max(float(g.norm()), floor)
              for n, g in ref_grads.items())
    tower = max(float(ref_grads[n].norm()) for n in ref_grads if "vision_tower" in n)
    return {"loss": abs(loss - ref_loss) / ref_loss, "grad": err, "tower": tower}


def _check(r: dict[str, float]) -> None:
    assert r["loss"] < 2e-5 and r["grad"] < 2e-5 and r["tower"] > 0, r


def test_a_prepared_row_trains_as_the_model_does_sp1(setup):
    from tests.layouts import sp_state

    _, vp, base = setup
    _check(_compare(vp, base, sp_state(sp=1, kernel="torch")))


def _worker(rank: int, world: int, base: str) -> dict[str, dict]:
    from longctx_cli.data.tokenizer import load_config_processor
    from tests.layouts import sp_state

    vp = load_config_processor(_config(Path(base)))
    return {f"sp{world} {spec}": _compare(vp, Path(base), sp_state(sp=world, kernel="torch",
                                                                   **spec))
            for spec in (dict(mode="ulysses"), dict(mode="ring"))}


def test_a_prepared_row_trains_as_the_model_does_sp2(setup):
    from tests.distributed import run_distributed

    _, _, base = setup
    for results in run_distributed(_worker, 2, str(base), timeout_s=240):
        assert len(results) == 2
        for r in results.values():
            _check(r)


def test_the_config_takes_it_and_the_model_must_agree(setup):
    from longctx_cli.data.vision.mistral import MistralCommonVision, check_model_agrees
    from longctx_cli.errors import UserError

    config, vp, _ = setup
    assert config.trains_images and isinstance(vp, MistralCommonVision)
    check_model_agrees(vp.tokenizer, _model_config(vp))  # the same ids and patch sizes
    for change, named in (({"image_token_index": 9}, "\\[IMG\\] id is 10"),
                          ({"spatial_merge_size": 1}, "spatial_merge_size is 2")):
        other = _model_config(vp)
        for key, value in change.items():
            setattr(other, "image_token_id" if key == "image_token_index" else key, value)
        with pytest.raises(UserError, match=f"mistral-common's {named} but the model's"):
            check_model_agrees(vp.tokenizer, other)
    from transformers import LlavaConfig

    with pytest.raises(UserError, match="Mistral 3 models .* this model is `llava`"):
        check_model_agrees(vp.tokenizer, LlavaConfig())
    other = _model_config(vp)
    other.vision_config.patch_size = 8
    with pytest.raises(UserError, match="image_patch_size is 4 but the model's is 8"):
        check_model_agrees(vp.tokenizer, other)


def test_a_tokenizer_without_an_image_config_is_a_user_error(tmp_path):
    from longctx_cli.data.tokenizer import load_config_processor
    from longctx_cli.errors import UserError

    data = json.loads(TEKKEN.read_text())
    data.pop("image")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tekken.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="has no image config"):
        load_config_processor(_config(tmp_path))


def test_prepare_end_to_end(setup):
    from longctx_cli.data.prepare import prepare

    config, _, base = setup
    records = [conversation(), RECORDS_TEXT]
    (base / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (stats,) = prepare(config, progress=False).report.datasets
    assert (stats.records, stats.skipped) == (2, 0)
    assert stats.target_tokens == sum(sum(t != IGN for t in _reference(base / "tok", r, base)[1])
                                      for r in records)
