"""Axolotl users' configs as they are: both generations of names, the key table, one report
of every problem with file:line:col, overrides, the plan's Axolotl section, docs/axolotl.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from longctx_cli.cli import app
from longctx_cli.config import axolotl, config_from_dict, docs, load_config
from longctx_cli.config.load import known_keys
from longctx_cli.config.plan import build_plan
from longctx_cli.config.schema import Config
from longctx_cli.config.sections.training import OPTIMIZERS
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.world import Platform
from longctx_cli.errors import UserError
from longctx_cli.train import optim, schedule, stopping

CONFIGS = Path(__file__).resolve().parent / "axolotl_configs"
DOC = Path(__file__).resolve().parents[1] / "docs" / "axolotl.md"
TINY = {"model_config": {"model_type": "llama"}}
SHAPE = ModelShape("llama", 64, 128, 2, 4, 2, 16, 384)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "axo.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as exc:
        fn(*args, **kwargs)
    return str(exc.value)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# ---- real Axolotl configs ---------------------------------------------------------------


def _local_data(name: str, tmp_path: Path, monkeypatch) -> None:
    """The configs name local data files the way users do (relative to where they run);
    validate checks they exist, so run in a folder that has them, one record each."""
    monkeypatch.chdir(tmp_path)
    for entry in yaml.safe_load((CONFIGS / name).read_text()).get("datasets") or []:
        files = entry.get("data_files") or entry["path"]  # `path: json` + data_files too
        for local in map(Path, [files] if isinstance(files, str) else files):
            if local.suffix in (".jsonl", ".json"):
                local.parent.mkdir(parents=True, exist_ok=True)
                pair = "bradley_terry" in str(entry.get("type"))  # a reward model's pair
                record = ({"input": "a question", "chosen": "a good answer",
                           "rejected": "a bad answer"} if pair else {"text": "one record"})
                local.write_text(json.dumps(record) + "\n")


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.iterdir()))
def test_axolotl_configs_validate_unchanged(name, offline, tmp_path, monkeypatch):
    nproc = "4" if name == "issue_sp4.yaml" else "8"
    _local_data(name, tmp_path, monkeypatch)
    result = CliRunner().invoke(app, ["validate", str(CONFIGS / name), "--nproc-per-node", nproc])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output and "axolotl keys" in result.output


def test_axolotl_qwen3_fsdp_tp_cp_runs_as_its_layout_says(offline, tmp_path, monkeypatch):
    """Axolotl's Qwen3-8B FSDP + TP + CP example: dp_shard 2 x cp 2 x tp 2 on 8 ranks."""
    path = CONFIGS / "qwen3_fsdp_tp_cp.yaml"
    _local_data(path.name, tmp_path, monkeypatch)
    result = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", "8"])
    assert result.exit_code == 0, result.output
    assert "dp 2 x cp 2 x tp 2" in " ".join(result.output.split())
    # 6 ranks cannot hold the 2 x 2 x 2 layout: refused, naming the degrees.
    refused = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", "6"])
    assert refused.exit_code == 2, refused.output
    assert "`tensor_parallel_size` = 2" in " ".join(refused.output.split())


def test_issue_example_maps_names():
    cfg = load_config(CONFIGS / "issue_sp4.yaml")
    assert cfg.parallel.sequence_parallel_degree == 4
    assert cfg.parallel.attention_kernel == "auto"
    assert ("flash_attention", "mapped to attention_kernel: auto") in [
        (k, v.split(" (")[0]) for k, v in cfg.axolotl_notes
    ]


def test_alst_config_keys():
    cfg = load_config(CONFIGS / "llama3_fsdp2_alst.yaml")
    assert cfg.data.sequence_len == 500_000 and cfg.parallel.sequence_parallel_degree == 8
    assert cfg.parallel.fsdp and cfg.parallel.fsdp_config.reshard_after_forward
    assert cfg.memory.activation_offloading is True and cfg.memory.tiled_mlp
    assert (cfg.training.optimizer == "adamw_torch_8bit" and cfg.model.dtype == "bfloat16"
            and cfg.model.tf32)
    notes = dict(cfg.axolotl_notes)
    assert notes["plugins"].startswith("ignored:")
    assert notes["min_sample_len"].startswith("ignored:")


