"""The one check path: `check_run` is what every entry point calls before it does anything.

`validate`, the launchers of `train`, `eval`, `generate` and `merge-lora`, and each rank
however it was started (the CLI's own torchrun, a user's `torchrun`, `srun`) call
`check_run`, so a config `validate` refuses is refused everywhere with the same paragraph.
It builds the plan (`config/plan.py:plan_for`: the world, every rule against the model and
the machine) and, for commands that read data, looks at the world around the config: the
output folder can be written, local dataset files exist, can be read and are not empty, eval
settings have eval data, and LoRA targets name modules the model has (read from a skeleton
of the model on the meta device: no weights are loaded or downloaded).

Forward-only commands (`eval`, `generate`, `merge-lora`) run the exported model: their SP
degree is a choice of the machine, not of the training run (`forward_only_plan`).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from longctx_cli.config.plan import Plan
    from longctx_cli.config.schema import Config, DatasetConfig

_TEXT_SUFFIXES = (".jsonl", ".json", ".txt")
# Commands that only run the exported model forward: any SP degree gives the same result.
FORWARD_ONLY = ("eval", "generate", "merge-lora")
# Keys that set the SP degree on the command line (`--sequence-parallel-degree 4`).
SP_DEGREE_KEYS = ("sequence_parallel_degree", "context_parallel_size")


def check_run(
    config: Config, command: str, nproc_per_node: int | None = None,
    nnodes: int | None = None, *, overrides: list[str] | None = None, assume_gpu: bool = False,
    world_checks: bool = True,
) -> tuple[Config, Plan]:
    """Every check of `command` on this world (flags, else torchrun's WORLD_SIZE, else the
    config): the first problem raises a UserError. Returns the config the command runs (a
    forward-only command's has the SP degree its ranks allow) and its plan.

    `world_checks` False: the world around the config (data files, output_dir, LoRA
    targets) is not looked at again; for ranks whose longctx launcher checked it."""
    from longctx_cli.config.plan import plan_for

    if command in FORWARD_ONLY and config.objective.reward_model:
        raise UserError(
            f"`longctx {command}` runs a causal LM, but `reward_model: true` trains a "
            "sequence classifier (a `score` head, no LM head).", where="reward_model",
            fix="load the run's final/ with AutoModelForSequenceClassification (and peft "
            "for an adapter) to score with it.")
    if command in FORWARD_ONLY:
        config, plan = forward_only_plan(config, nproc_per_node, nnodes,
                                         sp_given=sp_degree_given(overrides or []))
    else:
        plan = plan_for(config, nproc_per_node, nnodes, assume_gpu=assume_gpu)
    if world_checks and command in ("validate", "train"):
        preflight(config)
    return config, plan


def sp_degree_given(overrides: list[str]) -> bool:
    """Whether the command line sets the SP degree (`--sequence-parallel-degree N`)."""
    from longctx_cli.config.load import parse_overrides

    return any(key in SP_DEGREE_KEYS for key, _, _ in parse_overrides(overrides))


def forward_only_plan(
    config: Config, nproc_per_node: int | None, nnodes: int | None, sp_given: bool
) -> tuple[Config, Plan]:
    """The config and plan of a forward-only command on this world.

    Evaluation and generation run the exported, unsharded model, so the training run's
    tensor parallelism and data-parallel sharding do not apply, and the SP degree is the
    machine's choice: the one given on the command line, else the largest that divides the
    world and that the model allows (one SP group over every rank holds the longest rows;
    the rest of the world, if any, forms data-parallel groups). Every degree computes the
    same tokens and scores (exact SP)."""
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan, plan_for
    from longctx_cli.config.world import resolve_world

    config = config.model_copy(update={"tensor_parallel_size": 1, "fsdp": False,
                                       "dp_shard_size": None, "dp_replicate_size": None})
    if nproc_per_node is None and not os.environ.get("WORLD_SIZE"):
        # Without flags or torchrun: as many ranks as the run trained with in one SP group.
        nproc_per_node = config.parallel.world_size or config.parallel.sequence_parallel_degree
    if sp_given:
        return config, plan_for(config, nproc_per_node, nnodes)
    world, source = resolve_world(config, nproc_per_node, nnodes)
    shape = read_model_config(config)  # the SP settings tried below do not change it
    first_error: UserError | None = None
    for sp in (d for d in range(world, 0, -1) if world % d == 0):
        for candidate in _forward_layouts(config, sp):
            try:
                return candidate, build_plan(candidate, world, shape,
                                             nproc_per_node=nproc_per_node,
                                             world_source=source)
            except UserError as e:
                first_error = first_error or e
    assert first_error is not None  # sp 1 on the configured mode failed: the model's fault
    raise first_error


def _forward_layouts(config: Config, sp: int) -> list[Config]:
    """`config` at SP degree `sp`: its own mode first, then the plain default ring (a
    hybrid's `ulysses_degree` or a Ulysses head split may not fit `sp`)."""
    own = config.model_copy(update={"sequence_parallel_degree": sp})
    if config.parallel.sequence_parallel_mode == "ring":
        return [own]
    return [own, own.model_copy(update={"sequence_parallel_mode": "ring",
                                        "ulysses_degree": None})]


def preflight(config: Config) -> None:
    """Run every check; the first problem raises a UserError."""
    check_output_dir_writable(Path(config.output.output_dir))
    check_datasets(config)
    check_eval_data(config)
    check_lora_targets(config)
    check_lora_parameters(config)
    check_quantized_experts(config)
    check_user_code(config)
    if not config.model.random_init:
        from longctx_cli.config.sections.model import check_linearized_checkpoint

        check_linearized_checkpoint(config.model.base_model)


def check_user_code(config: Config) -> None:
    """`rl: grpo`: every reward function and dataset transform the config names imports (from
    the config's folder or the Python path) and is a function; called only while training."""
    if config.objective.rl != "grpo":
        return
    from longctx_cli.config.sections.grpo import is_reward_model
    from longctx_cli.user_code import resolve_callable

    for i, name in enumerate(config.trl.reward_funcs):
        if is_reward_model(name):  # its config only: the model loads in the ranks
            from longctx_cli.config.reward_models import (
                check_reward_model,
                reward_model_source,
            )

            check_reward_model(reward_model_source(name, config), config.model.trust_remote_code)
        else:
            resolve_callable(name, config.source_dir, f"trl.reward_funcs[{i}]")
    for i, entry in enumerate(config.data.datasets):
        if entry.transform:
            resolve_callable(entry.transform, config.source_dir, f"datasets[{i}].type")


# ---- output_dir ------------------------------------------------------------------------


def check_output_dir_writable(output_dir: Path) -> None:
    """output_dir is a folder (or can become one) in which files can be created.

    Nothing is left behind: a probe file is created in the nearest existing folder and
    removed. Permission bits alone would say nothing when running as root, so we write.
    """
    where = "output_dir"
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(
            f"{str(output_dir)!r} is an existing file, not a folder.",
            where=where,
            fix="choose another `output_dir`, or move that file away.",
        )
    existing = output_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            f"{str(output_dir)!r} cannot be created: {str(existing)!r} is a file, not a folder.",
            where=where,
            fix="choose an `output_dir` whose parent folders are folders.",
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".longctx-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"{str(output_dir)!r} cannot be written: creating a file in {str(existing)!r} "
            f"failed ({e.strerror}, errno {e.errno}).",
            where=where,
            fix="choose an `output_dir` on a writable disk with free space (a read-only "
            "mount, a full disk or missing permissions cause this).",
        ) from None


# ---- datasets ----------------------------------------------------------------------------


def check_datasets(config: Config) -> None:
    """Every local dataset path exists, is readable and holds at least one record."""
    from longctx_cli.data.load import resolve

    for key, entries in (("datasets", config.data.datasets),
                         ("eval_datasets", config.data.eval_datasets)):
        for entry in entries:
            if entry.type == "passkey" or not entry.path:
                continue
            source = resolve(entry)  # a UserError for a missing local path
            if source.kind == "files":
                for f in source.files:
                    _check_readable_nonempty(f, key, entry)


def _check_readable_nonempty(f: Path, key: str, entry: DatasetConfig) -> None:
    try:
        with open(f, "rb") as fh:
            has_data = _has_content(fh, f.suffix.lower())
    except OSError as e:
        raise UserError(f"dataset file {str(f)!r} cannot be read ({e.strerror}).", where=key,
                        fix="check the file's permissions and that the disk is mounted.") from None
    if not has_data:
        raise UserError(f"dataset file {str(f)!r} is empty (no records).", where=key,
                        fix=f"check the file, or remove the entry with path {entry.path!r}.")


def _has_content(fh: Any, suffix: str) -> bool:
    """Whether a file holds anything besides whitespace (reads only up to the first byte of
    content, so a large file costs one block)."""
    if suffix not in _TEXT_SUFFIXES:
        return bool(fh.read(1))
    for block in iter(lambda: fh.read(1 << 16), b""):
        stripped = block.strip()
        if stripped and stripped not in (b"[]",):
            return True
    return False


def check_eval_data(config: Config) -> None:
    """`eval_steps` needs eval data: `eval_datasets` or a `val_set_size` hold-out."""
    if config.eval.eval_steps and not config.data.eval_datasets and not config.data.val_set_size:
        raise UserError(
            f"eval_steps is {config.eval.eval_steps} but there is no eval data.",
            where="eval_steps",
            fix="add `eval_datasets`, set `val_set_size` (e.g. 0.05) to hold out part of "
            "`datasets`, or remove `eval_steps`.",
        )


# ---- LoRA targets ------------------------------------------------------------------------


def check_lora_targets(config: Config) -> None:
    """Every name in `lora_target_modules` matches a module of the model (peft's rules: a
    list entry matches a module name or its last dotted parts; a string is a regex)."""
    targets = config.lora.lora_target_modules
    if config.lora.adapter is None or targets == "all-linear":  # lora and qlora alike
        return
    names = module_classes(config)
    if names is None:
        return  # the model's config is not available offline: nothing to check against
    linear = sorted({n.rsplit(".", 1)[-1] for n, kind in names.items()
                     if kind == "Linear" and not n.endswith("lm_head")})
    if isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
    else:
        missing = [t for t in targets
                   if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise UserError(
            f"the model has no module named {', '.join(map(repr, missing))}; its linear "
            f"layers are {', '.join(linear)}.",
            where="lora_target_modules",
            fix="list names from that set, or use `all-linear`.",
        )


def check_lora_parameters(config: Config) -> None:
    """Every name in `lora_target_parameters` matches a parameter of the model that no
    linear module holds (peft's rule: the name, or its last dotted parts)."""
    targets = config.lora.lora_target_parameters
    if config.lora.adapter is None or not targets:
        return
    model = meta_model(config)
    if model is None:
        return  # the model's config is not available offline: nothing to check against
    names = [n for n, _ in model.named_parameters()]
    if config.model.llama4_linearized_experts:  # training replaces the fused experts' ones
        from longctx_cli.config.model_shape import linearized_expert_classes

        fused = {k.rsplit(".", 2)[0] for k in linearized_expert_classes(model)}
        names = [n for n in names if n.rsplit(".", 1)[0] not in fused]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        own = sorted({".".join(n.split(".")[-3:]) for n in names if ".experts." in n})
        raise UserError(
            f"the model has no parameter named {', '.join(map(repr, missing))}"
            + (f"; its experts' parameters are {', '.join(own)}" if own else "") + ".",
            where="lora_target_parameters",
            fix="name parameters as the model holds them (e.g. `mlp.experts.gate_up_proj`), "
            "or drop the key.",
        )


def check_quantized_experts(config: Config) -> None:
    """`quantize_moe_experts`: the model has fused expert weights to quantize, and LoRA
    targets none of them (peft cannot train a LoRA on a bitsandbytes-parametrized weight)."""
    if not config.lora.quantize_moe_experts:
        return
    from longctx_cli.config.shape import fused_expert_names

    model = meta_model(config)
    if model is None:
        return  # the model's config is not available offline: nothing to check against
    experts = fused_expert_names(model)
    if not experts:
        raise UserError(
            f"`quantize_moe_experts: true`, but model type `{model.config.model_type}` has no "
            "fused expert weights (3-D parameters named `expert`) to quantize: its linear "
            "layers, experts included, are quantized by `load_in_4bit` already.",
            where="quantize_moe_experts", fix="remove `quantize_moe_experts`.")
    asked = config.lora.lora_target_parameters or []
    adapted = [t for t in asked if any(n == t or n.endswith("." + t) for n in experts)]
    where, why = "lora_target_parameters", f"`lora_target_parameters` {adapted} put LoRA on"
    if not adapted:
        parameters, modules = peft_conversion(config, model)
        adapted = [t for t in sorted(set(parameters) - set(asked))
                   if any(n == t or n.endswith("." + t) for n in experts)]
        where = "lora_target_modules"
        why = (f"`lora_target_modules` {modules}: peft, for this MoE family under transformers "
               f"5, turns these names into LoRA on the fused parameters {adapted}: on")
    if adapted:
        raise UserError(
            f"{why} expert weights that `quantize_moe_experts` quantizes, which peft cannot "
            "train: its LoRA on a parameter that bitsandbytes already parametrizes is never "
            "removed after the forward (peft removes only its plain delta proxy, not the "
            "low-rank factor proxy it uses for experts, so the deltas pile up step after "
            "step), and of two adapted weights of one experts module the second reads the "
            "cached dequantized weight without its LoRA (no gradient).",
            where=where,
            fix="drop those names (LoRA on the attention and other linear layers still "
            "trains, the 4-bit experts stay frozen), or set `quantize_moe_experts: false` to "
            "adapt the experts in the run's dtype.")


def peft_conversion(config: Config, model: Any) -> tuple[list[str], list[str]]:
    """The parameters peft adapts for the run's LoRA targets, and the module names it turned
    into parameters: on transformers 5 its MoE conversion maps module names onto the fused
    expert parameters (`down_proj` -> the experts' `down_proj`, `gate_proj` + `up_proj` ->
    `gate_up_proj`)."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import (
        convert_peft_config_for_transformers,
        get_model_conversion_mapping,
    )

    lora = LoraConfig(r=config.lora.lora_r, target_modules=config.lora.lora_target_modules,
                      target_parameters=config.lora.lora_target_parameters)
    named = lora.target_modules
    try:
        convert_peft_config_for_transformers(lora, model, get_model_conversion_mapping(model))
    except ValueError:  # a target peft cannot convert: get_peft_model reports it
        pass
    if isinstance(named, str):  # a pattern or all-linear: peft resolved it as a whole
        return list(lora.target_parameters or []), [named]
    kept = set(lora.target_modules or [])
    return list(lora.target_parameters or []), [n for n in named or [] if n not in kept]


def meta_model(config: Config) -> Any:
    """The model built on the meta device from its config (no weights), or None."""
    import torch

    from longctx_cli.config.shape import causal_lm_class, is_vision_language

    hf = _hf_config(config)
    if hf is None:
        return None
    try:
        with torch.device("meta"):
            if is_vision_language(hf, config.vision.trains_images):  # the class training
                from transformers import AutoModelForImageTextToText  # builds for images

                return AutoModelForImageTextToText.from_config(
                    hf, trust_remote_code=config.model.trust_remote_code)
            return causal_lm_class(hf).from_config(
                hf, trust_remote_code=config.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - a model transformers cannot skeletonise: not our check
        return None


def module_classes(config: Config) -> dict[str, str] | None:
    """{module name: class name} of the model: a plain family's from its shape, any other's
    built on the meta device from its config."""
    from longctx_cli.config.model_shape import (
        linearized_expert_classes,
        plain_module_classes,
        read_model_config,
    )

    try:
        plain = plain_module_classes(read_model_config(config))
    except UserError:
        plain = None  # the plan reports an unreadable model config; here nothing to check
    if plain is not None:
        return plain
    model = meta_model(config)
    if model is None:
        return None
    names = {name: type(m).__name__ for name, m in model.named_modules() if name}
    if config.model.llama4_linearized_experts:  # the expert linears training makes
        names.update(linearized_expert_classes(model))
    return names


def _hf_config(config: Config) -> Any:
    """The model's transformers config without a download (validate fetched it if it could)."""
    from transformers import AutoConfig

    from longctx_cli.config import known_models
    from longctx_cli.config.model_shape import build_from_dict

    if config.model.model_config_dict is not None:
        return build_from_dict(config.model.model_config_dict, "model_config")
    try:
        return AutoConfig.from_pretrained(str(config.model.base_model), local_files_only=True,
                                          trust_remote_code=config.model.trust_remote_code,
                                          **config.model.revision_kwargs(config.model.base_model))
    except (OSError, ValueError):
        fields = known_models.lookup(str(config.model.base_model))
        return build_from_dict(fields, "base_model") if fields is not None else None
