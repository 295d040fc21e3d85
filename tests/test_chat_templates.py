"""The chat templates longctx ships (longctx_cli/data/templates/*.jinja): each renders a
conversation as its family's published format writes it, spelled out here by hand, without
any tokenizer's template; and the assistant-target mask a `chat_template` dataset trains on
is each assistant reply and the end-of-turn marker right after it, nothing else."""

from __future__ import annotations

import pytest

from longctx_cli.config.sections.data import SHIPPED_CHAT_TEMPLATES
from longctx_cli.data.chat_templates import END_OF_TURN, TEMPLATES
from longctx_cli.data.formats import FormatSpec, Turn, chat_target_spans, encode_spans
from longctx_cli.data.tokenizer import byte_tokenizer

SYSTEM, Q1, A1, Q2, A2 = "Be brief.", "Hi", "Hello!", "2+2?", "4"
CHAT = [("system", SYSTEM), ("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2)]
BOS = "<s>"


def _chatml(head: str = "") -> str:
    return head + "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in CHAT)


def _llama3_like(start: str, end: str, eot: str) -> str:
    return BOS + "".join(f"{start}{r}{end}\n\n{c}{eot}" for r, c in CHAT)


# The text each family's format gives CHAT (without its system turn where the family has no
# system role), written from the format's documentation.
EXPECTED = {
    "chatml": _chatml(),
    "qwen_25": _chatml(),
    "qwen2_vl": _chatml(),
    "falcon_h1": BOS + _chatml(),
    "qwen3": _chatml().replace(f"assistant\n{A2}", f"assistant\n<think>\n\n</think>\n\n{A2}"),
    "qwen3_5": _chatml().replace(f"assistant\n{A2}", f"assistant\n<think>\n\n</think>\n\n{A2}"),
    "llama3": _llama3_like("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "llama3_2_vision": _llama3_like("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "llama4": _llama3_like("<|header_start|>", "<|header_end|>", "<|eot|>"),
    "phi_3": "".join(f"<|{r}|>\n{c}<|end|>\n" for r, c in CHAT) + "</s>",
    "gemma": BOS + f"<start_of_turn>user\n{Q1}<end_of_turn>\n<start_of_turn>model\n{A1}"
             f"<end_of_turn>\n<start_of_turn>user\n{Q2}<end_of_turn>\n<start_of_turn>model\n"
             f"{A2}<end_of_turn>\n",
    "gemma3": BOS + f"<start_of_turn>user\n{SYSTEM}\n\n{Q1}<end_of_turn>\n<start_of_turn>model\n"
              f"{A1}<end_of_turn>\n<start_of_turn>user\n{Q2}<end_of_turn>\n<start_of_turn>model\n"
              f"{A2}<end_of_turn>\n",
    "gemma4": BOS + f"<|turn>system\n{SYSTEM}<turn|>\n<|turn>user\n{Q1}<turn|>\n<|turn>model\n"
              f"{A1}<turn|>\n<|turn>user\n{Q2}<turn|>\n<|turn>model\n{A2}<turn|>\n",
    "cohere": BOS + f"<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{SYSTEM}<|END_OF_TURN_TOKEN|>"
              f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{Q1}<|END_OF_TURN_TOKEN|>"
              f"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{A1}<|END_OF_TURN_TOKEN|>"
              f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{Q2}<|END_OF_TURN_TOKEN|>"
              f"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{A2}<|END_OF_TURN_TOKEN|>",
    "deepseek_v2": BOS + f"{SYSTEM}\n\n<｜User｜>{Q1}<｜Assistant｜>{A1}<｜end▁of▁sentence｜>"
                   f"<｜User｜>{Q2}<｜Assistant｜>{A2}<｜end▁of▁sentence｜>",
    "jamba": "<|startoftext|>" + "".join(f"<|bom|><|{r}|> {c}<|eom|>" for r, c in CHAT),
    "llava": f"{SYSTEM} USER: {Q1} ASSISTANT: {A1}</s>USER: {Q2} ASSISTANT: {A2}</s>",
    "pixtral": BOS + f"[INST]{Q1}[/INST]{A1}</s>[INST]{SYSTEM}\n\n{Q2}[/INST]{A2}</s>",
}
EXPECTED["gemma3n"] = EXPECTED["gemma3"]
EXPECTED["gemma4_unified"] = EXPECTED["gemma4"]
NO_SYSTEM = ("gemma",)  # families whose format has no system role


def _tokenizer():
    tok = byte_tokenizer()
    tok.add_special_tokens({"bos_token": BOS})
    return tok


def _chat(name: str) -> list[tuple[str, str]]:
    return CHAT[1:] if name in NO_SYSTEM else CHAT


def test_every_shipped_template_is_tested():
    assert sorted(EXPECTED) == sorted(TEMPLATES) == sorted(END_OF_TURN) == sorted(
        SHIPPED_CHAT_TEMPLATES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_template_renders_the_family_format(name):
    tok = _tokenizer()
    messages = [{"role": r, "content": c} for r, c in _chat(name)]
    text = tok.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False)
    expected = EXPECTED[name]
    if name in NO_SYSTEM:
        with pytest.raises(Exception, match="system"):
            tok.apply_chat_template([{"role": "system", "content": SYSTEM}, *messages],
                                    chat_template=TEMPLATES[name], tokenize=False)
    assert text == expected


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_assistant_targets_are_the_replies_and_their_end_marker(name):
    tok = _tokenizer()
    turns = [Turn(r, c, r == "assistant") for r, c in _chat(name)]
    spec = FormatSpec("chat_template", template=TEMPLATES[name],
                      end_markers=(END_OF_TURN[name], tok.eos_token))
    text, spans = chat_target_spans(tok, spec, turns, "test")
    assert [text[s:e] for s, e in spans] == [A1 + END_OF_TURN[name], A2 + END_OF_TURN[name]]
    ids, labels, _ = encode_spans(tok, text, spans)
    trained = [i for i, label in zip(ids, labels, strict=True) if label != -100]
    assert tok.decode(trained) == A1 + END_OF_TURN[name] + A2 + END_OF_TURN[name]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_5", "llama4", "llama3_2_vision",
                                  "gemma3n", "gemma4", "llava", "pixtral"])
def test_vision_parts_are_the_family_markers(name):
    image = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
             "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>", "llama4": "<|image|>",
             "llama3_2_vision": "<|image|>", "gemma3n": "<image_soft_token>",
             "gemma4": "<|image|>", "llava": "<image>\n", "pixtral": "[IMG]"}[name]
    tok = _tokenizer()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": Q1}]},
                {"role": "assistant", "content": A1}]
    text = tok.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False)
    assert image + Q1 in text and text.count(image) == 1