def test_qlora_config_keys():
    cfg = load_config(CONFIGS / "llama3_qlora_1b.yml")
    assert cfg.lora.adapter == "qlora" and cfg.lora.load_in_4bit and not cfg.lora.load_in_8bit
    assert cfg.lora.lora_target_modules == "all-linear"
    assert cfg.lora.lora_modules_to_save == ["embed_tokens", "lm_head"]
    assert cfg.model.special_tokens.pad_token == "<|end_of_text|>"
    assert dict(cfg.axolotl_notes)["lora_qkv_kernel"].startswith("ignored:")


# ---- both generations of names ----------------------------------------------------------


@pytest.mark.parametrize(("keys", "dtype"), [
    ({"bf16": True}, "bfloat16"), ({"bf16": "auto"}, "bfloat16"), ({"fp16": True}, "float16"),
    ({"bf16": False}, "float32"), ({"bf16": False, "fp16": True}, "float16"),
    ({"bfloat16": True}, "bfloat16"), ({"float32": True}, "float32"),
])
def test_precision_keys_map_to_dtype(keys, dtype):
    assert config_from_dict({**TINY, **keys}).model.dtype == dtype


@pytest.mark.parametrize(("keys", "kernel"), [
    ({"flash_attention": True}, "auto"), ({"attn_implementation": "flash_attention_2"}, "auto"),
    ({"attn_implementation": "kernels-community/flash-attn3"}, "auto"),
    ({"attn_implementation": "sdpa"}, "torch"), ({"attn_implementation": "eager"}, "torch"),
    ({"sdp_attention": True}, "torch"), ({"flex_attention": True}, "torch"),
])
def test_attention_keys_map_to_kernel(keys, kernel):
    assert config_from_dict({**TINY, **keys}).parallel.attention_kernel == kernel


def test_sequence_parallel_names_both_generations():
    assert config_from_dict({**TINY, "context_parallel_size": 2}
                            ).parallel.sequence_parallel_degree == 2
    same = {**TINY, "context_parallel_size": 2, "sequence_parallel_degree": 2}
    assert config_from_dict(same).parallel.sequence_parallel_degree == 2
    message = _error(config_from_dict, {**same, "sequence_parallel_degree": 4})
    assert "disagree" in message
    assert config_from_dict({**TINY, "ring_attn_func": "batch_ring"}).parallel.ring_attn_func


def test_model_and_tokenizer_keys():
    cfg = config_from_dict({
        "base_model": "org/m", "base_model_config": "org/cfg", "model_type": "LlamaForCausalLM",
        "tokenizer_type": "AutoTokenizer", "tokenizer_config": "org/tok",
        "trust_remote_code": False, "eot_tokens": ["<|eot_id|>"],
    })
    assert cfg.model.tokenizer == "org/tok" and cfg.model.base_model_config == "org/cfg"
    assert {"model_type", "tokenizer_type", "eot_tokens"} <= set(dict(cfg.axolotl_notes))
    assert "not a causal-LM or image-text class" in _error(config_from_dict,
                                                         {**TINY, "model_type": "T5Model"})


def test_mapping_conflicts_are_errors():
    message = _error(config_from_dict, {**TINY, "bf16": True, "dtype": "float32"})
    assert "`bf16` = True means `dtype: bfloat16`" in message
    message = _error(config_from_dict, {**TINY, "bf16": True, "fp16": True})
    assert "keep one" in message


