"""The model's head and the fidelity probe.

The head must equal what each family's own `forward` returns as logits; the probe must pass
a family longctx computes exactly and refuse, naming the model type and what differs, a family
whose head or attention does something longctx does not reproduce. The altered families below
are defined here, so no list inside longctx can know them: only the probe's comparison can.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama import modeling_llama

from longctx_cli.checks.fidelity import TOLERANCE, check_fidelity, run_probe, shrink_config
from longctx_cli.config import Config
from longctx_cli.errors import UserError
from longctx_cli.runtime.head import LogitTransform
from longctx_cli.runtime.model import decoder_and_head

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
    "initializer_range": 0.2,
}


# ---- altered families, unknown to longctx -------------------------------------------------


class GainHeadConfig(LlamaConfig):
    model_type = "probe_gain_head"


class GainHeadForCausalLM(LlamaForCausalLM):
    """Llama whose forward multiplies the logits by `config.output_gain` after lm_head."""

    config_class = GainHeadConfig

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden) * self.config.output_gain
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class TemperatureAttnConfig(LlamaConfig):
    model_type = "probe_temperature_attn"


def temperature_eager(module, query, key, value, attention_mask, scaling, dropout=0.0,
                      **kwargs):
    """The family's own eager attention: scores divided by a temperature it reads from the
    module, not from an argument, so no other attention implementation is told about it."""
    return modeling_llama.eager_attention_forward(
        module, query, key, value, attention_mask,
        scaling=scaling / module.config.attention_temperature, dropout=dropout,
    )


class TemperatureAttention(modeling_llama.LlamaAttention):
    """Only the family's own eager attention knows the temperature: an implementation that
    follows the standard signature computes a different model, and nothing says so.
    (A feature passed as an unknown keyword is refused by the attention entry point itself.)"""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        impl = self.config._attn_implementation
        fn = temperature_eager if impl == "eager" else modeling_llama.ALL_ATTENTION_FUNCTIONS[impl]
        out, weights = fn(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0,
                          **kwargs)
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(out), weights


class TemperatureAttnForCausalLM(LlamaForCausalLM):
    config_class = TemperatureAttnConfig

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = TemperatureAttention(config, i)
        self.post_init()


class NeedsWideConfig(LlamaConfig):
    model_type = "probe_needs_wide"


class NeedsWideForCausalLM(LlamaForCausalLM):
    """A family whose model cannot be built narrow (as if its kernels were sized for wide
    layers): the probe's tiny copy of it fails in the model's own code, before anything of
    longctx runs."""

    config_class = NeedsWideConfig

    def __init__(self, config):
        if config.hidden_size < 256:
            raise ValueError(f"hidden_size {config.hidden_size} < 256 is not supported")
        super().__init__(config)


AutoConfig.register(NeedsWideConfig.model_type, NeedsWideConfig)
AutoModelForCausalLM.register(NeedsWideConfig, NeedsWideForCausalLM)
AutoConfig.register(GainHeadConfig.model_type, GainHeadConfig)
AutoModelForCausalLM.register(GainHeadConfig, GainHeadForCausalLM)
AutoConfig.register(TemperatureAttnConfig.model_type, TemperatureAttnConfig)
AutoModelForCausalLM.register(TemperatureAttnConfig, TemperatureAttnForCausalLM)


# ---- the head -----------------------------------------------------------------------------

HEAD_CASES = {
    "granite": {"logits_scaling": 4.0},
    "cohere": {"logit_scale": 0.25},
    "gemma2": {"final_logit_softcapping": 0.5, "attn_logit_softcapping": None,
               "layer_types": ["full_attention"] * 2},
    "llama": {},
}


@pytest.mark.parametrize("model_type", list(HEAD_CASES))
def test_head_equals_the_models_own_logits(model_type: str) -> None:
    config = AutoConfig.for_model(model_type, **TINY, **HEAD_CASES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    ids = torch.randint(0, 128, (1, 24))
    decoder, head = decoder_and_head(model)
    ours = head(decoder(input_ids=ids).last_hidden_state[0])
    theirs = model(input_ids=ids).logits[0].float()
    plain = model.lm_head(decoder(input_ids=ids).last_hidden_state[0])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    transform = LogitTransform.from_config(config)
    # The transform is active here: lm_head alone would be a different model.
    assert transform.is_identity == (model_type == "llama")
    if not transform.is_identity:
        assert (plain - theirs).abs().max() > 1e-3


# ---- the probe ----------------------------------------------------------------------------


def test_llama_passes_and_leaves_the_rng_alone() -> None:
    state = torch.get_rng_state()
    result = run_probe(AutoConfig.for_model("llama"))
    assert torch.equal(state, torch.get_rng_state())
    assert result.model_type == "llama"
    assert result.loss_rel_error < 1e-5 and result.worst_gradient_rel_error < TOLERANCE
    assert result.gradients_checked >= 10
    assert result.summary().startswith("passed: tiny random `llama`")


@pytest.mark.parametrize("model_type", ["granite", "cohere"])
def test_head_transforms_pass(model_type: str) -> None:
    overrides = {"logits_scaling": 8.0} if model_type == "granite" else {}
    result = run_probe(AutoConfig.for_model(model_type, **overrides))
    assert any(f.startswith("head:") for f in result.features), result.features
    assert result.loss_rel_error < 1e-5


def test_gemma2_final_softcap_alone_passes() -> None:
    config = AutoConfig.for_model("gemma2", attn_logit_softcapping=None, num_hidden_layers=2,
                                  layer_types=["full_attention"] * 2)
    result = run_probe(config)
    assert "head: final softcap 1" in result.features


def test_an_unknown_logit_transform_is_refused() -> None:
    config = GainHeadConfig(**TINY, output_gain=3.0)
    with pytest.raises(UserError) as err:
        run_probe(config)
    message = str(err.value)
    assert "`probe_gain_head`" in message
    assert "the logits differ" in message and "after lm_head" in message
    assert "Fix:" in message and "fidelity_probe: false" in message


def test_an_unknown_attention_feature_is_refused() -> None:
    config = TemperatureAttnConfig(**TINY, attention_temperature=0.5)
    with pytest.raises(UserError) as err:
        run_probe(config)
    message = str(err.value)
    assert "`probe_temperature_attn`" in message
    assert "hidden states already differ" in message
    assert "gradient of `model." in message


def test_the_same_families_without_the_alteration_pass() -> None:
    # The refusals above come from the alterations, not from the custom classes themselves.
    run_probe(GainHeadConfig(**TINY, output_gain=1.0))
    run_probe(TemperatureAttnConfig(**TINY, attention_temperature=1.0))


def _assert_unchecked(message: str, model_type: str, gist: str) -> None:
    """The probe says it could not check (naming its own step and the exception's gist) and
    how to go on; it does not claim the model or longctx's attention differs."""
    assert f"could not check model type `{model_type}`" in message, message
    assert gist in message, message
    assert "not a finding about the model" in message
    assert "different model" not in message and "refuses model type" not in message
    assert "Fix: set `fidelity_probe: false`" in message
    assert "\n" not in message  # one paragraph


def test_a_config_that_cannot_be_shrunk_is_unchecked_not_passed() -> None:
    config = AutoConfig.for_model("rwkv")  # no attention heads to shrink
    with pytest.raises(UserError) as err:
        run_probe(config)
    _assert_unchecked(str(err.value), "rwkv", "longctx's own shrinking of the config")
    assert "no num_attention_heads" in str(err.value)  # the exception's one-line gist


def test_a_family_whose_tiny_copy_fails_is_unchecked_not_blamed() -> None:
    config = NeedsWideConfig(**{**TINY, "hidden_size": 512, "num_attention_heads": 8,
                                "head_dim": 64})
    AutoModelForCausalLM.from_config(config)  # the family itself builds at its own size
    with pytest.raises(UserError) as err:
        run_probe(config)
    message = str(err.value)
    _assert_unchecked(message, "probe_needs_wide", "longctx's tiny copy of it")
    assert "in the model's own eager forward, the reference" in message
    assert re.search(r"\(ValueError: hidden_size \d+ < 256 is not supported\)", message)
    assert message.startswith("fidelity_probe: ")
    off = {"model_type": "probe_needs_wide", **TINY, "hidden_size": 512,
           "num_attention_heads": 8, "head_dim": 64}
    assert check_fidelity(Config(model_config=off, datasets=[{"path": "x"}],
                                 fidelity_probe=False)).startswith("skipped")


def test_latent_attention_and_chunked_attention_families_pass() -> None:
    # Full-size default configs: the probe shrinks them into valid tiny models itself.
    deepseek = run_probe(AutoConfig.for_model("deepseek_v3"))
    assert any(f.startswith("latent attention (q/k head dim 48, v head dim 32)")
               for f in deepseek.features), deepseek.features
    llama4 = run_probe(AutoConfig.for_model("llama4_text"))
    assert "chunked attention 6 on 3/4 layers" in llama4.features, llama4.features


@pytest.mark.parametrize(("model_type", "fields"), [
    # LFM2-1.2B's pattern: short causal convolutions, then attention (the class's default
    # config has attention layers only).
    ("lfm2", {"full_attn_idxs": [2, 5, 8, 10, 12, 14]}),
    ("qwen3_next", {}),  # gated delta-net
    ("falcon_h1", {}),  # Mamba2 beside attention in every layer
    # Bamba-9B's pattern: attention at three layers, Mamba2 elsewhere (the probe keeps one
    # attention layer after a Mamba2 layer).
    ("bamba", {"attn_layer_indices": [9, 18, 27]}),
    # Nemotron-H's default pattern (Mamba2, MLP and attention blocks; the layer count is the
    # pattern's length, not a config field).
    ("nemotron_h", {}),
    # Zamba2: its hybrid layers wrap a Mamba2 decoder layer (covered) beside the shared
    # attention block.
    ("zamba2", {}),
    # The twins of the layers above in newer families: Qwen3.5's gated delta-net (its
    # checkpoints' multimodal config; the causal LM is built from the text config inside),
    # Kimi Linear's delta attention (beside latent attention), LaRA-mini's gated delta-net,
    # LFM3's and LFM2-MoE's short convolutions.
    ("qwen3_5", {}),
    # Qwen3.5-MoE: its delta-net gradients pass within the model's own float noise.
    ("qwen3_5_moe", {}),
    # Kimi Linear is a family-matrix row too; its defaults' probe is a slow extra (35 s).
    pytest.param("kimi_linear", {}, marks=pytest.mark.slow),
    ("lara_mini", {}),
    ("lfm3", {}),
    ("lfm2_moe", {"layer_types": ["conv", "full_attention", "conv", "full_attention"],
                  "num_hidden_layers": 4}),
    # Jamba's pattern: attention every 8 layers at offset 4, experts every 2 (its Mamba
    # takes no starting state: document prefixes on every sharding).
    ("jamba", {}),
    # No attention layer at all: Mamba2's scans, Mamba's and Falcon-Mamba's selective scans.
    ("mamba", {}),
    ("mamba2", {}),
    ("falcon_mamba", {}),
])
def test_covered_hybrid_families_pass_on_packed_rows(model_type: str, fields: dict) -> None:
    # The model's own forward over a packed row would run its scans and convolutions across
    # documents; longctx runs them per document (parallel/token_mixing.py) and matches the
    # model's own per-document training.
    result = run_probe(AutoConfig.for_model(model_type, **fields))
    assert result.loss_rel_error < 1e-5, result
    # Within the tolerance, or (Qwen3.5-MoE) within 3x the model's own float noise.
    assert result.worst_gradient_rel_error < 1e-4 or (
        result.own_noise is not None
        and result.worst_gradient_rel_error <= 3 * result.own_noise), result


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_models_own_noise_is_tight_without_noisy_kernels(model_type: str) -> None:
    # The allowance for gradients within the model's own float noise measures that noise as
    # the model's own padded-batch training against its per-document training. For a plain
    # attention model the two agree closely, so the allowance stays shut where no kernel
    # is noisy.
    from longctx_cli.checks import fidelity

    tiny = fidelity.shrink_config(AutoConfig.for_model(model_type))
    ids, _, _ = fidelity._probe_row()
    reference = fidelity._build(tiny, "eager", False)
    fidelity._reference(reference, ids)[0].backward()
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    own = fidelity._own_padded_batch_errors(reference, tiny, ids,
                                            fidelity.gradient_floor(grads), False)
    assert own is not None and len(own) == sum(
        p.grad is not None for p in reference.parameters())
    assert max(own.values()) < 1e-5, max(own.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize(("model_type", "part"), [
    ("recurrent_gemma", "`temporal_block` (RecurrentGemmaRecurrentBlock)"),  # RG-LRU
    ("minimax", "`self_attn` (MiniMaxLightningAttention)"),  # lightning (linear) attention
])
def test_uncovered_hybrid_families_are_refused_naming_the_layer(model_type: str,
                                                                part: str) -> None:
    with pytest.raises(UserError) as err:
        run_probe(AutoConfig.for_model(model_type))
    message = " ".join(str(err.value).split())
    assert f"mix tokens outside attention: {part} in layer" in message, message
    assert "Lfm2ShortConv" in message and "Fix:" in message  # what longctx does cover


def test_shrink_keeps_latent_attention_ratios_and_both_layer_kinds() -> None:
    config = AutoConfig.for_model("deepseek_v3")  # q/k 128 + 64, v 128; 256 experts, 8 groups
    tiny = shrink_config(config)
    ratio = config.qk_nope_head_dim / tiny.qk_nope_head_dim
    assert config.qk_rope_head_dim / tiny.qk_rope_head_dim == ratio
    assert config.v_head_dim / tiny.v_head_dim == ratio
    assert config.q_lora_rank / tiny.q_lora_rank == config.kv_lora_rank / tiny.kv_lora_rank
    assert tiny.head_dim == tiny.qk_rope_head_dim  # the family's own rule, kept
    assert tiny.n_routed_experts % tiny.n_group == 0
    assert tiny.n_routed_experts // tiny.n_group >= 2  # each group is scored by its top two
    assert 1 <= tiny.topk_group < tiny.n_group  # group-limited routing stays active
    assert 0 < tiny.first_k_dense_replace < tiny.num_hidden_layers  # dense and MoE layers


def test_shrink_keeps_layer_types_gqa_and_makes_windows_active() -> None:
    config = AutoConfig.for_model("gemma3_text")
    tiny = shrink_config(config)
    assert tiny.layer_types == config.layer_types[:6]  # the first full layer is the sixth
    assert tiny.num_hidden_layers == 6
    assert tiny.sliding_window < 13  # shorter than the probe's documents
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    assert tiny.vocab_size == 128 and tiny.hidden_size <= 128
    qwen = shrink_config(AutoConfig.for_model("qwen2", num_attention_heads=28,
                                              num_key_value_heads=4, hidden_size=3584))
    assert (qwen.num_attention_heads, qwen.num_key_value_heads) == (8, 2)


def test_shrinking_a_multimodal_config_fits_its_towers_and_mrope() -> None:
    from longctx_cli.checks.fidelity import PROBE_HEAD_DIM, shrink_vision_config

    qwen = shrink_vision_config(AutoConfig.for_model("qwen2_5_vl"))  # no mrope_section named
    assert sum(qwen.text_config.rope_parameters["mrope_section"]) == PROBE_HEAD_DIM // 2
    assert qwen.vision_config.out_hidden_size == qwen.text_config.hidden_size
    qwen2 = shrink_vision_config(AutoConfig.for_model("qwen2_vl"))  # its merger: hidden_size
    assert qwen2.vision_config.hidden_size == qwen2.text_config.hidden_size
    # GLM-4.6V-Flash rotates half of each head: its sections fill that half's half.
    glm = shrink_vision_config(AutoConfig.for_model("glm46v", text_config={"rope_parameters": {
        "rope_type": "default", "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5}}))
    assert sum(glm.text_config.rope_parameters["mrope_section"]) == PROBE_HEAD_DIM // 4
    bare = shrink_vision_config(AutoConfig.for_model("gemma4"), images=False)  # no towers
    assert bare.vision_config is None and bare.text_config.vocab_size == 128
    assert bare.image_token_id >= 128  # a text probe's random ids never name an image


def test_mistral3_vision_probe_passes_with_images_of_their_own_size() -> None:
    """Mistral 3's defaults, shrunk to a two-block Pixtral tower: the probe's row of three
    images of different sizes (each `image_sizes`, merged 2 x 2) through longctx at sp 1
    equals Mistral3ForConditionalGeneration's own training."""
    from transformers import Mistral3Config

    from longctx_cli.checks.fidelity import shrink_vision_config

    tiny = shrink_vision_config(Mistral3Config())
    assert tiny.vision_config.num_hidden_layers == 2 and tiny.vision_config.hidden_size == 32
    assert tiny.image_token_id < tiny.text_config.vocab_size
    result = run_probe(Mistral3Config(), images=True)
    assert result.summary().startswith("passed") and "images" in result.summary()
    assert result.loss_rel_error < 1e-4 and result.worst_gradient_rel_error < 1e-4
    assert result.gradients_checked > 40  # the tower's and the patch merger's among them


@pytest.mark.parametrize("bidirectional", ["vision", None])
def test_gemma4_vision_probe_passes_with_positioned_patches(bidirectional: str | None) -> None:
    """Gemma 4's defaults with its tower, shrunk to two blocks pooled 2 x 2: the probe's row
    of three images of their own patch grids (`image_position_ids`), with its images both
    ways on the sliding layers or causal, through longctx at sp 1 equals
    Gemma4ForConditionalGeneration's own training."""
    from transformers.models.gemma4 import configuration_gemma4 as g4

    from longctx_cli.checks.fidelity import shrink_vision_config

    config = AutoConfig.for_model(
        "gemma4", vision_config=g4.Gemma4VisionConfig().to_dict(),
        text_config={"use_bidirectional_attention": bidirectional})
    tiny = shrink_vision_config(config)
    assert tiny.vision_config.num_hidden_layers == 2 and tiny.vision_config.hidden_size == 32
    assert tiny.vision_config.pooling_kernel_size == 2
    assert tiny.image_token_id < tiny.text_config.vocab_size
    result = run_probe(config, images=True)
    assert result.summary().startswith("passed") and "images" in result.summary(), result
    assert result.loss_rel_error < 1e-5, result
    assert result.gradients_checked > 20  # the tower's among them


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_vision_probe_passes_on_its_defaults(model_type: str) -> None:
    # Its delta-nets run per document inside the VLM path too; their float32 chunked scan
    # moves its own gradients (A_log's, and what flows back through it) by ~1e-4 when its
    # batch changes, so a pass may rest on the model's own padded-batch noise.
    from longctx_cli.checks.fidelity import NOISE_CAP, NOISE_FACTOR, shrink_vision_config

    tiny = shrink_vision_config(AutoConfig.for_model(model_type))
    rope = tiny.text_config.rope_parameters  # a quarter-head rotary too small for 3 axes
    assert rope["mrope_section"] == [1, 1, 1] and rope["partial_rotary_factor"] < 1
    result = run_probe(AutoConfig.for_model(model_type), images=True)
    assert "images" in result.summary() and result.loss_rel_error < 1e-5, result
    assert result.worst_gradient_rel_error <= TOLERANCE or (
        result.own_noise is not None
        and result.worst_gradient_rel_error <= min(NOISE_FACTOR * result.own_noise,
                                                   NOISE_CAP)), result
    assert result.gradients_checked > 80  # the tower's, the delta-nets' and the experts'


def test_gemma4_with_its_towers_trains_its_text_exactly() -> None:
    from transformers.models.gemma4 import configuration_gemma4 as g4

    config = AutoConfig.for_model("gemma4", vision_config=g4.Gemma4VisionConfig().to_dict(),
                                  audio_config=g4.Gemma4AudioConfig().to_dict())
    assert run_probe(config).summary().startswith("passed")


def test_gemma3n_is_refused_for_its_timm_tower_naming_its_text_model() -> None:
    with pytest.raises(UserError) as e:
        run_probe(AutoConfig.for_model("gemma3n"))
    assert "timm backbone `mobilenetv5_300m_enc`" in str(e.value)
    assert "`gemma3n_text`" in e.value.fix


def test_trainer_check_respects_the_switch() -> None:
    base = {"model_config": {"model_type": "llama", **TINY}, "datasets": [{"path": "x"}]}
    assert check_fidelity(Config(**base)).startswith("passed")
    off = check_fidelity(Config(**base, fidelity_probe=False))
    assert off.startswith("skipped")
    altered = {"model_type": "probe_gain_head", **TINY, "output_gain": 2.0}
    with pytest.raises(UserError, match="probe_gain_head"):
        check_fidelity(Config(model_config=altered, datasets=[{"path": "x"}]))


# ---- validate -----------------------------------------------------------------------------


def _validate(tmp_path, model_config: dict, **extra):
    import yaml
    from typer.testing import CliRunner

    from longctx_cli.cli import app

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model_config": model_config, "tokenizer": "byte",
                                    "datasets": [{"type": "passkey"}], "sequence_len": 256,
                                    **extra}))
    return CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", "1"])


def test_validate_says_the_probe_passed(tmp_path) -> None:
    result = _validate(tmp_path, {"model_type": "llama", **TINY})
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "fidelity probe" in out and "passed: tiny random `llama`" in out


def test_validate_refuses_an_altered_family(tmp_path) -> None:
    result = _validate(tmp_path, {"model_type": "probe_temperature_attn", **TINY,
                                  "attention_temperature": 0.5})
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "`probe_temperature_attn`" in out and "valid" not in out.replace("invalid", "")
    skipped = _validate(tmp_path, {"model_type": "probe_temperature_attn", **TINY,
                                   "attention_temperature": 0.5}, fidelity_probe=False)
    assert skipped.exit_code == 0, skipped.output
    assert "skipped" in skipped.output


def test_eval_position_loss_applies_the_head() -> None:
    from datasets import Dataset

    from longctx_cli.eval.position_loss import position_loss
    from longctx_cli.parallel.attention import register_sp_attention
    from tests.layouts import rank_state

    config = AutoConfig.for_model("granite", **TINY, logits_scaling=4.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    ours = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("granite", **TINY, logits_scaling=4.0),
        attn_implementation=register_sp_attention())
    ours.load_state_dict(model.state_dict())
    ours.eval()
    docs = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n))
            for n in (9, 14, 7)]
    ids = torch.cat(docs)
    pos = torch.cat([torch.arange(d.numel()) for d in docs])
    labels = torch.where(pos == 0, -100, ids)
    rows = Dataset.from_dict({"input_ids": [ids.tolist()], "position_ids": [pos.tolist()],
                              "labels": [labels.tolist()]})
    decoder, head = decoder_and_head(ours)
    result = position_loss(decoder, head, rows, 32, 1,
                           rank_state(), 0)
    with torch.no_grad():
        want = sum(float(model(input_ids=d[None], labels=d[None]).loss) * (d.numel() - 1)
                   for d in docs) / sum(d.numel() - 1 for d in docs)
    assert abs(result.overall - want) <= 1e-5 * want, (result.overall, want)


def test_a_pass_is_remembered_per_model_config(tmp_path, monkeypatch) -> None:
    """The verdict file is keyed on the model config (and longctx's source and the library
    versions): the same config reads it back, another config probes again, and a failure
    is never written."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = {"model_config": {"model_type": "llama", **TINY}, "datasets": [{"path": "x"}]}
    first = check_fidelity(Config(**base))
    assert first.startswith("passed") and "remembered" not in first
    assert len(list((tmp_path / "longctx" / "fidelity").glob("*.txt"))) == 1
    again = check_fidelity(Config(**base))
    assert again == f"{first}; remembered from an earlier probe of this model config"
    other = {**base, "model_config": {"model_type": "llama", **TINY, "rope_theta": 500.0}}
    assert "remembered" not in check_fidelity(Config(**other))
    altered = {"model_type": "probe_gain_head", **TINY, "output_gain": 2.0}
    for _ in range(2):
        with pytest.raises(UserError, match="probe_gain_head"):
            check_fidelity(Config(model_config=altered, datasets=[{"path": "x"}]))
    assert len(list((tmp_path / "longctx" / "fidelity").glob("*.txt"))) == 2
