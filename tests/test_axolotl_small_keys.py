"""Small Axolotl keys that used to turn its examples away: SwanLab's tracker keys, a
dataset's `drop_system_message`, `unfrozen_parameters` with an adapter, `revision_of_model`,
`optimizer: muon`, added tokens, and Axolotl's cloud-launcher configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from longctx_cli.config.load import config_from_dict
from longctx_cli.errors import UserError
from tests.test_axolotl_round_two import _error, _notes


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


@pytest.mark.slow
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


# ---- tokens: added tokens, resized embeddings ------------------------------------------------

_TOKEN_KEYS = {"tokens": ["<|im_start|>"], "special_tokens": {"eos_token": "<|im_end|>"}}
_DOCS = [(17, 1, 22, 24), (30, 9, 23), (12, 38, 12), (5, 26, 33)]  # two steps of two rows


def _token_config(**keys: Any):
    from longctx_cli.config import Config
    from tests.train_helpers import TINY_LLAMA

    return Config(model_config=TINY_LLAMA, tokenizer="byte", datasets=[{"path": "unused"}],
                  dtype="float32", attention_kernel="torch", learning_rate=0.01,
                  adam_epsilon=1e-6, lr_scheduler="constant", gradient_accumulation_steps=2,
                  max_steps=2, seed=7, **keys)


def _token_row(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed row whose documents use the two added tokens (ids 384 and 385)."""
    docs = _DOCS[index]
    g = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(3, 386, (sum(docs),), generator=g)
    ids[::5] = 384
    ids[2::7] = 385
    pos = torch.cat([torch.arange(n) for n in docs])
    labels = ids.clone()
    labels[pos == 0] = -100
    return ids, pos, labels


