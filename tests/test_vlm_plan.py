"""What `validate` says of vision-language runs: the tower's rows, and each refusal with its
reason (no processes, no weights)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from longctx_cli.errors import UserError
from tests.vlm_models import _config


def _plan(hf_config, world: int = 2, sp: int | None = None, **overrides):
    from longctx_cli.config import config_from_dict
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform

    settings = {"model_config": {"model_type": "llama"}, "sequence_len": 4096,
                "datasets": [{"path": "chats.jsonl", "type": "chat_template"}],
                "sequence_parallel_degree": sp or world, **overrides}
    return build_plan(config_from_dict(settings), world, hf_config,
                      platform=Platform(cuda=False, ring_flash_attn=False))


def _rows(plan) -> dict[str, str]:
    return dict(plan._sections(plan.model)[0][1])


def test_plan_shows_the_tower_split_by_images_and_its_memory() -> None:
    plan = _plan(_config("qwen2_5_vl"), processor_type="AutoProcessor")
    rows = _rows(plan)
    assert "2 layers, hidden 32" in rows["vision tower"] and "trained" in rows["vision tower"]
    assert "SP group of 2" in rows["tower splits by"]
    # A row of only image tokens: 4096 tokens x 4 patches each, over 2 ranks.
    assert "8,192 patches per rank" in rows["tower memory"]
    assert plan.memory.vision_tower > 0
    without = replace(plan.memory, vision_tower=0)  # the tower is held at every moment
    assert plan.memory.total == without.total + plan.memory.vision_tower
    frozen = _rows(_plan(_config("qwen2_5_vl"), freeze_mm_modules=True))
    assert "frozen (`freeze_mm_modules`)" in frozen["vision tower"]
    assert _plan(_config("qwen2_5_vl"), freeze_mm_modules=True).memory.vision_tower < \
        plan.memory.vision_tower  # no gradients or optimizer state for a frozen tower


@pytest.mark.parametrize("mode", ["ring", "hybrid"])
def test_gemma3_images_under_a_ring_are_refused_with_the_true_reason(mode: str) -> None:
    from transformers import Gemma3Config

    extra = {"ulysses_degree": 2} if mode == "hybrid" else {}
    with pytest.raises(UserError) as e:
        _plan(Gemma3Config(), world=4, processor_type="AutoProcessor",
              sequence_parallel_mode=mode, **extra)
    assert e.value.where == "sequence_parallel_mode"
    assert "both directions" in str(e.value) and "causal" in str(e.value)
    assert "sequence_parallel_mode: ulysses" in e.value.fix


def test_gemma3_images_without_sp_need_no_mode() -> None:
    from transformers import Gemma3Config

    _plan(Gemma3Config(), world=2, sp=1, processor_type="AutoProcessor")  # data parallel only


def test_gemma3_images_under_ulysses_plan_their_bidirectional_attention() -> None:
    from transformers import Gemma3Config

    plan = _plan(Gemma3Config(), processor_type="AutoProcessor",
                 sequence_parallel_mode="ulysses")
    assert "both ways within each image" in _rows(plan)["image attention"]
    assert "image attention" not in _rows(_plan(_config("qwen2_5_vl"),
                                                processor_type="AutoProcessor"))


def test_gemma3_trains_its_language_model_on_text_without_a_processor() -> None:
    from transformers import Gemma3Config

    plan = _plan(Gemma3Config(), sequence_parallel_mode="ring")
    assert not plan.vision
    assert plan.memory.vision_tower == 0


def test_paligemma_is_refused_as_a_prefix_lm() -> None:
    from transformers import PaliGemmaConfig

    with pytest.raises(UserError) as e:
        _plan(PaliGemmaConfig(), processor_type="AutoProcessor")
    assert "prefix LM" in str(e.value) and e.value.where == "base_model"


@pytest.mark.parametrize("model_type, why", [
    ("llama4", "into tiles plus a global view"),
    ("gemma3n", "longctx has no audio inputs"),
    ("gemma4_unified", "has no vision tower: it embeds each image's raw patches"),
])
def test_vlm_families_not_rebuilt_are_refused_with_their_own_reason(model_type, why) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    if config.vision_config is None:  # Gemma 4 unified's defaults have no tower part
        config = AutoConfig.for_model(model_type, vision_config={})
    with pytest.raises(UserError) as e:
        _plan(config, processor_type="AutoProcessor")
    text = str(e.value)
    assert "does not rebuild its forward" in text and why in text, text
    assert e.value.where == "base_model" and "\n" not in text


def test_mistral3_plans_its_images_and_still_trains_its_text_rows() -> None:
    # With a processor its Pixtral tower is planned (its projector merges 2 x 2 patches, a
    # size named on the wrapper's config); without one its own class runs text rows as its
    # language model does (tests/family_matrix.py: exact under every strategy).
    from transformers import Mistral3Config

    from longctx_cli.config.sections.vision import VisionTower

    assert VisionTower.of(Mistral3Config()).merge == 2
    rows = _rows(_plan(Mistral3Config(), processor_type="AutoProcessor"))
    assert "vision tower" in rows
    plan = _plan(Mistral3Config())
    assert "vision tower" not in _rows(plan) and plan.memory.vision_tower == 0


@pytest.mark.parametrize("overrides, where", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"rl": "dpo", "datasets": [{"path": "p.jsonl", "type": "chatml.intel"}]}, "rl"),
])
def test_what_vlm_runs_cannot_do_is_refused(overrides, where) -> None:
    world = 4 if "tensor_parallel_size" in overrides else 2
    with pytest.raises(UserError) as e:
        _plan(_config("qwen2_5_vl"), world=world, sp=2, **overrides)
    assert e.value.where == where or f"`{where}`" in str(e.value), str(e.value)


def test_processor_type_on_a_text_model_is_refused() -> None:
    from transformers import LlamaConfig

    with pytest.raises(UserError) as e:
        _plan(LlamaConfig(num_attention_heads=4, hidden_size=64), processor_type="AutoProcessor")
    assert e.value.where == "processor_type"


def test_llava_images_plan_their_tower() -> None:
    rows = _rows(_plan(_config("llava"), processor_type="AutoProcessor"))
    assert "2 layers, hidden 32" in rows["vision tower"]


@pytest.mark.parametrize("overrides, where", [
    ({"processor_path": "proc"}, "processor_path"),
    ({"image_size": 448}, "image_size"),
    ({"image_resize_algorithm": "lanczos"}, "image_resize_algorithm"),
    ({"processor_type": "AutoProcessor", "datasets": [], "max_steps": 2,
      "pretraining_dataset": [{"path": "t.jsonl", "type": "pretrain"}]}, "pretraining_dataset"),
])
def test_keys_no_processor_would_read_are_refused(overrides, where) -> None:
    with pytest.raises(UserError) as e:
        _plan(_config("qwen2_5_vl"), **overrides)
    assert e.value.where == where, str(e.value)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_qwen3_5_images_plan_their_tower_under_rings_and_ulysses(family: str, mode: str) -> None:
    # Its images attend causally, as its text does: a ring computes them (no refusal).
    rows = _rows(_plan(_config(family), processor_type="AutoProcessor",
                       sequence_parallel_mode=mode))
    assert "2 layers, hidden 32" in rows["vision tower"] and "trained" in rows["vision tower"]
    assert "SP group of 2" in rows["tower splits by"]
    assert "image attention" not in rows


def test_fidelity_probe_checks_gemma3_with_its_bidirectional_images() -> None:
    from transformers import Gemma3Config

    from longctx_cli.checks.fidelity import run_probe

    result = run_probe(Gemma3Config(), images=True)
    assert "images" in result.summary() and result.worst_gradient_rel_error < 1e-4
    assert result.gradients_checked > 100  # the tower's and projector's weights among them
    # Without a processor its language model trains on text: the text probe runs on the
    # multimodal class (it used to fail shrinking the composite config, refusing the run).
    text = run_probe(Gemma3Config())
    assert "images" not in text.summary() and text.worst_gradient_rel_error < 1e-4


def test_gemma3_tower_memory_counts_its_pooled_patches() -> None:
    """Gemma 3 (896-pixel images, 14-pixel patches) pools 64 x 64 patches to 16 x 16 tokens:
    16 patches per image token."""
    from transformers import Gemma3Config

    from longctx_cli.config.sections.vision import VisionTower

    real = Gemma3Config(vision_config={"image_size": 896, "patch_size": 14})
    assert VisionTower.of(real).merge == 4
    rows = _rows(_plan(real, processor_type="AutoProcessor", sequence_parallel_mode="ulysses"))
    assert "32,768 patches per rank" in rows["tower memory"]  # 4096 tokens x 16 / 2 ranks


def test_gemma3_images_on_a_gpu_count_the_tiled_path() -> None:
    """On CUDA its image rows take the tiled matmul path under every kernel: the plan adds
    the score tiles (a text run of the same model keeps the fused kernel's none)."""
    from transformers import Gemma3Config

    from longctx_cli.config import config_from_dict
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform

    def tiles(**extra) -> int:
        settings = {"model_config": {"model_type": "llama"}, "sequence_len": 4096,
                    "datasets": [{"path": "chats.jsonl", "type": "chat_template"}],
                    "sequence_parallel_degree": 2, "sequence_parallel_mode": "ulysses",
                    "attention_kernel": "torch_flash", **extra}
        return build_plan(config_from_dict(settings), 2, Gemma3Config(),
                          platform=Platform(cuda=True, ring_flash_attn=False)).memory.score_tiles

    assert tiles(processor_type="AutoProcessor") > 0 and tiles() == 0


def _mllama_plan(**overrides):
    from transformers import MllamaConfig

    settings = {"adapter": "lora", "lora_r": 32, "lora_dropout": 0.05, "bf16": True,
                "sequence_len": 8192, "gradient_checkpointing": True,
                # Axolotl's examples/llama-3-vision/lora-11b.yaml
                "lora_target_modules": r"model.language_model.layers.[\d]+.(mlp|cross_attn|"
                r"self_attn).(up|down|gate|q|k|v|o)_proj", **overrides}
    return _plan(MllamaConfig(), processor_type="AutoProcessor", **settings)


def test_mllama_plan_counts_every_ranks_image_states() -> None:
    from rich.console import Console

    plan = _mllama_plan()
    console = Console(record=True, width=300)
    console.print(plan.to_table())
    text = console.export_text()
    assert "cross-attended images" in text and "more in their backward" in text
    rows = _rows(plan)
    # 448 / 14 = 32 patches a side, + the class token, for each of 4 tiles: the tower's
    # patches are one image's on each of the 2 ranks' runs (rounded up), not a token's each.
    assert "x 4 tiles x 1,025 patches, on every rank" in rows["image states"]
    assert "(assumed: set `images_per_row`)" in rows["image states"]
    assert "for 1 image per row (4,100 patches per rank)" in rows["tower memory"]
    memory = plan.memory
    assert memory.cross_images > 0 and memory.cross_images_backward > 0
    moments = dict(memory.moments())
    without = dict(replace(memory, cross_images=0, cross_images_backward=0).moments())
    assert moments["the loss"] - without["the loss"] == memory.cross_images
    assert moments["the optimizer update"] == without["the optimizer update"]  # freed by then
    four = _mllama_plan(images_per_row=4).memory
    assert four.cross_images == 4 * memory.cross_images  # every image's keys on every rank
    assert four.total > memory.total
    assert "(`images_per_row`)" in _rows(_mllama_plan(images_per_row=4))["image states"]


def test_mllama_plan_follows_what_autograd_keeps() -> None:
    # Without checkpointing the 8 cross-attention layers keep their keys, values and masks;
    # a full fine-tune keeps the states (k_proj's input) and, training the tower, their
    # gradient in backward.
    plain = _mllama_plan(gradient_checkpointing=False).memory
    checkpointed = _mllama_plan().memory
    assert plain.cross_images > 8 * checkpointed.cross_images
    assert plain.cross_images_backward == 0  # nothing recomputed, the tower frozen (LoRA)
    full = _mllama_plan(adapter=None, gradient_checkpointing=False).memory
    frozen = _mllama_plan(adapter=None, gradient_checkpointing=False,
                          freeze_mm_modules=True).memory
    assert full.cross_images_backward > 0 and frozen.cross_images_backward == 0


@pytest.mark.parametrize("targets, adapted", [
    (r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)"
     "_proj", (True, True)),
    (r"model.language_model.layers.[\d]+.self_attn.(q|k|v|o)_proj", (False, False)),
    (["q_proj", "v_proj"], (False, True)), (["cross_attn.k_proj"], (True, False)),
    ("all-linear", (True, True)),
])
def test_mllama_lora_targets_are_matched_as_peft_does(targets, adapted) -> None:
    from transformers import MllamaConfig

    from longctx_cli.config.sections.vision import CrossAttendedImages

    assert CrossAttendedImages.of(MllamaConfig()).adapted_kv(targets) == adapted


@pytest.mark.parametrize("processor", [True, False])
def test_images_per_row_is_refused_where_it_changes_nothing(processor: bool) -> None:
    extra = {"processor_type": "AutoProcessor"} if processor else {}
    with pytest.raises(UserError) as e:
        _plan(_config("qwen2_5_vl"), images_per_row=2, **extra)
    assert e.value.where == "images_per_row"
