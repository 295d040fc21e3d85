"""`longctx validate` on every model type transformers builds a causal LM or an
image-text-to-text model from: each gets a verdict, exact (the fidelity probe passed) or
refused in one paragraph, never a traceback.

    python benchmarks/family_sweep.py [--types llama gemma4_text ...] [--update] [--docs]

Each model type runs with the family's own defaults (`AutoConfig.for_model`, the sizes
transformers gives its flagship, per-layer fields and all) as an inline `model_config`, one
text dataset, sp 1, in this process (imports paid once). A config transformers itself cannot
build, or (where the probe could not check it) whose model its own class cannot build
from the default (on the meta device), is listed apart ("not built"); `PUBLISHED_FIELDS`
sets the fields whose default its own model cannot run. Prints a table (verdicts, then the
refusals grouped by their first words), writes `benchmarks/results/family-sweep-<date>.json`;
docs/families.md shows its summary (`python -m tests.family_matrix > docs/families.md`, or
`--docs`).
`--types ... --update` reruns those types and writes their verdicts into the newest saved
sweep (naming them and the date under "rerun"), so one family's mend needs no full sweep.
A 12 GiB address-space cap turns a runaway allocation into a refusal, not the machine's OOM.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, markdown_table, save_record, shown, write_results

MEMORY_CAP = 12 * 1024**3
# Keys of a config's `to_dict()` that are bookkeeping, not the model.
_BOOKKEEPING = ("transformers_version", "_name_or_path", "architectures", "dtype",
                "torch_dtype")


def model_types() -> list[str]:
    """Every model type of transformers' causal-LM and image-text-to-text mappings."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
                  | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


# Fields transformers' defaults leave unset although its own model cannot run without them,
# set to the published checkpoint's value (the model type's flagship).
PUBLISHED_FIELDS = {
    "deepseek_v2": {"num_experts_per_tok": 6},  # DeepSeek-V2: its router's top_k is None else
}


def _own_model_builds(model_type: str, config: Any) -> str | None:
    """None if transformers' own model class builds from `config` (on the meta device, no
    memory), else its error: a default config its own model cannot take is not longctx's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto = (AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            else AutoModelForImageTextToText)
    try:
        with torch.device("meta"):
            auto.from_config(config)
    except ImportError:  # an optional library (timm) missing here: validate says what it does
        return None
    except Exception as e:  # noqa: BLE001 - any failure of transformers' own class
        return f"transformers' own model fails on its defaults: {type(e).__name__}: {_first(e)}"
    return None


def verdict(model_type: str, folder: Path) -> dict[str, Any]:
    """`longctx validate` on the family's default config: {verdict, reason, seconds}."""
    import yaml
    from transformers import AutoConfig
    from typer.testing import CliRunner

    from longctx_cli.cli import app

    started = time.perf_counter()
    try:
        default = AutoConfig.for_model(model_type, **PUBLISHED_FIELDS.get(model_type, {}))
        fields = default.to_dict()
    except Exception as e:  # transformers' own limit, not longctx's
        return {"verdict": "not built", "reason": f"{type(e).__name__}: {_first(e)}",
                "seconds": 0.0}
    for key in _BOOKKEEPING:
        fields.pop(key, None)
    data = folder / "data.jsonl"
    if not data.exists():
        data.write_text(json.dumps({"text": "one record"}) + "\n")
    config = folder / f"{model_type}.yaml"
    config.write_text(yaml.safe_dump({
        "model_config": fields, "tokenizer": "byte", "datasets": [{"path": str(data)}],
        "sequence_len": 256, "dtype": "float32", "output_dir": str(folder / model_type),
    }))
    result = CliRunner().invoke(app, ["validate", str(config)], catch_exceptions=True)
    seconds = round(time.perf_counter() - started, 1)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return {"verdict": "traceback", "seconds": seconds,
                "reason": f"{type(result.exception).__name__}: {_first(result.exception)}"}
    text = " ".join(result.output.split())
    if result.exit_code == 0:
        probe = text[text.find("fidelity probe:"):].removesuffix(" valid")
        return {"verdict": "exact", "reason": probe, "seconds": seconds}
    reason = text[text.find("error:"):].removeprefix("error: ")
    own_failure = _own_model_builds(model_type, default) if "could not check" in reason else None
    if own_failure is not None:  # the probe's tiny copy failed where transformers' own does
        return {"verdict": "not built", "reason": own_failure, "seconds": seconds}
    return {"verdict": "refused", "reason": reason, "seconds": seconds}