def test_training_keys():
    cfg = config_from_dict({
        **TINY, "warmup_ratio": 0.1, "lr_scheduler": "cosine_with_min_lr",
        "saves_per_epoch": 2, "evals_per_epoch": 4, "early_stopping_patience": 2,
        "loss_watchdog_threshold": 5.0, "gradient_checkpointing": "offload",
        "batch_size": 8, "micro_batch_size": 2, "auto_resume_from_checkpoints": True,
        "ddp_timeout": 1800, "chunked_cross_entropy": True,
    })
    assert cfg.training.gradient_accumulation_steps == 4 and cfg.run.collective_timeout_s == 1800
    assert cfg.memory.gradient_checkpointing and cfg.memory.activation_offloading
    assert cfg.output.resume_from_checkpoint == "auto" and cfg.memory.chunked_loss
    message = _error(config_from_dict, {**TINY, "warmup_ratio": 0.1, "warmup_steps": 10})
    assert "keep one" in message
    assert "needs evaluations" in _error(config_from_dict, {**TINY, "early_stopping_patience": 1})


def test_adapter_keys():
    cfg = config_from_dict({**TINY, "adapter": "qlora"})
    assert cfg.lora.load_in_4bit  # what qlora means
    assert "trained in full" in _error(config_from_dict, {**TINY, "load_in_8bit": True})
    cfg = config_from_dict({**TINY, "adapter": "lora", "lora_target_linear": True,
                            "peft_use_dora": True, "peft_use_rslora": True})
    assert cfg.lora.lora_target_modules == "all-linear" and cfg.lora.peft_use_dora


def test_distribution_keys(tmp_path):
    ds = tmp_path / "z2.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    cfg = config_from_dict({**TINY, "deepspeed": str(ds)})
    assert cfg.parallel.fsdp and not cfg.parallel.fsdp_config.reshard_after_forward
    assert cfg.parallel.fsdp_config.offload_params
    assert "ZeRO-2" in dict(cfg.axolotl_notes)["deepspeed"]
    cfg = config_from_dict({**TINY, "deepspeed": {"zero_optimization": {"stage": 3}}})
    assert cfg.parallel.fsdp and cfg.parallel.fsdp_config.reshard_after_forward
    cfg = config_from_dict({**TINY, "fsdp": ["full_shard", "auto_wrap"],
                            "fsdp_config": {"fsdp_offload_params": True}})
    assert cfg.parallel.fsdp and cfg.parallel.fsdp_config.offload_params  # old `fsdp_` prefix
    cfg = config_from_dict({**TINY, "dp_shard_size": 2, "dp_replicate_size": 2})
    assert cfg.parallel.fsdp
    plan = build_plan(cfg, 4, SHAPE, platform=Platform(False, False))
    assert "HSDP: 2 replicas" in plan.fsdp_detail
    with pytest.raises(UserError, match="does not fit"):
        build_plan(cfg, 8, SHAPE, platform=Platform(False, False))


def test_expert_parallel_size_shards_the_experts_by_fsdp():
    # Axolotl's EP examples: `expert_parallel_size` alone (world = ep), and ep x dp_shard.
    for extra, world in (({}, 4), ({"dp_shard_size": 2}, 4), ({}, 8)):
        cfg = config_from_dict({**TINY, "expert_parallel_size": 4 // (extra.get(
            "dp_shard_size") or 1), **extra})
        assert cfg.parallel.fsdp and "no expert all-to-all" in dict(cfg.axolotl_notes)[
            "expert_parallel_size"]
        layout = build_plan(cfg, world, SHAPE, platform=Platform(False, False)).layout
        assert (layout.fsdp, layout.dp_shard, layout.dp_replicate) == (True, world, 1)
    cfg = config_from_dict({**TINY, "expert_parallel_size": 3})
    with pytest.raises(UserError, match="expert_parallel_size` = 3 does not divide the 4"):
        build_plan(cfg, 4, SHAPE, platform=Platform(False, False))
    # Its buffer sizes change no result; the token cap drops routed tokens, so it is refused.
    notes = dict(config_from_dict({**TINY, "expert_parallel_size": 2,
                                   "expert_parallel_num_nvl_bytes": 1 << 28}).axolotl_notes)
    assert notes["expert_parallel_num_nvl_bytes"].startswith("ignored")
    msg = _error(config_from_dict, {**TINY, "expert_parallel_token_capacity": 1024})
    assert "`expert_parallel_token_capacity` is not supported" in msg and "route" in msg


