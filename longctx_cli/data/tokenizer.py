"""Tokenizer loading: a Hugging Face tokenizer by path/hub id, or the built-in `byte` one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config
    from longctx_cli.data.vision.processor import VisionProcessor

BYTE = "byte"

# A minimal chat format for the byte tokenizer, so `chat_template` datasets work offline.
# An assistant turn ends with the eos token (the model learns to stop); other turns end with
# a newline. Nothing follows eos inside a turn because the byte tokenizer strips whitespace
# right after special tokens, which would break the text <-> token correspondence.
BYTE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- else -%}{{ '\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """The built-in byte-level tokenizer: 256 bytes + 3 specials (+125 unused ids), no files.

    ids: pad 0, eos 1, unk 2, byte b -> b + 3; vocabulary size 384. It saves with
    `save_pretrained` and loads back with `AutoTokenizer.from_pretrained` like any other.
    """
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    tok.chat_template = BYTE_CHAT_TEMPLATE
    return tok


def load_tokenizer(config: Config) -> PreTrainedTokenizerBase:
    """The tokenizer named by `config.model.tokenizer_source`, with a pad token guaranteed."""
    source = config.model.tokenizer_source
    if source is None:
        raise UserError(
            "no tokenizer to use: `model_config` builds a model but names no tokenizer.",
            where="config",
            fix="set `tokenizer: byte` (built-in, no files) or a tokenizer path / hub id.",
        )
    if source == BYTE:
        tok = byte_tokenizer()
    elif config.model.tokenizer_use_mistral_common:
        from longctx_cli.data.mistral_tokenizer import load_mistral_common
        from longctx_cli.hub import hub_reachable

        tok = load_mistral_common(source, local_only=not Path(source).expanduser().exists()
                                  and not hub_reachable())
    else:
        tok = _from_pretrained(source, config.model.trust_remote_code,
                               config.model.revision_kwargs(source))
    apply_special_tokens(tok, config)
    ensure_pad_token(tok)
    return tok


def apply_special_tokens(tok: PreTrainedTokenizerBase, config: Config) -> None:
    """Axolotl's `special_tokens:` and `tokens:`, in Axolotl's order: the named special tokens,
    then `tokens`, then `additional_special_tokens`. A token the vocabulary lacks is added
    (whole, never normalised, as Axolotl adds it); the model's embeddings then grow to the
    tokenizer's length (runtime/model.py:fit_embeddings)."""
    from transformers import AddedToken

    special = config.model.special_tokens
    named = special.model_dump(exclude_none=True) if special is not None else {}
    additional = named.pop("additional_special_tokens", None)
    for name, text in named.items():
        if _in_vocabulary(tok, text):
            setattr(tok, name, text)
        else:
            tok.add_special_tokens({name: AddedToken(text, rstrip=False, lstrip=False,
                                                     normalized=False)})
    if config.model.tokens:
        tok.add_tokens([AddedToken(t, rstrip=False, lstrip=False, normalized=False)
                        for t in config.model.tokens])
    if additional is not None:
        tok.add_special_tokens({"additional_special_tokens": additional},
                               replace_additional_special_tokens=False)


def _in_vocabulary(tok: PreTrainedTokenizerBase, token: str) -> bool:
    ids = tok.convert_tokens_to_ids(token)
    return ids is not None and (ids != tok.unk_token_id or token == tok.unk_token)


def _from_pretrained(source: str, trust_remote_code: bool,
                     revision: dict[str, str] | None = None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    from longctx_cli.hub import hub_reachable, offline_error

    local = Path(source).expanduser()
    if not local.exists() and (source.startswith(("/", ".", "~")) or source.count("/") > 1):
        # A hub id is `name` or `org/name`; this is a path, and asking the hub cannot help.
        raise UserError(
            f"could not load the tokenizer {source!r}: no such local folder.",
            where="tokenizer",
            fix="point `tokenizer` at a folder with the tokenizer files, give a hub id such as "
            "`org/name`, or use `tokenizer: byte`.",
        )
    if not local.exists() and not hub_reachable():
        try:  # no network: the local cache only, so a miss fails at once, not after retries
            return AutoTokenizer.from_pretrained(
                source, trust_remote_code=trust_remote_code, local_files_only=True,
                **(revision or {}))
        except (OSError, ValueError):
            raise offline_error("tokenizer", source, "tokenizer") from None
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                             **(revision or {}))
    except (OSError, ValueError) as exc:
        # transformers raises OSError for missing files / unknown hub ids and ValueError for
        # remote code that was not allowed; both are the user's to fix.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"could not load the tokenizer {source!r}: {first}",
            where="tokenizer",
            fix="check the path or hub id (and network access), set `trust_remote_code: true` "
            "if the tokenizer needs its own code, or use `tokenizer: byte`.",
        ) from exc


