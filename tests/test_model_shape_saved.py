"""A plain family's saved config.json is read without transformers (validate and the launcher
skip importing torch for it), and that reading equals transformers' own, or is not taken."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from longctx_cli.config import load_config
from longctx_cli.config.model_shape import (
    _saved_plain_shape,
    plain_module_classes,
    read_model_config,
)
from longctx_cli.config.shape import ModelShape

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100}
# config_value keys the plan and its rules read.
READ_KEYS = ("attention_chunk_size", "attn_logit_softcapping", "layer_types", "sliding_window",
             "no_rope_layers", "output_router_logits", "router_aux_loss_coef")

PLAIN = {
    "llama": ("llama", {}),
    "llama-gqa-tied": ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": True,
                                 "rope_theta": 500000.0, "max_position_embeddings": 8192}),
    "qwen2": ("qwen2", {"num_key_value_heads": 2}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
}
# Saved configs whose computation differs from the plain dict's: transformers reads them.
NOT_PLAIN = {
    "mistral-window": ("mistral", {}),  # sliding_window 4096 by default
    "llama-bias": ("llama", {"attention_bias": True}),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}),
    "llama-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 16}),
    "gemma": ("gemma", {}),
}


def _save(tmp_path, name, model_type, extra):
    folder = tmp_path / name
    AutoConfig.for_model(model_type, **SMALL, **extra).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", list(PLAIN))
def test_saved_plain_config_reads_as_transformers_reads_it(tmp_path, name):
    folder = _save(tmp_path, name, *PLAIN[name])
    fast = _saved_plain_shape(folder, "local path")
    assert fast is not None and fast.hf_config is None
    hf = AutoConfig.from_pretrained(folder)
    slow = ModelShape.from_hf_config(hf, source="local path")
    assert fast == slow and fast.context == slow.context
    assert all(fast.config_value(k) == slow.config_value(k) for k in READ_KEYS)
    # When the config object is needed, it is transformers' reading of the same file.
    assert fast.transformers_config().to_dict() == hf.to_dict()


@pytest.mark.parametrize("name", list(NOT_PLAIN))
def test_other_saved_configs_go_to_transformers(tmp_path, name):
    assert _saved_plain_shape(_save(tmp_path, name, *NOT_PLAIN[name]), "local path") is None


def test_unknown_or_changed_keys_go_to_transformers(tmp_path):
    folder = _save(tmp_path, "llama", "llama", {})
    saved = json.loads((folder / "config.json").read_text())
    for change in ({"architectures": ["LlamaForSequenceClassification"]},
                   {"some_new_switch": True}, {"attention_dropout": 0.1},
                   {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 10000.0}}):
        (folder / "config.json").write_text(json.dumps({**saved, **change}))
        assert _saved_plain_shape(folder, "local path") is None, change


def test_validate_of_a_saved_model_does_not_import_torch(tmp_path):
    folder = _save(tmp_path, "model", "llama", {})
    config_path = tmp_path / "config.yaml"
    config_path.write_text(f"base_model: {folder}\ntokenizer: byte\nsequence_len: 256\n"
                           "datasets:\n  - path: data.jsonl\n    type: completion\n")
    code = ("import sys; from longctx_cli.config import load_config; "
            "from longctx_cli.config.model_shape import read_model_config; "
            f"shape = read_model_config(load_config({str(config_path)!r})); "
            "print(shape.source, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out[-2:] == ["False", "False"], out
    # With overrides the run's config is transformers' reading of the file, overridden.
    config = load_config(config_path, ["--rope_theta", "20000"])
    shape = read_model_config(config)
    assert shape.transformers_config().rope_parameters["rope_theta"] == 20000.0


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_module_names_are_the_models_own(tmp_path, name):
    """The module tree the LoRA target check reads of a plain family, against the model
    transformers builds (on the meta device) from the same saved config."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = _save(tmp_path, name, *PLAIN[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    built = {n: type(m).__name__ for n, m in model.named_modules() if n}
    assert plain_module_classes(_saved_plain_shape(folder, "local path")) == built
    assert plain_module_classes(ModelShape.from_hf_config(model.config)) is None  # not plain


def test_lora_targets_of_a_saved_plain_model_are_checked_without_torch(tmp_path):
    folder = _save(tmp_path, "model", "llama", {})
    config_path = tmp_path / "config.yaml"
    config_path.write_text(f"base_model: {folder}\ntokenizer: byte\nsequence_len: 256\n"
                           "adapter: lora\nlora_target_modules: [q_proj, qkv_proj]\n"
                           "datasets:\n  - path: data.jsonl\n    type: completion\n")
    code = ("import sys; from longctx_cli.config import load_config; "
            "from longctx_cli.errors import UserError; "
            "from longctx_cli.preflight import check_lora_targets\n"
            f"try:\n    check_lora_targets(load_config({str(config_path)!r}))\n"
            "except UserError as e:\n    print(repr(str(e)))\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert "'qkv_proj'" in out[0] and "q_proj" in out[0], out
    assert out[-1] == "False False", out
