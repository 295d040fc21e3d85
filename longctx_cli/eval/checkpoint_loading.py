"""Load what `longctx eval --checkpoint` points at, always with the SP attention.

Accepted folders:

* the trainer's `final/` with a full model (`config.json` + weights), or any Hugging Face
  model folder of that shape (e.g. a base model to `--compare` with);
* the trainer's `final/` with a LoRA adapter (`adapter_config.json`); the base model is
  `final/base_model/` when present, else the adapter's `base_model_name_or_path`;
* a resumable `checkpoint-<step>/` (DCP state under `state/`): the model is built from the
  config, exactly as the trainer built it, and the `model` entry of the state is loaded.

LoRA weights are merged into the base for evaluation (one plain forward, same function).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from torch import nn

from longctx_cli.config import Config
from longctx_cli.durable import COMPLETE_MARKER
from longctx_cli.errors import UserError
from longctx_cli.integrity import verify_files
from longctx_cli.parallel.attention import ATTN_IMPLEMENTATION, register_sp_attention

FULL, LORA, DCP = "full", "lora", "dcp"
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
_FIX = "pass the trainer's `<output_dir>/final` or a `<output_dir>/checkpoint-<step>` folder."


def checkpoint_kind(path: Path) -> str:
    """`full`, `lora` or `dcp`; a UserError naming the problem for anything else."""
    if not path.exists():
        raise UserError(f"checkpoint {str(path)!r} does not exist.", where="--checkpoint", fix=_FIX)
    if not path.is_dir():
        raise UserError(f"checkpoint {str(path)!r} is a file, not a folder.",
                        where="--checkpoint", fix=_FIX)
    if (path / "state").is_dir():
        if not (path / COMPLETE_MARKER).is_file():
            raise UserError(
                f"{str(path)!r} is an incomplete checkpoint (no {COMPLETE_MARKER} marker: its "
                "write was interrupted).",
                where="--checkpoint",
                fix="use an older complete checkpoint-<step> or the final/ folder.",
            )
        return DCP
    if (path / "adapter_config.json").is_file():
        return LORA
    if (path / "config.json").is_file():
        if any(any(path.glob(p)) for p in _WEIGHT_PATTERNS):
            return FULL
        raise UserError(f"{str(path)!r} has a config.json but no model weights.",
                        where="--checkpoint", fix=_FIX)
    raise UserError(f"{str(path)!r} is not a model checkpoint{_hint(path)}.",
                    where="--checkpoint", fix=_FIX)


def _hint(path: Path) -> str:
    """Point at a checkpoint inside a run's output_dir, the usual mistake."""
    inner = [path / "final", *sorted(path.glob("checkpoint-*"))]
    found = [p for p in inner if p.is_dir()]
    return f" (did you mean {str(found[0])!r}?)" if found else ""


def check_intact(path: Path) -> None:
    """Refuse a folder whose files differ from its manifest (truncated, corrupted)."""
    problems = verify_files(path)
    if problems:
        raise UserError(
            f"checkpoint {str(path)!r} is damaged: {'; '.join(problems[:3])}.",
            where="--checkpoint",
            fix="evaluate an intact copy: an earlier `checkpoint-<step>` of the run, or "
            "export final/ again by resuming the run (`resume_from_checkpoint: auto`).",
        )


def lora_base_path(adapter_dir: Path) -> str:
    """The base model of an adapter: the bundled `base_model/`, else the adapter's own record."""
    bundled = adapter_dir / "base_model"
    if bundled.is_dir():
        return str(bundled)
    data = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = data.get("base_model_name_or_path")
    if not base:
        raise UserError(
            f"the adapter in {str(adapter_dir)!r} names no base model and has no base_model/.",
            where="--checkpoint",
            fix="set `base_model_name_or_path` in its adapter_config.json.",
        )
    return base


