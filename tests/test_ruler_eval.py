"""`longctx eval` with RULER tasks: every sample's greedy answer under SP (sp=2, two DP
groups) is the model's own single-process `generate` on the same prompt, scored with RULER's
string match; the report files exist; bad task names and lengths get one paragraph."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from longctx_cli.config.schema import Config
from longctx_cli.data.ruler import TASKS, make_sample, min_length, score
from longctx_cli.data.tokenizer import byte_tokenizer
from longctx_cli.errors import UserError
from longctx_cli.eval.ruler_eval import RULER_SEED, expand_tasks, ruler_spec
from tests.train_helpers import TINY_LLAMA, run_longctx

EVAL_TASKS = ["niah_single_1", "vt"]
SAMPLES = 2


def _length() -> int:
    tok = byte_tokenizer()
    return max(min_length(t, tok) for t in EVAL_TASKS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ruler") / "model"
    torch.manual_seed(11)
    fields = {**TINY_LLAMA, "max_position_embeddings": 4 * _length(), "initializer_range": 0.2}
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields)).save_pretrained(path)
    return path


def _expected(model_dir, length: int) -> list[tuple[str, int, int, str, float]]:
    tok = byte_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    out = []
    for task in EVAL_TASKS:
        for index in range(SAMPLES):
            sample = make_sample(task, tok, length, index, RULER_SEED)
            ids = torch.tensor([sample.prompt_ids])
            new = model.generate(ids, max_new_tokens=TASKS[task].max_new_tokens,
                                 do_sample=False, pad_token_id=0,
                                 eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
            text = tok.decode(new.tolist(), skip_special_tokens=True)
            out.append((task, length, index, text, score(task, text, list(sample.answers))))
    return out


@pytest.mark.slow  # generate under SP = single-process generate stays in test_generate
def test_ruler_eval_under_sp_equals_single_process_generate(tmp_path, model_dir):
    length = _length()
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({
        "base_model": str(model_dir), "tokenizer": "byte", "dtype": "float32",
        "attention_kernel": "torch", "sequence_len": 2 * length,
        "sequence_parallel_degree": 2, "output_dir": str(tmp_path / "out"),
        "eval_tasks": EVAL_TASKS, "eval_context_lengths": [length],
        "eval_ruler_samples": SAMPLES,
    }))
    result = run_longctx("eval", str(config), "--checkpoint", str(model_dir),
                         "--nproc-per-node", "4", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "eval" / "ruler.json").read_text())
    model = report["models"][0]
    got = [(s["task"], s["length"], s["index"], s["prediction"], s["score"])
           for s in model["samples"]]
    assert got == _expected(model_dir, length)
    assert report["tasks"] == EVAL_TASKS and report["lengths"] == [length]
    assert model["average"] == pytest.approx(
        sum(sum(s[4] for s in got if s[0] == t) / SAMPLES for t in EVAL_TASKS) / len(EVAL_TASKS))
    assert (tmp_path / "out" / "eval" / "ruler.png").stat().st_size > 0
    assert not (tmp_path / "out" / "eval" / "passkey.json").exists()  # not chosen
    assert "RULER" in result.stdout


def _config(**fields) -> Config:
    return Config.model_validate({"model_config": TINY_LLAMA, "tokenizer": "byte",
                                  "datasets": [{"type": "passkey"}], **fields})


def test_task_names_expand_and_unknown_ones_are_refused():
    others, ruler = expand_tasks(["passkey", "ruler", "vt", "passkey"])
    assert others == ["passkey"] and ruler == list(TASKS)
    with pytest.raises(UserError) as e:
        expand_tasks(["niah_single"])
    assert "niah_single_1" in str(e.value) and e.value.where == "eval_tasks"


def test_lengths_are_checked_before_any_rank_starts():
    tok = byte_tokenizer()
    shortest = min_length("vt", tok)
    with pytest.raises(UserError) as e:  # too short for the task
        ruler_spec(_config(sequence_len=4 * shortest, eval_context_lengths=[shortest - 1]),
                   tok, ["vt"], [], 8 * shortest)
    assert f"{shortest:,}" in str(e.value)
    with pytest.raises(UserError) as e:  # beyond the model's positions: the RoPE note
        ruler_spec(_config(sequence_len=4 * shortest, eval_context_lengths=[2 * shortest]),
                   tok, ["vt"], [], shortest + 1)
    assert "RoPE" in str(e.value) and "max_position_embeddings" in str(e.value)
    with pytest.raises(UserError) as e:  # beyond what the plan budgets
        ruler_spec(_config(sequence_len=shortest, eval_context_lengths=[2 * shortest]),
                   tok, ["vt"], [], 8 * shortest)
    assert "sequence_len" in str(e.value)
    spec = ruler_spec(_config(sequence_len=8 * shortest), tok, ["vt"],
                      [shortest // 2, shortest, 8 * shortest], None)
    assert spec.lengths == [shortest, 8 * shortest]  # defaults too short for vt are dropped