def test_ignored_and_refused_keys():
    cfg = config_from_dict({**TINY, "plugins": ["axolotl.integrations.liger.LigerPlugin"],
                            "use_kernels": True, "hub_model_id": "me/x", "rl": None})
    notes = dict(cfg.axolotl_notes)
    assert all(notes[k].startswith("ignored") for k in ("plugins", "use_kernels", "hub_model_id"))
    for key, value in (("vllm", {"host": "0.0.0.0"}), ("processor_kwargs", {"size": 8}),
                       ("neftune_noise_alpha", 5)):
        assert f"`{key}` is not supported" in _error(config_from_dict, {**TINY, key: value})


# ---- one report with every problem -----------------------------------------------------


def test_every_problem_in_one_report_with_locations(tmp_path):
    path = _write(tmp_path, (
        "model_config: {model_type: llama}\n"
        "sequence_parallel_degree: true\n"
        "max_seq_length: 4096\n"
        "rl: gdpo\n"
        "optimizer: adafactor\n"
        "seed: 1\n"
        "seed: 2\n"
        "fsdp_confg: {}\n"
    ))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "6 problems" in text
    assert f"{path}:2:27: `sequence_parallel_degree` = True is invalid" in text
    assert f"{path}:3:1: unknown key `max_seq_length`; did you mean `sequence_len`?" in text
    assert f"{path}:4:5: `rl` = 'gdpo' is invalid: `rl: gdpo` cannot run" in text
    assert f"{path}:5:12: `optimizer` = 'adafactor' is invalid" in text
    assert f"{path}:7:1: duplicate key `seed` (first at line 6)" in text
    assert "did you mean `fsdp_config`?" in text
    assert "Traceback" not in result.output


def test_issue_misleading_suggestions_are_gone():
    for key in ("fsdp_config", "deepspeed", "tensor_parallel_size"):
        assert key in known_keys(Config)


# ---- overrides ----------------------------------------------------------------------------


def test_overrides_are_typed_validated_and_named(tmp_path):
    path = _write(tmp_path, "model_config: {model_type: llama}\nlearning_rate: 1.0e-4\n")
    cfg = load_config(path, ["--learning-rate", "2e-5", "--micro-batch-size=2",
                             "--gradient-checkpointing", "--flash-attention", "true"])
    assert cfg.training.learning_rate == 2e-5 and cfg.training.micro_batch_size == 2
    assert cfg.memory.gradient_checkpointing and cfg.parallel.attention_kernel == "auto"
    message = _error(load_config, path, ["--micro-batch-size", "true", "--lerning-rate", "1"])
    assert "--micro-batch-size (command line): `micro_batch_size` = True" in message
    assert "--lerning-rate (command line): unknown key `lerning_rate`" in message
    strict = _write(tmp_path, "model_config: {model_type: llama}\nstrict: true\n")
    assert "`strict: true` allows overrides only" in _error(load_config, strict, ["--seed", "3"])


def test_validate_plans_a_flash_config_without_a_gpu(tmp_path, offline):
    path = _write(tmp_path, "base_model: meta-llama/Llama-3.1-8B\nattention_kernel: flash\n"
                            "sequence_parallel_degree: 2\n")
    result = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", "2"])
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "assumed" in text and "flash (requested)" in text


# ---- optimizers, schedules, cadence, stop rules ------------------------------------------


