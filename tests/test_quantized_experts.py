"""`quantize_moe_experts`: QLoRA whose MoE experts' fused 3-D weights are packed into 4 bits
too (bitsandbytes' `replace_parameter_4bit`, the call Axolotl makes), which the 4-bit linear
layers leave in full precision.

A tiny Qwen3-MoE trained by longctx with it at sp 2 (the P2P stripe default, Ulysses, the
P2P stripe with FSDP2 sharding the packed expert bytes, and with gradient checkpointing;
gloo) has, at every step, the loss and LoRA gradients of the same quantized peft model's
own Hugging Face forward/backward in one process on the same documents (built here with
transformers, bitsandbytes and peft directly, not with longctx's loader), and the same
final LoRA weights. The rounding of the experts matters: the reference with full-precision
experts has a visibly different loss. An 8-bit base holds its experts in int8 with a scale
per row: the same check against transformers + bitsandbytes' own row-wise rounding at sp 2.
Where it cannot run (a full-precision base,
LoRA on the quantized experts, a model without fused experts) it is refused with the
reason."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from tests import family_matrix as fm
from tests.distributed import run_distributed

pytest.importorskip("bitsandbytes")

FAMILY = next(f for f in fm.FAMILIES if f.name == "qwen3_moe")
QLORA = {"adapter": "qlora", "lora_r": 4, "lora_alpha": 8,
         "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
         "quantize_moe_experts": True}
FSDP = "FSDP sp2 (P2P stripe)"
SETTINGS = {**{c: fm.COLUMN[c].settings for c in ("P2P stripe sp2 (default)", "Ulysses sp2")},
            FSDP: {**fm.SP2, "fsdp": True},
            # each layer recomputed in backward, its experts dequantized again
            "P2P stripe sp2, checkpointed": {**fm.SP2, "gradient_checkpointing": True}}
COLUMNS = list(SETTINGS)
GRAD_TOL = 1e-4


def _recording(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[dict]:
    """The gradients the optimizer steps with, per step (after the sum over ranks and
    clipping), by name: recorded by a step pre-hook of the optimizer itself."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    grads: list[dict] = []

    def hook(opt, args, kwargs):
        grads.append({names[id(p)]: _full(p.grad).detach().double().numpy().copy()
                      for group in opt.param_groups for p in group["params"]
                      if p.grad is not None})

    optimizer.register_step_pre_hook(hook)
    return grads


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor of an FSDP2 shard (collective: every rank steps), else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _hf_quantized_peft_model(config, quantize_experts: bool = True) -> torch.nn.Module:
    """The same model as transformers, bitsandbytes and peft build it: the seeded random init
    saved, loaded back 4-bit (NF4, double quantization), each fused expert weight quantized
    with `replace_parameter_4bit`, LoRA on the attention projections. An 8-bit config: loaded
    back 8-bit, each fused expert weight replaced by its bitsandbytes row-wise int8 rounding
    (from float16, as the 8-bit linear layers round), frozen."""
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.nn import Linear4bit
    from bitsandbytes.nn.parametrize import replace_parameter_4bit
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    hf_config = AutoConfig.for_model(**config.model.model_config_dict)
    torch.manual_seed(config.training.seed)
    full = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    eight = config.lora.load_in_8bit
    if eight:
        quant = BitsAndBytesConfig(load_in_8bit=True)
    with tempfile.TemporaryDirectory() as tmp:
        full.save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, quantization_config=quant, device_map={"": "cpu"},
            attn_implementation="eager")
    experts = [n for n, p in model.named_parameters() if p.ndim == 3]
    assert len(experts) == 2 * hf_config.num_hidden_layers, experts  # gate_up_proj, down_proj
    for name in experts if quantize_experts else []:
        module, _, param = name.rpartition(".")
        if eight:
            weight = model.get_parameter(name)
            rows = weight.detach().reshape(-1, weight.shape[-1]).half()
            packed, stats, _ = bnb_functional.int8_vectorwise_quant(rows)
            rounded = bnb_functional.int8_vectorwise_dequant(packed, stats)
            setattr(model.get_submodule(module), param, torch.nn.Parameter(
                rounded.reshape(weight.shape).float(), requires_grad=False))
            continue
        replace_parameter_4bit(model.get_submodule(module), param, compress_statistics=True,
                               quant_type="nf4")
    for module in model.modules():
        if isinstance(module, Linear4bit):  # the kernel training uses (runtime/model.py)
            module.support_avx512bf16_for_cpu = False
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=QLORA["lora_target_modules"],
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora).train()


