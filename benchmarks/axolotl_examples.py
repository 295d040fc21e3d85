"""Validate every config of an Axolotl checkout's `examples/` folder, unchanged, offline.

    python benchmarks/axolotl_examples.py PATH/TO/axolotl [--nproc-per-node 8] [--docs]

Each config is run through `longctx validate` as a user would (8 ranks by default, as most
of Axolotl's multi-GPU examples assume), in a folder of its own where its local data files
exist (one record each). A config whose model needs the hub (no network here) is run a second
time with a stand-in config.json in a private Hugging Face cache (llama-shaped, or for a
vision-language example of a family longctx trains, that family's default config): that
second pass checks everything but the model's own shape. `examples/archived` is left out. Prints a
table of the outcomes (refusals grouped by their reason), writes
`benchmarks/results/axolotl-examples-<date>.json` (with the summary docs/axolotl.md shows),
and with `--docs` regenerates docs/axolotl.md.
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

STAND_IN = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rope_theta": 500000.0}
WITH_CONFIG = "valid once the model's config is at hand"
HUB = ("hub is unreachable", "cannot read the config of `base_model`")


def _local_data(config: dict, folder: Path) -> None:
    for entry in config.get("datasets") or []:
        if not isinstance(entry, dict):
            continue
        files = entry.get("data_files") or entry.get("path")
        for local in map(Path, [files] if isinstance(files, str) else files or []):
            if local.suffix in (".jsonl", ".json") and not local.is_absolute():
                (folder / local).parent.mkdir(parents=True, exist_ok=True)
                (folder / local).write_text(json.dumps({"text": "one record"}) + "\n")


# A vision-language example (`processor_type`) of a family longctx trains gets that family's
# default config (transformers' own) as its stand-in, found by the model's name; any other
# keeps the llama one, which then says it has no vision tower.
VLM_STAND_INS = (("qwen2.5-vl", "Qwen2_5_VLConfig"), ("qwen2-vl", "Qwen2VLConfig"),
                 ("qwen3-vl", "Qwen3VLConfig"), ("llava", "LlavaConfig"),
                 ("gemma-3-", "Gemma3Config"))


def stand_in_config(model_id: str, vision: bool) -> dict:
    """The config.json a stand-in for `model_id` holds (see VLM_STAND_INS)."""
    import transformers

    name = model_id.lower()
    for pattern, config_class in VLM_STAND_INS if vision else ():
        if pattern in name and "gemma-3n" not in name:
            return getattr(transformers, config_class)().to_dict()
    return STAND_IN


def _stand_in(cache: Path, model_id: str, vision: bool = False) -> None:
    """A config.json for `model_id` in the private cache, as the hub client lays it out."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    (repo / "snapshots" / "0").mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / "0" / "config.json").write_text(
        json.dumps(stand_in_config(model_id, vision)))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("0")


def _validate_all(jobs: list[tuple[Path, Path]], nproc: int) -> list[tuple[int, str]]:
    """`longctx validate` on each (config, folder), in this process (the CLI's own entry
    point, run as `longctx validate` runs it): one import of torch for all of them."""
    from typer.testing import CliRunner

    from longctx_cli.cli import app

    results = []
    for path, folder in jobs:
        os.chdir(folder)
        run = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", str(nproc)])
        results.append((run.exit_code, " ".join(run.output.split())))
    os.chdir(ROOT)
    return results