def _first(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""


def reason_group(reason: str) -> str:
    """A refusal's kind: the words that name why, without the model's own names."""
    for mark, group in (
        ("takes images, but longctx does not rebuild", "a vision-language family longctx "
         "does not rebuild"),
        ("mix tokens outside attention", "layers that mix tokens outside attention (not "
         "covered)"),
        ("has no attention heads", "no attention layers (recurrent / state-space)"),
        ("names no attention heads longctx can read", "no attention heads longctx can read"),
        ("is an encoder-decoder model", "an encoder-decoder model"),
        ("uses sparse attention", "sparse attention (an indexer's top-k keys)"),
        ("prefix LM", "a prefix LM (image and prompt attend both ways)"),
        ("drops attention probabilities of whole rows", "attention dropout under a ring "
         "(the fix names Ulysses or the override)"),
        ("output_router_logits", "router auxiliary loss (the fix names the override)"),
        ("does not dispatch through transformers' AttentionInterface", "attention outside "
         "transformers' AttentionInterface"),
        ("builds its vision tower as the timm backbone", "a timm vision tower (no tiny "
         "copy; its text model is checked alone)"),
        ("could not check", "the probe could not build or run its tiny copy"),
        ("would train a different model", "the probe found a difference"),
    ):
        if mark in reason:
            return group
    return reason.split(":")[0][:80]


def summary(results: dict[str, dict[str, Any]]) -> str:
    """The Markdown docs/families.md shows: counts, refusals by kind, then every verdict."""
    counts = collections.Counter(r["verdict"] for r in results.values())
    groups = collections.Counter(reason_group(r["reason"]) for r in results.values()
                                 if r["verdict"] == "refused")
    order = ("exact", "refused", "traceback", "not built")
    lines = [markdown_table(["verdict", "model types"],
                            [(v, counts[v]) for v in order if counts[v]], right=(1,)),
             "", markdown_table(["why refused", "model types"], groups.most_common(),
                                right=(1,)),
             "", markdown_table(["model type", "verdict", "why"], [
                 (f"`{t}`", r["verdict"], reason_group(r["reason"])
                  if r["verdict"] != "exact" else "fidelity probe passed")
                 for t, r in sorted(results.items())])]
    return "\n".join(lines)


def _updated(rerun: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest saved sweep's verdicts with `rerun`'s in their place."""
    newest = sorted(RESULTS.glob("family-sweep-*.json"))[-1]
    return {**json.loads(newest.read_text())["results"], **rerun}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="only these model types")
    parser.add_argument("--update", action="store_true",
                        help="write the --types verdicts into the newest saved sweep")
    parser.add_argument("--docs", action="store_true", help="regenerate docs/families.md")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, hard))
    types = args.types or model_types()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            results[model_type] = verdict(model_type, Path(tmp))
            r = results[model_type]
            print(f"{model_type:32} {r['verdict']:10} {r['seconds']:6.1f}s  "
                  f"{reason_group(r['reason']) if r['verdict'] != 'exact' else ''}",
                  flush=True)
    if args.update and args.types:
        results = _updated(results)
    text = summary(results)
    print(text)
    if args.update and args.types:
        newest = sorted(RESULTS.glob("family-sweep-*.json"))[-1]
        record = json.loads(newest.read_text())
        import transformers

        when = time.strftime("%Y-%m-%d")  # a rerun under another transformers names it
        if transformers.__version__ != record["transformers"]:
            when += f" (transformers {transformers.__version__})"
        rerun = {**record.get("rerun", {}), **{t: when for t in args.types}}
        write_results(newest, {**record, "results": results, "summary": text, "rerun": rerun})
        print(f"updated {shown(newest)}")
    elif not args.types:
        import transformers

        save_record("family-sweep", {"transformers": transformers.__version__,
                                     "results": results, "summary": text})
    if args.docs:
        from tests.family_matrix import render

        (Path(__file__).resolve().parent.parent / "docs" / "families.md").write_text(render())


if __name__ == "__main__":
    main()
