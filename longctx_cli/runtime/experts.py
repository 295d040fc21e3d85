"""Linearized experts (`llama4_linearized_experts`): a MoE block's fused expert weights as one
`nn.Linear` per expert and projection, so that LoRA can target, and bitsandbytes quantize,
each expert's projections (peft and bitsandbytes work on linear layers, not on 3-D parameters).

The model's own experts module is replaced once, after loading (`linearize_experts`); the
replacement computes what it did (the same weights, the same activation, expert by expert).
Saved weights go back to the model's own layout (`fused_expert_state`), so a full export
loads in plain transformers. The family's record (families.py `fused_experts`) names the
module class and its layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from longctx_cli.config.sections.model import linearized_checkpoint_error
from longctx_cli.families import LINEARIZED_EXPERT_KEY, family


class LinearizedExperts(nn.Module):
    """One `gate`, `up` and `down` linear per expert (families.py LINEARIZED_EXPERT_LINEARS
    names them), computing the fused module's forward: rows grouped by expert in,
    `down(act(gate(x)) * up(x))` per expert out."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        gate_up, down = fused.gate_up_proj, fused.down_proj  # [E, H, 2I], [E, I, H]
        self.num_experts, self.hidden_size, width = gate_up.shape
        inner = width // 2
        kwargs = {"bias": False, "device": gate_up.device, "dtype": gate_up.dtype}

        def linears(n_in: int, n_out: int) -> nn.ModuleList:
            return nn.ModuleList(nn.Linear(n_in, n_out, **kwargs)
                                 for _ in range(self.num_experts))

        self.gate_projs = linears(self.hidden_size, inner)
        self.up_projs = linears(self.hidden_size, inner)
        self.down_projs = linears(inner, self.hidden_size)
        with torch.no_grad():
            for e in range(self.num_experts):  # nn.Linear holds [out, in]: the transposes
                self.gate_projs[e].weight.copy_(gate_up[e, :, :inner].T)  # gate: first half
                self.up_projs[e].weight.copy_(gate_up[e, :, inner:].T)
                self.down_projs[e].weight.copy_(down[e].T)
        self.act_fn = fused.act_fn

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.view(self.num_experts, -1, self.hidden_size)
        out = torch.stack([
            self.down_projs[e](self.up_projs[e](rows[e]) * self.act_fn(self.gate_projs[e](rows[e])))
            for e in range(self.num_experts)])
        return out.view(-1, self.hidden_size)


def fused_experts_class(model: nn.Module) -> str | None:
    """The class name of the model's fused experts modules (its family's record), or None."""
    config = getattr(model, "config", None)
    types = {getattr(config, "model_type", "")}
    if config is not None and hasattr(config, "get_text_config"):
        types.add(getattr(config.get_text_config(), "model_type", ""))
    return next((family(t).fused_experts for t in types if family(t).fused_experts), None)


def linearize_experts(model: nn.Module, quantization: Any = None) -> int:
    """Replace every fused experts module of `model` by its `LinearizedExperts`; returns how
    many were replaced (0: the family has none). `quantization`: the run's 4-bit
    `BitsAndBytesConfig`, with which each expert's linear is quantized as bitsandbytes
    quantizes the model's other linears on loading (the fused weights were not)."""
    name = fused_experts_class(model)
    found = [(parent, child_name) for parent in model.modules()
             for child_name, child in parent.named_children() if type(child).__name__ == name]
    for parent, child_name in found:  # one block at a time: its fused weights then go
        experts = LinearizedExperts(getattr(parent, child_name))
        setattr(parent, child_name, experts)
        if quantization is not None:
            for projs in (experts.gate_projs, experts.up_projs, experts.down_projs):
                for e, linear in enumerate(projs):
                    projs[e] = _quantized_4bit(linear, quantization)
    return len(found)


def _quantized_4bit(linear: nn.Linear, quantization: Any) -> nn.Module:
    """`linear` as a bitsandbytes 4-bit layer of `quantization`'s settings."""
    import bitsandbytes as bnb

    options = {"quant_type": quantization.bnb_4bit_quant_type,
               "compress_statistics": quantization.bnb_4bit_use_double_quant,
               "quant_storage": quantization.bnb_4bit_quant_storage}
    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                              compute_dtype=quantization.bnb_4bit_compute_dtype,
                              device="meta", **options)
    weight = linear.weight.detach()
    layer.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, **options)
    return layer.to(weight.device)  # moving a Params4bit off the meta device quantizes it


def fused_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every linearized expert's weights back in the model's own layout:
    `<experts>.gate_up_proj` `[E, H, 2I]` (gate, then up) and `<experts>.down_proj`
    `[E, I, H]`. Other entries are kept as they are (in order)."""
    linear: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = LINEARIZED_EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
        else:
            linear.setdefault(match["experts"], {}).setdefault(match["proj"], {})[
                int(match["e"])] = value
    for experts, projs in linear.items():
        gate, up, down = (_stacked(projs[p]) for p in ("gate", "up", "down"))
        out[f"{experts}.gate_up_proj"] = torch.cat([gate, up], dim=-1)
        out[f"{experts}.down_proj"] = down
    return out


def _stacked(weights: dict[int, torch.Tensor]) -> torch.Tensor:
    """Expert `e`'s `[out, in]` linear weight at `[e]`, transposed: `[experts, in, out]`."""
    return torch.stack([weights[e].T for e in range(len(weights))])


def refuse_linearized_checkpoint(unexpected_keys: Iterable[str], base_model: str) -> None:
    """Refuse a checkpoint saved with linearized experts, on the loader's unexpected keys
    (validate refuses it already where its weight index is on this machine)."""
    linear = next((k for k in sorted(unexpected_keys) if LINEARIZED_EXPERT_KEY.match(k)), None)
    if linear is not None:
        raise linearized_checkpoint_error(linear, base_model)
