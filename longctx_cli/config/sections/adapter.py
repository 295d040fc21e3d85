"""The adapter section: LoRA/QLoRA adapters and the quantized base they train on, with the
layouts a quantized base cannot run in and the plan's adapter row."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from longctx_cli.config.sections.base import Section
from longctx_cli.errors import UserError


class AdapterSection(Section):
    title = "adapter"

    adapter: Literal["lora", "qlora"] | None = Field(
        None, description="lora, qlora (LoRA on a 4-bit base), or null for full fine-tuning."
    )
    load_in_4bit: bool = Field(
        False, description="Quantize the base weights to 4 bits (bitsandbytes NF4); needs an "
        "adapter. With `fsdp` the packed weights are sharded too (FSDP-QLoRA); not with TP."
    )
    load_in_8bit: bool = Field(
        False, description="Quantize the base weights to 8 bits (bitsandbytes); needs an "
        "adapter; not with FSDP or TP."
    )
    quantize_moe_experts: bool = Field(
        False, description="With `load_in_4bit` or `load_in_8bit`: also quantize the MoE "
        "experts' fused 3-D weights (e.g. `mlp.experts.gate_up_proj`), which the quantized "
        "linear layers leave in full precision (Axolotl's key): 4 bits as bitsandbytes' "
        "`replace_parameter_4bit` packs them, or int8 with a scale per row. The experts stay "
        "frozen: LoRA on them (`lora_target_parameters`, or module names "
        "peft maps onto them, e.g. `down_proj`) is refused. With `fsdp` their packed bytes "
        "are sharded too."
    )
    bnb_config_kwargs: dict[str, Any] | None = Field(
        None, description="Extra BitsAndBytesConfig arguments, e.g. `{bnb_4bit_quant_type: fp4}`."
    )
    lora_model_dir: str | None = Field(
        None, description="Continue training this saved LoRA adapter instead of a new one."
    )
    lora_r: int = Field(8, ge=1, description="LoRA rank.")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: list[str] | str | None = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names to adapt, or `all-linear`.",
    )
    lora_target_linear: bool = Field(
        False, description="Adapt every linear layer (same as `lora_target_modules: all-linear`)."
    )
    lora_target_parameters: list[str] | None = Field(
        None, description="Parameters to adapt that no linear module holds, e.g. a MoE "
        "block's fused expert weights `[mlp.experts.gate_up_proj, mlp.experts.down_proj]` "
        "(peft's `target_parameters`: a name or its last dotted parts); with "
        "`lora_target_modules` both are adapted. Not with `lora_dropout` or DoRA (peft "
        "cannot apply either to a parameter).",
    )
    lora_modules_to_save: list[str] | None = Field(
        None, description="Modules trained in full beside the adapter, e.g. [lm_head]."
    )
    peft_use_dora: bool = Field(False, description="DoRA: weight-decomposed LoRA.")
    peft_use_rslora: bool = Field(False, description="rsLoRA: scale by alpha / sqrt(r).")

    @model_validator(mode="after")
    def _consistent(self) -> AdapterSection:
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("`load_in_4bit` and `load_in_8bit` are both on; choose one")
        if self.adapter == "qlora" and not self.load_in_4bit:
            if self.load_in_8bit:
                raise ValueError("`adapter: qlora` is LoRA on a 4-bit base; set "
                                 "`load_in_4bit: true` instead of load_in_8bit")
            self.load_in_4bit = True  # what qlora means
        if (self.load_in_4bit or self.load_in_8bit) and self.adapter is None:
            raise ValueError("a quantized base (`load_in_4bit`/`load_in_8bit`) cannot be "
                             "trained in full; set `adapter: lora` (or qlora)")
        if self.quantize_moe_experts and not (self.load_in_4bit or self.load_in_8bit):
            raise ValueError(
                "`quantize_moe_experts: true` packs the experts' fused weights as the base's "
                "linear layers are packed, so it needs a quantized base: set `load_in_4bit: "
                "true` (adapter: qlora) or `load_in_8bit: true`, or remove the key")
        if self.lora_model_dir and self.adapter is None:
            raise ValueError("`lora_model_dir` continues an adapter; set `adapter: lora`")
        if self.lora_target_linear:
            self.lora_target_modules = "all-linear"
        if self.lora_target_parameters and (self.lora_dropout or self.peft_use_dora):
            key = "lora_dropout" if self.lora_dropout else "peft_use_dora"
            raise ValueError(f"`lora_target_parameters` cannot be trained with `{key}`: peft's "
                             "LoRA on a parameter computes the adapted weight, not the "
                             "layer's input, so it has no input to drop out and no DoRA "
                             f"norm; set `{key}` off")
        return self

    @property
    def quantized(self) -> bool:
        """The base weights are quantized by bitsandbytes (4 or 8 bits)."""
        return self.load_in_4bit or self.load_in_8bit


def check_adapter(adapter: AdapterSection, fsdp: bool, tp: int) -> None:
    """The layouts an adapter's base cannot run in (`fsdp`, `tp`: the run's), and an empty
    target list."""
    if adapter.adapter is None:
        return
    if fsdp and adapter.load_in_8bit:
        # FSDP-QLoRA (4-bit) works: FSDP2 shards the packed weights as plain uint8 tensors and
        # bitsandbytes finds each layer's quantization state on the module again. The 8-bit
        # layer keeps its row scales (SCB) on the weight tensor itself, which FSDP2 replaces.
        raise UserError(
            "FSDP with an 8-bit base (`load_in_8bit`) cannot run: bitsandbytes' 8-bit layers "
            "keep their row scales on the weight tensor, and FSDP2 replaces that tensor with "
            "its gathered copy, which has none (the first forward fails).",
            where="load_in_8bit",
            fix="use `adapter: qlora` (a 4-bit base, which FSDP shards), or turn FSDP off "
            "(fsdp, fsdp_config, deepspeed, dp_shard_size) for the 8-bit base.",
        )
    if tp > 1 and adapter.quantized:
        bits = 4 if adapter.load_in_4bit else 8
        raise UserError(
            f"`tensor_parallel_size` = {tp} with a {bits}-bit base "
            "cannot run: TP turns each linear weight into a DTensor of its rows or columns, "
            "but a bitsandbytes weight is a packed tensor whose quantization state describes "
            "the whole matrix, and bitsandbytes cannot wrap the DTensor (the first forward "
            "fails).",
            where="tensor_parallel_size",
            fix="use `tensor_parallel_size: 1`: sequence parallelism splits the sequence and "
            "FSDP (`fsdp: true`) shards the 4-bit base; or train `adapter: lora` on a "
            "full-precision base with TP.",
        )
    targets = adapter.lora_target_modules
    if adapter.lora_target_parameters and targets in (None, []):
        return  # LoRA on the parameters alone
    if not targets or (isinstance(targets, str) and not targets.strip()):
        raise UserError(
            f"`lora_target_modules` = {targets!r} is empty: LoRA would train nothing.",
            fix="list module names, e.g. `[q_proj, k_proj, v_proj, o_proj]`, or `all-linear`.",
        )


def adapter_rows(adapter: AdapterSection, dtype: str) -> list[tuple[str, str]]:
    """The plan's adapter row (none for a full fine-tune)."""
    if adapter.adapter is None:
        return []
    base = "4-bit" if adapter.load_in_4bit else "8-bit" if adapter.load_in_8bit else dtype
    extras = [n for n, on in (("DoRA", adapter.peft_use_dora),
                               ("rsLoRA", adapter.peft_use_rslora)) if on]
    if adapter.quantize_moe_experts:
        extras.append("4-bit experts")
    if adapter.lora_target_parameters:
        extras.append("parameters " + ", ".join(adapter.lora_target_parameters))
    return [("adapter", f"{adapter.adapter}, r {adapter.lora_r}, {base} base"
             + (f", {', '.join(extras)}" if extras else "")
             + (f", from {adapter.lora_model_dir}" if adapter.lora_model_dir else ""))]
