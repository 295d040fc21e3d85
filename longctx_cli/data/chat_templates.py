"""Named chat templates shipped with longctx, and picking the template a dataset uses.

Each template is written from its format's published token layout (the text a model of that
family sees around every turn), one `templates/<name>.jinja` file each, its layout in the
comment at its top. They are plain Jinja for `apply_chat_template(chat_template=...)` and
render turns as `messages` of `{role, content}` (content a string, or for the vision families
a list of parts whose image, video and audio parts are written as the family's markers).
`END_OF_TURN` is the text each one puts right after a turn's content: the marker
`train_on_eos` is about.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config.sections.data import CHAT_TEMPLATE_FALLBACK, SHIPPED_CHAT_TEMPLATES
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config, DatasetConfig

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
# Names whose model family writes its turns as another shipped template does.
_SAME_AS = {"gemma4_unified": "gemma4"}
TEMPLATES = {name: (TEMPLATE_DIR / f"{_SAME_AS.get(name, name)}.jinja").read_text(
    encoding="utf-8") for name in SHIPPED_CHAT_TEMPLATES}
CHATML = TEMPLATES["chatml"]  # the plainest one, which the tests also render by name
END_OF_TURN = {
    "chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>",
    "gemma3": "<end_of_turn>", "phi_3": "<|end|>", "qwen_25": "<|im_end|>",
    "qwen2_vl": "<|im_end|>", "qwen3_5": "<|im_end|>", "falcon_h1": "<|im_end|>",
    "llama4": "<|eot|>", "llama3_2_vision": "<|eot_id|>", "gemma": "<end_of_turn>",
    "gemma3n": "<end_of_turn>", "gemma4": "<turn|>", "gemma4_unified": "<turn|>",
    "cohere": "<|END_OF_TURN_TOKEN|>", "deepseek_v2": "<｜end▁of▁sentence｜>",
    "jamba": "<|eom|>", "llava": "</s>", "pixtral": "</s>",
}
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