def _from_pretrained(source: str, config: Config, hf_config=None) -> nn.Module:
    from transformers import AutoConfig

    from longctx_cli.runtime.model import DTYPES, model_class_and_attention

    revision = config.model.revision_kwargs(source)  # an adapter's base: the run's revision
    try:
        auto_class, attn = model_class_and_attention(
            hf_config if hf_config is not None else AutoConfig.from_pretrained(
                source, trust_remote_code=config.model.trust_remote_code, **revision),
            ATTN_IMPLEMENTATION, config.trains_images)
        model = auto_class.from_pretrained(
            source,
            attn_implementation=attn,
            dtype=DTYPES[config.model.dtype],
            trust_remote_code=config.model.trust_remote_code,
            **revision,
            **({"config": hf_config} if hf_config is not None else {}),
        )
    except (OSError, ValueError, SafetensorError) as e:
        # SafetensorError: a weights file without a manifest that is truncated or corrupt.
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"could not load the model {source!r}: {first}",
                        where="--checkpoint", fix=_FIX) from None
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UserError(
            f"model type `{model.config.model_type}` did not accept the sequence-parallel "
            "attention.",
            where="--checkpoint",
            fix="use a model whose attention dispatches through transformers' "
            "AttentionInterface (Llama, Qwen2/3, Mistral, Gemma, ...).",
        )
    return model


def _load_lora(path: Path, config: Config) -> nn.Module:
    from peft import PeftModel

    from longctx_cli.runtime.experts import linearize_experts
    from longctx_cli.runtime.model import (
        changes_model_config,
        fit_embeddings,
        model_config_of,
        peft_quietly,
    )

    # The adapter was trained on the base under the run's config (RoPE scaling, overrides);
    # a bundled base_model/ was saved with it already.
    run_config = model_config_of(config) if changes_model_config(config) and not (
        path / "base_model").is_dir() else None
    base = _from_pretrained(lora_base_path(path), config, run_config)
    if config.model.llama4_linearized_experts:  # the adapter may target the expert linears
        linearize_experts(base)
    fit_embeddings(base, config)  # the rows the run added (`tokens`), before the adapter loads
    with peft_quietly():
        return PeftModel.from_pretrained(base, str(path)).merge_and_unload()


def _load_dcp(path: Path, config: Config) -> nn.Module:
    """Build the model as the trainer did and load the `model` entry of its DCP state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from longctx_cli.runtime.model import build_model

    model = build_model(config)
    state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=str(path / "state"))
    except Exception as e:  # noqa: BLE001 - DCP raises several types for a mismatched state
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"the state in {str(path)!r} does not fit the model this config builds: {first}",
            where="--checkpoint",
            fix="evaluate a checkpoint with the config of the run that wrote it.",
        ) from None
    set_model_state_dict(model, state["model"])
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def _run_config_for_base(config: Config, path: Path):
    """The run's model config when `path` is the run's own `base_model` and the run changes
    its config (RoPE scaling, overrides): evaluating the base under the run's settings is the
    "before" of the run. Any other full model keeps its own config.json."""
    from longctx_cli.runtime.model import changes_model_config, model_config_of

    base = config.model.base_model
    if base is None or not changes_model_config(config):
        return None
    if Path(base).expanduser().resolve() != path.expanduser().resolve():
        return None
    return model_config_of(config)


def load_for_eval(config: Config, path: Path) -> nn.Module:
    """The model in `path`, SP attention on, in eval mode, with gradients off."""
    register_sp_attention()
    kind = checkpoint_kind(path)
    check_intact(path)
    if kind == DCP:
        model = _load_dcp(path, config)
    elif kind == LORA:
        model = _load_lora(path, config)
    else:
        model = _from_pretrained(str(path), config, _run_config_for_base(config, path))
        from longctx_cli.runtime.model import fit_embeddings

        fit_embeddings(model, config)  # a base before the run's added tokens: as training began
    model.eval()
    model.requires_grad_(False)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # one forward per row: a KV cache is wasted memory
    return model