def pad_id(tok: PreTrainedTokenizerBase) -> int:
    """The id rows are padded with; 0 for a tokenizer without one (the padding is masked)."""
    return tok.pad_token_id if tok.pad_token_id is not None else 0


def ensure_pad_token(tok: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a pad token (the trainer pads rows); reuse eos, as most recipes do."""
    if tok.pad_token_id is not None:
        return
    if tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    elif tok.unk_token is not None:
        tok.pad_token = tok.unk_token
    else:
        raise UserError(
            "the tokenizer has no pad, eos or unk token to pad rows with.",
            where="tokenizer",
            fix="use a tokenizer that defines an eos token.",
        )


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A hash of everything about a tokenizer that changes the token ids it produces."""
    h = hashlib.sha256()
    h.update(type(tok).__name__.encode())
    for token, idx in sorted(tok.get_vocab().items()):
        h.update(f"{token}\x00{idx}\x01".encode("utf-8", "surrogatepass"))
    specials = {
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "unk": tok.unk_token_id,
        "template": tok.chat_template if isinstance(tok.chat_template, str) else
        json.dumps(tok.chat_template, sort_keys=True),
    }
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    # A probe catches normaliser / pre-tokeniser differences the vocabulary does not show.
    probe = "Hello, World!  12345 \u00e9t\u00e9\n\tThe pass key is 0."
    h.update(json.dumps(tok(probe)["input_ids"]).encode())
    return h.hexdigest()[:16]


# ---- the tokenizer of a run (a vision run's is its processor's) ---------------------------


def run_tokenizer(config: Config) -> tuple[Any, Any]:
    """The tokenizer a run reads with, and what is saved beside its weights (in `final/`, a
    checkpoint, a merged model): a vision-language run's processor's tokenizer and its
    processor files (`ProcessorFiles`), else the run's tokenizer for both. Train, eval,
    generate and merge-lora read through this one rule."""
    from longctx_cli.data.vision.processor import ProcessorFiles, processor_folder

    if not config.trains_images:
        tok = load_tokenizer(config)
        return tok, tok
    processor = load_config_processor(config)
    return processor.tokenizer, ProcessorFiles(processor, processor_folder(config))


def load_config_processor(config: Config) -> VisionProcessor:
    """The processor of a vision run, with the config's special_tokens, a pad token and a
    chat template on its tokenizer (so `chat_template: tokenizer_default` means the
    processor's own template, as for a text model's tokenizer)."""
    from longctx_cli.data.vision.mistral import mistral_common_vision
    from longctx_cli.data.vision.processor import (
        _image_size,
        _resample,
        load_processor,
        processor_folder,
    )

    if config.model.tokenizer_use_mistral_common:  # mistral-common encodes chat and images
        return mistral_common_vision(load_tokenizer(config), _image_size(config.vision.image_size),
                                     _resample(config.vision.image_resize_algorithm),
                                     str(config.model.tokenizer_source))
    folder = processor_folder(config)
    vp = load_processor(folder, image_size=config.vision.image_size,
                        image_resize_algorithm=config.vision.image_resize_algorithm)
    check_processor_class(vp.processor, config.vision.processor_type, folder)
    tok = vp.tokenizer
    if not isinstance(getattr(tok, "chat_template", None), str) and vp.chat_template:
        tok.chat_template = vp.chat_template
    apply_special_tokens(tok, config)
    ensure_pad_token(tok)
    return vp


def check_processor_class(processor: Any, named: str | None, folder: str) -> None:
    """A `processor_type` other than AutoProcessor names the class the folder must hold
    (Axolotl loads that class; here AutoProcessor loads the folder's and it must agree)."""
    if named in (None, "AutoProcessor"):
        return
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    classes = [c.__name__ for c in type(processor).__mro__]
    if named not in classes:
        known = set(PROCESSOR_MAPPING_NAMES.values())
        held = next((c for c in classes if c in known), classes[0])  # past longctx's subclass
        raise UserError(
            f"`processor_type: {named}` names a processor class, but the processor in "
            f"{folder} is a {held}.", where="processor_type",
            fix=f"write `processor_type: AutoProcessor` (the class the folder names), or "
            f"point `processor_path` at a {named}'s files.")