def _added_tokens_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`longctx train`'s step on a ring of `world_size` ranks, the added tokens' model."""
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from longctx_cli.train.optim import make_optimizer
    from longctx_cli.train.step import train_step

    config = _token_config(**_TOKEN_KEYS, sequence_parallel_degree=world_size,
                           sequence_parallel_mode="ring")
    plan = build_plan(config, world_size, read_model_config(config),
                      platform=Platform(cuda=False, ring_flash_attn=False))
    state = build_parallel_state(plan.layout, torch.device("cpu"))
    model = build_model(config, state)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, params)
    losses = []
    for step in range(2):
        batches = [shard_batch(*_token_row(i), state, 0) for i in (2 * step, 2 * step + 1)]
        losses.append(train_step(model, decoder, head, params, optimizer, batches, config,
                                 state, use_fsdp=False).loss)
    # numpy: pickled by value (tensors would travel as handles that die with the worker)
    weights = {k: v.detach().double().numpy().copy() for k, v in model.named_parameters()}
    return {"losses": losses, "weights": weights if rank == 0 else None}


def test_added_tokens_train_under_sp_as_hf_trains_the_resized_model() -> None:
    from longctx_cli.data.tokenizer import load_tokenizer
    from longctx_cli.runtime.model import load_base_model
    from longctx_cli.train.optim import make_optimizer
    from tests.distributed import run_distributed
    from tests.own_training import own_training

    config = _token_config(**_TOKEN_KEYS)
    tok = load_tokenizer(config)
    # Axolotl's order: the named special tokens, then `tokens`.
    assert len(tok) == 386
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"]) == [384, 385]
    assert tok.eos_token == "<|im_end|>" and tok("a<|im_start|>b").input_ids[1] == 385
    # HF's own resize of the same model, new rows drawn from the seed, as Axolotl resizes.
    model = load_base_model(_token_config(), "eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model.resize_token_embeddings(386, mean_resizing=False)
    new_rows = model.get_input_embeddings().weight[384:].detach().clone()
    ours = load_base_model(config, "eager")
    assert ours.get_input_embeddings().num_embeddings == 386 == ours.config.vocab_size
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                 model.state_dict().values(), strict=True))
    optimizer = make_optimizer(config, list(model.parameters()))
    steps = [[(d, None) for i in (2 * s, 2 * s + 1)
              for d in torch.split(_token_row(i)[0], list(_DOCS[i])) if d.numel() > 1]
             for s in range(2)]
    want = own_training(model.train(), optimizer, steps, config.training.max_grad_norm)
    got = run_distributed(_added_tokens_worker, 2, timeout_s=300)[0]
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a - b) / abs(b) < 1e-5, (got["losses"], want["losses"])
    for name, w in want["weights"].items():
        w = torch.from_numpy(w)
        assert float((torch.from_numpy(got["weights"][name]) - w).norm() / w.norm()) < 1e-4, name
    # The new rows trained (in the input embeddings and the untied lm_head).
    moved = torch.from_numpy(got["weights"]["model.embed_tokens.weight"][384:]).float() - new_rows
    assert moved.abs().min(dim=1).values.gt(0).all() and moved.norm() > 1e-3
    assert got["weights"]["lm_head.weight"].shape[0] == 386


def test_embeddings_size_rules_of_axolotl_and_the_adapter_rule() -> None:
    from longctx_cli.runtime.model import build_model, embeddings_size, load_base_model

    plain = _token_config()
    assert embeddings_size(plain, 386, 384) == 386
    assert embeddings_size(plain, 380, 384) == 384  # larger embeddings stay
    assert embeddings_size(_token_config(shrink_embeddings=True), 380, 384) == 380
    assert embeddings_size(_token_config(resize_token_embeddings_to_32x=True), 386, 384) == 416
    assert embeddings_size(_token_config(resize_token_embeddings_to_32x=True), 384, 384) == 384
    padded = load_base_model(_token_config(**_TOKEN_KEYS, resize_token_embeddings_to_32x=True),
                             "eager")
    assert padded.get_input_embeddings().num_embeddings == 416 == padded.lm_head.out_features
    mean = load_base_model(_token_config(**_TOKEN_KEYS, mean_resizing_embeddings=True), "eager")
    rows = mean.get_input_embeddings().weight.detach()
    # transformers' mean resizing: drawn around the old rows' mean (not the seed's N(0, std))
    assert (rows[384:].mean(0) - rows[:384].mean(0)).norm() < rows[:384].std(0).norm()
    # With an adapter the new rows train only in modules peft saves whole, as Axolotl asks.
    assert "lora_modules_to_save: [embed_tokens, lm_head]" in _error(
        {"adapter": "lora", "tokens": ["<x>"]})
    with pytest.raises(UserError, match="lacks \\['lm_head'\\]"):
        build_model(_token_config(**_TOKEN_KEYS, adapter="lora", lora_target_linear=True,
                                  lora_modules_to_save=["embed_tokens"]))
    model = build_model(_token_config(**_TOKEN_KEYS, adapter="lora", lora_target_linear=True,
                                      lora_modules_to_save=["embed_tokens", "lm_head"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"base_model.model.model.embed_tokens.modules_to_save.default.weight",
            "base_model.model.lm_head.modules_to_save.default.weight"} <= trained


@pytest.mark.slow
def test_merge_lora_resizes_the_adapters_base_as_training_did(tmp_path) -> None:
    import json

    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.train_helpers import TINY_LLAMA, run_longctx, train, write_config

    base = tmp_path / "base"
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(base)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"text": f"<|im_start|>user {i} says hi<|im_end|> " * 3})
                            + "\n" for i in range(24)))
    config = write_config(tmp_path, "run", data, model_config=None, base_model=str(base),
                          adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True,
                          lora_modules_to_save=["embed_tokens", "lm_head"], max_steps=2,
                          val_set_size=0, eval_steps=None, **_TOKEN_KEYS)
    train(config, 1)
    final = tmp_path / "run" / "final"
    assert not (final / "base_model").exists()  # the adapter names the 384-row base folder
    merged_dir = tmp_path / "merged"
    result = run_longctx("merge-lora", str(config), "--checkpoint", str(final),
                         "--output", str(merged_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager")
    assert merged.config.vocab_size == 386
    # peft's own merge onto the base resized by transformers (the saved embedding and
    # lm_head replace the resized rows whole).
    want = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    want.resize_token_embeddings(386, mean_resizing=False)
    want = PeftModel.from_pretrained(want, str(final)).merge_and_unload()
    ids = torch.tensor([[3, 40, 384, 77, 385, 90]])
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids).logits, want.eval()(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def _tp_rows_worker(rank: int, world_size: int, keys: dict[str, Any]) -> str:
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.runtime.model import build_model

    config = _token_config(**keys, tensor_parallel_size=world_size)
    plan = build_plan(config, world_size, read_model_config(config),
                      platform=Platform(cuda=False, ring_flash_attn=False))
    state = build_parallel_state(plan.layout, torch.device("cpu"))
    try:
        model = build_model(config, state)
    except UserError as e:
        return str(e)
    return f"rows {model.get_input_embeddings().weight.full_tensor().shape[0]}"


@pytest.mark.slow
def test_added_tokens_under_tensor_parallelism_need_rows_tp_divides() -> None:
    from tests.distributed import run_distributed

    # One added token: 385 rows, which TP 2 cannot split; rounded up to 32 it can.
    odd = run_distributed(_tp_rows_worker, 2, {"tokens": ["<x>"]}, timeout_s=300)[0]
    assert "have 385 rows" in odd and "resize_token_embeddings_to_32x" in odd, odd
    padded = run_distributed(_tp_rows_worker, 2, {"tokens": ["<x>"],
                                                  "resize_token_embeddings_to_32x": True},
                             timeout_s=300)[0]
    assert padded == "rows 416", padded


def test_eval_of_the_base_resizes_it_as_training_began(tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.eval.checkpoint_loading import load_for_eval
    from longctx_cli.runtime.model import load_base_model
    from tests.train_helpers import TINY_LLAMA

    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(base)
    config = config_from_dict({"base_model": str(base), "tokenizer": "byte", "dtype": "float32",
                               "seed": 7, **_TOKEN_KEYS})
    before = load_for_eval(config, base)
    start = load_base_model(config, "eager")  # the model training starts from
    assert before.get_input_embeddings().num_embeddings == 386
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(),
                                                 start.state_dict().values(), strict=True))
