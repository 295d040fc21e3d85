"""`longctx merge-lora` (and `merge_lora: true`): the merged folder loads with plain
transformers and computes what the trained adapter computes on its base."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from tests.train_helpers import run_longctx, train, write_config, write_documents

IDS = torch.arange(3, 40).unsqueeze(0)


def _logits(model, eval_mode: bool = True) -> torch.Tensor:
    # A 4-bit model stays in train mode: bitsandbytes' CPU inference path repacks weights for
    # a kernel that does not take this tiny shape (no dropout is configured either way).
    with torch.no_grad():
        return (model.eval() if eval_mode else model.train())(IDS).logits


def test_merge_lora_key_writes_a_plain_model_equal_to_peft_merge(tmp_path):
    data = write_documents(tmp_path / "docs.jsonl", seed=8)
    config = write_config(tmp_path, "lora", data, adapter="lora", lora_r=4, lora_alpha=8,
                          lora_target_linear=True, max_steps=3, merge_lora=True)
    train(config, 1)
    run = tmp_path / "lora"
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", attn_implementation="eager")
    base = AutoModelForCausalLM.from_pretrained(run / "final" / "base_model",
                                                attn_implementation="eager")
    want = PeftModel.from_pretrained(base, str(run / "final")).merge_and_unload()
    torch.testing.assert_close(_logits(merged), _logits(want), rtol=1e-5, atol=1e-5)
    assert (run / "merged" / "generation_config.json").is_file()
    assert (run / "merged" / "tokenizer_config.json").is_file()
    # The command refuses a full model and an occupied output folder, in one paragraph.
    again = run_longctx("merge-lora", str(config), "--checkpoint", str(run / "final"))
    assert again.returncode == 2 and "is not empty" in again.stderr
    full = run_longctx("merge-lora", str(config), "--checkpoint", str(run / "merged"),
                       "--output", str(tmp_path / "x"))
    assert full.returncode == 2 and "full model already" in full.stderr
    assert "Traceback" not in again.stderr + full.stderr


@pytest.mark.slow  # merging stays by default in the test above
def test_qlora_merge_dequantises_the_base_it_was_trained_on(tmp_path):
    data = write_documents(tmp_path / "docs.jsonl", seed=9)
    config = write_config(tmp_path, "qlora", data, adapter="qlora", load_in_4bit=True,
                          lora_r=4, lora_alpha=8, lora_target_linear=True, max_steps=3,
                          bnb_config_kwargs={"bnb_4bit_use_double_quant": False})
    train(config, 1)
    run = tmp_path / "qlora"
    result = run_longctx("merge-lora", str(config), "--checkpoint", str(run / "final"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dequantised the 4-bit base" in result.stderr
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", attn_implementation="eager")
    quantized = AutoModelForCausalLM.from_pretrained(
        run / "final" / "base_model", attn_implementation="eager", dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                               bnb_4bit_compute_dtype=torch.float32,
                                               bnb_4bit_use_double_quant=False,
                                               bnb_4bit_quant_type="nf4"),
        device_map={"": "cpu"})
    trained = PeftModel.from_pretrained(quantized, str(run / "final"))  # as training ran it
    got, want = _logits(merged), _logits(trained, eval_mode=False)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # Merged into the original full-precision weights instead, it would not be the model.
    plain = AutoModelForCausalLM.from_pretrained(run / "final" / "base_model",
                                                 attn_implementation="eager")
    naive = PeftModel.from_pretrained(plain, str(run / "final")).merge_and_unload()
    assert float((_logits(naive) - want).norm() / want.norm()) > 1e-3


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
