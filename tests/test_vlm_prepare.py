"""Vision-language data through `prepare` (#65): image-bearing chat records become cached rows
with the vision columns the trainer reads, equal to `pack_vision_documents` of the encoded
documents; the cache is reused, and rebuilt when an image's bytes change; text runs keep
their rows as they were."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from longctx_cli.config.load import config_from_dict, load_config
from longctx_cli.constants import IGNORE_INDEX as IGN
from longctx_cli.data import cache, vision
from longctx_cli.data.prepare import compute_fingerprint, format_spec, prepare
from longctx_cli.errors import UserError
from tests.vlm_fixtures import write_tiny_qwen_vl_processor

VISION_COLUMNS = ["input_ids", "labels", "position_ids", "pixel_values", "pixel_dim",
                  "image_grid_thw", "media_kinds", "second_per_grid_ts"]


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen_vl_processor(tmp_path_factory.mktemp("proc"))


def make_image(path: Path, size: tuple[int, int], seed: int) -> Path:
    """A noisy RGB PNG (every patch different); size is (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def records() -> list[dict]:
    """Conversations in the layouts users have: image parts, an `images` column with a
    marker, a video given as frames, a text-only one, and one with no reply (skipped)."""
    def turn(role: str, *parts: dict) -> dict:
        return {"role": role, "content": list(parts)}

    def text(t: str) -> dict:
        return {"type": "text", "text": t}

    return [
        {"messages": [turn("user", {"type": "image", "path": "img/a.png"},
                           text("Describe this image.")),
                      turn("assistant", text("A red square."))]},
        {"messages": [turn("user", text("And these?"), {"type": "image", "path": "img/b.png"},
                           {"type": "image", "path": "img/c.png"}),
                      {"role": "assistant", "content": "A cat."}]},
        {"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                      {"role": "assistant", "content": "A cat."}],
         "images": ["img/d.png"]},
        {"messages": [turn("user", {"type": "video", "video": ["img/f0.png", "img/f1.png",
                                                               "img/f2.png"]},
                           text("What happens?")),
                      turn("assistant", text("The picture changes."))]},
        {"messages": [{"role": "user", "content": "Describe this image."},
                      {"role": "assistant", "content": "The image is a red square."}]},
        {"messages": [turn("user", {"type": "image", "path": "img/a.png"}, text("No reply."))]},
    ]


@pytest.fixture()
def data(tmp_path) -> Path:
    folder = tmp_path / "data"
    for name, size, seed in (("a", (84, 56), 1), ("b", (56, 56), 2), ("c", (140, 70), 3),
                             ("d", (56, 84), 4), ("f0", (56, 56), 5), ("f1", (56, 56), 6),
                             ("f2", (56, 56), 7)):
        make_image(folder / "img" / f"{name}.png", size, seed)
    path = folder / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return path


def vlm_config(tmp_path: Path, proc_dir: Path, data: Path, **kw):
    return config_from_dict({
        "model_config": {"model_type": "llama"}, "processor_type": "AutoProcessor",
        "processor_path": str(proc_dir), "sequence_len": 160,
        "shuffle_merged_datasets": False,
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": str(data), "type": "chat_template"}], **kw})


def encoded(config, data: Path) -> list[vision.VisionDocument]:
    """The records encoded one by one, as the data module's own function makes them."""
    vp = vision.load_config_processor(config)
    spec = format_spec(config.data.datasets[0], config, vp.tokenizer)
    docs = [vision.encode_vision_record(r, vp, f"{data}:{n + 1}", base_dir=data.parent,
                                        spec=spec) for n, r in enumerate(records())]
    return [d for d in docs if d.has_targets]


def assert_rows_equal(table, rows: list[vision.VisionRow]) -> None:
    assert table.num_rows == len(rows)
    got = table.to_pylist()
    for row, want in zip(got, rows, strict=True):
        assert row["input_ids"] == want.input_ids
        assert row["labels"] == want.labels
        assert row["position_ids"] == want.position_ids
        assert row["pixel_dim"] == want.pixel_values.shape[1] == 3 * 2 * 14 * 14
        np.testing.assert_array_equal(
            np.asarray(row["pixel_values"], dtype=np.float32).reshape(-1, row["pixel_dim"]),
            want.pixel_values)
        assert row["image_grid_thw"] == [list(g) for g in want.image_grid_thw]
        assert row["media_kinds"] == want.media_kinds
        assert row["second_per_grid_ts"] == pytest.approx(want.second_per_grid_ts)


# ---- rows ----------------------------------------------------------------------------------


def test_cached_rows_are_the_packed_documents(tmp_path, proc_dir, data):
    import pyarrow as pa

    config = vlm_config(tmp_path, proc_dir, data)
    prepared = prepare(config, progress=False)
    table = prepared.train.with_format("arrow")[:]
    assert table.column_names == VISION_COLUMNS
    types = dict(zip(table.column_names, table.schema.types, strict=True))
    assert types["pixel_values"] == pa.list_(pa.float32())
    assert types["pixel_dim"] == pa.int32()
    assert types["image_grid_thw"] == pa.list_(pa.list_(pa.int32()))
    assert types["media_kinds"] == pa.list_(pa.int8())
    assert types["second_per_grid_ts"] == pa.list_(pa.float32())
    assert all(types[c] == pa.list_(pa.int32()) for c in ("input_ids", "labels",
                                                           "position_ids"))

    docs = encoded(config, data)
    assert len(docs) == 5  # the record without a reply has no targets
    want = vision.pack_vision_documents(docs, config.data.sequence_len)
    assert len(want) > 1 and any(len(r.image_counts) > 1 for r in want)  # packed, several rows
    assert_rows_equal(table, want)
    # The video: a grid of 2 temporal patches (3 frames padded to 4), kind 2, its seconds.
    kinds = [k for r in want for k in r.media_kinds]
    assert kinds.count(vision.VIDEO) == 1
    assert [s for r in want for s in r.second_per_grid_ts] == [2 / vision.DEFAULT_VIDEO_FPS]
    # The text-only conversation's row holds nothing of it in the vision columns.
    assert any(r.image_counts.count(0) for r in want)

    # What a rank reads without `datasets` sees the same columns.
    light = cache.read_entry(Path(prepared.path), prepared.report.fingerprint)
    assert light is not None and light.train.column_names == VISION_COLUMNS
    assert light.train[0]["image_grid_thw"] == table.to_pylist()[0]["image_grid_thw"]


def test_report_counts_images_and_skips(tmp_path, proc_dir, data):
    config = vlm_config(tmp_path, proc_dir, data)
    report = prepare(config, progress=False).report
    docs = encoded(config, data)
    rows = vision.pack_vision_documents(docs, config.data.sequence_len)
    (stats,) = report.datasets
    assert (stats.records, stats.skipped, stats.skip_reason) == (6, 1, "no target tokens")
    assert stats.samples == 5 and stats.tokens == sum(len(d) for d in docs)
    assert stats.images == sum(len(d.image_grid_thw) for d in docs) == 5
    assert stats.image_tokens == sum(d.image_tokens for d in docs)
    assert report.vision and report.train.images == 5
    assert report.train.image_tokens == stats.image_tokens
    assert report.train.max_images == max(len(r.image_grid_thw) for r in rows)
    assert report.train.max_image_tokens == max(sum(1 for t in r.mm_token_type_ids if t)
                                                for r in rows)
    assert report.train.target_tokens == sum(sum(1 for x in d.labels if x != IGN)
                                             for d in docs)
    text = str(report)
    assert "(max/row)" in text and "(tokens)" in text
    assert "<|image_pad|>x" in text  # a sample's image tokens are written once, counted
    again = prepare(config, progress=False).report  # the cached report says the same
    assert again.reused and again.train == report.train and again.datasets[0].images == 5


# ---- the cache -----------------------------------------------------------------------------


def test_cache_reused_and_rebuilt_when_an_image_changes(tmp_path, proc_dir, data):
    config = vlm_config(tmp_path, proc_dir, data)
    key, seen = cache.inputs_key(config), cache.witness(config)
    first = prepare(config, progress=False)
    assert not first.reused
    # The launcher's record of the entry (what train/run.py keeps after a full check).
    warm = cache.remember_inputs(config, Path(first.path), first.report.fingerprint, key, seen)
    assert warm is not None and cache.confirm_warm(config) == warm
    again = prepare(vlm_config(tmp_path, proc_dir, data), progress=False)
    assert again.reused and again.path == first.path
    assert cache.inputs_key(config) == key

    make_image(data.parent / "img" / "b.png", (56, 56), 99)  # same path and size, new pixels
    assert compute_fingerprint(config, None) != first.report.fingerprint
    assert cache.inputs_key(config) != key  # the launcher's warm check sees it too
    assert cache.confirm_warm(config) is None
    rebuilt = prepare(config, progress=False)
    assert not rebuilt.reused
    assert "datasets[0].images" in rebuilt.report.reason
    old = np.asarray(first.train.with_format("numpy")[:]["pixel_values"], dtype=object)
    new = np.asarray(rebuilt.train.with_format("numpy")[:]["pixel_values"], dtype=object)
    assert any(not np.array_equal(a, b) for a, b in zip(old, new, strict=True))


def test_fingerprint_follows_the_vision_settings(tmp_path, proc_dir, data):
    base = compute_fingerprint(vlm_config(tmp_path, proc_dir, data), None)
    assert compute_fingerprint(vlm_config(tmp_path, proc_dir, data), None) == base
    variants = [vlm_config(tmp_path, proc_dir, data, image_size=56),
                vlm_config(tmp_path, proc_dir, data, image_size=56,
                           image_resize_algorithm="lanczos")]
    other = write_tiny_qwen_vl_processor(tmp_path / "proc2")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    settings["max_pixels"] = 28 * 28 * 8
    (other / "preprocessor_config.json").write_text(json.dumps(settings))
    variants.append(vlm_config(tmp_path, other, data))
    prints = {compute_fingerprint(c, None) for c in variants}
    assert len(prints | {base}) == len(variants) + 1


def test_text_run_rows_have_no_vision_columns(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": "word " * i}) + "\n" for i in range(1, 8)))
    config = config_from_dict({"model_config": {"model_type": "llama"}, "tokenizer": "byte",
                               "sequence_len": 64, "datasets": [{"path": str(path)}],
                               "dataset_prepared_path": str(tmp_path / "prepared")})
    prepared = prepare(config, progress=False)
    assert prepared.train.column_names == ["input_ids", "labels", "position_ids"]
    parts = json.loads((Path(prepared.path) / cache.FINGERPRINT_FILE).read_text())["parts"]
    assert "vision" not in parts and "processor" not in parts
    assert all("images" not in d for d in parts["datasets"])
    assert not prepared.report.vision and "images" not in str(prepared.report)


# ---- splits, other types, length rules, errors -----------------------------------------------


def test_val_set_size_holds_out_vision_rows(tmp_path, proc_dir, data):
    config = vlm_config(tmp_path, proc_dir, data, val_set_size=1, sample_packing=False)
    prepared = prepare(config, progress=False)
    assert prepared.eval is not None and prepared.eval.column_names == VISION_COLUMNS
    assert (len(prepared.train), len(prepared.eval)) == (4, 1)
    images = sum(len(r) for split in (prepared.train, prepared.eval)
                 for r in split["image_grid_thw"])
    assert images == 5 and prepared.report.eval is not None
    assert prepared.report.train.images + prepared.report.eval.images == 5


def test_eval_datasets_and_a_text_type_in_a_vision_run(tmp_path, proc_dir, data):
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": "Name a colour.", "output": "Red."}) + "\n")
    config = vlm_config(tmp_path, proc_dir, data, sample_packing=False,
                        eval_datasets=[{"path": str(alpaca), "type": "alpaca"}])
    prepared = prepare(config, progress=False)
    (row,) = prepared.eval.to_list()
    assert row["pixel_values"] == [] and row["image_grid_thw"] == []
    assert row["media_kinds"] == [] and row["second_per_grid_ts"] == []
    assert row["pixel_dim"] == 3 * 2 * 14 * 14
    assert row["position_ids"] == list(range(len(row["input_ids"])))
    assert any(label != IGN for label in row["labels"])


def test_documents_over_sequence_len(tmp_path, proc_dir, data):
    docs = encoded(vlm_config(tmp_path, proc_dir, data), data)
    long = max(docs, key=len)
    limit = len(long) - 1
    with pytest.raises(UserError, match=r"d\.jsonl:\d+: .*image/video tokens") as err:
        prepare(vlm_config(tmp_path, proc_dir, data, sequence_len=limit,
                           excess_length_strategy="error"), progress=False)
    assert "\n" not in str(err.value)
    dropped = prepare(vlm_config(tmp_path, proc_dir, data, sequence_len=limit),
                      progress=False)  # the default, `drop`
    (stats,) = dropped.report.datasets
    assert (stats.too_long, stats.dropped, stats.samples) == (1, 1, 4)
    # Truncating text after the last image keeps every image whole (two entries: the
    # truncated documents still concatenate with the other's).
    entry = {"path": str(data), "type": "chat_template"}
    cut = prepare(vlm_config(tmp_path, proc_dir, data, sequence_len=limit,
                             excess_length_strategy="truncate", datasets=[entry, entry]),
                  progress=False)
    assert [d.truncated for d in cut.report.datasets] == [1, 1]
    assert cut.report.train.images == 10
    assert max(len(r) for r in cut.train["input_ids"]) == limit
    # Truncating inside the images would cut one: refused, saying so.
    last = max(i for i, t in enumerate(long.mm_token_type_ids) if t)
    with pytest.raises(UserError, match="never an image"):
        prepare(vlm_config(tmp_path, proc_dir, data, sequence_len=last,
                           excess_length_strategy="truncate"), progress=False)


def test_a_missing_image_names_its_line(tmp_path, proc_dir, data):
    (data.parent / "img" / "d.png").unlink()
    with pytest.raises(UserError, match=r"d\.jsonl:3: image file .*d\.png does not exist"):
        prepare(vlm_config(tmp_path, proc_dir, data), progress=False)


def test_processor_path_is_read_beside_the_config(tmp_path, proc_dir, data):
    import shutil

    shutil.copytree(proc_dir, tmp_path / "run" / "processor")
    (tmp_path / "run" / "config.yaml").write_text(
        "model_config: {model_type: llama}\nprocessor_type: AutoProcessor\n"
        "processor_path: processor\nsequence_len: 160\nshuffle_merged_datasets: false\n"
        f"dataset_prepared_path: {tmp_path / 'prepared'}\n"
        f"datasets: [{{path: {data}, type: chat_template}}]\n")
    config = load_config(tmp_path / "run" / "config.yaml")
    assert vision.processor_folder(config) == str(tmp_path / "run" / "processor")
    assert len(prepare(config, progress=False).train) >= 2


def test_unsupported_vision_runs_are_refused(tmp_path, proc_dir, data):
    with pytest.raises(UserError, match="pretrain"):
        prepare(vlm_config(tmp_path, proc_dir, data, datasets=[
            {"path": str(data), "type": "pretrain"}]), progress=False)
