"""`longctx generate`: greedy tokens under SP (ring stripe sp=2, Ulysses sp=2) equal the
model's own single-process greedy `generate` on the same prompt."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from longctx_cli.data.tokenizer import byte_tokenizer
from longctx_cli.eval.generate import prompt_ids
from tests.train_helpers import TINY_LLAMA, run_longctx

PROMPT = "The pass key is 4242. Remember it. " * 5 + "What is the pass key? The pass key is"
NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "model"
    torch.manual_seed(5)
    cfg = AutoConfig.for_model(**{**TINY_LLAMA, "initializer_range": 0.2})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def hf_greedy(model_dir, prompt: str = PROMPT, new: int = NEW) -> list[int]:
    """The model's own single-process greedy `generate` after `prompt` (byte tokenizer)."""
    tok = byte_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids(tok, prompt)])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         eos_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


# tests/test_decode.py checks the cached decode of every strategy at sp 2 and 4; here the CLI.
@pytest.mark.parametrize("layout", [{"sequence_parallel_degree": 2},
                                    pytest.param({"sequence_parallel_degree": 2,
                                                  "sequence_parallel_mode": "ulysses"},
                                                 marks=pytest.mark.slow),
                                    pytest.param({}, marks=pytest.mark.slow)])
def test_generate_under_sp_equals_single_process_generate(tmp_path, model_dir, layout):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"base_model": str(model_dir), "tokenizer": "byte",
                                  "dtype": "float32", "attention_kernel": "torch",
                                  "sequence_len": 512, "output_dir": str(tmp_path / "out"),
                                  **layout}))
    nproc = str(layout.get("sequence_parallel_degree", 1))
    result = run_longctx("generate", str(config), "--checkpoint", str(model_dir),
                         "--prompt-file", str(prompt), "--max-new-tokens", str(NEW),
                         "--nproc-per-node", nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "generate.json").read_text())
    assert record["new_token_ids"] == hf_greedy(model_dir)
    assert record["prompt_tokens"] == len(prompt_ids(byte_tokenizer(), PROMPT))
    assert result.stdout.strip() == record["text"].strip()
    assert "prompt: " in result.stderr


@pytest.mark.slow
def test_generate_refuses_a_prompt_beyond_sequence_len(tmp_path, model_dir):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"base_model": str(model_dir), "tokenizer": "byte",
                                  "sequence_len": 64}))
    prompt = tmp_path / "p.txt"
    prompt.write_text("x" * 100)
    result = run_longctx("generate", str(config), "--checkpoint", str(model_dir),
                         "--prompt-file", str(prompt))
    assert result.returncode == 2 and "beyond `sequence_len` = 64" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_generate_reads_the_prompt_from_the_command_line(tmp_path, model_dir):
    """`--prompt TEXT` is tokenized like the file's text (here 100 bytes: past the row), and
    giving both --prompt and --prompt-file is refused."""
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"base_model": str(model_dir), "tokenizer": "byte",
                                  "sequence_len": 64}))
    result = run_longctx("generate", str(config), "--checkpoint", str(model_dir),
                         "--prompt", "x" * 100)
    assert result.returncode == 2 and "--prompt: the prompt is 100 tokens" in result.stderr
    prompt = tmp_path / "p.txt"
    prompt.write_text("hi")
    result = run_longctx("generate", str(config), "--checkpoint", str(model_dir),
                         "--prompt", "hi", "--prompt-file", str(prompt))
    assert result.returncode == 2 and "both --prompt and --prompt-file" in result.stderr
    assert "Traceback" not in result.stderr
