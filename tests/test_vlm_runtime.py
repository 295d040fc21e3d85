"""Vision-language models under SP equal the model's own Hugging Face training.

One packed row of three documents (two images in the first, none in the second, one in
the third; images cut by shard boundaries at sp 2 and 4) through longctx's rebuilt forward
(tower split by images, merge, then shard; mRoPE per document) under each SP strategy:
the loss and every gradient (language model, projector, vision tower) equal each
document's own `forward(..., labels=)`, float32 on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.families import BIDIRECTIONAL_IMAGE_FAMILIES
from longctx_cli.parallel.attention import register_sp_attention
from longctx_cli.parallel.meta_relay import relay_sp_meta
from longctx_cli.parallel.token_mixing import attach_token_mixing
from longctx_cli.runtime.head import model_head
from longctx_cli.runtime.loss import lm_loss_sum
from longctx_cli.runtime.vision import VisionLanguageForward, split_images
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.vlm_models import FAMILIES, VIDEO_FAMILIES, image_row, own_vlm_step, tiny_vlm

TOL = 2e-5


def _reference(family: str, specs: tuple | None = None
               ) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_vlm(family, "eager")
    loss = own_vlm_step(model, image_row(family, specs=specs)[4])
    # A weight the forward never reads (LLaVA's unused last tower norm) has no gradient.
    return loss, {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                  for n, p in model.named_parameters()}


def _longctx(family: str, state, specs: tuple | None = None
             ) -> tuple[float, dict[str, torch.Tensor], int]:
    model = tiny_vlm(family, register_sp_attention())
    attach_token_mixing(model)  # as build_model does: Qwen3.5's delta-nets run per document
    relay_sp_meta(model)
    vlm = VisionLanguageForward(model)
    ids, pos, labels, images, docs = image_row(family, specs=specs)
    batch = vlm.shard(ids, pos, labels, images, state)
    hidden = vlm.hidden_states(batch)
    count = sum(int((d_labels[1:] != IGNORE_INDEX).sum()) for _, d_labels, _ in docs)
    head = model_head(model.get_output_embeddings(), model.config)
    loss = lm_loss_sum(head, hidden, batch.shift_labels) / count
    loss.backward()
    value = loss.detach().clone()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if state.layout.sp > 1:
            dist.all_reduce(g, group=state.sp_group)
        grads[name] = g
    if state.layout.sp > 1:
        dist.all_reduce(value, group=state.sp_group)
    facts = {**_slice_facts(vlm, batch, state), "mixer_calls": batch.sp_meta.token_mixer_calls}
    return float(value), grads, batch.sp_meta.attention_calls, facts


def _slice_facts(vlm, batch, state) -> dict[str, bool]:
    """Whether this rank's slice holds no image token, and whether it holds part of an
    image whose other tokens another rank holds (an image cut by a shard boundary)."""
    from longctx_cli.parallel.sharding import slice_sequence

    image = vlm.token_types(batch.vision.input_ids) != 0  # an image's or a video's tokens
    mine = torch.zeros_like(image)
    mine[slice_sequence(torch.arange(image.numel()), state)] = True
    pairs = image[:-1] & image[1:]  # neighbours within one image's run of tokens
    cut = bool((pairs & (mine[:-1] != mine[1:])).any())
    return {"no_image": not bool((image & mine).any()), "cut_image": cut}


def _compare(family: str, state, specs: tuple | None = None) -> dict[str, float]:
    """longctx's loss and gradients against the model's own on `image_row(family, specs)`."""
    loss, grads, calls, facts = _longctx(family, state, specs)
    ref_loss, ref_grads = _reference(family, specs)
    assert set(ref_grads) == set(grads), set(ref_grads) ^ set(grads)
    # Relative error per weight; a gradient that is zero in exact arithmetic (a key bias
    # under softmax) is compared against a floor of the largest gradient's size.
    floor = 1e-4 * max(float(g.norm()) for g in ref_grads.values())
    errors = {n: float((grads[n] - g).norm()) / max(float(g.norm()), floor)
              for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    err = errors[worst]
    tower = [n for n in ref_grads if "visual" in n or "vision_tower" in n or "vision_model" in n]
    return {"loss": abs(loss - ref_loss) / ref_loss, "grad": err, "worst": worst,
            "calls": calls, "tower_grad": max(float(ref_grads[n].norm()) for n in tower),
            **facts}


LAYOUTS = {
    2: [dict(mode="ring"), dict(mode="ring", layout="zigzag"),
        dict(mode="ring", ring_attn_func="batch_ring"), dict(mode="ulysses")],
    4: [dict(mode="ring"), dict(mode="ulysses"), dict(mode="hybrid", ulysses_degree=2)],
}


def _worker(rank: int, world: int, families: tuple[str, ...]) -> dict[str, dict]:
    out = {}
    for spec in LAYOUTS[world]:
        state = sp_state(sp=world, kernel="torch", **spec)
        for family in families:
            name = f"{family} sp{world} {spec}"
            if family in BIDIRECTIONAL_IMAGE_FAMILIES and spec["mode"] != "ulysses":
                out[name] = {"refused": _refused(family, state)}
                continue
            out[name] = _compare(family, state)
    return out


def _refused(family: str, state) -> bool:
    """Whether a ring refuses the family's bidirectional image tokens (it cannot compute
    them) instead of training causal ones."""
    try:
        _longctx(family, state)
    except NotImplementedError as e:
        return "ulysses" in str(e)
    return False


def _check(results: dict[str, dict]) -> None:
    for name, r in results.items():
        if "refused" in r:
            assert r["refused"], name
            continue
        assert r["loss"] < TOL and r["grad"] < TOL, (name, r)
        assert r["calls"] >= 2, (name, r)  # every layer went through the SP attention
        assert r["tower_grad"] > 0, (name, r)  # the tower is trained, not just carried


@pytest.mark.parametrize("family", FAMILIES)
def test_sp1_equals_the_models_own_training(family: str) -> None:
    # The default layout (a ring of one): Gemma 3's image runs take the Ulysses path there.
    _check({family: _compare(family, sp_state(sp=1, kernel="torch"))})


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_equals_the_models_own_training(world: int) -> None:
    ranks = run_distributed(_worker, world, FAMILIES, timeout_s=300)
    for results in ranks:
        _check(results)
    # The row's cases happen: images cut by shard boundaries, and at sp 4 a rank whose
    # slice holds no image token at all (it still runs the tower, on nothing it keeps).
    for family in FAMILIES:  # in some layout of this sp degree
        assert any(r[name].get("cut_image") for r in ranks for name in r
                   if name.startswith(f"{family} ")), (family, ranks)
    if world == 4:
        assert any(r[name].get("no_image") for r in ranks for name in r), ranks


def test_images_split_into_balanced_contiguous_runs() -> None:
    assert split_images([24, 4, 24], 2) == [(0, 2), (2, 3)]
    assert split_images([24, 4, 24], 4) == [(0, 0), (0, 1), (1, 2), (2, 3)] or \
        sum(b - a for a, b in split_images([24, 4, 24], 4)) == 3
    runs = split_images([10] * 8, 4)
    assert runs == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_images([5], 3) == [(0, 0), (0, 1), (1, 1)] or \
        sum(b - a for a, b in split_images([5], 3)) == 1


# ---- the run's own model build: LoRA and a frozen tower ------------------------------------


def _built(family: str, state) -> torch.nn.Module:
    """The model `longctx train` builds for a LoRA run with `freeze_mm_modules`."""
    from longctx_cli.config import config_from_dict
    from longctx_cli.runtime.model import build_model
    from tests.vlm_models import _config

    config = config_from_dict({
        "model_config": _config(family).to_dict(), "seed": 0, "dtype": "float32",
        "sequence_len": 64, "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
        "lora_target_modules": ["q_proj", "v_proj", "down_proj"], "freeze_mm_modules": True,
        "processor_type": "AutoProcessor",  # images: Gemma 3 has a text-only causal LM too
        "datasets": [{"path": "unused.jsonl", "type": "chat_template"}],
        "sequence_parallel_degree": state.layout.sp,
    })
    return build_model(config, state)


def _lora_compare(family: str, state) -> dict[str, float]:
    from peft import LoraConfig, get_peft_model

    from longctx_cli.runtime.model import decoder_and_head

    ours = _built(family, state)
    decoder, head = decoder_and_head(ours, images=True)
    ids, pos, labels, images, docs = image_row(family)
    batch = decoder.shard(ids, pos, labels, images, state)
    count = sum(int((d_labels[1:] != IGNORE_INDEX).sum()) for _, d_labels, _ in docs)
    (lm_loss_sum(head, decoder.hidden_states(batch), batch.shift_labels) / count).backward()
    reference = tiny_vlm(family, "eager")
    for module in (reference.model.get_submodule(n) for n in ("visual", "vision_tower",
                                                              "multi_modal_projector")
                   if hasattr(reference.model, n)):
        module.requires_grad_(False)
    reference = get_peft_model(reference, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        exclude_modules=r".*(visual|vision_tower|multi_modal_projector).*",
        task_type="CAUSAL_LM"))
    reference.load_state_dict(ours.state_dict())
    own_vlm_step(reference, docs)
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    ref = dict(reference.named_parameters())
    assert trained.keys() == {n for n, p in ref.items() if p.requires_grad}
    # The tower and projector are frozen whole: no adapters there either.
    assert not any("visual" in n or "vision_tower" in n or "projector" in n
                   for n in trained), sorted(trained)
    errors = {}
    for name, p in trained.items():
        g = p.grad.clone()
        if state.layout.sp > 1:
            dist.all_reduce(g, group=state.sp_group)
        r = ref[name].grad
        errors[name] = float((g - r).norm()) / max(float(r.norm()), 1e-8)
    lora_b = [n for n in trained if "lora_B" in n]
    return {"grad": max(errors.values()), "lora_b": len(lora_b),
            "lora_b_norm": min(float(ref[n].grad.norm()) for n in lora_b)}


def _lora_worker(rank: int, world: int) -> dict[str, dict]:
    state = sp_state(sp=world, kernel="torch", mode="ulysses")  # what every family runs
    return {family: _lora_compare(family, state) for family in FAMILIES}


def test_lora_with_frozen_tower_equals_the_models_own_training() -> None:
    for results in run_distributed(_lora_worker, 2, timeout_s=300):
        for family, r in results.items():
            assert r["grad"] < TOL, (family, r)
            assert r["lora_b"] >= 4 and r["lora_b_norm"] > 0, (family, r)


# ---- data-parallel ranks whose rows differ in images -----------------------------------------


def _dp_worker(rank: int, world: int) -> dict[str, dict]:
    """dp 2: rank 0's row holds images, rank 1's holds text only. Every rank must run the
    tower (FSDP2 gathers its weights over both), and both must hold its gradients (their sum
    over data-parallel ranks packs the same tensors on each)."""
    from longctx_cli.config import config_from_dict
    from longctx_cli.layout import Layout
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from longctx_cli.train.step import sum_gradients
    from tests.vlm_models import _config

    out = {}
    for fsdp in (False, True):
        layout = Layout(dp_replicate=1 if fsdp else 2, dp_shard=2 if fsdp else 1, fsdp=fsdp,
                        kernel="torch")
        state = build_parallel_state(layout)
        config = config_from_dict({
            "model_config": _config("qwen2_5_vl").to_dict(), "seed": 0, "dtype": "float32",
            "sequence_len": 128, "fsdp": fsdp,
            "datasets": [{"path": "unused.jsonl", "type": "chat_template"}]})
        model = build_model(config, state)
        decoder, head = decoder_and_head(model)
        ids, pos, labels, images, docs = image_row("qwen2_5_vl")
        if rank == 1:  # the text-only document alone
            ids, labels, _ = docs[1]
            pos, images = torch.arange(len(ids)), None
        batch = decoder.shard(ids, pos, labels, images, state)
        (lm_loss_sum(head, decoder.hidden_states(batch), batch.shift_labels) / 50).backward()
        tower = [p for n, p in model.named_parameters() if "visual" in n]
        own = sum(float(p.grad.full_tensor().norm() if hasattr(p.grad, "full_tensor")
                        else p.grad.norm()) for p in tower)
        if not fsdp:
            sum_gradients([p for p in model.parameters() if p.requires_grad], state)
        out[f"fsdp={fsdp}"] = {"tower_grads": all(p.grad is not None for p in tower),
                               "own_norm": own}
    return out


def test_data_parallel_rank_without_images_still_runs_the_tower() -> None:
    ranks = run_distributed(_dp_worker, 2, timeout_s=240)  # a hang fails by the timeout
    for name in ("fsdp=False", "fsdp=True"):
        assert all(r[name]["tower_grads"] for r in ranks), (name, ranks)
    # Without FSDP each rank holds its own gradient before the sum: the text-only rank's
    # tower gradient is zero (it ran the tower on a blank input it keeps nothing of).
    assert ranks[0]["fsdp=False"]["own_norm"] > 0 and ranks[1]["fsdp=False"]["own_norm"] == 0


# ---- decoding after a prompt with images ---------------------------------------------------


def _generate_worker(rank: int, world: int, family: str) -> dict[str, list[int]]:
    """Greedy tokens after a prompt holding images (and, for the Qwen-VL families, a video), by
    longctx's SP decoding and by the model's own `generate`."""
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.runtime.sampling import greedy_tokens

    _, _, _, _, docs = image_row(family)
    ids, _, media = docs[-1] if family in VIDEO_FAMILIES else docs[0]
    out = {}
    for mode in ("ulysses",) if family in BIDIRECTIONAL_IMAGE_FAMILIES else ("ring", "ulysses"):
        state = sp_state(sp=world, kernel="torch", mode=mode)
        model = tiny_vlm(family, register_sp_attention()).eval()
        attach_token_mixing(model)  # as build_model does (Qwen3.5 decodes by full forwards)
        relay_sp_meta(model)
        decoder, head = decoder_and_head(model, images=True)
        out[mode] = greedy_tokens(decoder, head, ids.tolist(), 8, state, 0,
                                  torch.device("cpu"), None, media)
    reference = tiny_vlm(family, "eager").eval()
    kwargs = {}
    if family in BIDIRECTIONAL_IMAGE_FAMILIES:  # the prompt's images attend both ways
        kwargs["token_type_ids"] = (ids == 190).long()[None]
    if media.image_grid_thw is None:
        kwargs["pixel_values"] = media.pixel_values
        if media.image_sizes is not None:  # Mistral 3: images at their own sizes
            kwargs["image_sizes"] = media.image_sizes
    else:
        from longctx_cli.runtime.vision import IMAGE, VIDEO

        images, videos = media.only(IMAGE), media.only(VIDEO)
        kwargs.update(pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw,
                      mm_token_type_ids=((ids == 190).long() + 2 * (ids == 191).long())[None])
        if videos is not None:
            kwargs.update(pixel_values_videos=videos.pixel_values,
                          video_grid_thw=videos.image_grid_thw)
            if family == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = videos.seconds_per_grid
    with torch.no_grad():
        generated = reference.generate(input_ids=ids[None], max_new_tokens=8, do_sample=False,
                                       min_new_tokens=8, **kwargs)
    out["generate"] = generated[0, len(ids):].tolist()
    return out


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava", "gemma3", "qwen3_5"])
def test_decoding_after_images_under_sp_equals_generate(family: str) -> None:
    for result in run_distributed(_generate_worker, 2, family, timeout_s=240):
        assert result["ulysses"] == result["generate"], result
        if family in BIDIRECTIONAL_IMAGE_FAMILIES:  # a ring refuses its image runs
            assert "ring" not in result
        else:
            assert result["ring"] == result["generate"], result