def _steps() -> list[list[tuple[torch.Tensor, None]]]:
    return [[(d, None) for i in fm.step_rows(step) for d in fm.documents(i) if d.numel() > 1]
            for step in range(fm.STEPS)]


def _reference(base: dict = QLORA) -> dict:
    from longctx_cli.train.optim import make_optimizer
    from tests.own_training import own_training

    config = fm.make_config(FAMILY, base)
    model = _hf_quantized_peft_model(config)
    optimizer = make_optimizer(config, [p for p in model.parameters() if p.requires_grad])
    grads = _recording(optimizer, model)
    run = own_training(model, optimizer, _steps(), config.training.max_grad_norm)
    first = _steps()[0]
    with torch.no_grad():  # the first step's loss with the experts left in float32
        plain = _hf_quantized_peft_model(config, quantize_experts=False)
        targets = sum(d.numel() - 1 for d, _ in first)
        run["unrounded_loss"] = sum(float(plain(input_ids=d[None], labels=d[None]).loss)
                                    * (d.numel() - 1) / targets for d, _ in first)
    return {**run, "grads": grads}


def _longctx(column: str, base: dict = QLORA) -> dict:
    """What `longctx train` runs on this process group (the family matrix's
    `longctx_training`), with the optimizer's gradients recorded."""
    import torch.distributed as dist

    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from longctx_cli.train.optim import make_optimizer
    from longctx_cli.train.step import train_step

    config = fm.make_config(FAMILY, {**SETTINGS[column], **base})
    plan = build_plan(config, dist.get_world_size(), read_model_config(config),
                      platform=Platform(**fm.CPU))
    state = build_parallel_state(plan.layout, torch.device("cpu"))
    model = build_model(config, state)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, params)
    grads = _recording(optimizer, model)
    losses = []
    for step in range(fm.STEPS):
        batches = [shard_batch(*fm.packed_row(i), state, 0) for i in fm.step_rows(step)]
        losses.append(train_step(model, decoder, head, params, optimizer, batches, config,
                                 state, use_fsdp=column == FSDP).loss)
    packed = {f"{name}.{param}": chain.original for name, module in model.named_modules()
              for param, chain in getattr(module, "parametrizations", {}).items()}
    return {"losses": losses, "weights": fm._weights(model), "grads": grads,
            "quantized": sorted(packed),
            "sharded": sorted(n for n, t in packed.items() if hasattr(t, "full_tensor"))}


def _worker(rank: int, world: int) -> dict:
    out = {c: _longctx(c) for c in COLUMNS}
    if rank == 0:
        out["reference"] = _reference()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_worker, 2, timeout_s=600)[0]


