"""What a `trl.reward_funcs` entry naming a reward model must be, read from its config alone
(where it is, whether transformers builds a sequence-classifier longctx reproduces): the
checks `validate` runs before any rank starts and `train/reward_model.py` runs again where it
loads the model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from longctx_cli.config.schema import Config

WHERE = "trl.reward_funcs"
NEEDED = ("a sequence-classification model with a one-output head, saved with "
          "`AutoModelForSequenceClassification.save_pretrained` (config.json, weights with "
          "`score.weight`)")


def reward_model_source(entry: str | None, config: Config) -> str | None:
    """Where a `trl.reward_funcs` model entry (or its `reward_processing_classes` tokenizer)
    is: the folder beside the config when one is there, else the entry as given (an absolute
    folder, or a hub id for the local cache)."""
    if entry is None:
        return None
    beside = Path(config.source_dir or ".") / entry
    return str(beside) if beside.is_dir() else entry


def check_reward_model(source: str, trust_remote_code: bool = False) -> None:
    """What `RewardModel.load` refuses that its config shows (before any rank starts): raises
    the same `UserError`."""
    classification_class(source, read_reward_config(source, trust_remote_code))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _looks_like_path(source: str) -> bool:
    """A hub id is `name` or `org/name`; anything else is meant as a folder."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1


def read_reward_config(source: str, trust_remote_code: bool) -> PretrainedConfig:
    from transformers import AutoConfig

    local = Path(source).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        found = sorted(p.name for p in local.iterdir())[:8]
        raise UserError(
            f"the reward model folder {source!r} has no config.json (it holds "
            f"{', '.join(found) if found else 'nothing'}), so it is not a saved model.",
            where=WHERE, fix=f"point it at {NEEDED}.")
    if not local.exists() and _looks_like_path(source):
        raise UserError(
            f"the reward model {source!r} is not a folder that exists.",
            where=WHERE, fix=f"point it at {NEEDED}, or at a hub id in the local cache.")
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code,
                                          local_files_only=True)
    except (OSError, ValueError) as e:
        if local.exists():
            raise UserError(
                f"the config of the reward model {source!r} could not be read: "
                f"{first_line(e)}",
                where=WHERE, fix=f"point it at {NEEDED}.") from None
        raise UserError(
            f"the reward model {source!r} is neither a folder nor a hub id in the local "
            "Hugging Face cache; longctx does not download reward models.",
            where=WHERE,
            fix=f"download it first (`hf download {source}`) or point at a folder with {NEEDED}.",
        ) from None


def classification_class(source: str, hf_config: PretrainedConfig) -> type:
    """The class `AutoModelForSequenceClassification` builds for this config, checked to be
    one whose forward longctx reproduces (`GenericForSequenceClassification`: `score`
    applied to the decoder's last hidden state, pooled at the rightmost non-pad token)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.modeling_layers import GenericForSequenceClassification

    architectures = list(getattr(hf_config, "architectures", None) or [])
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise UserError(
            f"the reward model {source!r} is a {', '.join(architectures)} (config.json "
            "`architectures`), not a sequence-classification model: loading it as one would "
            "score with a randomly initialised head (TRL does so without a word).",
            where=WHERE,
            fix=f"point it at {NEEDED}; a causal LM can judge only through a Python reward "
            "function.")
    if hf_config.num_labels != 1:
        raise UserError(
            f"the reward model {source!r} has a head of {hf_config.num_labels} labels. TRL "
            "loads reward models with `num_labels=1` and takes `logits[:, 0]`; transformers "
            "refuses a checkpoint whose head has another size (a size mismatch), so TRL "
            "cannot load it either.",
            where=WHERE, fix="use a reward model with one output (num_labels 1).")
    mapping = AutoModelForSequenceClassification._model_mapping
    if type(hf_config) in mapping:
        model_class = mapping[type(hf_config)]
    elif "AutoModelForSequenceClassification" in (getattr(hf_config, "auto_map", None) or {}):
        model_class = AutoModelForSequenceClassification  # remote code: checked once loaded
    else:
        raise UserError(
            f"transformers has no sequence-classification model for the reward model "
            f"{source!r} (model_type `{hf_config.model_type}`).",
            where=WHERE, fix=f"point it at {NEEDED}.")
    if model_class is not AutoModelForSequenceClassification and not issubclass(
            model_class, GenericForSequenceClassification):
        raise UserError(unsupported_family(source, model_class.__name__),
                        where=WHERE, fix=FAMILY_FIX)
    return model_class


FAMILY_FIX = ("use a reward model of a decoder family whose sequence classifier is "
               "transformers' generic one (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, "
               "OLMo, ...), or a Python reward function.")


def unsupported_family(source: str, class_name: str) -> str:
    return (f"the reward model {source!r} is a {class_name}, whose classification forward "
            "longctx does not reproduce under sequence parallelism (it scores the `score` "
            "head of transformers' generic sequence classifier only).")
