"""The schema and YAML loading: types, defaults, aliases, and every way a file can be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from longctx_cli.config import Config, DatasetConfig, config_from_dict, load_config
from longctx_cli.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = {"model_config": {"model_type": "llama"}}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _message(exc: pytest.ExceptionInfo[UserError]) -> str:
    return " ".join(str(exc.value).split())


# ---- schema -----------------------------------------------------------------------------


def test_defaults():
    cfg = config_from_dict(TINY)
    assert cfg.data.sequence_len == 4096
    assert cfg.parallel.sequence_parallel_degree == 1
    assert cfg.parallel.sequence_parallel_mode == "ring"
    assert cfg.parallel.heads_k_stride == 1
    assert cfg.parallel.ring_attn_func is None  # the plan picks the ring (layout.default_ring)
    assert cfg.parallel.sp_sharding is None
    assert cfg.parallel.attention_kernel == "auto"
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.trust_remote_code is False
    assert cfg.lora.adapter is None
    assert cfg.lora.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cfg.data.datasets == []
    assert cfg.output.output_dir == "./outputs"


def test_types_are_coerced_and_nested_datasets_parsed():
    cfg = config_from_dict(
        {**TINY, "sequence_len": "8192", "datasets": [{"type": "passkey", "num_samples": 3}]}
    )
    assert cfg.data.sequence_len == 8192
    assert isinstance(cfg.data.datasets[0], DatasetConfig)
    assert cfg.data.datasets[0].num_samples == 3
    assert cfg.data.datasets[0].field == "text"


def test_model_config_key_maps_to_model_config_dict():
    cfg = config_from_dict({"model_config": {"model_type": "llama", "hidden_size": 64}})
    assert cfg.model.model_config_dict == {"model_type": "llama", "hidden_size": 64}


def test_alias_context_parallel_size():
    cfg = config_from_dict({**TINY, "context_parallel_size": 4})
    assert cfg.parallel.sequence_parallel_degree == 4


def test_prepared_path_and_tokenizer_source():
    cfg = config_from_dict({"base_model": "org/model", "output_dir": "out/"})
    assert cfg.prepared_path == "out/prepared"
    assert cfg.model.tokenizer_source == "org/model"
    cfg = config_from_dict({**TINY, "tokenizer": "byte", "dataset_prepared_path": "/data/p"})
    assert cfg.prepared_path == "/data/p"
    assert cfg.model.tokenizer_source == "byte"


def test_unknown_key_suggests_the_closest():
    with pytest.raises(UserError) as exc:
        config_from_dict({**TINY, "sequence_lenght": 1024})
    assert "unknown key `sequence_lenght`" in _message(exc)
    assert "did you mean `sequence_len`?" in _message(exc)


def test_unknown_key_inside_a_dataset_entry():
    with pytest.raises(UserError) as exc:
        config_from_dict({**TINY, "datasets": [{"type": "passkey", "feild": "x"}]})
    assert "`datasets[0].feild`" in _message(exc)
    assert "did you mean `field`?" in _message(exc)
    assert _message(exc).count("`datasets[0].feild`") == 1  # reported once


def test_unknown_key_inside_a_dataset_entry_of_a_file_is_reported_once(tmp_path: Path):
    config = tmp_path / "config.yaml"
    config.write_text("model_config:\n  model_type: llama\ntokenizer: byte\ndatasets:\n"
                      "  - path: data.jsonl\n    type: completion\n    fieldd: text\n")
    with pytest.raises(UserError) as exc:
        load_config(config)
    assert _message(exc).count("unknown key `datasets[0].fieldd`") == 1
    assert "config.yaml:7:5" in _message(exc) and "did you mean `field`?" in _message(exc)


def test_wrong_type_names_key_and_value():
    with pytest.raises(UserError) as exc:
        config_from_dict({**TINY, "micro_batch_size": "two"})
    assert "`micro_batch_size` = 'two' is invalid" in _message(exc)


def test_out_of_range_value():
    with pytest.raises(UserError) as exc:
        config_from_dict({**TINY, "sequence_parallel_degree": 0})
    assert "`sequence_parallel_degree` = 0" in _message(exc)


def test_bad_literal_in_a_dataset_entry():
    with pytest.raises(UserError) as exc:
        config_from_dict({**TINY, "datasets": [{"type": "chat"}]})
    assert "`datasets[0].type` = 'chat'" in _message(exc)


def test_model_source_is_required():
    with pytest.raises(UserError) as exc:
        config_from_dict({"sequence_len": 1024})
    assert "`base_model`" in _message(exc)
    assert "`model_config`" in _message(exc)


def test_model_config_needs_model_type():
    with pytest.raises(UserError) as exc:
        config_from_dict({"model_config": {"hidden_size": 64}})
    assert "`model_type`" in _message(exc)


# ---- files ------------------------------------------------------------------------------


def test_bundled_examples_load():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        assert isinstance(load_config(path), Config), path


def test_bad_yaml_reports_line_and_column(tmp_path):
    path = _write(tmp_path, "base_model: org/model\nsequence_len: [1, 2\nseed: 1\n")
    with pytest.raises(UserError) as exc:
        load_config(path)
    assert f"{path}:3:5" in _message(exc)
    assert "invalid YAML" in _message(exc)


def test_bad_indentation_reports_its_line(tmp_path):
    path = _write(tmp_path, "model_config:\n  model_type: llama\n hidden_size: 3\n")
    with pytest.raises(UserError) as exc:
        load_config(path)
    assert f"{path}:3:" in _message(exc)


def test_missing_file():
    with pytest.raises(UserError) as exc:
        load_config("no/such/config.yaml")
    assert "'no/such/config.yaml' does not exist" in _message(exc)


def test_empty_file(tmp_path):
    with pytest.raises(UserError) as exc:
        load_config(_write(tmp_path, "# only a comment\n"))
    assert "the file is empty" in _message(exc)


def test_non_mapping_yaml(tmp_path):
    with pytest.raises(UserError) as exc:
        load_config(_write(tmp_path, "- base_model\n- sequence_len\n"))
    assert "must be a mapping" in _message(exc)
    assert "not list" in _message(exc)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"base_model: \xff\xfe\n")
    with pytest.raises(UserError) as exc:
        load_config(path)
    assert "UTF-8" in _message(exc)


def test_error_names_the_file(tmp_path):
    with pytest.raises(UserError) as exc:
        load_config(_write(tmp_path, "base_model: org/m\nsequence_len: -3\n"))
    assert str(tmp_path / "config.yaml") in _message(exc)
    assert "`sequence_len` = -3" in _message(exc)


def test_evals_per_epoch_zero_means_no_eval():
    """Axolotl reads `evals_per_epoch: 0` as "no evaluation" (its example configs carry it)."""
    from longctx_cli.train.evaluation import eval_interval

    cfg = config_from_dict({**TINY, "evals_per_epoch": 0})
    assert cfg.eval.evals_per_epoch == 0 and eval_interval(cfg, 10, 100) is None
    assert eval_interval(config_from_dict({**TINY, "evals_per_epoch": 2}), 10, 100) == 5