def _relative(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    diff = sum(float(np.square(got[k] - want[k]).sum()) for k in want)
    norm = sum(float(np.square(want[k]).sum()) for k in want)
    return (diff / norm) ** 0.5


def test_the_experts_are_quantized_and_their_rounding_matters(runs):
    layers = FAMILY.config()["num_hidden_layers"]
    for column in COLUMNS:
        quantized = runs[column]["quantized"]
        assert len(quantized) == 2 * layers, quantized
        assert all(n.endswith(("experts.gate_up_proj", "experts.down_proj"))
                   for n in quantized), quantized
        # FSDP2 shards the packed bytes (and gathers them for the forward), nothing else does
        assert runs[column]["sharded"] == (quantized if column == FSDP else []), column
    reference = runs["reference"]
    change = abs(reference["unrounded_loss"] - reference["losses"][0]) / reference["losses"][0]
    assert change > 100 * fm.LOSS_TOL, change


@pytest.mark.parametrize("column", COLUMNS)
def test_sp2_has_the_quantized_models_own_loss_and_gradients(runs, column):
    run, reference = runs[column], runs["reference"]
    assert len(run["grads"]) == len(reference["grads"]) == fm.STEPS
    for step in range(fm.STEPS):
        loss = abs(run["losses"][step] - reference["losses"][step]) / reference["losses"][step]
        assert loss < fm.LOSS_TOL, (step, loss)
        assert _relative(run["grads"][step], reference["grads"][step]) < GRAD_TOL, step
    lora = {k: v for k, v in reference["weights"].items() if "lora_" in k}
    assert _relative({k: run["weights"][k] for k in lora}, lora) < fm.WEIGHT_TOL


# ---- where it cannot run ----------------------------------------------------------------


# An 8-bit base (Axolotl's GLM-4.7-Flash LoRA example): the experts in int8 too.
LORA8 = {**QLORA, "adapter": "lora", "load_in_8bit": True}
COLUMNS8 = ["P2P stripe sp2 (default)", "Ulysses sp2"]


def _worker8(rank: int, world: int) -> dict:
    out = {c: _longctx(c, LORA8) for c in COLUMNS8}
    if rank == 0:
        out["reference"] = _reference(LORA8)
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def runs8() -> dict:
    return run_distributed(_worker8, 2, timeout_s=600)[0]


@pytest.mark.parametrize("column", COLUMNS8)
def test_an_8bit_base_has_its_int8_experts_own_loss_and_gradients(runs8, column):
    run, reference = runs8[column], runs8["reference"]
    assert len(run["quantized"]) == 2 * FAMILY.config()["num_hidden_layers"]
    change = abs(reference["unrounded_loss"] - reference["losses"][0]) / reference["losses"][0]
    assert change > 4 * fm.LOSS_TOL, change  # the int8 rounding of the experts shows
    for step in range(fm.STEPS):
        loss = abs(run["losses"][step] - reference["losses"][step]) / reference["losses"][step]
        assert loss < fm.LOSS_TOL, (step, loss)
        assert _relative(run["grads"][step], reference["grads"][step]) < GRAD_TOL, step


def test_qlora_targets_are_checked_as_lora_targets_are():
    """A name that matches no module would be skipped by peft (LoRA on the others only):
    refused for qlora as for lora (Axolotl's GLM-4.7-Flash examples name `k_proj`, `v_proj`
    of a model whose attention has `kv_b_proj`)."""
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import check_lora_targets

    check_lora_targets(fm.make_config(FAMILY, QLORA))
    for base in (QLORA, LORA8):
        config = fm.make_config(FAMILY, {**base, "lora_target_modules": ["q_proj", "kv_b_proj"]})
        with pytest.raises(UserError) as error:
            check_lora_targets(config)
        assert error.value.where == "lora_target_modules" and "'kv_b_proj'" in str(error.value)


def test_refused_without_a_quantized_base():
    with pytest.raises(ValueError, match="needs a quantized base") as error:
        fm.make_config(FAMILY, {**QLORA, "adapter": "lora"})
    assert "`load_in_8bit: true`" in str(error.value)


def test_lora_on_the_quantized_experts_is_refused_with_peft_s_reason():
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import check_quantized_experts

    check_quantized_experts(fm.make_config(FAMILY, QLORA))
    config = fm.make_config(FAMILY, {**QLORA, "lora_target_parameters": ["experts.down_proj"]})
    with pytest.raises(UserError, match="which peft cannot train") as error:
        check_quantized_experts(config)
    assert error.value.where == "lora_target_parameters"
    # peft maps `down_proj` (and `all-linear`) of a transformers-5 MoE onto the experts' fused
    # parameters itself: the same LoRA on the quantized experts, refused the same way.
    for modules in (["q_proj", "down_proj"], "all-linear"):
        config = fm.make_config(FAMILY, {**QLORA, "lora_target_modules": modules})
        with pytest.raises(UserError, match="turns these names into LoRA on the fused") as error:
            check_quantized_experts(config)
        assert error.value.where == "lora_target_modules" and "down_proj" in str(error.value)


def test_a_model_without_fused_experts_is_refused():
    from longctx_cli.errors import UserError
    from longctx_cli.preflight import check_quantized_experts

    llama = next(f for f in fm.FAMILIES if f.name == "llama")
    with pytest.raises(UserError, match="has no fused expert weights"):
        check_quantized_experts(fm.make_config(llama, QLORA))


def test_the_memory_estimate_holds_the_experts_in_4_bits():
    from longctx_cli.config.memory_estimate import estimate_memory, quantized_weight_bytes
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform

    on = fm.make_config(FAMILY, QLORA)
    off = fm.make_config(FAMILY, {**QLORA, "quantize_moe_experts": False})
    shape = read_model_config(on)
    layout = build_plan(on, 1, shape, platform=Platform(**fm.CPU)).layout
    experts = shape.fused_expert_weights
    cfg = FAMILY.config()
    assert experts == cfg["num_hidden_layers"] * cfg["num_experts"] * 3 * (
        cfg["hidden_size"] * cfg["moe_intermediate_size"])
    packed, scales = quantized_weight_bytes(on)
    (with_experts, notes), (without, _) = (estimate_memory(c, shape, 1, layout)
                                           for c in (on, off))
    assert with_experts.parameters - without.parameters == (
        int(experts * packed) + int(experts * scales))
    assert any("quantize_moe_experts" in n for n in notes)


@pytest.mark.parametrize("eight", [True, False], ids=["8-bit", "4-bit"])
def test_checkpointed_steps_leave_no_dequantized_weight_cached(eight):
    """A non-reentrant checkpoint's recompute stops inside the layer once it has what
    backward needs, skipping plain forward hooks: the per-forward dequantization cache must
    still close, or every dequantized expert weight stays resident (and cached) for good."""
    from types import SimpleNamespace

    from torch.nn.utils import parametrize
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.runtime.model import quantize_fused_experts

    hf_config = AutoConfig.for_model(**FAMILY.config())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    quantization = SimpleNamespace(load_in_8bit=eight, bnb_4bit_use_double_quant=True,
                                   bnb_4bit_quant_type="nf4")
    assert quantize_fused_experts(model, quantization) == 2 * hf_config.num_hidden_layers
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, hf_config.vocab_size, (1, 16))
    enabled_before = parametrize._cache_enabled
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert parametrize._cache_enabled == enabled_before
    if enabled_before == 0:
        assert not parametrize._cache


