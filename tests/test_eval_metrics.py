"""The eval metrics can fail: an oracle scores 100%, a near-oracle 0%; buckets are exact;
bad checkpoints give clear errors; LoRA and DCP checkpoints load; plots are optional."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longctx_cli.data.tokenizer import byte_tokenizer, pad_id
from longctx_cli.errors import UserError
from longctx_cli.eval.checkpoint_loading import checkpoint_kind, load_for_eval
from longctx_cli.eval.passkey_grid import GridResult, GridSpec, SampleResult, run_passkey_grid
from longctx_cli.eval.position_loss import PositionLoss, bucket_edges, bucket_of, position_loss
from longctx_cli.eval.report import ModelResult, write_all
from tests.layouts import rank_state

VOCAB = 384
CPU = torch.device("cpu")


class NextTokenOracle(nn.Module):
    """A stand-in decoder whose hidden state at t is the one-hot of input token t+1, so with
    an identity lm_head it predicts every next token. It sees the whole row (sp=1) and counts
    itself as the SP attention call the real decoder would make."""

    def __init__(self, scale_by_position: bool = False, break_last_key_token: bool = False):
        super().__init__()
        self.scale_by_position = scale_by_position
        self.break_last_key_token = break_last_key_token

    def forward(self, input_ids, position_ids, sp_meta):
        sp_meta.attention_calls += 1
        ids = input_ids.reshape(-1)
        nxt = torch.cat([ids[1:], ids.new_zeros(1)])
        if self.break_last_key_token:
            # The row ends with the key tokens, "]" and eos: position T-4 predicts the last
            # key token.
            nxt[-4] = (nxt[-4] + 1) % VOCAB
        hidden = F.one_hot(nxt, VOCAB).float()
        if self.scale_by_position:
            # Confidence grows with the position, so the loss differs from bucket to bucket.
            hidden = hidden * position_ids.reshape(-1, 1).float() * 0.05
        return SimpleNamespace(last_hidden_state=hidden.unsqueeze(0))


SPEC = GridSpec(context_lengths=[300, 400], depths=[0.0, 0.5, 1.0], samples_per_cell=2,
                key_length=5)


def _grid(decoder: nn.Module, lm_head: nn.Module | None = None) -> GridResult:
    tokenizer = byte_tokenizer()
    return run_passkey_grid(decoder, lm_head or nn.Identity(), tokenizer, SPEC, rank_state(),
                            pad_id(tokenizer))


def test_oracle_retrieves_every_key():
    result = _grid(NextTokenOracle())
    assert len(result.samples) == 2 * 3 * 2
    assert result.accuracy == 1.0
    assert all(s.correct and s.predicted == s.key for s in result.samples)
    assert len({s.key for s in result.samples}) > 1  # keys differ between samples


def test_random_model_scores_zero():
    # The real decoder with random weights: the metric must be able to fail.
    from longctx_cli.config.load import config_from_dict
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from tests.train_helpers import TINY_LLAMA

    config = config_from_dict({"model_config": TINY_LLAMA, "tokenizer": "byte",
                               "datasets": [{"type": "passkey"}], "sequence_len": 512,
                               "seed": 3})
    decoder, head = decoder_and_head(build_model(config))
    result = _grid(decoder, head)
    assert len(result.samples) == 12
    assert result.accuracy == 0.0
    assert all(len(s.predicted) > 0 for s in result.samples)  # it did predict something


def test_one_wrong_key_token_fails_the_sample():
    result = _grid(NextTokenOracle(break_last_key_token=True))
    assert result.accuracy == 0.0
    # Every other key token is still predicted: only the last digit is off.
    assert all(s.predicted[:-1] == s.key[:-1] and s.predicted != s.key for s in result.samples)


def test_bucket_edges_agree_with_bucket_of():
    for length, buckets in [(10, 4), (512, 16), (7, 7), (5, 8)]:
        starts, ends = bucket_edges(length, buckets)
        got = bucket_of(torch.arange(length), length, buckets).tolist()
        want = [next(i for i, (a, b) in enumerate(zip(starts, ends, strict=True)) if a <= p < b)
                for p in range(length)]
        assert got == want
        assert starts[0] == 0 and ends[-1] == length


def _expected_bucket_means(rows: list[dict], length: int, buckets: int) -> list[float]:
    """Hand computation: CE of the scaled one-hot at every labelled next token."""
    sums, counts = [0.0] * buckets, [0] * buckets
    for row in rows:
        ids, pos, labels = row["input_ids"], row["position_ids"], row["labels"]
        for t in range(len(ids) - 1):
            if labels[t + 1] == -100 or pos[t + 1] == 0:
                continue
            c = pos[t] * 0.05
            loss = math.log(math.exp(c) + (VOCAB - 1)) - c
            b = pos[t] * buckets // length
            sums[b] += loss
            counts[b] += 1
    return [s / n if n else math.nan for s, n in zip(sums, counts, strict=True)]


def test_position_loss_is_token_weighted_per_bucket():
    from datasets import Dataset

    rows = [  # two packed documents, a short row, and masked tokens
        {"input_ids": list(range(5, 25)), "position_ids": list(range(12)) + list(range(8)),
         "labels": [-100] + list(range(6, 17)) + [-100] + list(range(18, 25))},
        {"input_ids": list(range(40, 47)), "position_ids": list(range(7)),
         "labels": [-100, 41, 42, -100, -100, 45, 46]},
    ]
    got = position_loss(NextTokenOracle(scale_by_position=True), nn.Identity(),
                        Dataset.from_list(rows), 16, 4,
                        rank_state(), 0)
    want = _expected_bucket_means(rows, 16, 4)
    assert got.tokens == [10, 9, 3, 0]
    for g, w in zip(got.mean, want, strict=True):
        assert (math.isnan(g) and math.isnan(w)) or abs(g - w) < 1e-5


# ---- checkpoint folders ---------------------------------------------------------------------


def test_bad_checkpoint_folders_are_user_errors(tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        checkpoint_kind(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        checkpoint_kind(tmp_path / "file")
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    with pytest.raises(UserError, match="did you mean .*final"):
        checkpoint_kind(run)
    (run / "final" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="no model weights"):
        checkpoint_kind(run / "final")
    (run / "checkpoint-5" / "state").mkdir(parents=True)
    with pytest.raises(UserError, match="incomplete checkpoint"):
        checkpoint_kind(run / "checkpoint-5")


def _tiny_config(tmp_path: Path, **extra):
    import yaml

    from longctx_cli.config import load_config
    from tests.train_helpers import TINY_LLAMA

    data = {"model_config": TINY_LLAMA, "tokenizer": "byte", "dtype": "float32",
            "attention_kernel": "torch", "seed": 5, "output_dir": str(tmp_path / "out"), **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.model import decoder_and_head, sp_hidden_states

    decoder, head = decoder_and_head(model)
    batch = shard_batch(ids, torch.arange(ids.numel()), ids, rank_state())
    with torch.no_grad():
        return head(sp_hidden_states(decoder, batch))


def _perturb(model: nn.Module, only: str = "") -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in name:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))


def test_lora_final_and_dcp_checkpoint_load_the_trained_weights(tmp_path: Path):
    from longctx_cli.runtime.model import build_model, load_base_model
    from longctx_cli.train.checkpoint_files import export_final, save_checkpoint

    config = _tiny_config(tmp_path, adapter="lora", lora_target_modules=["q_proj", "v_proj"])
    model = build_model(config)
    _perturb(model, only="lora_B")  # a fresh adapter is a no-op; make it matter
    model.eval()
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    out = tmp_path / "out"
    export_final(model, byte_tokenizer(), out / "final", True,
                 lambda d: load_base_model(config, "sdpa").save_pretrained(d))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_checkpoint(out, 3, model, optimizer, scheduler, {"step": 3})

    base = load_for_eval(config, out / "final" / "base_model")
    assert (_logits(base, ids) - want).abs().max() > 1e-3  # the adapter changes the output
    for path in (out / "final", out / "checkpoint-3"):
        loaded = load_for_eval(config, path)
        assert not loaded.training
        assert torch.allclose(_logits(loaded, ids), want, atol=1e-5, rtol=1e-5), path


# ---- outputs --------------------------------------------------------------------------------


def _results() -> list[ModelResult]:
    spec = GridSpec([300], [0.0, 1.0], 1, 5)
    grid = GridResult(spec, [SampleResult(300, 0.0, 0, "12345", "12345", True),
                             SampleResult(300, 1.0, 0, "67890", "67899", False)])
    positions = PositionLoss([0, 4], [4, 8], [6.0, 0.0], [3, 0])
    return [ModelResult("run/final", "/x/run/final", grid, positions)]


def test_outputs_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a missing package looks like
    lines = write_all(_results(), 8, tmp_path)
    assert any("matplotlib is not installed" in line for line in lines)
    assert not list(tmp_path.glob("*.png"))
    passkey = json.loads((tmp_path / "passkey.json").read_text())
    assert passkey["models"][0]["accuracy"] == 0.5
    assert passkey["models"][0]["cells"][1] == {"context_len": 300, "depth": 1.0, "correct": 0,
                                                "total": 1, "accuracy": 0.0}
    buckets = json.loads((tmp_path / "position_loss.json").read_text())["models"][0]["buckets"]
    assert [b["loss"] for b in buckets] == [2.0, None]
    csv_lines = (tmp_path / "position_loss.csv").read_text().splitlines()
    assert csv_lines[0] == "model,checkpoint,bucket,start,end,tokens,loss"
    assert csv_lines[1:] == ["run/final,/x/run/final,0,0,4,3,2.000000",
                             "run/final,/x/run/final,1,4,8,0,"]


def test_outputs_with_matplotlib_include_pngs(tmp_path: Path):
    pytest.importorskip("matplotlib")
    lines = write_all(_results() * 2, 8, tmp_path)
    assert not any("not installed" in line for line in lines)
    for name in ("passkey_heatmap.png", "position_loss.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_position_table_stops_at_the_last_bucket_with_tokens():
    from rich.console import Console

    from longctx_cli.eval.report import position_table

    console = Console(width=100, record=True)
    console.print(position_table(_results()))
    text = console.export_text()
    assert "0-3" in text and "2.0000" in text
    assert "4-7" not in text  # empty trailing bucket: in the files, not the table
    assert "no tokens at positions 4 and beyond" in " ".join(text.split())