def _validate_with_stand_ins(jobs: list[tuple[Path, Path]], nproc: int, cache: Path
                             ) -> list[tuple[int, str]]:
    """The same in a child process whose Hugging Face cache is `cache` (the hub client reads
    its cache folder once, when it is imported)."""
    spec = Path(cache) / "jobs.json"
    spec.write_text(json.dumps([[str(p), str(f)] for p, f in jobs]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    run = subprocess.run([sys.executable, __file__, "--worker", str(spec),
                          "--nproc-per-node", str(nproc)], env=env, capture_output=True,
                         text=True, check=True)
    return [tuple(r) for r in json.loads(run.stdout)]


def _reason(output: str) -> str:
    """The first problem of a refusal, with its file location and quoted values dropped."""
    first = re.sub(r"^error: (\d+ problems in the config: )?", "", output)
    first = re.sub(r"^\S+\.ya?ml(:\d+:\d+)?: ", "", first)
    first = re.sub(r" \S+\.ya?ml:\d+:\d+: .*", "", first)
    first = first.split(" Fix:")[0]
    first = re.sub(r"'[^']*'", "'...'", first)
    return re.sub(r"('\.\.\.', )+('\.\.\.' or )?'\.\.\.'", "'...'", first)[:150]


def survey(axolotl: Path, nproc: int) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    examples = sorted(p for p in (axolotl / "examples").rglob("*.y*ml")
                      if "archived" not in p.parts)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs, configs = [], []
        for i, path in enumerate(examples, 1):
            try:
                config = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError:
                config = {}
            folder = Path(tmp) / f"run{i}"
            folder.mkdir()
            if isinstance(config, dict):
                _local_data(config, folder)
            jobs.append((path.resolve(), folder))
            configs.append(config if isinstance(config, dict) else {})
        print(f"validating {len(jobs)} configs ...", file=sys.stderr)
        results = _validate_all(jobs, nproc)
        hub = [i for i, (code, out) in enumerate(results)
               if code != 0 and any(h in out for h in HUB) and configs[i].get("base_model")]
        cache = Path(tmp) / "hf-cache"
        cache.mkdir()
        for i in hub:
            model_id = configs[i].get("base_model_config") or configs[i]["base_model"]
            _stand_in(cache, str(model_id), bool(configs[i].get("processor_type")))
        print(f"again with a stand-in model config: {len(hub)} configs ...", file=sys.stderr)
        for i, result in zip(hub, _validate_with_stand_ins([jobs[i] for i in hub], nproc, cache),
                             strict=True):
            results[i] = (result[0], result[1], "stand-in")
        for path, result in zip(examples, results, strict=True):
            row = {"config": str(path.relative_to(axolotl)), "outcome": "refused"}
            if result[0] == 0:
                row["outcome"] = WITH_CONFIG if len(result) > 2 else "valid"
            else:
                row["reason"] = _reason(result[1])
                if len(result) > 2:  # the stand-in config may be what it refused
                    row["reason"] += " (with the stand-in config)"
            rows.append(row)
    return {"date": datetime.date.today().isoformat(), "nproc_per_node": nproc,
            "axolotl_commit": _commit(axolotl), "configs": rows}


def _commit(axolotl: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(axolotl), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def summary(result: dict) -> str:
    rows = result["configs"]
    outcomes = collections.Counter(r["outcome"] for r in rows)
    reasons = collections.Counter(r["reason"] for r in rows if "reason" in r)
    lines = [
        f"Measured by `python benchmarks/axolotl_examples.py` on {len(rows)} configs of "
        f"Axolotl's `examples/` (commit {result['axolotl_commit']}, `archived/` left out, "
        f"{result['nproc_per_node']} ranks, offline, {result['date']}):",
        "",
        f"- {outcomes['valid']} validate unchanged;",
        f"- {outcomes[WITH_CONFIG]} validate unchanged once the model's "
        "config.json is at hand (their models need the hub, which the run had not; a "
        "stand-in config was used, so these check everything but the model's shape);",
        f"- {outcomes['refused']} are refused, each in one paragraph. First reasons:",
        "",
        markdown_table(["configs", "first reason"],
                       ([n, reason.replace("|", "/")] for reason, n in reasons.most_common())),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("axolotl", type=Path, nargs="?", help="an Axolotl checkout")
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--docs", action="store_true", help="rewrite docs/axolotl.md's summary")
    parser.add_argument("--from-json", type=Path, help="summarise an earlier run's JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # the stand-in pass, in its own process (see _validate_with_stand_ins)
        jobs = [(Path(p), Path(f)) for p, f in json.loads(args.worker.read_text())]
        print(json.dumps(_validate_all(jobs, args.nproc_per_node)))
        return
    if args.from_json:
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