# The 8-bit torchao optimizer alone takes ~45 s here: a slow extra (the other 8-bit ones run).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "adamw_torch_8bit" else n for n in OPTIMIZERS])
def test_every_optimizer_name_really_steps_on_cpu(name):
    if name in optim._BNB:
        pytest.importorskip("bitsandbytes")
    if name in optim._TORCHAO:
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    before = layer.weight.detach().clone()
    opt = optim.make_optimizer(config_from_dict({**TINY, "optimizer": name,
                                                 "learning_rate": 1e-2}), list(layer.parameters()))
    layer(torch.randn(4, 256)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(before, layer.weight)
    cls, _ = optim.optimizer_class(name)
    if name in optim._BNB:
        assert cls.__module__.startswith("bitsandbytes")
    if name in optim._TORCHAO:
        assert cls.__module__.startswith("torchao")


@pytest.mark.parametrize("name", Config.flat_fields()["lr_scheduler"].annotation.__args__)
def test_every_scheduler_name_builds_and_steps(name):
    cfg = config_from_dict({**TINY, "lr_scheduler": name, "warmup_ratio": 0.2,
                            "learning_rate": 1.0})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = optim.make_scheduler(cfg, opt, 10)
    for _ in range(5):
        opt.step()
        sched.step(1.0) if optim.is_plateau(cfg) else sched.step()
    assert math.isfinite(opt.param_groups[0]["lr"])
    if not optim.is_plateau(cfg):
        assert optim.warmup_steps(cfg, 10) == 2


def test_cadence_and_stop_rules():
    assert schedule.interval(None, 2, None, 10, 30) == 5  # saves_per_epoch
    assert schedule.interval(0.25, None, None, 10, 40) == 10  # fraction of all steps
    assert schedule.interval(7, None, "epoch", 10, 30) == 10
    assert schedule.interval(7, None, "no", 1, 1) is None
    stop = stopping.EarlyStopping(2)
    assert [stop.should_stop(x) for x in (3.0, 2.0, 2.5, 2.1)] == [False, False, False, True]
    dog = stopping.LossWatchdog(5.0, 2)
    assert [dog.tripped(x) for x in (6.0, 4.0, 6.0, float("nan"))] == [False, False, False, True]


def test_special_tokens_in_the_vocabulary_or_added(tmp_path):
    from longctx_cli.data.tokenizer import load_tokenizer

    cfg = config_from_dict({**TINY, "tokenizer": "byte", "special_tokens": {"pad_token": "</s>"}})
    assert load_tokenizer(cfg).pad_token == "</s>"
    # One the vocabulary lacks is added, as Axolotl adds it (the embeddings then grow).
    new = config_from_dict({**TINY, "tokenizer": "byte",
                            "special_tokens": {"pad_token": "<|end_of_text|>"}})
    tok = load_tokenizer(new)
    assert tok.pad_token == "<|end_of_text|>" and tok.pad_token_id == len(tok) - 1 == 384


# ---- docs/axolotl.md ------------------------------------------------------------------------


def test_axolotl_md_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == docs.render_axolotl(), (
        "docs/axolotl.md is stale; regenerate it with "
        "`python -m longctx_cli.config.docs axolotl > docs/axolotl.md`"
    )


def test_axolotl_table_is_consistent():
    ours = set(known_keys(Config))
    assert set(axolotl.SAME) <= ours
    # The table speaks for keys that are not ours, except Axolotl's list form of `fsdp`.
    assert set(axolotl.AXOLOTL_KEYS) & ours == {"fsdp"}
    assert not set(axolotl.RENAMES) & (ours | set(axolotl.AXOLOTL_KEYS))
    text = docs.render_axolotl()
    for key in [*axolotl.SAME, *axolotl.AXOLOTL_KEYS]:
        assert f"| `{key}` |" in text, key
    for rule in axolotl.AXOLOTL_KEYS.values():
        assert rule.reason and (rule.kind != "mapped" or rule.apply is not None)


def test_an_empty_key_is_not_set(tmp_path):
    """Axolotl templates leave many keys empty (`fp16:`, `fsdp:`, `xformers_attention:`): an
    empty key takes its default, in datasets too; `max_grad_norm:` empty keeps its own
    meaning (no clipping)."""
    path = tmp_path / "c.yml"
    path.write_text(
        "model_config: {model_type: llama}\nfp16:\nfsdp:\nxformers_attention:\n"
        "lora_target_modules:\nwarmup_steps:\nmax_grad_norm:\nseed:\n"
        "datasets:\n  - path: d.jsonl\n    type: alpaca\n    split:\n"
    )
    cfg = load_config(path)
    assert cfg.parallel.fsdp is False and cfg.training.seed == 42 and cfg.model.dtype == "bfloat16"
    assert cfg.training.max_grad_norm is None
    assert cfg.data.datasets[0].split == "train"