# ---- the command line: checkpoints, resume, merge-lora ----------------------------------


@pytest.mark.slow  # FSDP's parity with the 4-bit experts runs by default (FSDP column above)
def test_fsdp_run_checkpoints_resumes_and_merges_into_the_rounded_experts(tmp_path):
    """`longctx train` with FSDP at sp 2 saves checkpoints of the 4-bit experts (their packed
    bytes under their own names, which torch.distributed.checkpoint maps back), a run resumed
    from checkpoint-2 ends on the same adapter bit for bit, and `merge-lora` writes experts
    that are the base's experts rounded through 4 bits, the weights the adapter trained with."""
    import shutil

    import bitsandbytes.functional as F
    from safetensors.torch import load_file

    from tests.train_helpers import final_tensors, run_longctx, train, write_config
    from tests.train_helpers import write_documents as documents

    data = documents(tmp_path / "docs.jsonl")
    model = {**FAMILY.config(), "model_type": "qwen3_moe"}
    options = {**QLORA, "model_config": model, "sequence_parallel_degree": 2, "fsdp": True,
               "max_steps": 3, "save_steps": 2, "eval_steps": 3}
    train(write_config(tmp_path, "run", data, **options), 2)
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    train(write_config(tmp_path, "resumed", data, resume_from_checkpoint="auto", **options), 2)
    want = final_tensors(tmp_path / "run", adapter=True)
    got = final_tensors(tmp_path / "resumed", adapter=True)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)

    merged = tmp_path / "merged"
    result = run_longctx("merge-lora", str(tmp_path / "run.yaml"), "--checkpoint",
                         str(tmp_path / "run" / "final"), "--output", str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    base = load_file(str(tmp_path / "run" / "final" / "base_model" / "model.safetensors"))
    out = load_file(str(merged / "model.safetensors"))
    # transformers saves the experts one by one (gate, up, down); the model fuses gate and up.
    experts = "model.layers.0.mlp.experts"
    count = model["num_experts"]

    def fused(weights: dict) -> torch.Tensor:
        return torch.stack([torch.cat([weights[f"{experts}.{e}.gate_proj.weight"],
                                       weights[f"{experts}.{e}.up_proj.weight"]])
                            for e in range(count)])

    packed, state = F.quantize_4bit(fused(base), compress_statistics=True, quant_type="nf4")
    assert torch.equal(fused(out), F.dequantize_4bit(packed, state))
    assert not torch.equal(fused(out), fused(base))
