"""Named chat templates shipped with longctx, and picking the template a dataset uses.

Each template is written from its format's published token layout (the text a model of that
family sees around every turn). They are plain Jinja for `apply_chat_template(chat_template=...)`
and render turns as `messages` of `{role, content}`. `END_OF_TURN` is the text each one puts
right after a turn's content: the marker `train_on_eos` is about.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config.sections.data import CHAT_TEMPLATE_FALLBACK
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config, DatasetConfig

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per turn.
CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama 3 instruct: bos, then per turn a header, a blank line, the trimmed text, <|eot_id|>.
LLAMA3 = (
    "{{- bos_token if bos_token else '' -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- m['content'] | trim -}}{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# Qwen3: ChatML turns; an assistant turn after the last user turn opens with a think block
# (its `reasoning_content`, empty when none and it is the final turn), as Qwen3 renders it.
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user -%}"
    "{%- set thought = m['reasoning_content'] if m['reasoning_content'] is string else '' -%}"
    "{%- if thought or loop.last -%}"
    "{{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
    "{{- m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)

# Gemma 3: bos; user and model turns only (a system text opens the first user turn);
# <start_of_turn>role\ntext<end_of_turn>\n, the assistant role is written `model`.
GEMMA3 = (
    "{{- bos_token if bos_token else '' -}}"
    "{%- set ns = namespace(prefix='', first=0) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.prefix = messages[0]['content'] | trim -%}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{%- if (role == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('gemma3 needs turns alternating user/assistant, starting with user') -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if loop.first and ns.first -%}{{- ns.prefix + '\\n\\n' -}}{%- endif -%}"
    "{{- m['content'] | trim -}}{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# Phi-3: <|role|>\ntext<|end|>\n per turn; a finished conversation ends with eos.
PHI_3 = (
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}"
    "{%- elif eos_token -%}{{- eos_token -}}{%- endif -%}"
)

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen3": QWEN3, "gemma3": GEMMA3,
             "phi_3": PHI_3}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>",
               "gemma3": "<end_of_turn>", "phi_3": "<|end|>"}
_FALLBACK = CHAT_TEMPLATE_FALLBACK


def resolve_template(
    config: Config, entry: DatasetConfig, tok: PreTrainedTokenizerBase
) -> tuple[str, list[str]]:
    """(Jinja text, end-of-turn markers) for a `chat_template` entry.

    The entry's own `chat_template` wins over the top-level one. Markers: the named template's
    end-of-turn text, then the tokenizer's eos token (what most templates end a turn with).
    """
    name = entry.chat_template or config.data.chat_template
    eos = [tok.eos_token] if tok.eos_token else []
    own = tok.chat_template if isinstance(tok.chat_template, str) else None
    if name == "tokenizer_default" or (name.startswith(_FALLBACK) and own):
        if not own:
            raise UserError(
                "the tokenizer has no chat template (`chat_template: tokenizer_default`).",
                where="chat_template",
                fix=f"pick one: `chat_template: chatml` (or {', '.join(TEMPLATES)}), or "
                "`chat_template: jinja` with `chat_template_jinja`.",
            )
        return own, eos
    if name.startswith(_FALLBACK):
        name = name[len(_FALLBACK):]
    if name in TEMPLATES:
        return TEMPLATES[name], [END_OF_TURN[name], *eos]
    if name == "jinja":
        return _jinja_text(config.data.chat_template_jinja), eos
    raise UserError(
        f"unknown chat template {name!r}.",
        where="chat_template",
        fix=f"use tokenizer_default, {', '.join(TEMPLATES)}, jinja (with `chat_template_jinja`) "
        "or tokenizer_default_fallback_<name>.",
    )


def _jinja_text(value: str | None) -> str:
    if not value:
        raise UserError(
            "`chat_template: jinja` needs the template in `chat_template_jinja`.",
            where="chat_template_jinja",
            fix="set `chat_template_jinja:` to the Jinja text or a path to a .jinja file.",
        )
    if "{" not in value and Path(value).expanduser().is_file():
        return Path(value).expanduser().read_text(encoding="utf-8")
    return value
