"""`longctx eval` at sp=2 (the real command: launcher, torchrun, two gloo ranks) gives the
same passkey grid and per-position losses as the same evaluation at sp=1."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from longctx_cli.config import load_config
from longctx_cli.data.prepare import prepare
from longctx_cli.data.tokenizer import load_tokenizer, pad_id
from longctx_cli.eval.checkpoint_loading import load_for_eval
from longctx_cli.eval.passkey_grid import grid_spec, run_passkey_grid
from longctx_cli.eval.position_loss import position_loss
from longctx_cli.train.checkpoint_files import save_checkpoint
from tests.layouts import rank_state
from tests.train_helpers import TINY_LLAMA, run_longctx

CPU = torch.device("cpu")


def _configs(root: Path) -> tuple[Path, Path]:
    base = {
        "model_config": TINY_LLAMA,
        "tokenizer": "byte",
        "dtype": "float32",
        "datasets": [{"type": "passkey", "num_samples": 20, "context_lengths": [256, 448]}],
        "sequence_len": 512,
        "val_set_size": 4,
        "dataset_prepared_path": str(root / "prepared"),  # shared: both see the same rows
        "attention_kernel": "torch",
        "eval_context_lengths": [256, 333],  # 333: padding at sp=2 with zigzag
        "eval_depths": [0.0, 1.0],
        "eval_samples_per_cell": 2,
        "eval_position_buckets": 8,
        "seed": 11,
        "collective_timeout_s": 60,
    }
    paths = []
    for sp, layout in ((1, "contiguous"), (2, "zigzag")):
        path = root / f"sp{sp}.yaml"
        path.write_text(yaml.safe_dump(
            {**base, "sequence_parallel_degree": sp, "sp_sharding": layout,
             "output_dir": str(root / f"sp{sp}")}))
        paths.append(path)
    return paths[0], paths[1]


def _write_checkpoints(config_path: Path, root: Path) -> tuple[Path, Path]:
    """A random full model in HF format, and a DCP checkpoint-<step>/ of different weights."""
    from longctx_cli.runtime.model import build_model, load_base_model

    config = load_config(config_path)
    final = root / "run" / "final"
    load_base_model(config, "sdpa").save_pretrained(final)
    trained = build_model(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return final, save_checkpoint(root / "run", 7, trained, optimizer, scheduler, {"step": 7})


def _reference(config_path: Path, paths: list[Path]) -> list[tuple[list[dict], dict]]:
    """The sp=1 evaluation in this process: (passkey samples, position losses) per model."""
    from longctx_cli.runtime.model import decoder_and_head

    config = load_config(config_path)
    tokenizer = load_tokenizer(config)
    rows = prepare(config, tokenizer, progress=False).eval
    spec, ctx = grid_spec(config, tokenizer), rank_state()
    out = []
    for path in paths:
        decoder, head = decoder_and_head(load_for_eval(config, path))
        grid = run_passkey_grid(decoder, head, tokenizer, spec, ctx, pad_id(tokenizer))
        losses = position_loss(decoder, head, rows, config.data.sequence_len,
                               config.eval.eval_position_buckets, ctx, 0)
        out.append((grid.to_dict()["samples"], losses.to_dict()))
    return out


def test_eval_at_sp2_equals_sp1(tmp_path: Path):
    sp1, sp2 = _configs(tmp_path)
    final, checkpoint = _write_checkpoints(sp1, tmp_path)

    result = run_longctx("eval", str(sp2), "--checkpoint", str(final),
                         "--compare", str(checkpoint), timeout=240)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "passkey retrieval" in result.stdout and "loss by position" in result.stdout

    out = tmp_path / "sp2" / "eval"
    passkey = json.loads((out / "passkey.json").read_text())
    positions = json.loads((out / "position_loss.json").read_text())
    assert [m["checkpoint"] for m in passkey["models"]] == [str(final), str(checkpoint)]
    assert passkey["context_lengths"] == [256, 333]

    reference = _reference(sp1, [final, checkpoint])
    for got_grid, got_loss, (want_grid, want_loss) in zip(
            passkey["models"], positions["models"], reference, strict=True):
        # Identical grid, down to the predicted key tokens of every sample.
        assert got_grid["samples"] == want_grid
        assert len(want_grid) == 2 * 2 * 2
        assert got_grid["accuracy"] <= 0.1  # random weights retrieve nothing
        assert [b["tokens"] for b in got_loss["buckets"]] == \
            [b["tokens"] for b in want_loss["buckets"]]
        assert sum(b["tokens"] for b in want_loss["buckets"]) > 1000
        for g, w in zip(got_loss["buckets"], want_loss["buckets"], strict=True):
            if w["loss"] is None:  # a bucket beyond the longest document
                assert g["loss"] is None
            else:
                assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (g, w)
    # The two checkpoints really differ, so the compare column is not a copy.
    assert reference[0][1]["overall_loss"] != reference[1][1]["overall_loss"]
    assert (out / "position_loss.csv").is_file()
