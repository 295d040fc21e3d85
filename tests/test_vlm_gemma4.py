"""Gemma 4 with images under SP equals the model's own Hugging Face training.

A tiny `Gemma4ForConditionalGeneration` (tests/vlm_models.py: sliding and full layers, the
full ones wider with keys as values, KV sharing, per-layer input embeddings; a tower over
each image's own patches with their (x, y), pooled 2 x 2) and one packed row of three
documents (two images in the first, the larger cut by the shard boundary of every sp-2
layout; text only; one image). longctx's rebuilt forward (runtime/vision.py: the tower split
by whole images, each padded to the row's most patches, the features gathered and written
over placeholders embedded as the pad token, as the model's own forward embeds them) against
each document's own `forward(input_ids=, pixel_values=, image_position_ids=,
mm_token_type_ids=, labels=)`, its images padded to that document's most patches.

With `use_bidirectional_attention: vision` (`gemma4`) an image's tokens attend both ways on
the sliding layers and causally on the full ones: exact at sp 1 and under Ulysses, refused by
the rings. Without it (`gemma4_causal`) the images are causal: exact under every layout.

The tower's gradients are the model's own float32 rounding's worst: its images are no
targets, so their features' gradient comes only from the later tokens that attend to them,
and with causal images the model's own float32 training is 2e-5 to 4e-5 relative off its
float64 training on every tower weight (measured: up to 3.8e-5, at sp 1). So each gradient
is held against the model's own float64 training, within TOL or NOISE_FACTOR times the
model's own float32 error on that weight, whichever is larger (never above NOISE_CAP); the
loss within TOL.
"""

from __future__ import annotations

import functools

import pytest
import torch

from longctx_cli.config.sections.vision import VisionTower
from longctx_cli.errors import UserError
from longctx_cli.families import (
    BIDIRECTIONAL_IMAGE_FAMILIES,
    VISION_FAMILIES,
    family,
    image_attention,
)
from longctx_cli.runtime.vision import VisionInputs, VisionLanguageForward
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_vlm_runtime import _longctx
from tests.vlm_models import GEMMA4_POOL, image_row, own_vlm_step, tiny_vlm

TOL = 2e-5
NOISE_FACTOR = 3.0
NOISE_CAP = 2e-4
# The sp-2 rings: the default P2P stripe ring and the llama3 ring on zigzag slices run by
# default, the llama3 ring on contiguous slices with -m slow.
RINGS = (dict(mode="ring", layout="stripe"), dict(mode="ring", layout="zigzag"))
SLOW_RINGS = (dict(mode="ring"),)
ULYSSES = dict(mode="ulysses")


@functools.cache  # the same in every layout a process checks (callers only read it)
def _own(name: str, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """The model's own training of the row's documents in `dtype`: loss and gradients."""
    model = tiny_vlm(name, "eager").to(dtype)
    if dtype == torch.float64:  # torch's grouped matmul takes no float64: experts one by one
        model.set_experts_implementation("eager")
    docs = [(ids, labels, None if m is None else VisionInputs(
        m.pixel_values.to(dtype), patch_positions=m.patch_positions))
        for ids, labels, m in image_row(name)[4]]
    loss = own_vlm_step(model, docs)
    return loss, {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double()
                  for n, p in model.named_parameters()}


def _errors(grads: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]
            ) -> dict[str, float]:
    # Relative per weight, against a floor of the largest gradient's size (a gradient that is
    # zero in exact arithmetic, a bias under softmax).
    floor = 1e-4 * max(float(g.norm()) for g in exact.values())
    return {n: float((grads[n].double() - g).norm()) / max(float(g.norm()), floor)
            for n, g in exact.items()}


def compare(name: str, state) -> dict:
    """longctx's loss and gradients (float32) against the model's own float64 training, and
    the model's own float32 training's distance from that."""
    loss, grads, calls, facts = _longctx(name, state)
    exact_loss, exact = _own(name, torch.float64)
    own_loss, own = _own(name, torch.float32)
    assert set(grads) == set(exact), set(grads) ^ set(exact)
    ours, noise = _errors(grads, exact), _errors(own, exact)
    bound = {n: min(max(TOL, NOISE_FACTOR * noise[n]), NOISE_CAP) for n in exact}
    worst = max(ours, key=lambda n: ours[n] / bound[n])
    tower = [n for n in exact if "vision_tower" in n]
    return {"loss": abs(loss - exact_loss) / exact_loss, "grad": ours[worst],
            "bound": bound[worst], "worst": worst, "calls": calls,
            "own_loss": abs(own_loss - exact_loss) / exact_loss,
            "tower_grad": max(float(exact[n].norm()) for n in tower),
            "beyond_tol": sum(ours[n] > TOL for n in exact), **facts}


def check(results: dict[str, dict]) -> None:
    for name, r in results.items():
        if "refused" in r:
            assert r["refused"], (name, r)
            continue
        assert r["loss"] < TOL and r["grad"] <= r["bound"], (name, r)
        assert r["calls"] >= 4, (name, r)  # every layer went through the SP attention
        assert r["tower_grad"] > 0, (name, r)  # the tower is trained, not just carried


def _refused(name: str, state) -> bool:
    """Whether a ring refuses both-ways image tokens instead of training causal ones."""
    try:
        _longctx(name, state)
    except NotImplementedError as e:
        return "ulysses" in str(e)
    return False


