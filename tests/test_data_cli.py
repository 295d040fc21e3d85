"""`longctx preprocess` end to end on files the test writes."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from longctx_cli.cli import app


def test_preprocess_builds_then_reuses_and_reports_bad_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": f"sample {i} " * (i + 1)}) + "\n" for i in range(30)))
    (tmp_path / "c.yaml").write_text(
        "model_config: {model_type: llama}\ntokenizer: byte\nsequence_len: 256\n"
        "datasets: [{path: d.jsonl}]\ndataset_prepared_path: prep\n")
    runner = CliRunner()
    first = runner.invoke(app, ["preprocess", "c.yaml"])
    assert first.exit_code == 0, first.output
    assert "Built cache prep" in first.output and "packing efficiency" in first.output
    assert len(list((tmp_path / "prep").glob("*/COMPLETE"))) == 1  # prep/<fingerprint>/
    second = runner.invoke(app, ["preprocess", "c.yaml"])
    assert second.exit_code == 0 and "Reused cache prep" in second.output

    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    bad = runner.invoke(app, ["preprocess", "c.yaml"])
    assert bad.exit_code == 2
    assert "d.jsonl:2" in bad.output and "Traceback" not in bad.output
    assert len(list((tmp_path / "prep").glob("*/COMPLETE"))) == 1  # the good cache is still there
