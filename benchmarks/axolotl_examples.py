"""Validate every config of an Axolotl checkout's `examples/` folder, unchanged, offline.

    python benchmarks/axolotl_examples.py PATH/TO/axolotl [--nproc-per-node 8] [--docs]

Each config is run through `longctx validate` as a user would, at the rank count its
data-parallel degrees multiply to (`ranks_of`; 8 where it names none, as most of Axolotl's
multi-GPU examples assume), in a folder of its own where its local data files exist (one
record each). A config whose model needs the hub (no network here) is run a second time with
its model's family config as config.json in a private Hugging Face cache: FAMILIES maps each
hub model the examples name to its model type, and transformers' own config class of that
type gives the structure (never a llama stand-in). `examples/archived` is left out. Prints a
table of the outcomes (refusals grouped by their reason, then counts by family), writes
`benchmarks/results/axolotl-examples-<date>.json` (rows, per-family counts and reasons, the
summary docs/axolotl.md shows), and with `--docs` regenerates docs/axolotl.md. `--only TEXT`
runs just the configs whose path holds TEXT and prints their outcomes; with `--update` it
writes them into the newest saved results (listed under "rerun").
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from common import RESULTS, ROOT, markdown_table, shown, write_results

WITH_CONFIG = "valid with its family's config"
HUB = ("hub is unreachable", "cannot read the config of `base_model`")

# The family (transformers' model type) of every hub model Axolotl's examples name, as that
# model's own config.json gives it; a tuple adds the config's own sub-config choices (Mistral
# 3's text decoder). None: a model transformers has no config class for.
FAMILIES: dict[str, str | tuple[str, dict] | None] = {
    "Qwen/Qwen2-7B": "qwen2", "Qwen/Qwen2.5-0.5B": "qwen2", "Qwen/Qwen2.5-3B": "qwen2",
    "Qwen/Qwen2.5-72B": "qwen2", "deepcogito/cogito-v1-preview-qwen-14B": "qwen2",
    "Qwen/Qwen2-VL-7B-Instruct": "qwen2_vl", "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen3-8B": "qwen3", "Qwen/Qwen3-32B": "qwen3",
    "Skywork/Skywork-Reward-V2-Qwen3-8B": "qwen3", "katanemo/Plano-Orchestrator-4B": "qwen3",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3_moe", "nvidia/Qwen3-30B-A3B-NVFP4": "qwen3_moe",
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3_next",
    "nvidia/Qwen3-Next-80B-A3B-Instruct-NVFP4": "qwen3_next",
    "Qwen/Qwen3.5-4B": "qwen3_5", "Qwen/Qwen3.5-9B": "qwen3_5", "Qwen/Qwen3.5-27B": "qwen3_5",
    "Qwen/Qwen3.5-35B-A3B": "qwen3_5_moe", "Qwen/Qwen3.5-35B-A3B-Base": "qwen3_5_moe",
    "Qwen/Qwen3.5-122B-A10B": "qwen3_5_moe",
    "HuggingFaceTB/SmolLM2-135M": "llama", "NousResearch/Llama-2-7b-hf": "llama",
    "NousResearch/Llama-3.2-1B": "llama", "NousResearch/Meta-Llama-3-8B": "llama",
    "NousResearch/Meta-Llama-3-8B-Instruct": "llama", "NousResearch/Meta-Llama-3.1-8B": "llama",
    "TheBloke/Llama-2-7B-GPTQ": "llama", "canopylabs/orpheus-3b-0.1-pretrained": "llama",
    "casperhansen/llama-3-70b-fp16": "llama", "deepcogito/cogito-v1-preview-llama-3B": "llama",
    "hugging-quants/Meta-Llama-3.1-405B-BNB-NF4-BF16": "llama",
    "meta-llama/Llama-3.1-8B": "llama", "meta-llama/Llama-3.2-1B": "llama",
    "meta-llama/Llama-3.2-1B-Instruct": "llama", "meta-llama/Llama-3.2-3B": "llama",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama", "neuralmagic/Sparse-Llama-3.1-8B-2of4": "llama",
    "alpindale/Llama-3.2-11B-Vision-Instruct": "mllama",
    "axolotl-quants/Llama-4-Maverick-17B-128E-Linearized-bnb-nf4-bf16": "llama4",
    "axolotl-quants/Llama-4-Scout-17B-16E-Linearized-bnb-nf4-bf16": "llama4",
    "ByteDance-Seed/Seed-OSS-36B-Instruct": "seed_oss",
    "CohereForAI/c4ai-command-r7b-12-2024": "cohere2",
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": "smolvlm",
    "LiquidAI/LFM2-350M": "lfm2",
    # transformers' LFM2-MoE defaults name no layer types (its model cannot be built from
    # them); the published model mixes short convolutions with a few attention layers.
    "LiquidAI/LFM2-8B-A1B": ("lfm2_moe", {"num_hidden_layers": 24, "layer_types": [
        "full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]}),
    "LiquidAI/LFM2-VL-450M": "lfm2_vl",
    "Mapika/GLM-5.2-NVFP4": "glm_moe_dsa", "THUDM/GLM-4-32B-0414": "glm4",
    "zai-org/GLM-4.5-Air": "glm4_moe", "zai-org/GLM-4.6V-Flash": "glm46v",
    "zai-org/GLM-4.7-Flash": "glm4_moe_lite",
    "MiniMaxAI/MiniMax-M2": "minimax_m2", "moonshotai/Kimi-Linear-48B-A3B-Instruct": "kimi_linear",
    "OpenGVLab/InternVL3_5-8B-HF": "internvl", "PaddlePaddle/PaddleOCR-VL-1.6": "paddleocr_vl",
    "XiaomiMiMo/MiMo-7B-RL": None,  # its own code (`trust_remote_code`), no transformers class
    "ai21labs/AI21-Jamba-1.5-Large": "jamba", "ai21labs/Jamba-v0.1": "jamba",
    "allenai/Olmo-3-7B-Instruct-SFT": "olmo3",
    "arcee-ai/AFM-4.5B": "arcee", "arcee-ai/Trinity-Nano-Preview": "afmoe",
    "axolotl-ai-co/Falcon-E-1.2-3B-Exp-prequantized": "bitnet",
    "tiiuae/Falcon-E-3B-Base-prequantized": "bitnet",
    "axolotl-ai-co/Mistral-Medium-3.5-128B-BF16": ("mistral3", {"text_config": {
        "model_type": "ministral3"}}),
    "axolotl-ai-co/Mistral-Small-4-119B-2603-BF16": ("mistral3", {"text_config": {
        "model_type": "mistral4"}}),
    "mistralai/Ministral-3-3B-Reasoning-2512": ("mistral3", {"text_config": {
        "model_type": "ministral3"}}),
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": "mistral3",
    "mistralai/Magistral-Small-2509": "mistral3",
    "mistralai/Devstral-Small-2507": "mistral", "mistralai/Magistral-Small-2506": "mistral",
    "mistralai/Magistral-Small-2507": "mistral", "mistralai/Ministral-8B-Instruct-2410": "mistral",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistral", "mistralai/Mistral-7B-v0.1": "mistral",
    "mistral-community/Mixtral-8x22B-v0.1": "mixtral", "mistralai/Mixtral-8x7B-v0.1": "mixtral",
    "mistral-community/pixtral-12b": "llava", "llava-hf/llava-1.5-7b-hf": "llava",
    "mistralai/Voxtral-Mini-3B-2507": "voxtral",
    "axolotl-ai-co/gpt-oss-120b-dequantized": "gpt_oss", "openai/gpt-oss-20b": "gpt_oss",
    "openai/gpt-oss-safeguard-20b": "gpt_oss",
    # transformers' DeepSeek-V2 defaults route to no expert count (`num_experts_per_tok`
    # None, which its own forward cannot run); the published models route to 6.
    "axolotl-quants/DeepSeek-V2.5-bnb-nf4-bf16": ("deepseek_v2", {
        "num_experts_per_tok": 6, "n_routed_experts": 160, "n_group": 8, "topk_group": 3,
        "topk_method": "group_limited_greedy"}),
    "deepseek-ai/DeepSeek-V2-Lite": ("deepseek_v2", {"num_experts_per_tok": 6,
                                                     "first_k_dense_replace": 1}),
    "nvidia/DeepSeek-V4-Flash-NVFP4": "deepseek_v4",
    "google/gemma-2-2b": "gemma2", "google/gemma-2-9b": "gemma2",
    "google/gemma-3-1b-it": "gemma3_text", "google/gemma-3-270m-it": "gemma3_text",
    "google/gemma-3-4b-it": "gemma3", "google/gemma-3-12b-it": "gemma3",
    "google/gemma-3-27b-it": "gemma3", "google/gemma-3n-E2B-it": "gemma3n",
    # transformers' Gemma 4 configs default to no towers (its text model); the published
    # instruction models carry a vision tower (E2B an audio one too).
    "google/gemma-4-E2B-it": ("gemma4", {"vision_config": {}, "audio_config": {}}),
    "google/gemma-4-31B": "gemma4",
    **dict.fromkeys(("google/gemma-4-26B-A4B", "nvidia/Gemma-4-26B-A4B-NVFP4"), (
        "gemma4", {"text_config": {"enable_moe_block": True, "num_experts": 128,
                                   "top_k_experts": 8, "moe_intermediate_size": 704}})),
    "google/gemma-4-12B-it": ("gemma4_unified", {"vision_config": {}}),
    "ibm-granite/granite-4.0-tiny-preview": "granitemoehybrid",
    "microsoft/Phi-3-mini-4k-instruct": "phi3", "microsoft/Phi-3.5-mini-instruct": "phi3",
    "microsoft/phi-1_5": "phi", "microsoft/phi-2": "phi",
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "nemotron_h",
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": "nemotron_h",
    "nvidia/Nemotron-Mini-4B-Instruct": "nemotron",
    "state-spaces/mamba-2.8b": "mamba", "swiss-ai/Apertus-8B-Instruct-2509": "apertus",
    "tencent/Hunyuan-0.5B-Instruct": "hunyuan_v1_dense",
    **{f"tiiuae/Falcon-H1-{size}": "falcon_h1" for size in (
        "0.5B-Instruct", "1.5B-Base", "1.5B-Deep-Base", "3B-Base", "7B-Base", "34B-Base")},
}
# Keys of a config's `to_dict()` that are bookkeeping, not the model.
_BOOKKEEPING = ("transformers_version", "_name_or_path", "architectures", "dtype",
                "torch_dtype")


def _local_data(config: dict, folder: Path) -> None:
    for entry in config.get("datasets") or []:
        if not isinstance(entry, dict):
            continue
        files = entry.get("data_files") or entry.get("path")
        for local in map(Path, [files] if isinstance(files, str) else files or []):
            if local.suffix in (".jsonl", ".json") and not local.is_absolute():
                (folder / local).parent.mkdir(parents=True, exist_ok=True)
                (folder / local).write_text(json.dumps({"text": "one record"}) + "\n")


def family_of(model_id: str) -> tuple[str, dict] | None:
    """(model type, the config's own choices) of hub model `model_id` (see FAMILIES)."""
    family = FAMILIES.get(model_id.strip())
    if family is None:
        return None
    return (family, {}) if isinstance(family, str) else family


def family_config(model_id: str) -> dict | None:
    """The config.json `model_id`'s family gives it: transformers' own config class of that
    model type (the flagship's structure: layer types, MoE, per-layer fields, towers), with
    the model's own sub-config choices; None where FAMILIES names no family."""
    from transformers import AutoConfig

    family = family_of(model_id)
    if family is None:
        return None
    fields = AutoConfig.for_model(family[0], **family[1]).to_dict()
    for key in _BOOKKEEPING:
        fields.pop(key, None)
    return fields


def _family_cache(cache: Path, model_id: str, fields: dict, revision: str | None = None
                  ) -> None:
    """`fields` as `model_id`'s config.json in the private cache, as the hub client lays it
    out (also as the example's `revision_of_model`, which the family config stands in for)."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    (repo / "snapshots" / "0").mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / "0" / "config.json").write_text(json.dumps(fields))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("0")
    if revision:
        (repo / "refs" / revision).write_text("0")


def _validate_all(jobs: list[tuple[Path, Path, int]]) -> list[tuple[int, str]]:
    """`longctx validate` on each (config, folder, ranks), in this process (the CLI's own entry
    point, run as `longctx validate` runs it): one import of torch for all of them."""
    from typer.testing import CliRunner

    from longctx_cli.cli import app

    results = []
    for path, folder, ranks in jobs:
        os.chdir(folder)
        # Wide enough that no message is wrapped inside a file path (the reasons drop those).
        run = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", str(ranks)],
                                 env={"COLUMNS": "4000"})
        results.append((run.exit_code, " ".join(run.output.split())))
    os.chdir(ROOT)
    return results


def _validate_with_families(jobs: list[tuple[Path, Path, int]], cache: Path
                            ) -> list[tuple[int, str]]:
    """The same in a child process whose Hugging Face cache is `cache`, which holds each
    model's family config (the hub client reads its cache folder once, when it is
    imported)."""
    spec = Path(cache) / "jobs.json"
    spec.write_text(json.dumps([[str(p), str(f), n] for p, f, n in jobs]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    run = subprocess.run([sys.executable, __file__, "--worker", str(spec)], env=env,
                         capture_output=True, text=True, check=True)
    return [tuple(r) for r in json.loads(run.stdout)]


def _reason(output: str) -> str:
    """The first problem of a refusal, with its file location and quoted values dropped."""
    output = output[output.find("error:"):] if "error:" in output else output  # after a plan
    first = re.sub(r"^error: (\d+ problems in the config: )?", "", output)
    first = re.sub(r"^\S+\.ya?ml(:\d+:\d+)?: ", "", first)
    first = re.sub(r" \S+\.ya?ml:\d+:\d+: .*", "", first)
    first = first.split(" Fix:")[0]
    first = re.sub(r"(?<![A-Za-z])'[^']*'(?![A-Za-z])", "'...'", first)  # not apostrophes
    return re.sub(r"('\.\.\.', )+('\.\.\.' or )?'\.\.\.'", "'...'", first)[:150]


# The degrees an Axolotl config multiplies its world from, where it names its data-parallel
# ones (`dp_shard_size: 16  # requires 2x8xH100 nodes`); any other runs at `--nproc-per-node`.
DEGREES = ("dp_replicate_size", "dp_shard_size", "context_parallel_size",
           "tensor_parallel_size", "expert_parallel_size")


def ranks_of(config: dict, default: int) -> int:
    """The rank count `config` was written for (see DEGREES)."""
    if not any(isinstance(config.get(k), int) for k in DEGREES[:2]):
        return default
    world = 1
    for key in DEGREES:
        world *= config[key] if isinstance(config.get(key), int) and config[key] > 0 else 1
    return world


def survey(axolotl: Path, nproc: int, only: list[str] | None = None) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    examples = sorted(p for p in (axolotl / "examples").rglob("*.y*ml")
                      if "archived" not in p.parts
                      and (not only or any(o in str(p.relative_to(axolotl)) for o in only)))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs, configs = [], []
        for i, path in enumerate(examples, 1):
            try:
                config = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError:
                config = {}
            config = config if isinstance(config, dict) else {}
            folder = Path(tmp) / f"run{i}"
            folder.mkdir()
            _local_data(config, folder)
            jobs.append((path.resolve(), folder, ranks_of(config, nproc)))
            configs.append(config)
        print(f"validating {len(jobs)} configs ...", file=sys.stderr)
        results: list[tuple] = list(_validate_all(jobs))
        hub = [i for i, (code, out) in enumerate(results)
               if code != 0 and any(h in out for h in HUB) and configs[i].get("base_model")]
        cache = Path(tmp) / "hf-cache"
        cache.mkdir()
        known = []
        for i in hub:
            model_id = str(configs[i].get("base_model_config") or configs[i]["base_model"])
            fields = family_config(model_id)
            if fields is None:
                results[i] = (2, f"the benchmark knows no transformers family for `{model_id}`"
                              " (FAMILIES)", "family")
                continue
            revision = configs[i].get("revision_of_model")
            _family_cache(cache, model_id.strip(), fields,
                          str(revision) if revision is not None else None)
            known.append(i)
        print(f"again with each model's family config: {len(known)} configs ...",
              file=sys.stderr)
        for i, result in zip(known, _validate_with_families([jobs[i] for i in known], cache),
                             strict=True):
            results[i] = (result[0], result[1], "family")
        for path, config, result in zip(examples, configs, results, strict=True):
            model_id = str(config.get("base_model_config") or config.get("base_model") or "")
            family = family_of(model_id) if model_id else None
            row = {"config": str(path.relative_to(axolotl)), "outcome": "refused",
                   "family": family[0] if family else None,
                   "ranks": ranks_of(config, nproc)}
            if result[0] == 0:
                row["outcome"] = WITH_CONFIG if len(result) > 2 else "valid"
            else:
                row["reason"] = _reason(result[1])
                if len(result) > 2 and row["family"]:  # the family's config was read
                    row["reason"] += f" (with the `{row['family']}` config)"
            rows.append(row)
    return {"date": datetime.date.today().isoformat(), "nproc_per_node": nproc,
            "axolotl_commit": _commit(axolotl), "configs": rows,
            "families": per_family(rows)}


def per_family(rows: list[dict]) -> dict[str, dict]:
    """{model type: {valid, refused, reasons: {reason: configs}}} over the examples' rows
    (`?` for those without a hub model the table knows)."""
    out: dict[str, dict] = {}
    for row in rows:
        entry = out.setdefault(row["family"] or "?", {"valid": 0, "refused": 0, "reasons": {}})
        if row["outcome"] == "refused":
            entry["refused"] += 1
            entry["reasons"][row["reason"]] = entry["reasons"].get(row["reason"], 0) + 1
        else:
            entry["valid"] += 1
    return dict(sorted(out.items()))


def _commit(axolotl: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(axolotl), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# Why a refused example is refused, by the words of its reason: a feature longctx does not
# offer (docs/axolotl.md's key table lists each), an error of the example itself (Axolotl
# too refuses it, or would skip or train nothing of what it names), or a computation longctx
# cannot do exactly yet (it refuses rather than train a different model).
OUT_OF_SCOPE = "a feature out of scope"
EXAMPLE_ERROR = "an error of the example itself"
NOT_EXACT = "not exact here yet"
REMOTE_CODE = "a model whose code is not in transformers (not checked offline)"
KINDS = (
    ("knows no transformers family", REMOTE_CODE),
    *((mark, OUT_OF_SCOPE) for mark in (
        "`ebft` is not", "`qat` is not", "`use_onebitllms` is not", "`diffusion` is not",
        "`gptq` is not", "`lisa_n_layers` is not", "LoftQ", "`relora` is not",
        "`fp8` is not", "`use_ray` is not", "`rl: gdpo`", "`optimizer: muon`",
        "cloud launcher config", "`use_eaft` is not", "is not a causal-LM or image-text class",
        "audio inputs are not supported", "`expert_parallel_token_capacity` is not")),
    *((mark, EXAMPLE_ERROR) for mark in (
        "unknown key", "`warmup_steps` = ", "`unfrozen_parameters`",
        "the model has no module named")),
)


def reason_kind(reason: str) -> str:
    """The kind of a refusal (`KINDS`); what no mark names is not exact here yet."""
    return next((kind for mark, kind in KINDS if mark in reason), NOT_EXACT)


def summary(result: dict) -> str:
    rows = result["configs"]
    outcomes = collections.Counter(r["outcome"] for r in rows)
    reasons = collections.Counter(r["reason"] for r in rows if "reason" in r)
    kinds = collections.Counter(reason_kind(r["reason"]) for r in rows if "reason" in r)
    families = result.get("families") or per_family(rows)
    lines = [
        f"Measured by `python benchmarks/axolotl_examples.py` on {len(rows)} configs of "
        f"Axolotl's `examples/` (commit {result['axolotl_commit']}, `archived/` left out, "
        f"offline, {result['date']}; each at the rank count its data-parallel degrees "
        f"multiply to, else {result['nproc_per_node']}"
        + (f"; {len(result['rerun'])} configs rerun after a mend on "
           f"{', '.join(sorted(set(result['rerun'].values())))}" if result.get("rerun") else "")
        + "):",
        "",
        f"- {outcomes['valid'] + outcomes[WITH_CONFIG]} validate unchanged: "
        f"{outcomes['valid']} as they are, {outcomes[WITH_CONFIG]} whose model needs the hub "
        "(which the run had not) with that model's family config in its place "
        "(transformers' own config class of the model's type: its layers, experts, towers);",
        f"- {outcomes['refused']} are refused, each in one paragraph:",
        "",
        markdown_table(["refused for", "configs"],
                       ([k, kinds[k]] for k in (OUT_OF_SCOPE, EXAMPLE_ERROR, REMOTE_CODE,
                                                NOT_EXACT) if kinds[k]),
                       right=(1,)),
        "",
        "Their first reasons:",
        "",
        markdown_table(["configs", "kind", "first reason"],
                       ([n, reason_kind(reason), reason.replace("|", "/")]
                        for reason, n in reasons.most_common())),
        "",
        "By family (the model type of each example's model):",
        "",
        markdown_table(["family", "valid", "refused"],
                       ([f"`{name}`", f["valid"], f["refused"]]
                        for name, f in families.items()), right=(1, 2)),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("axolotl", type=Path, nargs="?", help="an Axolotl checkout")
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--docs", action="store_true", help="rewrite docs/axolotl.md's summary")
    parser.add_argument("--from-json", type=Path, help="summarise an earlier run's JSON")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="just the configs whose path holds TEXT (repeatable); prints "
                             "each outcome and writes no results file")
    parser.add_argument("--update", action="store_true",
                        help="with --only: write those configs' outcomes into the newest "
                             "saved results (naming them under `rerun`), so a mend needs no "
                             "full survey")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # the family pass, in its own process (see _validate_with_families)
        jobs = [(Path(p), Path(f), n) for p, f, n in json.loads(args.worker.read_text())]
        print(json.dumps(_validate_all(jobs)))
        return
    if args.only:
        rerun = survey(args.axolotl, args.nproc_per_node, args.only)
        for row in rerun["configs"]:
            print(f"{row['config']}: {row['outcome']}"
                  + (f"\n    {row['reason']}" if "reason" in row else ""))
        if not args.update:
            return
        newest = sorted(RESULTS.glob("axolotl-examples-*.json"))[-1]
        result = json.loads(newest.read_text())
        fresh = {row["config"]: row for row in rerun["configs"]}
        result["configs"] = [fresh.get(row["config"], row) for row in result["configs"]]
        result["rerun"] = {**result.get("rerun", {}), **dict.fromkeys(fresh, rerun["date"])}
        result["families"] = per_family(result["configs"])
        result["summary"] = summary(result)
        write_results(newest, result)
        print(f"updated {shown(newest)}", file=sys.stderr)
    elif args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = survey(args.axolotl, args.nproc_per_node)
        result["summary"] = summary(result)
        out = write_results(RESULTS / f"axolotl-examples-{result['date']}.json", result)
        print(f"wrote {shown(out)}", file=sys.stderr)
    print(result.get("summary") or summary(result))
    if args.docs:  # docs/axolotl.md shows the newest results file's summary
        from longctx_cli.config.docs import render_axolotl

        (ROOT / "docs" / "axolotl.md").write_text(render_axolotl())


if __name__ == "__main__":
    main()
