"""Tiled MLP and activation offload: exact outputs and gradients, and the saved bytes they move."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from longctx_cli.runtime.memory_savers import (
    OffloadStats,
    activation_offload,
    apply_tiled_mlp,
    tile_count,
)

TOKENS = 192
SHAPE = dict(
    hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
)


def tiny_llama(seed: int = 0, checkpointing: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**SHAPE), attn_implementation="sdpa", dtype=torch.float32
    )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, SHAPE["vocab_size"], (1, TOKENS), generator=g)


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out = model(input_ids=ids).logits
    loss = out.float().pow(2).mean() + out[0, :, 3].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    scale = b.abs().max().clamp_min(1e-12)
    assert float((a - b).abs().max() / scale) < rel


def assert_same_run(plain: nn.Module, other: nn.Module, ids: torch.Tensor) -> None:
    out_a, grads_a = loss_and_grads(plain, ids)
    out_b, grads_b = loss_and_grads(other, ids)
    assert_close_rel(out_b, out_a)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert_close_rel(grads_b[name], grads_a[name])


@pytest.mark.parametrize("tiles", [None, 7])
def test_tiled_mlp_exact(tiles):
    plain = tiny_llama()
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, tiles)
    assert_same_run(plain, tiled, batch())


def test_tiled_mlp_keeps_parameter_names_and_is_idempotent():
    model = tiny_llama()
    names = [n for n, _ in model.named_parameters()]
    apply_tiled_mlp(model, 4)
    apply_tiled_mlp(model, 4)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == list(tiny_llama().state_dict())


def test_tiled_mlp_exact_with_lora_and_checkpointing():
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj",
                                                             "q_proj"],
        init_lora_weights=False, task_type="CAUSAL_LM",
    )
    plain = get_peft_model(tiny_llama(checkpointing=True), lora)
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, 5)
    assert_same_run(plain, tiled, batch())


def test_tile_count():
    assert tile_count(4096, 256, None) == 16
    assert tile_count(100, 256, None) == 1
    assert tile_count(10, 256, 64) == 10  # never more tiles than tokens
    assert tile_count(4096, 256, 3) == 3


class SavedBytes:
    """Bytes of distinct storages autograd saves for backward (weights excluded)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    meter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        model(input_ids=ids).logits.sum().backward()
    return meter.total


def test_tiled_mlp_drops_saved_bytes_as_predicted():
    plain, tiled = tiny_llama(), tiny_llama()
    apply_tiled_mlp(tiled, 4)
    drop = saved_bytes(plain, batch()) - saved_bytes(tiled, batch())
    # SwiGLU keeps gate, silu(gate), up and their product: 4 x [tokens, intermediate] per layer.
    predicted = SHAPE["num_hidden_layers"] * 4 * TOKENS * SHAPE["intermediate_size"] * 4
    assert abs(drop - predicted) <= 0.05 * predicted


def test_activation_offload_exact_and_moves_layer_inputs():
    plain = tiny_llama(checkpointing=True)
    offloaded = copy.deepcopy(plain)
    ids = batch()
    out_a, grads_a = loss_and_grads(plain, ids)
    with activation_offload(True) as stats:
        out_b, grads_b = loss_and_grads(offloaded, ids)
    assert_close_rel(out_b, out_a)
    for name in grads_a:
        assert torch.equal(grads_b[name], grads_a[name])
    # Outside the recomputed layers, what is saved is each layer's input [tokens, hidden]
    # plus the final norm and lm_head ([tokens, hidden] each), the logits the test's loss
    # keeps, and the token ids: that is what leaves the device.
    h, layers = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
    fixed = TOKENS * SHAPE["vocab_size"] * 4 + TOKENS * 8
    layer_inputs = layers * TOKENS * h * 4
    assert fixed + layer_inputs <= stats.in_host <= fixed + layer_inputs + 5 * TOKENS * h * 4
    assert stats.offloaded == 0  # CPU tensors have no other memory to go to


def test_activation_offload_disabled_is_a_no_op():
    with activation_offload(False) as stats:
        torch.ones(3, requires_grad=True).exp().sum().backward()
    assert stats == OffloadStats()