def test_generation_prompts_and_thinking():
    tok = _tokenizer()
    user = [{"role": "user", "content": Q1}]

    def render(name: str, **kwargs) -> str:
        return tok.apply_chat_template(user, chat_template=TEMPLATES[name], tokenize=False,
                                       add_generation_prompt=True, **kwargs)

    assert render("qwen3_5").endswith("<|im_start|>assistant\n<think>\n")
    assert render("qwen3_5", enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render("gemma4").endswith("<|turn>model\n<|channel>thought\n<channel|>")
    assert render("gemma4", enable_thinking=True) == (
        f"{BOS}<|turn>system\n<|think|>\n<turn|>\n<|turn>user\n{Q1}<turn|>\n<|turn>model\n")
    assert render("qwen_25").startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n")
    assert render("qwen2_vl").startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    reasoned = [*user, {"role": "assistant", "content": A1, "reasoning_content": "think"}]
    assert f"<|turn>model\n<|channel>thought\nthink\n<channel|>{A1}<turn|>" in (
        tok.apply_chat_template(reasoned, chat_template=TEMPLATES["gemma4"], tokenize=False))
    assert f"<think>\nthink\n</think>\n\n{A1}<|im_end|>" in tok.apply_chat_template(
        reasoned, chat_template=TEMPLATES["qwen3_5"], tokenize=False)
