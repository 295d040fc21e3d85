"""The lean RMSNorm (runtime/memory_savers.py): the model's own norm output bit for bit,
gradients equal to its autograd's, only the input and rstd saved, one chunk of float32
temporaries in backward; applied to exactly the Llama-style norms of a model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from longctx_cli.constants import LEAN_NORM_CHUNK_TENSORS
from longctx_cli.families import LEAN_NORM_MODEL_TYPES
from longctx_cli.runtime.memory_savers import (
    _LEAN_MARK,
    apply_lean_rms_norm,
    is_llama_rms_norm,
    lean_rms_norm,
)
from tests import family_matrix as fm

F32, BF16 = torch.float32, torch.bfloat16
# [b, t, hidden] (a layer's norms) and [b, t, heads, head_dim] (Qwen3's q_norm / k_norm);
# 2 x 37 = 74 rows, 2 x 37 x 3 = 222: neither a multiple of the chunks below.
SHAPES = [(2, 37, 48), (2, 37, 3, 48)]


def chunk_bytes(rows: int, hidden: int = 48) -> int:
    """The budget that makes a backward chunk `rows` rows long."""
    return LEAN_NORM_CHUNK_TENSORS * 4 * hidden * rows


def norm(cls: type[nn.Module] = LlamaRMSNorm, weight_dtype: torch.dtype = F32,
         hidden: int = 48, seed: int = 0) -> nn.Module:
    module = cls(hidden, eps=1e-6)
    with torch.no_grad():  # a trained weight, not ones
        module.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return module.to(weight_dtype)


def inputs(shape, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)


def grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor, forward=None):
    """(output, grad of x, grad of the weight) of `forward` (default: the module's own)."""
    x = x.detach().requires_grad_()
    module.weight.grad = None
    out = (forward or module)(x)
    out.backward(g)
    gw = module.weight.grad if module.weight.requires_grad else None
    return out.detach(), x.grad, gw


def lean(module: nn.Module, chunk: int):
    return lambda x: lean_rms_norm(x, module.weight, module.variance_epsilon, chunk)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---- forward: bit for bit ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("x_dtype", [F32, BF16])
@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_is_the_modules_own_bit_for_bit(cls, x_dtype, w_dtype, shape):
    module = norm(cls, w_dtype)
    x = inputs(shape, x_dtype)
    with torch.no_grad():
        want = module(x)
    assert apply_lean_rms_norm(module) == 1
    for grad in (False, True):  # the plain path, then LeanRMSNorm.apply
        with torch.set_grad_enabled(grad):
            got = module(x.clone().requires_grad_(grad))
        # Mixed dtypes promote as the module does: weight float32 x bf16 input -> float32.
        assert got.dtype == want.dtype and torch.equal(got.detach(), want)


# ---- backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 10**6])  # several chunks with a short last one; one
def test_backward_fp32_equals_the_modules_autograd(w_dtype, shape, rows):
    module = norm(LlamaRMSNorm, w_dtype)
    x, g = inputs(shape, F32), inputs(shape, F32, seed=2)
    out, gx, gw = grads(module, x, g)
    out_l, gx_l, gw_l = grads(module, x, g, lean(module, chunk_bytes(rows)))
    assert torch.equal(out, out_l)
    assert gx_l.dtype == gx.dtype and gw_l.dtype == gw.dtype == w_dtype
    assert rel(gx_l, gx) < 1e-5
    assert rel(gw_l, gw) < (1e-5 if w_dtype == F32 else 2**-8)  # both round to bf16


def _float64_reference(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """The gradients of the norm's formula computed in float64 (no rounding anywhere)."""
    x64 = x.double().requires_grad_()
    w64 = module.weight.detach().double().requires_grad_()
    variance = x64.pow(2).mean(-1, keepdim=True)
    (w64 * (x64 * torch.rsqrt(variance + module.variance_epsilon))).backward(g.double())
    return x64.grad, w64.grad


@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_bf16_is_as_accurate_as_the_modules_autograd(w_dtype, shape):
    """Below float32 both round: against the float64 gradient our error is at most the
    module's own bf16 autograd error (within a factor of 1.5; it computes in float32)."""
    module = norm(LlamaRMSNorm, w_dtype)
    x = inputs(shape, BF16)
    g = inputs(shape, torch.promote_types(BF16, w_dtype), seed=2)
    _, gx, gw = grads(module, x, g)
    _, gx_l, gw_l = grads(module, x, g, lean(module, chunk_bytes(7)))
    assert (gx_l.dtype, gw_l.dtype) == (gx.dtype, gw.dtype) == (BF16, w_dtype)
    gx_ref, gw_ref = _float64_reference(module, x, g)
    assert rel(gx_l, gx_ref) <= 1.5 * rel(gx, gx_ref) + 1e-6
    assert rel(gw_l, gw_ref) <= 1.5 * rel(gw, gw_ref) + 1e-6
    # and close to the module's own gradient: a few bf16 roundings apart
    assert rel(gx_l, gx) < 2**-6 and rel(gw_l, gw) < 2**-6


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_frozen_weight_gets_no_gradient_and_none_is_computed():
    """A LoRA run's norm weights are frozen: backward then computes grad_x only."""
    module = norm(LlamaRMSNorm, F32).requires_grad_(False)
    x, g = inputs(SHAPES[0], F32), inputs(SHAPES[0], F32, seed=2)
    _, gx, _ = grads(module, x, g)
    y = lean(module, chunk_bytes(5))(x.detach().requires_grad_())
    ops = _Ops()
    with ops:
        y.backward(g)
    assert module.weight.grad is None
    # grad_w is a sum over rows (aten.sum); grad_x needs only a mean per row.
    assert not [n for n in ops.names if n.startswith("sum")], ops.names
    module.requires_grad_(True)
    ops = _Ops()
    y = lean(module, chunk_bytes(5))(x.detach().requires_grad_())
    with ops:
        y.backward(g)
    assert [n for n in ops.names if n.startswith("sum")]  # the check above can fail
    x_only = x.detach().requires_grad_()
    lean(module.requires_grad_(False), chunk_bytes(5))(x_only).backward(g)
    assert rel(x_only.grad, gx) < 1e-5


# ---- memory -----------------------------------------------------------------------------


class _PeakAllocated(TorchDispatchMode):
    """The peak of the bytes of storages made while active (an operator's output whose
    storage is none of its inputs') that are still alive: views and in-place results are
    not new memory."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in given and (key not in self.live or self.live[key][0].expired()):
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(v[1] for v in self.live.values()))
        return out


class _Saved:
    """Bytes autograd saves for backward, weights apart."""

    def __init__(self) -> None:
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            self.bytes += t.numel() * t.element_size()
        return t


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_backward_holds_grad_x_and_one_chunk_not_full_size_float32_copies(dtype):
    rows, hidden, chunk_rows = 4096, 256, 256
    module = norm(LlamaRMSNorm, dtype, hidden)
    x = inputs((rows, hidden), dtype).requires_grad_()
    g = inputs((rows, hidden), dtype, seed=2)
    full_fp32 = rows * hidden * 4
    grad_x = rows * hidden * x.element_size()
    budget = chunk_bytes(chunk_rows, hidden)
    peaks, saved = {}, {}
    for name, forward in [("module", module), ("lean", lean(module, budget))]:
        saved[name] = _Saved()
        with torch.autograd.graph.saved_tensors_hooks(saved[name].pack, lambda t: t):
            y = forward(x)
        peaks[name] = _PeakAllocated()
        with peaks[name]:
            y.backward(g)
        x.grad = module.weight.grad = None
        del y
    # The module's autograd: several [rows, hidden] float32 temporaries beside grad_x.
    assert peaks["module"].peak >= grad_x + 3 * full_fp32
    # Lean: grad_x plus one chunk's temporaries (and vectors: rstd, the weight's gradient).
    assert peaks["lean"].peak <= grad_x + budget + 64 * 1024, (peaks["lean"].peak, grad_x)
    # Saved: the input as given and a float32 rstd per row; the module also saves the
    # normalized tensor (and below float32 a float32 copy of the input instead of it).
    assert saved["lean"].bytes == rows * hidden * x.element_size() + rows * 4
    assert saved["module"].bytes >= saved["lean"].bytes + rows * hidden * x.element_size()


# ---- applying it to a model -------------------------------------------------------------

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def tiny(model_type: str, seed: int = 0, **fields) -> nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY, **fields})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                            dtype=torch.float32).train()


def test_apply_changes_the_llama_style_norms_and_nothing_else():
    qwen3 = tiny("qwen3", head_dim=8)
    names = [n for n, _ in qwen3.named_parameters()]
    # per layer input, post-attention, q and k norms; the final norm
    assert apply_lean_rms_norm(qwen3) == 2 * 4 + 1
    assert apply_lean_rms_norm(qwen3) == 0  # idempotent
    assert [n for n, _ in qwen3.named_parameters()] == names
    assert all(getattr(m, _LEAN_MARK, False) for m in qwen3.modules()
               if isinstance(m, Qwen3RMSNorm))
    assert apply_lean_rms_norm(tiny("gemma", head_dim=8)) == 0  # 1 + weight
    assert apply_lean_rms_norm(tiny("olmo2")) == 0  # (weight * x).to(dtype)
    llama = tiny("llama")
    llama.model.layers[0].post_attention_layernorm = GemmaRMSNorm(32)
    assert apply_lean_rms_norm(llama) == 4
    assert "forward" not in vars(llama.model.layers[0].post_attention_layernorm)
    for odd in (GemmaRMSNorm(8), Olmo2RMSNorm(8), nn.LayerNorm(8), nn.RMSNorm(8)):
        assert not is_llama_rms_norm(odd)

    class Shifted(LlamaRMSNorm):  # a subclass with its own formula
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states) + 1

    class Renamed(LlamaRMSNorm):  # same formula, inherited: it matches
        pass

    assert not is_llama_rms_norm(Shifted(8)) and is_llama_rms_norm(Renamed(8))
    bad_eps = LlamaRMSNorm(8)
    bad_eps.variance_epsilon = torch.tensor(1e-6)
    assert not is_llama_rms_norm(bad_eps)


def test_deep_copy_of_a_lean_norm_uses_its_own_weight():
    """peft's modules_to_save deep-copies a module: the copy's forward must be its own."""
    module = norm(LlamaRMSNorm, F32)
    apply_lean_rms_norm(module)
    twin = copy.deepcopy(module)
    with torch.no_grad():
        twin.weight.mul_(2)
    x = inputs(SHAPES[0], F32)
    assert torch.equal(twin(x), 2 * module(x))


def _loss_and_grads(model: nn.Module, ids: torch.Tensor):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_training_step_with_lean_norms_equals_the_models_own(checkpointing):
    plain = tiny("llama")
    if checkpointing:
        plain.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    leaned = copy.deepcopy(plain)
    assert apply_lean_rms_norm(leaned) == 5
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    loss, want = _loss_and_grads(plain, ids)
    loss_l, got = _loss_and_grads(leaned, ids)
    assert torch.equal(loss, loss_l)  # the forward is the same bits
    assert got.keys() == want.keys()
    for name in want:
        assert rel(got[name], want[name]) < 1e-5, name


def test_lean_norm_model_types_are_the_families_whose_layer_norms_all_match():
    """LEAN_NORM_MODEL_TYPES (what the memory estimate believes) is exactly the families of
    the matrix whose decoder layers' own norms all became lean."""
    from longctx_cli.config.shape import causal_lm_class
    from longctx_cli.runtime.head import decoder_of

    assert LEAN_NORM_MODEL_TYPES <= {f.model_type for f in fm.FAMILIES}
    seen: dict[str, bool] = {}
    for family in fm.FAMILIES:
        if family.model_type in seen:
            continue
        fields = family.config()
        model_type = fields.pop("model_type")
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = causal_lm_class(hf_config).from_config(hf_config)
        apply_lean_rms_norm(model)
        norms = [child for layer in decoder_of(model).layers for child in layer.children()
                 if "norm" in type(child).__name__.lower()]
        assert norms, model_type
        seen[model_type] = all(getattr(n, _LEAN_MARK, False) for n in norms)
    assert {t for t, lean_ in seen.items() if lean_} == LEAN_NORM_MODEL_TYPES
