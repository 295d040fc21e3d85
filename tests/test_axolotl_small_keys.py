"""Small Axolotl keys that used to turn its examples away: SwanLab's tracker keys, a
dataset's `drop_system_message`, `unfrozen_parameters` with an adapter, `revision_of_model`,
`optimizer: muon`, added tokens, and Axolotl's cloud-launcher configs."""

from __future__ import annotations

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.errors import UserError

BASE = {"model_config": {"model_type": "llama"}, "tokenizer": "byte"}


def _error(data: dict) -> str:
    with pytest.raises(UserError) as exc:
        config_from_dict({**BASE, **data})
    return " ".join(str(exc.value).split())


def _notes(data: dict) -> dict[str, str]:
    return dict(config_from_dict({**BASE, **data}).axolotl_notes)


def test_swanlab_keys_of_axolotls_examples_are_ignored_tracker_keys() -> None:
    theirs = {"use_swanlab": True, "swanlab_project": "p", "swanlab_experiment_name": "run-1",
              "swanlab_description": "d", "swanlab_workspace": "w", "swanlab_mode": "cloud",
              "swanlab_log_model": False, "swanlab_log_completions": True,
              "swanlab_completion_log_interval": 100, "swanlab_completion_max_buffer": 128}
    notes = _notes(theirs)
    assert all("ignored" in notes[k] and "Weights & Biases" in notes[k] for k in theirs), notes


# ---- drop_system_message ---------------------------------------------------------------------


def test_drop_system_message_leaves_out_a_first_system_turn(tmp_path) -> None:
    from longctx_cli.data.chat_templates import resolve_template
    from tests.test_data_formats import SHAREGPT, TOK, cfg, one, sharegpt, tokenize

    rec = sharegpt(("system", "Be brief."), ("human", "Q"), ("gpt", "A"), ("human", "Q2"),
                   ("gpt", "A2"))
    bare = sharegpt(("human", "Q"), ("gpt", "A"), ("human", "Q2"), ("gpt", "A2"))
    dropped = {**SHAREGPT, "drop_system_message": True}
    with_system = one(tokenize(tmp_path, [rec], SHAREGPT, chat_template="chatml"))
    assert "Be brief." in TOK.decode(with_system[0])
    # Gemma's template has no system role (why Axolotl's gemma2 example drops it).
    with pytest.raises(UserError, match="no system role"):
        tokenize(tmp_path, [rec], SHAREGPT, chat_template="gemma")
    for template in ("chatml", "gemma"):
        got = one(tokenize(tmp_path, [rec], dropped, chat_template=template))
        assert got == one(tokenize(tmp_path, [bare], SHAREGPT, chat_template=template))
        # The text is the template's rendering of the conversation without its system turn.
        config = cfg(tmp_path, dropped, chat_template=template)
        messages = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]],
                     "content": t["value"]} for t in bare["conversations"]]
        text = TOK.apply_chat_template(
            messages, chat_template=resolve_template(config, config.data.datasets[0], TOK)[0],
            tokenize=False)
        assert TOK.decode(got[0]) == text
    # Only a first system turn is dropped (as Axolotl does); a later one stays.
    later = sharegpt(("human", "Q"), ("system", "Be brief."), ("gpt", "A"))
    ids = one(tokenize(tmp_path, [later], dropped, chat_template="chatml"))[0]
    assert "Be brief." in TOK.decode(ids)


def test_drop_system_message_of_a_reward_pair_and_of_other_types() -> None:
    from longctx_cli.data.preference import pair_texts
    from tests.test_preference import tokenizer

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    record = {"system": "Be brief.", "input": "Sky?", "chosen": "Blue.", "rejected": "Green."}
    assert pair_texts(record, "bradley_terry.chat_template", "r:1", tok=tokenizer(),
                      template=template, drop_system=True) == (
        "<user>Sky?</s><assistant>", "Blue.</s>", "Green.</s>")
    msg = _error({"datasets": [{"path": "d.jsonl", "type": "alpaca",
                                "drop_system_message": True}]})
    assert "`drop_system_message`" in msg and "`alpaca`" in msg and "chat_template" in msg


