"""The fused lm_head + cross-entropy (`runtime/loss.py:LinearCrossEntropy`) against autograd
through the model's own head and torch's cross_entropy: the loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longctx_cli.runtime.head import LogitTransform, ModelHead
from longctx_cli.runtime.loss import LinearCrossEntropy, fused_head, lm_loss_sum


def _case(dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(48, 500, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(500, 48, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(500, generator=g))
    hidden = torch.randn(203, 48, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 500, (203,), generator=g)
    labels[::5] = -100
    labels[64:128] = -100  # a whole block without a target
    return linear, hidden, labels


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> bool:
    """Relative error of the whole tensor (float32 sums in another order differ in ulps)."""
    return bool((got.double() - want.double()).norm() <= rtol * want.double().norm())


def _autograd(linear, hidden, labels, scale):
    hidden = hidden.detach().clone().requires_grad_()
    linear.zero_grad()
    loss = F.cross_entropy(linear(hidden).float(), labels, ignore_index=-100, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), hidden.grad, linear.weight.grad.clone(), (
        linear.bias.grad.clone() if linear.bias is not None else None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", [1, 64, 100, 1000])
def test_loss_and_gradients_match_autograd_float32(bias, block):
    linear, hidden, labels = _case(torch.float32, bias)
    want = _autograd(linear, hidden, labels, scale=0.37)
    linear.zero_grad()
    loss = lm_loss_sum(ModelHead(linear, LogitTransform()), hidden, labels, block)
    (loss * 0.37).backward()
    assert torch.allclose(loss, want[0], rtol=1e-6)
    assert _close(hidden.grad, want[1]) and _close(linear.weight.grad, want[2])
    if bias:
        assert _close(linear.bias.grad, want[3])
    assert hidden.grad[64:128:5].abs().sum() == 0  # ignored tokens get no gradient


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-6), (torch.bfloat16, 2e-2)])
def test_other_dtypes_follow_the_autograd_path(dtype, rtol):
    linear, hidden, labels = _case(dtype, bias=True)
    want = _autograd(linear, hidden, labels, scale=1.0)
    linear.zero_grad()
    loss = LinearCrossEntropy.apply(hidden, linear.weight, linear.bias, labels, 64)
    loss.backward()
    assert torch.allclose(loss, want[0], rtol=rtol)
    assert hidden.grad.dtype == dtype and linear.weight.grad.dtype == dtype
    assert _close(hidden.grad, want[1], rtol) and _close(linear.weight.grad, want[2], rtol)


def test_tied_weight_sums_both_roles_gradients():
    torch.manual_seed(0)
    embed = nn.Embedding(300, 32)
    head = nn.Linear(32, 300, bias=False)
    head.weight = embed.weight  # tied, as tie_word_embeddings does
    ids = torch.randint(0, 300, (90,))
    labels = torch.roll(ids, -1)
    grads = []
    for fused in (True, False):
        embed.zero_grad()
        hidden = torch.tanh(embed(ids))
        loss = (lm_loss_sum(head, hidden, labels, 16) if fused else
                F.cross_entropy(head(hidden).float(), labels, reduction="sum"))
        loss.backward()
        grads.append(embed.weight.grad.clone())
    assert _close(grads[0], grads[1])


def test_frozen_head_gets_no_weight_gradient():
    linear, hidden, labels = _case(torch.float32, bias=False)
    linear.weight.requires_grad_(False)
    loss = lm_loss_sum(linear, hidden, labels, 32)
    loss.backward()
    assert linear.weight.grad is None
    want = _autograd(linear.requires_grad_(True), hidden, labels, 1.0)
    assert _close(hidden.grad, want[1])


def test_only_a_plain_linear_head_in_training_is_fused():
    linear, hidden, _ = _case(torch.float32, bias=False)
    assert fused_head(ModelHead(linear, LogitTransform()), hidden) is linear
    # a family's logit transform, a layer with its own forward, no graph, autocast: autograd
    assert fused_head(ModelHead(linear, LogitTransform(softcap=30.0)), hidden) is None

    class Adapted(nn.Linear):
        pass

    assert fused_head(Adapted(48, 500), hidden) is None
    with torch.no_grad():
        assert fused_head(linear, hidden) is None
    assert fused_head(linear, hidden.detach()) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_head(linear, hidden) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_block_of_logits_alive_at_a_time(dtype):
    """When a block's logits are made, no earlier block's logits (or their compute-dtype
    gradient) are still alive: the loss's peak is one block's, which the estimate counts."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    linear, hidden, labels = _case(dtype, bias=False)
    labels[64:128] = 0  # every block has targets
    block, vocab = 32, linear.out_features
    alive: list[weakref.ref] = []
    seen_alive: list[int] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                earlier = [r for r in alive if r() is not None and r() is not out]
                if out.shape == (block, vocab):  # a block's logits being made
                    seen_alive.append(len({r().data_ptr() for r in earlier}))
            if isinstance(out, torch.Tensor) and out.shape == (block, vocab):
                alive.append(weakref.ref(out))
            return out

    with Watch():
        LinearCrossEntropy.apply(hidden, linear.weight, None, labels, block)
    assert len(seen_alive) >= 3, seen_alive
    # float32 reuses one buffer for every block (it is the only one alive, by design)
    assert max(seen_alive) == (1 if dtype == torch.float32 else 0), seen_alive


