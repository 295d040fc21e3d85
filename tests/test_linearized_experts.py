"""`llama4_linearized_experts`: Llama 4's fused experts as one linear per expert and
projection (runtime/experts.py). A tiny Llama 4 text model (the family matrix's), linearized
and trained by longctx under SP 2 (a ring and Ulysses, gloo), equals the *unlinearized*
model's own Hugging Face training on the same tokens (tests/own_training.py): the losses of
every step, and the final weights (AdamW's steps on the gradients) mapped back to the fused
layout. A full export loads in plain transformers and gives the trained model's logits;
QLoRA quantizes the expert linears, which compute the model's own experts on the dequantized
weights; merge-lora writes a plain model; and the key is refused where it cannot apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import family_matrix as fm
from tests.distributed import run_distributed

FAMILY = next(f for f in fm.FAMILIES if f.name == "llama4_text")
ON = {"llama4_linearized_experts": True}
COLUMNS = ["ring sp2", "Ulysses sp2"]


def _fused(weights: dict) -> dict:
    """A run's final weights (numpy) with the linearized experts mapped back."""
    from longctx_cli.runtime.experts import fused_expert_state

    state = fused_expert_state({k: torch.from_numpy(v) for k, v in weights.items()})
    return {k: v.numpy() for k, v in state.items()}


def _worker(rank: int, world: int) -> dict:
    out = {c: fm.longctx_training(FAMILY, {**fm.COLUMN[c].settings, **ON}) for c in COLUMNS}
    if rank == 0:
        out["reference"] = fm.reference_training(FAMILY)  # the fused model's own training
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_worker, 2, timeout_s=600)[0]