# ---- unfrozen_parameters with an adapter -----------------------------------------------------


def test_unfrozen_parameters_of_axolotls_gemma3_examples_train_nothing_and_are_refused() -> None:
    # Axolotl matches them against the peft model's names (base_model.model....): none match.
    msg = _error({"adapter": "qlora", "load_in_4bit": True,
                  "unfrozen_parameters": ["^model.language_model.*", "^lm_head.*"]})
    assert "`unfrozen_parameters` ['^model.language_model.*', '^lm_head.*'] with `adapter`" in msg
    assert "start with `base_model.model.`" in msg and "nothing would train" in msg
    assert "can match none" in _error({"adapter": "lora", "unfrozen_parameters": [
        r"base_model\.model\.model\.layers\.1\.", "lm_head"]})


def test_unfrozen_parameters_with_an_adapter_train_the_adapter_weights_they_match() -> None:
    import re

    from longctx_cli.runtime.model import build_model
    from tests.train_helpers import TINY_LLAMA

    common = {"model_config": TINY_LLAMA, "tokenizer": "byte", "adapter": "lora",
              "lora_target_linear": True}
    whole = build_model(config_from_dict(common))
    adapter = [n for n, p in whole.named_parameters() if p.requires_grad]
    pattern = r"base_model.model.model.layers.1.self_attn.[a-z_]+.lora_B"
    model = build_model(config_from_dict({**common, "unfrozen_parameters": [pattern]}))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    # Axolotl's freeze: every parameter off, then on where the pattern (literal dots) matches.
    expected = [n for n in adapter
                if re.match(r"base_model\.model\.model\.layers\.1\.self_attn\.[a-z_]+\.lora_B",
                            n)]
    assert trained == expected and len(expected) == 4, trained
    # A base weight beside the adapter would train but never reach the adapter's export.
    with pytest.raises(UserError, match="matches base weights") as exc:
        build_model(config_from_dict({**common, "unfrozen_parameters": [
            r"base_model\.model\.model\.embed_tokens"]}))
    assert "lora_modules_to_save" in str(exc.value)


@pytest.mark.slow  # two trainings; the rules above stay in the default run
def test_unfrozen_adapter_weights_under_sp_equal_one_process_and_leave_the_rest(tmp_path):
    from tests.train_helpers import (
        assert_same_run,
        final_tensors,
        train,
        write_config,
        write_documents,
    )

    data = write_documents(tmp_path / "docs.jsonl", seed=6)
    keys = {"adapter": "lora", "lora_target_linear": True, "max_steps": 2, "val_set_size": 0,
            "eval_steps": None, "learning_rate": 1e-2,
            "unfrozen_parameters": ["base_model.model.model.layers.1.[a-z_.]+lora_"]}
    train(write_config(tmp_path, "sp1", data, **keys), 1)
    train(write_config(tmp_path, "sp2", data, sequence_parallel_degree=2, **keys), 2)
    assert_same_run(tmp_path / "sp2", tmp_path / "sp1", adapter=True)
    final = final_tensors(tmp_path / "sp2", adapter=True)
    # lora_B starts at zero: it moved in layer 1 only; layer 0's adapter stayed as it began.
    for name, tensor in final.items():
        if "lora_B" in name:
            assert bool(tensor.abs().sum() > 0) == (".layers.1." in name), name


# ---- revision_of_model -----------------------------------------------------------------------

_LOAD_AT_REVISION = """
import json, sys
from longctx_cli.config.load import config_from_dict
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.data.tokenizer import load_tokenizer
from longctx_cli.preflight import meta_model
from longctx_cli.runtime.model import load_base_model

config = config_from_dict(json.loads(sys.argv[1]))
shape = read_model_config(config)
model = load_base_model(config, "eager")
print(json.dumps({"shape": shape.hidden_size, "source": shape.source,
                  "model": model.config.hidden_size,
                  "meta": meta_model(config).config.hidden_size,
                  "template": load_tokenizer(config).chat_template}))
"""


