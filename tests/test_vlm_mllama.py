"""Mllama (Llama 3.2 Vision) with images under SP equals its own Hugging Face training.

Its images are not merged into the tokens: each is one <|image|> token, and the text model's
cross-attention layers attend from the text tokens to the tower's states of the document's
images (every tile's patches), with the mask its processor writes. One packed row of three
documents (`tests/vlm_models.py` MLLAMA_DOCUMENTS): text before the first image (rows that
see no tile), an image whose rows cross the sp 2 boundary, a document without images (its
own forward skips the cross-attention layer), and two images in a row. The loss and every
gradient (self- and cross-attention layers, their gates, projector, tower) equal each
document's own `MllamaForConditionalGeneration(pixel_values=, aspect_ratio_ids=,
aspect_ratio_mask=, cross_attention_mask=, labels=)`.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.families import VISION_FAMILIES, family, image_attention
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_vlm_runtime import TOL, _compare

# Ulysses, the default P2P stripe ring (token i on rank i % 2: each rank's mask rows are every
# other token's), the llama3 ring on zigzag and on contiguous slices, the P2P ring.
SPECS = (dict(mode="ulysses"), dict(mode="ring", layout="stripe"),
         dict(mode="ring", layout="zigzag"), dict(mode="ring"),
         dict(mode="ring", ring_attn_func="batch_ring"))


def _check(results: dict[str, dict]) -> None:
    for name, r in results.items():
        assert r["loss"] < TOL and r["grad"] < TOL, (name, r)
        assert r["calls"] == 2, (name, r)  # the two self-attention layers, through SP
        assert r["tower_grad"] > 0, (name, r)


def _mllama(state) -> dict:
    return _compare("mllama", state)


def test_mllama_is_rebuilt_with_cross_attended_tiles() -> None:
    record = family("mllama")
    assert "mllama" in VISION_FAMILIES and record.vision_refusal is None
    assert record.vision.pixels == "tiled" and record.vision.images_attend == "cross"
    from tests.vlm_models import _config

    assert image_attention(_config("mllama")) == "cross"


def test_sp1_equals_the_models_own_training() -> None:
    from tests.vlm_models import _config, image_row, own_vlm_step, tiny_vlm

    _check({"mllama sp1": _mllama(sp_state(sp=1, kernel="torch"))})
    # The reference trains the cross attention (its gates open): the row tests it.
    model = tiny_vlm("mllama", "eager")
    own_vlm_step(model, image_row("mllama")[4])
    cross = model.model.language_model.layers[1]
    assert _config("mllama").text_config.cross_attention_layers == [1]
    assert float(cross.cross_attn.k_proj.weight.grad.norm()) > 0
    assert float(cross.cross_attn_attn_gate.grad.abs()) > 0


def test_checkpointed_layers_recompute_the_cross_attention_exactly() -> None:
    """With activation checkpointing (Axolotl's example sets `gradient_checkpointing`), the
    cross-attention layer runs again in backward and finds the row's image context still on
    the metadata: the gradients stay the model's own."""
    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.runtime.head import model_head
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.model import enable_checkpointing
    from longctx_cli.runtime.vision import VisionLanguageForward
    from tests.test_vlm_runtime import _reference
    from tests.vlm_models import image_row, tiny_vlm

    model = tiny_vlm("mllama", register_sp_attention())
    enable_checkpointing(model, {"use_reentrant": False})
    vlm = VisionLanguageForward(model)
    ids, pos, labels, images, docs = image_row("mllama")
    batch = vlm.shard(ids, pos, labels, images, sp_state(sp=1, kernel="torch"))
    count = sum(int((d_labels[1:] != IGNORE_INDEX).sum()) for _, d_labels, _ in docs)
    head = model_head(model.get_output_embeddings(), model.config)
    loss = lm_loss_sum(head, vlm.hidden_states(batch), batch.shift_labels) / count
    loss.backward()
    ref_loss, ref_grads = _reference("mllama")
    assert abs(float(loss) - ref_loss) / ref_loss < TOL
    floor = 1e-4 * max(float(g.norm()) for g in ref_grads.values())
    for name, p in model.named_parameters():
        err = float((p.grad - ref_grads[name]).norm()) / max(float(ref_grads[name].norm()), floor)
        assert err < TOL, (name, err)


def _worker(rank: int, world: int, specs: tuple[dict, ...]) -> dict[str, dict]:
    return {f"mllama sp{world} {spec}": _mllama(sp_state(sp=world, kernel="torch", **spec))
            for spec in specs}


def test_sp2_ulysses_and_rings_equal_the_models_own_training() -> None:
    for results in run_distributed(_worker, 2, SPECS[:3], timeout_s=240):
        _check(results)
        assert len(results) == 3


@pytest.mark.slow  # the llama3 ring on contiguous slices and the P2P ring
def test_sp2_more_rings_equal_the_models_own_training() -> None:
    for results in run_distributed(_worker, 2, SPECS[3:], timeout_s=240):
        _check(results)
        assert len(results) == 2


def _worker4(rank: int, world: int) -> dict[str, dict]:
    state = sp_state(sp=4, kernel="torch", mode="hybrid", ulysses_degree=2)
    return {"mllama sp4 hybrid": _mllama(state)}


@pytest.mark.slow  # four ranks: one encodes no image (a blank tower call)
def test_sp4_hybrid_equals_the_models_own_training() -> None:
    for results in run_distributed(_worker4, 4, timeout_s=300):
        _check(results)


def test_cross_attention_never_goes_through_the_causal_sp_attention() -> None:
    """The cross-attention layer's call reaches parallel/cross_attention.py with its image
    keys (not a causal strategy), and outside the rebuilt forward (no image context on the
    metadata) it is refused instead of attending as self-attention would."""
    from longctx_cli.parallel.attention import longctx_attention_forward
    from longctx_cli.parallel.sharding import shard_batch
    from tests.vlm_models import tiny_vlm

    model = tiny_vlm("mllama", "eager")
    layer = model.model.language_model.layers[1].cross_attn
    state = sp_state(sp=1, kernel="torch")
    meta = shard_batch(torch.arange(8), torch.arange(8), torch.arange(8), state).sp_meta
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 20, 16)
    mask = torch.ones(1, 1, 8, 20, dtype=torch.bool)
    with pytest.raises(ValueError, match="image context"):
        longctx_attention_forward(layer, q, k, k, mask, sp_meta=meta)
    meta.cross_rows = torch.tensor([1.0] * 4 + [0.0] * 4)
    out, _ = longctx_attention_forward(layer, q, k, k, mask, sp_meta=meta)
    assert meta.attention_calls == 0  # not counted as SP attention
    ref = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * layer.scaling, -1)
    ref = (ref @ k.repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(out[:, :4], ref[:, :4], rtol=1e-5, atol=1e-6)
    assert float(out[:, 4:].abs().max()) == 0


# ---- data-parallel ranks whose rows differ in images ----------------------------------------


def _dp_worker(rank: int, world: int) -> dict:
    """FSDP2 over 2 ranks: rank 0's row holds images, rank 1's is the text-only document.
    Both call the tower and the cross-attention layer (rank 1 on a blank image, its output
    zeroed), so FSDP2's collective gathers of their weights match: no hang."""
    from longctx_cli.config import config_from_dict
    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.layout import Layout
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from tests.vlm_models import _config, image_row

    state = build_parallel_state(Layout(dp_replicate=1, dp_shard=2, fsdp=True, kernel="torch"))
    config = config_from_dict({
        "model_config": _config("mllama").to_dict(), "seed": 0, "dtype": "float32",
        "sequence_len": 128, "fsdp": True, "processor_type": "AutoProcessor",
        "datasets": [{"path": "unused.jsonl", "type": "chat_template"}]})
    model = build_model(config, state)
    decoder, head = decoder_and_head(model, images=True)
    ids, pos, labels, images, docs = image_row("mllama")
    if rank == 1:
        ids, labels, _ = docs[1]
        pos, images = torch.arange(len(ids)), None
    batch = decoder.shard(ids, pos, labels, images, state)
    hidden = decoder.hidden_states(batch)
    (lm_loss_sum(head, hidden, batch.shift_labels) / 50).backward()
    cross = [p for n, p in model.named_parameters() if "cross_attn" in n]
    return {"grads": all(p.grad is not None for p in cross),
            "targets": int((batch.shift_labels != IGNORE_INDEX).sum())}


@pytest.mark.slow  # ~16 s: FSDP2 over two ranks
def test_fsdp_ranks_with_and_without_images_run_the_same_layers() -> None:
    ranks = run_distributed(_dp_worker, 2, timeout_s=240)  # a hang fails by the timeout
    assert all(r["grads"] and r["targets"] > 0 for r in ranks), ranks


# ---- the run's own build: LoRA on the self- and cross-attention layers ----------------------


def _lora_compare(state) -> dict:
    """The run's own model (`adapter: lora` with the Axolotl example's regex targets: every
    projection of the text model's layers, its cross attention's too) against peft's LoRA on
    the model's own forward, each document of the row."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from longctx_cli.config import config_from_dict
    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from tests.vlm_models import _config, image_row, own_vlm_step, tiny_vlm

    config = config_from_dict({
        "model_config": _config("mllama").to_dict(), "seed": 0, "dtype": "float32",
        "sequence_len": 64, "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
        "lora_target_modules": TARGETS, "processor_type": "AutoProcessor",
        "datasets": [{"path": "unused.jsonl", "type": "chat_template"}],
        "sequence_parallel_degree": state.layout.sp})
    ours = build_model(config, state)
    with torch.no_grad():  # the reference's gates (tiny_vlm opens them; build_model does not)
        reference = tiny_vlm("mllama", "eager")
        for name, p in ours.named_parameters():
            if name.endswith(("gate", "gate_attn", "gate_ffn")):
                p.copy_(dict(reference.named_parameters())[name.replace("base_model.model.", "")])
    decoder, head = decoder_and_head(ours, images=True)
    ids, pos, labels, images, docs = image_row("mllama")
    batch = decoder.shard(ids, pos, labels, images, state)
    count = sum(int((d_labels[1:] != IGNORE_INDEX).sum()) for _, d_labels, _ in docs)
    (lm_loss_sum(head, decoder.hidden_states(batch), batch.shift_labels) / count).backward()
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                     task_type="CAUSAL_LM"))
    reference.load_state_dict(ours.state_dict())
    own_vlm_step(reference, docs)
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    ref = dict(reference.named_parameters())
    assert trained.keys() == {n for n, p in ref.items() if p.requires_grad}
    errors = {}
    for name, p in trained.items():
        g = p.grad.clone()
        if state.layout.sp > 1:
            dist.all_reduce(g, group=state.sp_group)
        errors[name] = float((g - ref[name].grad).norm()) / max(float(ref[name].grad.norm()),
                                                                1e-8)
    cross_b = [n for n in trained if "cross_attn" in n and "lora_B" in n]
    return {"grad": max(errors.values()), "cross_lora_b": len(cross_b),
            "cross_b_norm": min(float(ref[n].grad.norm()) for n in cross_b)}


def _lora_worker(rank: int, world: int) -> dict:
    return _lora_compare(sp_state(sp=world, kernel="torch", mode="ulysses"))


@pytest.mark.slow  # ~30 s on two ranks; LoRA with the VLM path runs by default elsewhere
def test_lora_on_self_and_cross_attention_equals_peft_on_the_models_own_training() -> None:
    for r in run_distributed(_lora_worker, 2, timeout_s=240):
        assert r["grad"] < TOL and r["cross_lora_b"] == 4 and r["cross_b_norm"] > 0, r


# ---- `longctx validate` on Axolotl's Llama 3.2 Vision example -------------------------------

# examples/llama-3-vision/lora-11b.yaml of Axolotl, its model a tiny Llama 3.2 Vision config
# (the hub model is not read here) and its dataset a local file, over sp 2.
AXOLOTL_EXAMPLE = """\
processor_type: AutoProcessor
skip_prepare_dataset: true
remove_unused_columns: false
sample_packing: false
chat_template: llama3_2_vision
datasets:
  - path: {data}
    type: chat_template
val_set_size: 0.0
output_dir: {out}
adapter: lora
sequence_len: 8192
pad_to_sequence_len: false
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
gradient_accumulation_steps: 4
micro_batch_size: 1
num_epochs: 1
optimizer: adamw_bnb_8bit
lr_scheduler: cosine
learning_rate: 0.0002
bf16: true
tf32: true
gradient_checkpointing: true
logging_steps: 1
attn_implementation: sdpa
warmup_ratio: 0.1
weight_decay: 0.0
sequence_parallel_degree: 2
"""
# Its LoRA targets: the text model's self- and cross-attention projections and MLPs.
TARGETS = (r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn)."
           r"(up|down|gate|q|k|v|o)_proj")


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_validate_says_axolotls_example_is_valid(tmp_path, mode: str) -> None:
    import json

    import yaml
    from typer.testing import CliRunner

    from longctx_cli.cli import app
    from tests.vlm_fixtures import make_image, write_tiny_mllama_processor
    from tests.vlm_models import _config

    data = tmp_path / "chats.jsonl"  # llava-instruct-mix-vsft's layout: an `images` column
    make_image(tmp_path, "img/a.png", (40, 24), 0)
    data.write_text(json.dumps({"images": ["img/a.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}) + "\n")
    config = yaml.safe_load(AXOLOTL_EXAMPLE.format(data=data, out=tmp_path / "out"))
    config.update(model_config=_config("mllama").to_dict(), sequence_parallel_mode=mode,
                  lora_target_modules=TARGETS,
                  processor_path=str(write_tiny_mllama_processor(tmp_path / "processor")))
    path = tmp_path / "lora-11b.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", "2"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "valid" in text and "fidelity probe" in text.lower(), text