@pytest.mark.parametrize("column", COLUMNS)
def test_linearized_sp2_equals_the_fused_models_own_training(runs, column):
    run = runs[column]
    assert "refused" not in run, run.get("refused")
    assert any(".experts.gate_projs.3." in k for k in run["weights"])  # it was linearized
    fused = {**run, "weights": _fused(run["weights"])}
    assert sorted(fused["weights"]) == sorted(runs["reference"]["weights"])
    cell = fm.compare(fused, runs["reference"])
    assert cell["loss"] < fm.LOSS_TOL and cell["weights"] < fm.WEIGHT_TOL, cell
    from longctx_cli.runtime.model import load_base_model

    start = dict(load_base_model(fm.make_config(FAMILY), "eager").named_parameters())
    for name in ("model.layers.0.feed_forward.experts.gate_up_proj",
                 "model.layers.1.feed_forward.experts.down_proj"):  # the experts trained
        moved = fused["weights"][name] - start[name].detach().double().numpy()
        assert abs(moved).max() > 1e-4, name


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own forward (eager attention: longctx's SP attention needs a batch)."""
    from longctx_cli.runtime.model import unwrap

    unwrap(model).set_attn_implementation("eager")
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


def _perturb_experts(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_projs." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))


def test_full_export_loads_in_plain_transformers(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from longctx_cli.data.tokenizer import byte_tokenizer
    from longctx_cli.runtime.model import build_model
    from longctx_cli.train.checkpoint_files import export_final

    model = build_model(fm.make_config(FAMILY, ON))
    _perturb_experts(model)  # stands for training: the export must carry these weights
    model.eval()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    export_final(model, byte_tokenizer(), tmp_path / "final", False)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32,
                                                 attn_implementation="eager")
    assert any(n.endswith("experts.gate_up_proj") for n, _ in plain.named_parameters())
    assert torch.allclose(_logits(plain, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("adapter", [{"adapter": "lora"},
                                     {"adapter": "qlora", "load_in_4bit": True}])
def test_merge_lora_on_expert_linears_writes_a_plain_model(tmp_path: Path, adapter: dict):
    """QLoRA: merged into the dequantized 4-bit experts, what the adapter trained against."""
    from transformers import AutoModelForCausalLM

    from longctx_cli.data.tokenizer import byte_tokenizer
    from longctx_cli.eval.merge import merge_lora
    from longctx_cli.runtime.model import build_model, load_base_model
    from longctx_cli.train.checkpoint_files import export_final

    if adapter["adapter"] == "qlora":
        pytest.importorskip("bitsandbytes")
    lora = {**adapter, "lora_r": 4, "lora_alpha": 8, "tokenizer": "byte",
            "lora_target_modules": ["q_proj", *(f"{proj}_projs.{e}" for e in range(4)
                                                for proj in ("gate", "up", "down"))]}
    config = fm.make_config(FAMILY, {**ON, **lora})
    model = build_model(config)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a fresh adapter is a no-op; make it matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    assert any("_projs.2.lora_B" in n for n, _ in model.named_parameters())
    model.eval()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    base = load_base_model(config, "eager", quantize=False)
    assert (_logits(base, ids) - want).abs().max() > 1e-3  # the adapter changes the output
    export_final(model, byte_tokenizer(), tmp_path / "final", True,
                 lambda d: load_base_model(config, "sdpa", quantize=False).save_pretrained(d))
    merged = merge_lora(config, tmp_path / "final", tmp_path / "merged", say=lambda _: None)
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32,
                                                 attn_implementation="eager")
    assert torch.allclose(_logits(plain, ids), want, atol=1e-5, rtol=1e-5)
    if adapter["adapter"] == "lora":  # `longctx eval` loads the adapter on a linearized base
        from longctx_cli.eval.checkpoint_loading import load_for_eval

        loaded = load_for_eval(config, tmp_path / "final")
        assert torch.allclose(_logits(loaded, ids), want, atol=1e-5, rtol=1e-5)


def test_qlora_quantizes_the_expert_linears_exactly():
    """Each expert linear is a 4-bit layer of the run's settings, and the experts compute
    transformers' own fused experts on the dequantized weights."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Linear4bit
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from longctx_cli.runtime.experts import LinearizedExperts, fused_expert_state
    from longctx_cli.runtime.model import build_model

    config = fm.make_config(FAMILY, {**ON, "adapter": "qlora", "load_in_4bit": True,
                                     "lora_r": 4, "lora_alpha": 8,
                                     "lora_target_modules": ["q_proj"]})
    model = build_model(config)
    experts = [m for m in model.modules() if isinstance(m, LinearizedExperts)]
    assert len(experts) == 2
    for module in experts:
        linears = [*module.gate_projs, *module.up_projs, *module.down_projs]
        assert all(isinstance(m, Linear4bit) and m.weight.quant_state.quant_type == "nf4"
                   for m in linears)
        state = fused_expert_state({
            f"x.{kind}_projs.{e}.weight": dequantize_4bit(linear.weight.data,
                                                          linear.weight.quant_state)
            for kind, projs in (("gate", module.gate_projs), ("up", module.up_projs),
                                ("down", module.down_projs))
            for e, linear in enumerate(projs)})
        own = Llama4TextExperts(model.base_model.model.config)
        own.load_state_dict({"gate_up_proj": state["x.gate_up_proj"],
                             "down_proj": state["x.down_proj"]})
        rows = torch.randn(module.num_experts * 5, module.hidden_size,
                           generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            assert torch.allclose(module(rows), own(rows), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides, where, says", [
    ({}, "llama4_linearized_experts", "has no fused experts"),
    ({"adapter": "lora", "load_in_8bit": True, "lora_r": 4, "lora_alpha": 8,
      "lora_target_modules": ["q_proj"]}, "load_in_8bit", "in 4 bits only"),
    ({"adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True, "lora_r": 4,
      "lora_alpha": 8, "lora_target_modules": ["q_proj"]}, "quantize_moe_experts",
     "no longer exist once they are linearized"),
])
def test_refused_where_it_cannot_apply(overrides, where, says):
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.errors import UserError

    family = FAMILY if where != "llama4_linearized_experts" else next(
        f for f in fm.FAMILIES if f.name == "llama")
    config = fm.make_config(family, {**ON, **overrides})
    with pytest.raises(UserError) as e:
        build_plan(config, 1, read_model_config(config))
    assert e.value.where == where and says in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_saved_linearized_is_refused_not_loaded_with_random_experts(
        tmp_path: Path):
    """Axolotl's `...-Linearized-...` checkpoints: transformers would leave the experts at
    their random initialisation."""
    from longctx_cli.config.sections.model import check_linearized_checkpoint
    from longctx_cli.data.tokenizer import byte_tokenizer
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import preflight
    from longctx_cli.runtime.experts import linearize_experts
    from longctx_cli.runtime.model import build_model, load_base_model

    model = load_base_model(fm.make_config(FAMILY), "eager")
    linearize_experts(model)
    model.save_pretrained(tmp_path / "linearized")  # the linear layers' own names
    byte_tokenizer().save_pretrained(tmp_path / "linearized")
    config = fm.make_config(FAMILY, ON).model_copy(deep=True)
    config.model.base_model, config.model.model_config_dict = str(tmp_path / "linearized"), None
    for refuse in (build_model, preflight):  # the loader, and validate where it can read it
        with pytest.raises(UserError) as e:
            refuse(config)
        assert e.value.where == "base_model" and ".experts.down_projs.0.weight" in str(e.value)
        assert "delinearize-llama4" in e.value.fix and "\n" not in str(e.value)
    (tmp_path / "plain").mkdir()
    load_base_model(fm.make_config(FAMILY), "eager").save_pretrained(tmp_path / "plain")
    config.model.base_model = str(tmp_path / "plain")
    check_linearized_checkpoint(config.model.base_model)  # the model's own layout passes


def test_lora_may_target_the_expert_linears_of_a_linearized_model():
    """validate's LoRA target check knows the linears training makes (and only then)."""
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import check_lora_targets

    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8,
            "lora_target_modules": ["q_proj", "gate_projs.3", "down_projs.0"]}
    check_lora_targets(fm.make_config(FAMILY, {**ON, **lora}))
    with pytest.raises(UserError) as e:
        check_lora_targets(fm.make_config(FAMILY, lora))
    assert e.value.where == "lora_target_modules" and "'gate_projs.3'" in str(e.value)


def test_lora_target_parameters_of_the_fused_experts_are_refused_once_linearized():
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import check_lora_parameters

    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj"],
            "lora_target_parameters": ["feed_forward.experts.gate_up_proj"]}
    check_lora_parameters(fm.make_config(FAMILY, lora))  # the fused model has them
    with pytest.raises(UserError) as e:
        check_lora_parameters(fm.make_config(FAMILY, {**ON, **lora}))
    assert e.value.where == "lora_target_parameters"


def test_the_fidelity_probe_runs_the_linearized_experts():
    """The probe (every run's start, and validate) compares longctx's linearized side with
    the model's own fused forward, gradients mapped back; remembered apart from a plain pass."""
    from transformers import AutoConfig

    from longctx_cli.checks.fidelity import run_probe, verdict_path

    config = AutoConfig.for_model("llama4_text")
    result = run_probe(config, linearized=True)
    assert result.summary().startswith("passed") and "experts linearized" in result.features
    assert result.gradients_checked == run_probe(config).gradients_checked  # every one
    assert verdict_path(config, linearized=True) != verdict_path(config)


def test_axolotl_key_is_the_model_sections_own():
    from longctx_cli.config import Config

    config = Config(base_model="unused", datasets=[{"path": "unused"}], **ON)
    assert config.model.llama4_linearized_experts


@pytest.mark.slow  # the CLI end to end: two `longctx train` runs (about a minute)
def test_longctx_train_fsdp_sp2_linearized_equals_the_fused_run(tmp_path: Path):
    """`longctx train` with FSDP2 at sp 2, linearized, equals the fused model's sp 1 run (the
    family matrix holds that one exact against the model's own training), and its final/
    loads in plain transformers with the fused experts."""
    from transformers import AutoModelForCausalLM

    from tests.train_helpers import assert_same_run, train, write_config, write_documents

    model = {**FAMILY.config(), "vocab_size": 260}  # the byte tokenizer's vocabulary
    data = write_documents(tmp_path / "docs.jsonl")
    common = {"model_config": model, "max_steps": 3, "eval_steps": 3}
    train(write_config(tmp_path, "fused", data, **common), 1)
    train(write_config(tmp_path, "linear", data, **common, **ON, fsdp=True,
                       sequence_parallel_degree=2), 2)
    assert_same_run(tmp_path / "linear", tmp_path / "fused", tol=1e-5, weight_tol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "linear" / "final")
    assert any(n.endswith("experts.gate_up_proj") for n, _ in plain.named_parameters())