# ---- the head weight gradient under half precision: half inputs, float32 accumulation -----

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weight_gradient_keeps_its_bound_against_float64(dtype):
    """The fused bf16/fp16 weight gradient against the float64 gradient of the same rounded
    logits (the half forward is unchanged; what changed is G rounded to the half dtype and
    G.T @ H accumulated in float32): elementwise within the bound the docstring states."""
    linear, hidden, labels = _case(dtype, bias=False, seed=3)
    loss = LinearCrossEntropy.apply(hidden, linear.weight, None, labels, 64)
    loss.backward()
    got = linear.weight.grad.double()
    h64 = hidden.detach().double()
    logits = F.linear(hidden.detach(), linear.weight.detach()).double()  # half, as the path
    valid = labels != -100
    grad_logits = torch.softmax(logits, 1)
    grad_logits[torch.arange(len(labels)), labels.clamp(min=0)] -= 1
    grad_logits[~valid] = 0
    exact = grad_logits.t() @ h64
    u, n = UNIT_ROUNDOFF[dtype], int(valid.sum())
    scale = grad_logits.abs().t() @ h64.abs()
    tiny = 2.0**-25 * h64.abs().sum(0)[None, :] if dtype == torch.float16 else 0.0
    bound = u * exact.abs() + (1 + u) * ((u + n * 2.0**-24) * scale + tiny) + 1e-30
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() / bound).max())
    # and not vacuous: the bound is a small fraction of the gradient itself
    assert float((bound - 1e-30).norm() / exact.norm()) < 4 * u


def test_sliced_tensor_core_path_adds_every_vocabulary_slice():
    """The CUDA path's slicing (scratch rows fewer than the vocabulary, a ragged last slice)
    gives the same sum as one float32 matmul of the half values; the product is computed here
    as the CUDA op defines it, half inputs with a float32 result."""
    from longctx_cli.runtime.loss import add_head_weight_grad

    g = torch.Generator().manual_seed(1)
    grad = torch.randn(37, 500, generator=g).bfloat16()
    h = torch.randn(37, 48, generator=g).bfloat16()
    whole = torch.full((500, 48), 0.5)
    sliced = whole.clone()
    add_head_weight_grad(whole, grad, h, None)
    scratch = torch.empty(7, 48)
    add_head_weight_grad(sliced, grad, h, scratch,
                         product=lambda a, b, out: torch.mm(a.float(), b.float(), out=out))
    assert torch.allclose(sliced, whole, rtol=1e-6, atol=1e-6)
    exact = 0.5 + grad.double().t() @ h.double()
    assert _close(whole, exact, rtol=1e-6)


def test_the_float32_output_matmul_binds_as_the_cuda_path_calls_it():
    """`aten::mm.dtype_out` exists with this Python signature (it has no CPU kernel: the
    dispatcher, not the argument parser, refuses it here)."""
    from longctx_cli.runtime.loss import half_mm_f32

    a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 2, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"mm\.dtype_out"):
        half_mm_f32(a, b, torch.empty(4, 2))
