"""`longctx merge-lora`: fold a trained LoRA adapter into its base and write a plain Hugging
Face model folder (weights in the config's dtype, tokenizer, generation config).

A vision-language base loads with its own Auto class (`AutoModelForImageTextToText`, as the
trainer and `longctx eval` load it) and the merged folder keeps the run's processor files, as
the trainer's `final/` does, so it loads back with `AutoProcessor` too. With
`freeze_mm_modules` the adapter holds nothing for the tower, which is saved as it was.

The merged weights compute what the adapter was trained on: for QLoRA that is the
*dequantised* 4-bit base plus the adapter, so a quantized base is loaded as training loaded it
(bitsandbytes), dequantised, and only then merged; merging into the original full-precision
weights instead would give a model that was never trained.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config import Config
from longctx_cli.errors import UserError
from longctx_cli.eval.checkpoint_loading import (
    FULL,
    LORA,
    check_intact,
    checkpoint_kind,
    lora_base_path,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from longctx_cli.data.vision.processor import ProcessorFiles

# The attention the merged model is saved with: a standard one, so that it loads anywhere.
MERGE_ATTENTION = "sdpa"


def default_output(config: Config) -> Path:
    return Path(config.output.output_dir) / "merged"


def merge_lora(config: Config, checkpoint: Path, output: Path | None = None,
               say=print) -> Path:
    """Write `base + adapter` of `checkpoint` (a LoRA `final/`) to `output`; returns it."""
    from peft import PeftModel

    from longctx_cli.runtime.experts import fused_expert_state, linearize_experts
    from longctx_cli.runtime.model import (
        DTYPES,
        bnb_quantization,
        changes_model_config,
        fit_embeddings,
        load_device_map,
        model_class_and_attention,
        model_config_of,
        peft_quietly,
        quantize_fused_experts,
        remove_fused_expert_quantization,
    )

    output = output or default_output(config)
    kind = checkpoint_kind(checkpoint)
    if kind != LORA:
        raise UserError(
            f"{str(checkpoint)!r} holds "
            + ("a full model already: there is no adapter to merge" if kind == FULL else
               "a resumable training state, not an exported adapter") + ".",
            where="--checkpoint",
            fix="pass the `final/` folder of a LoRA or QLoRA run (it holds "
            "adapter_config.json)" + ("; a full model loads as it is" if kind == FULL else
                                      "; resume the run to export it") + ".",
        )
    check_intact(checkpoint)
    if output.exists() and any(output.iterdir()):
        raise UserError(f"{str(output)!r} exists and is not empty.", where="--output",
                        fix="choose another --output, or move that folder away.")
    companion = saved_with(config)  # before the slow load: a bad processor_path fails first
    dtype = DTYPES[config.model.dtype]
    base_path = lora_base_path(checkpoint)
    quantization = bnb_quantization(config, dtype)
    kwargs = {"dtype": dtype, "trust_remote_code": config.model.trust_remote_code}
    if changes_model_config(config) and not (checkpoint / "base_model").is_dir():
        # The adapter was trained on the base under the run's config (RoPE scaling, overrides);
        # a bundled base_model/ was saved with it already.
        kwargs["config"] = model_config_of(config)
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map=load_device_map())
    say(f"loading the base model {base_path}"
        + (" (quantized as in training)" if quantization is not None else ""))
    try:
        # The class training loaded: a vision-language model is no AutoModelForCausalLM.
        auto_class, kwargs["attn_implementation"] = model_class_and_attention(
            kwargs.get("config") or _base_config(base_path, config), MERGE_ATTENTION,
            config.trains_images)
        base = auto_class.from_pretrained(base_path, **kwargs,
                                          **config.model.revision_kwargs(base_path))
        fit_embeddings(base, config)  # the rows the run added, before the adapter loads
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"could not load the base model {base_path!r}: {first}",
                        where="--checkpoint",
                        fix="make the adapter's base model reachable (a local folder, or "
                        "the hub), or bundle it as final/base_model/.") from None
    linearized = config.model.llama4_linearized_experts and linearize_experts(
        base, quantization) > 0  # as training did, quantized too: the adapter may target them
    if quantization is not None:
        # The adapter learned on the dequantised weights: merge into exactly those.
        base = base.dequantize().to(dtype)
        if config.lora.quantize_moe_experts:  # the experts as training saw them: 4-bit rounded
            quantize_fused_experts(base, quantization)
            remove_fused_expert_quantization(base)
        bits = '4' if config.lora.load_in_4bit else '8'
        say(f"dequantised the {bits}-bit base to {config.model.dtype} "
            "(what the adapter was trained against) before merging")
    with peft_quietly():
        merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
    merged.config.use_cache = True
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # Linearized experts are saved in the model's own layout, which plain transformers loads.
    state = fused_expert_state(merged.state_dict()) if linearized else None
    merged.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    companion.save_pretrained(tmp)  # as the trainer exported it to final/
    output.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)
    loads = f"{auto_class.__name__}.from_pretrained"
    if config.vision.processor_type:
        loads += " and AutoProcessor.from_pretrained"
    say(f"merged model: {output} (load it with {loads})")
    return output


def _base_config(base_path: str, config: Config) -> PretrainedConfig:
    """The base model's own config (which Auto class loads it)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(base_path, trust_remote_code=config.model.trust_remote_code,
                                      **config.model.revision_kwargs(base_path))


def saved_with(config: Config) -> ProcessorFiles | PreTrainedTokenizerBase:
    """What is saved beside the merged weights: a vision-language run's processor files
    (tokenizer, image processor, chat template, under the model's own processor class), else
    the tokenizer, exactly as the trainer's `final/` holds them (`train/loop.py`)."""
    from longctx_cli.data.tokenizer import run_tokenizer

    return run_tokenizer(config)[1]


def run_merge(config_path: Path, checkpoint: Path, output: Path | None,
              overrides: list[str] | None = None) -> int:
    """Entry of `longctx merge-lora` (one process): the checks every entry point runs, then
    the merge."""
    from longctx_cli.config import load_config
    from longctx_cli.preflight import check_run

    overrides = list(overrides or [])
    config, _ = check_run(load_config(config_path, overrides), "merge-lora", 1,
                          overrides=overrides)
    merge_lora(config, checkpoint, output, say=lambda line: print(line, file=sys.stderr))
    return 0


def merge_after_training(config: Config) -> None:
    """`merge_lora: true` (Axolotl's key): after a LoRA run's launcher finished, merge
    `final/` into `<output_dir>/merged`."""
    merge_lora(config, Path(config.output.output_dir) / "final",
               say=lambda line: print(line, file=sys.stderr))
