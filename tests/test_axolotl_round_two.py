"""Axolotl keys that used to be turned away: unknown keys (warning or strict error), the
streaming keys, gpt-oss's MXFP4 loading keys and reasoning traces, curriculum order and
sequential packing, `reinit_weights` and `unfrozen_parameters`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longctx_cli.config.load import config_from_dict, load_config
from longctx_cli.data.pack import ffd_bins, sequential_bins
from longctx_cli.data.prepare import prepare
from longctx_cli.data.tokenizer import byte_tokenizer
from longctx_cli.errors import UserError
from longctx_cli.runtime.batches import step_row_indices
from tests.train_helpers import TINY_LLAMA, assert_same_run, train, write_config, write_documents

TOK = byte_tokenizer()
BASE = {"model_config": {"model_type": "llama"}, "tokenizer": "byte"}


def _error(data: dict) -> str:
    with pytest.raises(UserError) as exc:
        config_from_dict({**BASE, **data})
    return " ".join(str(exc.value).split())


def _notes(data: dict) -> dict[str, str]:
    return dict(config_from_dict({**BASE, **data}).axolotl_notes)


# ---- unknown keys ---------------------------------------------------------------------------


def test_unknown_key_is_a_listed_warning_and_a_near_miss_an_error() -> None:
    assert "not a key longctx knows" in _notes({"strict": False,
                                                "my_team_tag": "x"})["my_team_tag"]
    msg = _error({"learning_rat": 1e-4})
    assert "unknown key `learning_rat`; did you mean `learning_rate`?" in msg
    assert msg.count("learning_rat`") == 1


def test_other_tools_keys_that_share_words_with_ours_are_not_typos() -> None:
    # Keys of Axolotl's own examples that share words with longctx's: listed with what
    # longctx does (kernel switches and trackers ignored), never "did you mean".
    theirs = {"use_scattermoe": True, "liger_rms_norm_gated": True, "use_swanlab": False}
    notes = _notes(theirs)
    assert all("ignored" in notes[k] and "did you mean" not in notes[k] for k in theirs), notes
    # A fractional `warmup_steps` (Axolotl's EP examples) is invalid there too: the fix names
    # the ratio key.
    assert "write `warmup_ratio: 0.1`" in _error({"warmup_steps": 0.1})
    assert config_from_dict({**BASE, "warmup_steps": 5.0}).training.warmup_steps == 5
    # Those that would change the run are refused with their own reason.
    msg = _error({"expert_parallel_token_capacity": 64})
    assert "is not supported" in msg and "route" in msg and "did you mean" not in msg
    # One letter added (a typo in one of Axolotl's own examples), one swapped, one dropped.
    for typo, key in (("context_parapllel_size", "context_parallel_size"),
                      ("lora_aplha", "lora_alpha"), ("micro_batchsize", "micro_batch_size")):
        assert f"unknown key `{typo}`; did you mean `{key}`?" in _error({typo: 2})


def test_older_axolotl_model_config_overrides_are_ignored_as_axolotl_does() -> None:
    # Axolotl's Mixtral examples still carry `model_config: {output_router_logits: true}`,
    # which Axolotl no longer reads; longctx's inline `model_config` needs a model_type.
    config = config_from_dict({"base_model": "mistralai/Mistral-7B-v0.1", "tokenizer": "byte",
                               "model_config": {"output_router_logits": True}})
    assert config.model.model_config_dict is None
    assert "overrides_of_model_config" in dict(config.axolotl_notes)["model_config"]
    assert "needs a `model_type`" in _error({"model_config": {"hidden_size": 64}})


def test_strict_makes_every_unknown_key_an_error(tmp_path: Path) -> None:
    msg = _error({"strict": True, "my_team_tag": "x"})
    assert "unknown key `my_team_tag`" in msg and "strict: true" in msg
    path = tmp_path / "c.yaml"
    path.write_text("model_config: {model_type: llama}\ntokenizer: byte\nstrict: false\n"
                    "my_team_tag: x\n")
    assert "my_team_tag" in dict(load_config(path).axolotl_notes)
    with pytest.raises(UserError, match="unknown key `my_team_tag`"):
        load_config(path, ["--strict"])


def test_unknown_dataset_key_is_listed_once_or_refused_when_near(tmp_path: Path) -> None:
    entry = {"path": "d.jsonl", "type": "completion", "team_note": "x"}
    notes = _notes({"strict": False, "datasets": [entry]})
    assert "not a key longctx knows" in notes["datasets[0].team_note"]
    msg = _error({"datasets": [{"path": "d.jsonl", "type": "completion", "feild": "text"}]})
    assert msg.count("unknown key `datasets[0].feild`; did you mean `field`?") == 1


# ---- streaming, MXFP4 ----------------------------------------------------------------------


def test_streaming_keys() -> None:
    notes = _notes({"streaming_multipack_buffer_size": 10000, "pretrain_multipack_attn": True})
    assert "packed row by row" in notes["streaming_multipack_buffer_size"]
    assert "never attend to each other" in notes["pretrain_multipack_attn"]
    assert "attend to each other" in _error({"pretrain_multipack_attn": False})


def test_gpt_oss_quantization_keys_and_mxfp4_detection() -> None:
    from transformers import GptOssConfig

    from longctx_cli.runtime.model import is_mxfp4

    notes = _notes({"model_quantization_config": "Mxfp4Config",
                    "model_quantization_config_kwargs": {"dequantize": True}})
    assert "dequantised" in notes["model_quantization_config"]
    assert "dequantize: true" in _error({"model_quantization_config": "Mxfp4Config",
                                         "model_quantization_config_kwargs":
                                         {"dequantize": False}})
    assert "load_in_4bit" in _error({"model_quantization_config": "BitsAndBytesConfig"})
    assert is_mxfp4(GptOssConfig(quantization_config={"quant_method": "mxfp4"}))
    assert not is_mxfp4(GptOssConfig())


# ---- reasoning traces -----------------------------------------------------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|end|>{% endfor %}"
)


def test_reasoning_trace_is_rendered_and_trained(tmp_path: Path) -> None:
    conv = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "thought": "add two and two"}]
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": conv}) + "\n")
    cfg = config_from_dict({
        **BASE, "chat_template": "jinja", "chat_template_jinja": THINKING_TEMPLATE,
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": str(data), "type": "chat_template", "field_thinking": "thought"}],
    })
    row = prepare(cfg, progress=False).train[0]
    text = TOK.decode(row["input_ids"])
    assert "<think>add two and two</think>4" in text
    target = TOK.decode([t for t in row["labels"] if t != -100])
    assert target.startswith("add two and two</think>4"), target
    assert "2+2?" not in target


# ---- order: curriculum and sequential packing ----------------------------------------------


def test_sequential_bins_keep_order() -> None:
    lengths = [5, 3, 4, 2, 6, 1]
    assert sequential_bins(lengths, 8) == [[0, 1], [2, 3], [4, 5]]
    assert [i for b in sequential_bins(lengths, 8) for i in b] == list(range(6))
    assert ffd_bins(lengths, 8) != sequential_bins(lengths, 8)


def test_curriculum_reads_rows_in_order() -> None:
    assert step_row_indices(1, 3, 4, 10, seed=0, shuffle=False) == [4, 5, 6, 7]
    assert step_row_indices(2, 3, 4, 10, seed=0, shuffle=False) == [8, 9]
    assert step_row_indices(3, 3, 4, 10, seed=0, shuffle=False) == [0, 1, 2, 3]  # epoch 2
    assert step_row_indices(1, 3, 4, 10, seed=0) != [4, 5, 6, 7]


def test_curriculum_rows_are_in_file_order(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i:02d} " + "x" * (i % 7)}) + "\n"
                            for i in range(40)))
    cfg = config_from_dict({
        **BASE, "sequence_len": 64, "sample_packing_sequentially": True,
        "curriculum_sampling": True, "shuffle_merged_datasets": False, "val_set_size": 4,
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": str(data), "type": "completion", "field": "text"}]})
    prepared = prepare(cfg, progress=False)
    order = [int(piece[:2]) for row in prepared.train
             for piece in TOK.decode(row["input_ids"]).split("doc ")[1:]]
    held = [int(piece[:2]) for row in prepared.eval
            for piece in TOK.decode(row["input_ids"]).split("doc ")[1:]]
    assert order == sorted(order) and sorted(order + held) == list(range(40))


@pytest.mark.slow
def test_curriculum_and_sequential_packing_train_exactly_under_sp(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "docs.jsonl", seed=4)
    keys = {"curriculum_sampling": True, "sample_packing_sequentially": True,
            "shuffle_merged_datasets": False}
    one = write_config(tmp_path, "sp1", data, **keys)
    two = write_config(tmp_path, "sp2", data, sequence_parallel_degree=2, **keys)
    train(one, 1)
    train(two, 2)
    assert_same_run(tmp_path / "sp2", tmp_path / "sp1")


# ---- reinit_weights, unfrozen_parameters ----------------------------------------------------


def test_reinit_weights_draws_the_architecture_afresh(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.runtime.model import load_base_model

    saved = tmp_path / "base"
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(saved)
    common = {"tokenizer": "byte", "dtype": "float32", "seed": 7}
    trained = load_base_model(config_from_dict({"base_model": str(saved), **common}), "eager")
    fresh = load_base_model(config_from_dict({"base_model": str(saved), "reinit_weights": True,
                                              **common}), "eager")
    drawn = load_base_model(config_from_dict({"model_config": TINY_LLAMA, **common}), "eager")
    w = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(fresh.state_dict()[w], trained.state_dict()[w])
    assert torch.equal(fresh.state_dict()[w], drawn.state_dict()[w])  # seed 7, same config


def test_unfrozen_parameters_train_only_what_they_match(tmp_path: Path) -> None:
    from longctx_cli.runtime.model import build_model

    cfg = config_from_dict({"model_config": TINY_LLAMA, "tokenizer": "byte",
                            "unfrozen_parameters": [r"model\.layers\.1\.", r"lm_head"]})
    trained = {n for n, p in build_model(cfg).named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("model.layers.1.") or n.startswith("lm_head")
                           for n in trained)
    # Axolotl's syntax: dots are literal, `[start:end]` trains only those rows.
    axolotl_style = config_from_dict({"model_config": TINY_LLAMA, "tokenizer": "byte",
                                      "unfrozen_parameters": ["model.embed_tokens.weight[2:5]"]})
    model = build_model(axolotl_style)
    (name,) = [n for n, p in model.named_parameters() if p.requires_grad]
    assert name == "model.embed_tokens.weight"
    weight = model.get_input_embeddings().weight
    model.get_input_embeddings()(torch.arange(10)).pow(2).sum().backward()
    assert weight.grad[2:5].abs().sum() > 0
    assert weight.grad[:2].abs().sum() == 0 and weight.grad[5:].abs().sum() == 0
    assert "not with `fsdp`" in _error({"unfrozen_parameters": ["lm_head[0:4]"], "fsdp": True})
    with pytest.raises(UserError, match="matches none of the model's parameters"):
        build_model(config_from_dict({"model_config": TINY_LLAMA, "tokenizer": "byte",
                                      "unfrozen_parameters": ["layers_1"]}))
    assert "drop one of them" in _error({"unfrozen_parameters": ["x"], "adapter": "lora"})


@pytest.mark.slow  # suite budget; unfrozen_parameters' plan and rules stay in the default run
def test_unfrozen_parameters_under_sp_equal_one_process_and_leave_the_rest(tmp_path):
    from safetensors.torch import load_file

    from longctx_cli.runtime.model import load_base_model

    data = write_documents(tmp_path / "docs.jsonl", seed=6)
    keys = {"unfrozen_parameters": [r"model\.layers\.1\.self_attn\."], "max_steps": 2,
            "val_set_size": 0, "eval_steps": None}
    one = write_config(tmp_path, "sp1", data, **keys)
    two = write_config(tmp_path, "sp2", data, sequence_parallel_degree=2, **keys)
    train(one, 1)
    train(two, 2)
    assert_same_run(tmp_path / "sp2", tmp_path / "sp1")
    final = load_file(str(tmp_path / "sp2" / "final" / "model.safetensors"))
    init = load_base_model(load_config(two), "eager").state_dict()
    for name, tensor in final.items():
        moved = not torch.equal(tensor, init[name].to(tensor.dtype))
        assert moved == name.startswith("model.layers.1.self_attn."), name