def _hub_snapshot(repo, commit: str, hidden: int, template: str) -> None:
    """One revision of a tiny llama in the hub client's cache layout (files, no blobs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.data.tokenizer import byte_tokenizer
    from tests.train_helpers import TINY_LLAMA

    folder = repo / "snapshots" / commit
    fields = {**TINY_LLAMA, "hidden_size": hidden}
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields)).save_pretrained(folder)
    tok = byte_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(folder)


def test_revision_of_model_loads_that_revision_of_model_config_and_tokenizer(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny"
    main, tagged = "a" * 40, "b" * 40
    _hub_snapshot(repo, main, 32, "main {{ messages }}")
    _hub_snapshot(repo, tagged, 48, "v1 {{ messages }}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    (repo / "refs" / "v1").write_text(tagged)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.getcwd()}

    def load(**keys) -> dict:
        data = {"base_model": "someone/tiny", "dtype": "float32", **keys}
        run = subprocess.run([sys.executable, "-c", _LOAD_AT_REVISION, json.dumps(data)],
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    at_v1 = load(revision_of_model="v1")
    assert (at_v1["shape"], at_v1["model"], at_v1["meta"]) == (48, 48, 48)
    assert at_v1["template"].startswith("v1") and "someone/tiny@v1" in at_v1["source"]
    at_commit = load(revision_of_model=tagged)  # a commit, as Axolotl's examples pin it
    assert (at_commit["model"], at_commit["template"][:2]) == (48, "v1")
    unpinned = load()
    assert (unpinned["model"], unpinned["template"][:4]) == (32, "main")
    # A revision the cache does not hold is not replaced by another.
    path = tmp_path / "v2.yaml"
    path.write_text("base_model: someone/tiny\nrevision_of_model: v2\ntokenizer: byte\n")
    run = subprocess.run([sys.executable, "-m", "longctx_cli", "validate", str(path)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    said = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 2 and "Traceback" not in said, said
    assert "someone/tiny" in said and "not cached" in said, said


def test_revision_of_model_with_a_local_folder_or_inline_config_is_refused(tmp_path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    msg = " ".join(str(_raises({"base_model": str(folder), "revision_of_model": "v1"})).split())
    assert "`revision_of_model` = 'v1' picks a hub revision" in msg
    assert "is a local folder" in msg and "give the hub id" in msg
    assert "inline `model_config` has none" in _error({"revision_of_model": "v1"})


def _raises(data: dict) -> UserError:
    with pytest.raises(UserError) as exc:
        config_from_dict({"tokenizer": "byte", **data})
    return exc.value


# ---- optimizer: muon -------------------------------------------------------------------------


def test_axolotls_muon_is_refused_with_how_it_differs_from_torchs() -> None:
    msg = _error({"optimizer": "muon"})
    assert "`optimizer: muon`" in msg and "DistMuon" in msg and "torch.optim.Muon" in msg
    assert "never trained" in msg and "optimizer: adamw" in msg


# ---- Axolotl's cloud launcher configs --------------------------------------------------------


def test_a_cloud_launcher_config_is_named_for_what_it_is(tmp_path) -> None:
    from longctx_cli.config.load import load_config

    path = tmp_path / "modal.yaml"
    path.write_text("project_name:\nvolumes:\n  - name: axolotl-data\n    mount: /workspace/data\n"
                    "secrets:\n  - HF_TOKEN\ngpu: h100\ngpu_count: 1\nmemory: 128\n")
    with pytest.raises(UserError) as exc:
        load_config(path)
    msg = " ".join(str(exc.value).split())
    assert msg.startswith(f"{path}: this is an Axolotl cloud launcher config (keys `gpu`")
    assert "not a training config" in msg and "--cloud" in msg and "Fix: give longctx" in msg
    # A training config that happens to use one such name is read as one.
    assert "unknown key `gpu`" in _error({"gpu": "h100"})