def test_gemma4_is_rebuilt_and_its_config_picks_how_images_attend() -> None:
    from transformers import AutoConfig

    record = family("gemma4")
    assert "gemma4" in VISION_FAMILIES and "gemma4" in BIDIRECTIONAL_IMAGE_FAMILIES
    assert record.vision_refusal is None and record.vision.pixels == "positioned"
    assert record.vision.prepared  # its processor's rows: tests/test_vlm_gemma4_data.py
    both = AutoConfig.for_model("gemma4", vision_config={},
                                text_config={"use_bidirectional_attention": "vision"})
    assert image_attention(both) == "sliding_both_ways"
    assert image_attention(AutoConfig.for_model("gemma4", vision_config={})) == "causal"
    assert VisionTower.of(both).merge == both.vision_config.pooling_kernel_size


@pytest.mark.parametrize("name", ["gemma4", "gemma4_causal", "gemma4_moe"])
def test_sp1_equals_the_models_own_training(name: str) -> None:
    check({name: compare(name, sp_state(sp=1, kernel="torch"))})


def _worker(rank: int, world: int, exact: tuple[tuple[str, dict], ...],
            refused: tuple[dict, ...]) -> dict[str, dict]:
    """`exact`: (model, layout) pairs compared with the model's own training; `refused`: the
    layouts that must refuse `gemma4`'s both-ways images rather than train causal ones."""
    out = {f"{name} {spec}": compare(name, sp_state(sp=world, kernel="torch", **spec))
           for name, spec in exact}
    for spec in refused:
        out[f"gemma4 {spec}"] = {"refused": _refused("gemma4", sp_state(
            sp=world, kernel="torch", **spec))}
    return out


def _check_sp2(exact: tuple[tuple[str, dict], ...], refused: tuple[dict, ...]) -> None:
    ranks = run_distributed(_worker, 2, exact, refused, timeout_s=300)
    for results in ranks:
        check(results)
    assert len(ranks[0]) == len(exact) + len(refused), ranks[0]
    for name, spec in exact:  # a shard boundary cuts an image in every layout
        assert any(r[f"{name} {spec}"]["cut_image"] for r in ranks), (name, spec, ranks)


def test_sp2_ulysses_and_rings_equal_the_models_own_training_or_are_refused() -> None:
    _check_sp2((*[("gemma4_causal", spec) for spec in (*RINGS, ULYSSES)],
                ("gemma4", ULYSSES)), refused=RINGS)


@pytest.mark.slow  # the default run checks two rings, Ulysses, and the MoE at sp 1
def test_sp2_contiguous_ring_and_the_moe_under_ulysses() -> None:
    _check_sp2((*[("gemma4_causal", spec) for spec in SLOW_RINGS], ("gemma4_moe", ULYSSES)),
               refused=SLOW_RINGS)


def _worker4(rank: int, world: int) -> dict[str, dict]:
    hybrid = dict(mode="hybrid", ulysses_degree=2)
    return {"gemma4_causal hybrid": compare("gemma4_causal", sp_state(
                sp=world, kernel="torch", **hybrid)),
            "gemma4 ulysses": compare("gemma4", sp_state(sp=world, kernel="torch", **ULYSSES)),
            "gemma4 hybrid": {"refused": _refused("gemma4", sp_state(
                sp=world, kernel="torch", **hybrid))}}


@pytest.mark.slow  # four ranks: hybrid exact with causal images, refused with both-ways ones
def test_sp4_hybrid_and_ulysses() -> None:
    for results in run_distributed(_worker4, 4, timeout_s=600):
        check(results)


def test_the_blank_tower_call_of_a_text_row_is_one_pooled_token() -> None:
    vlm = VisionLanguageForward(tiny_vlm("gemma4", "eager"))
    blank = vlm._blank(torch.device("cpu"))
    assert blank.patches_per_image() == [GEMMA4_POOL**2]
    with torch.no_grad():
        features, deep = vlm.encode(blank)
        assert features.shape == (1, 64) and not deep
        assert float(vlm._tower_zero(torch.device("cpu"))) == 0


# ---- what `validate` refuses -------------------------------------------------------------


def _plan(hf_config, **overrides):
    from tests.test_vlm_plan import _plan as plan

    return plan(hf_config, **overrides)


def _both_ways():
    from transformers import AutoConfig

    return AutoConfig.for_model("gemma4", vision_config={},
                                text_config={"use_bidirectional_attention": "vision"})


@pytest.mark.parametrize("mode", ["ring", "hybrid"])
def test_a_ring_with_both_ways_images_is_refused_naming_ulysses(mode: str) -> None:
    extra = {"ulysses_degree": 2} if mode == "hybrid" else {}
    with pytest.raises(UserError) as e:
        _plan(_both_ways(), world=4, sp=4, sequence_parallel_mode=mode,
              processor_type="AutoProcessor", **extra)
    text = str(e.value)
    assert e.value.where == "sequence_parallel_mode" and "both directions" in text, text
    assert "ulysses" in e.value.fix and "\n" not in text


def test_its_processor_rows_train_under_ulysses_and_its_videos_stay_refused() -> None:
    """`processor_type` is accepted for Gemma 4 (its rows are built, see
    tests/test_vlm_gemma4_data.py): the plan shows its both-ways images on the sliding
    layers; the rings stay refused (above) and so do videos (the data side's refusal,
    tests/test_vlm_gemma4_data.py)."""
    from tests.test_vlm_plan import _rows

    rows = _rows(_plan(_both_ways(), world=2, sp=2, sequence_parallel_mode="ulysses",
                       processor_type="AutoProcessor"))
    assert "sliding-window layers" in rows["image attention"], rows
    assert family("gemma4").vision.video_refusal
