"""What `validate` counts of Mllama's cross-attended images equals what its forward keeps.

Every rank holds the projected tower states of all the row's images, and each
cross-attention layer keeps tensors the size of those keys for its backward (k_norm's, the
keys and values SDPA takes, the mask it converts to the compute dtype; LoRA's input copies).
The estimate's terms (`CrossAttendedImages.memory`) are held against the bytes of every
tensor autograd saves inside the language model whose shape has the row's key count, on a
tiny `MllamaForConditionalGeneration` run as runtime/vision.py runs it.
"""

from __future__ import annotations

import pytest
import torch


def _saved_key_bytes(dtype: torch.dtype, lora_dropout: float | None, frozen: bool
                     ) -> tuple[int, int, int]:
    """(bytes saved inside the language model with a dimension of the row's keys, that key
    count, the row's tokens), one forward at sp 1; `lora_dropout`: LoRA on k_proj and v_proj
    (None: no adapter); `frozen`: the tower and projector are (`freeze_mm_modules`)."""
    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.runtime.vision import VisionLanguageForward
    from tests.layouts import sp_state
    from tests.vlm_models import image_row, tiny_vlm

    model = tiny_vlm("mllama", register_sp_attention()).to(dtype)
    if frozen:
        for name in ("vision_model", "multi_modal_projector"):
            model.model.get_submodule(name).requires_grad_(False)
    if lora_dropout is not None:
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=["k_proj", "v_proj"],
            exclude_modules=r".*(vision_model|multi_modal_projector).*"))
    vlm = VisionLanguageForward(model)
    ids, pos, labels, images, _ = image_row("mllama")
    images.pixel_values = images.pixel_values.to(dtype)
    vision = model.config.vision_config
    keys = images.num_images * vision.max_num_tiles * (
        (vision.image_size // vision.patch_size) ** 2 + 1)
    assert keys not in (ids.numel(), model.config.text_config.hidden_size)  # told apart
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if keys in t.shape:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    language = model.model.language_model
    language.register_forward_pre_hook(lambda *_: hooks.__enter__())
    language.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    batch = vlm.shard(ids, pos, labels, images, sp_state(sp=1, kernel="torch"))
    hidden = vlm.hidden_states(batch)
    assert hidden.requires_grad
    return sum(storages.values()), keys, ids.numel()


@pytest.mark.parametrize("dtype, lora_dropout, frozen", [
    (torch.float32, None, False), (torch.bfloat16, None, False), (torch.bfloat16, None, True),
    (torch.bfloat16, 0.0, True), (torch.float32, 0.0, True), (torch.float32, 0.1, True),
    (torch.bfloat16, 0.1, True),
])
def test_the_estimate_counts_what_the_cross_attention_keeps(dtype, lora_dropout, frozen
                                                             ) -> None:
    from longctx_cli.config.sections.vision import CrossAttendedImages, TowerRun
    from tests.layouts import layout_of
    from tests.vlm_models import _config, image_row

    measured, keys, tokens = _saved_key_bytes(dtype, lora_dropout, frozen)
    config = _config("mllama")
    cross = CrossAttendedImages.of(config)
    images = image_row("mllama")[3].num_images
    assert cross.keys_per_image * images == keys
    lora = lora_dropout is not None
    run = TowerRun(dtype=str(dtype).removeprefix("torch."), frozen=frozen,
                   adapter="lora" if lora else None, row_tokens=tokens, checkpointed=False,
                   images_per_row=images,
                   adapted_kv=(lora, lora),
                   lora_r=4, lora_dropout=bool(lora_dropout))
    states, kept, _ = cross.memory(run, layout_of(sp=1))
    assert 0.9 <= measured / (states + kept) <= 1.15, (measured, states, kept)

