"""The measured figures README.md and docs/ show, each written from its results JSON.

    python benchmarks/figures.py                   # rewrite every generated block
    python benchmarks/figures.py --check           # change nothing; exit 1 where one is stale
    python benchmarks/figures.py --time-validate 5 # time `longctx validate`, 5 runs -> JSON

A generated block is the text between `<!-- NAME:start -->` and `<!-- NAME:end -->` on a
page. Each one has exactly one renderer here, and each renderer reads one or more files of
`benchmarks/results/` (where a benchmark has its own rendering code, the renderer calls it).
`tests/test_front_door.py` fails when a block is not what its renderer writes now, when
README.md, benchmarks/README.md or a page of docs/ holds a block no renderer knows, and when
one of those pages shows a measured figure outside a block. The Quickstart's train log in
docs/training.md is one block too: an excerpt of the log `benchmarks/quickstart.py
--record-run` recorded.

`--time-validate N` runs `longctx validate examples/tiny_passkey.yaml --nproc-per-node 2`
N times from the repository's root (fidelity probe on, as by default) and writes
`benchmarks/results/validate-time-<date>.json`: seconds to the plan's first line and to
the exit, the machine, and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS, ROOT, cpu_model, markdown_table, span, write_results


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _wrap(name: str, body: str) -> str:
    start, end = _markers(name)
    return f"{start}\n{body.strip()}\n{end}"


# ---- the GPU status: one ratio over every one-GPU throughput file ---------------------------

GPU_FILES = "gpu-*.json"


def gpu_speed() -> tuple[list[str], float, float]:
    """The cards measured (short names) and the lowest and highest ratio of longctx's
    tokens/s to plain HF's at the same length in the same file, over every GPU file."""
    cards, ratios = [], []
    for path in sorted(glob.glob(str(RESULTS / GPU_FILES))):
        report = json.loads(Path(path).read_text())
        if report.get("dry_run"):
            continue
        card = re.search(r"[ahbl]\d{2,3}", report["device"].lower())
        name = card.group(0).upper() if card else report["device"]
        if name not in cards:
            cards.append(name)
        ok = [r for r in report.get("throughput", []) if r["status"] == "ok"]
        for r in ok:
            if r["impl"].startswith("longctx/torch_flash"):
                hf = [h for h in ok if h["impl"].startswith("hf/") and h["tokens"] == r["tokens"]]
                ratios += [r["tokens_per_s"] / h["tokens_per_s"] for h in hf]
    return cards, min(ratios), max(ratios)


def status_line() -> str:
    """The status in one line: the README's box, and the header of every GPU example."""
    cards, low, high = gpu_speed()
    return (f"Status: CPU tested; one GPU measured ({' and '.join(cards)}: a step at "
            f"{low:.2f}-{high:.2f}x plain HF's speed); several GPUs and several nodes "
            "implemented, never run.")


def status_box() -> str:
    cards, low, high = gpu_speed()
    one = " and one ".join(cards)
    return _wrap("status", markdown_table(["hardware", "status"], [
        ["CPU (`gloo`)", "tested: every strategy against the model's own training, in the test "
         "suite ([how](docs/families.md#how-exactness-is-judged))"],
        ["one GPU", f"measured on one {one}: a step at {low:.2f}-{high:.2f}x plain HF's speed "
         "([gpu.md](docs/gpu.md#measured-on-an-h100-and-an-h200))"],
        ["several GPUs, several nodes", "implemented, never run"],
    ]))


def _card(report: dict) -> str:
    card = re.search(r"[ahbl]\d{2,3}", report["device"].lower())
    return card.group(0).upper() if card else report["device"]


def gpu_summary() -> str:
    """docs/gpu.md's summary: per card, longctx's speed and memory against plain HF's at the
    same length in the same file, and the estimate against the peak (the card's newest file
    with a `longest` part, the estimate recomputed by the current code)."""
    from benchmarks.gpu import LLAMA3_8B, estimate_bytes, longctx_config

    by_card: dict[str, list[tuple[str, dict]]] = {}
    # A lease's first file, then the ones named after it (`-remeasured`, `-second`).
    def lease(path: str) -> tuple[str, int]:
        return re.sub(r"-[a-z]+\.json$", ".json", path), len(path)

    for path in sorted(glob.glob(str(RESULTS / GPU_FILES)), key=lease):
        report = json.loads(Path(path).read_text())
        if not report.get("dry_run"):
            by_card.setdefault(_card(report), []).append((Path(path).name, report))
    rows = []
    for card, reports in by_card.items():
        speed, memory, estimate = [], [], []
        for _, report in reports:
            ok = [r for r in report.get("throughput", []) if r["status"] == "ok"]
            for r in ok:
                if not r["impl"].startswith("longctx/torch_flash"):
                    continue
                for h in (h for h in ok if h["impl"].startswith("hf/")
                          and h["tokens"] == r["tokens"]):
                    speed.append(r["tokens_per_s"] / h["tokens_per_s"])
                    if r["tokens"] >= 32768:
                        memory.append(r["peak_bytes"] / h["peak_bytes"])
        longest = [r for _, r in reports if "longest" in r]
        if longest:
            lg = longest[-1]["longest"]
            for trial in lg["trials"]:
                if trial["status"] == "ok" and trial.get("peak_bytes"):
                    config = longctx_config(LLAMA3_8B, trial["tokens"], lg["kernel"], "bfloat16",
                                            **lg["options"])
                    estimate.append(estimate_bytes(config, lg["kernel"], True)
                                    / trial["peak_bytes"])
        rows.append([card, ", ".join(f"`{name}`" for name, _ in reports), span(speed, ".2f", "x"),
                     span(memory, ".2f", "x"), span(estimate, ".2f", "x") if estimate else "-"])
    return _wrap("gpu-summary", markdown_table(
        ["card", "files", "longctx's tok/s / plain HF's", "longctx's peak / HF's, 32K on",
         "`validate`'s estimate / peak, the last lease"], rows))


def gpu_file(name: str, stem: str) -> Callable[[], str]:
    """Every table `python benchmarks/gpu.py --table` prints for one GPU file."""
    def render() -> str:
        from benchmarks.gpu import tables

        return _wrap(name, f"{tables(_json(stem))}\n\n`benchmarks/results/{stem}`")
    return render


# ---- README: the Quickstart's time, the comparison with ALST --------------------------------

# The README shows every machine the Quickstart was timed on (same seed, different CPUs).
QUICKSTART = ("quickstart-2026-11-28.json", "quickstart-2026-12-04-amd.json")
PEERS = ("peers-startup-2026-11-27.json", "reach-2026-11-27.json",
         "live-activations-lean-2026-11-27.json")


def quickstart_time() -> str:
    from benchmarks.quickstart import readme_line

    measured = []
    for name in QUICKSTART:
        data = _json(name)
        data.setdefault("json", f"benchmarks/results/{name}")
        measured.append(data)
    return readme_line(measured)


def peers_table() -> str:
    from benchmarks.peers import side_by_side

    peers, reach, live = (_json(name) for name in PEERS)
    name, row = next(iter(peers["results"].items()))
    table = side_by_side(row, reach, live, peers.get("tokens", {}).get(name))
    command = (f"python benchmarks/peers.py --table benchmarks/results/{PEERS[0]} --reach "
               f"benchmarks/results/{PEERS[1]} --live benchmarks/results/{PEERS[2]}")
    return _wrap("peers", f"{table}\n\nThe table: `{command}`, from runs of {peers['date']} "
                 f"on a VM ({peers['machine']}).")


# ---- docs: blocks whose benchmark renders them ----------------------------------------------


def example_results() -> str:
    from benchmarks.example import readme_section

    return readme_section(_json("example-2026-11-23.json"))


def example_ruler() -> str:
    from benchmarks.example_after import docs_section

    return docs_section(_json("example-after-2026-11-24.json"))


def hybrid_bench() -> str:
    from benchmarks.hybrid import docs_section

    return docs_section([RESULTS / "hybrid-2026-11-24.json",
                         RESULTS / "hybrid-one-document-2026-11-24.json",
                         RESULTS / "hybrid-prefix-one-document-2026-11-24.json"])


def balance_table() -> str:
    from benchmarks.balance import readme_table

    return _wrap("balance", readme_table(_json("balance.json")))


# ---- docs: blocks rendered here -------------------------------------------------------------


def prefix_sharing() -> str:
    name = "prefix-sharing-2026-11-26.json"
    data = _json(name)
    rows = data["rows"]
    unshared, shared = rows["unshared"], rows["shared"]

    def cells(row: dict) -> str:
        lo, med, hi = row["s_per_step"]
        return (f"{lo:.2f} / {med:.2f} / {hi:.2f} | {row['peak_mib'][0]:,.0f}-"
                f"{row['peak_mib'][1]:,.0f} MiB")

    time_cut = 1 - shared["s_per_step"][1] / unshared["s_per_step"][1]
    mem_cut = 1 - max(shared["peak_mib"]) / max(unshared["peak_mib"])
    model = data["model"]
    return _wrap("prefix-sharing-results", "\n".join([
        f"Measured by `python {data['command']}` (2-core AMD EPYC, {data['date']},",
        f"benchmarks/results/{name}): DPO with LoRA (the reference pass",
        f"included) on a Llama from config (hidden {model['hidden_size']}, "
        f"{model['num_hidden_layers']} layers, vocabulary {model['vocab_size']:,}, float32), one",
        f"pair a step with an {data['prompt_tokens']:,}-token prompt and answers of about 60 "
        "tokens, sp 2 on the default",
        f"ring (the P2P stripe ring on CPU), {data['runs']} alternated runs, steps "
        f"2-{data['steps']}:",
        "",
        "| | s/step, min / median / max | peak RSS per rank |",
        "| --- | --- | --- |",
        f"| unshared (`sequence_len` {data['sequence_len']:,}) | {cells(unshared)} |",
        f"| `prefix_sharing: true` | {cells(shared)} |",
        "",
        f"{time_cut:.0%} less time per step (more than the half of the tokens it drops: "
        "attention over a",
        f"document grows with its square) and {mem_cut:.0%} less memory, with the same loss at "
        "every step (to",
        "1e-5). What it does not show: GPU speed, or prompts short next to their answers, "
        "where the",
        "saving shrinks to the prompt's share of the row.",
    ]))


def preference_results() -> str:
    name = "preference_example-2026-11-26.json"
    data = _json(name)
    runs = data["runs"]
    steps = sorted(runs[0]["held_out_accuracy"], key=int)
    # One column per evaluation; after the first where every seed is at 100%, the rest of
    # the run (every seed still at 100%) in one column.
    cols: list[tuple[str, list[float]]] = []
    for step in steps:
        values = [r["held_out_accuracy"][step] for r in runs]
        full = min(values) == 1.0
        if full and len(cols) > 1 and min(cols[-1][1]) == 1.0 and min(cols[-2][1]) == 1.0:
            cols[-1] = (f"{cols[-1][0].split('-')[0]}-{step}", values)
        else:
            cols.append((step, values))

    def pct(values: list[float]) -> str:
        lo, hi = (round(100 * v) for v in (min(values), max(values)))
        return f"{lo}%" if lo == hi else f"{lo}-{hi}%"

    seeds = [r["seed"] for r in runs]
    minutes = [r["seconds"] / 60 for r in runs]
    return _wrap("preference-results", "\n".join([
        "Held-out reward accuracy (the share of about 130 held-out pairs whose chosen answer "
        "gets the",
        f"higher reward), {len(runs)} seeds, `python benchmarks/preference_example.py --seeds "
        f"{' '.join(map(str, seeds))}`",
        f"(benchmarks/results/{name}), 2-core AMD EPYC, {span(minutes, '.1f')} min per",
        "run while other jobs shared the machine:",
        "",
        "| step | " + " | ".join(c[0] for c in cols) + " |",
        "| --- " * (len(cols) + 1) + "|",
        f"| range over seeds {seeds[0]}-{seeds[-1]} | "
        + " | ".join(pct(c[1]) for c in cols) + " |",
        "",
        "Two seeds stay at chance for the first evaluations and then climb; one is right from "
        "its first",
        "evaluation; all of them end at every pair right. What it shows: the preference",
        "loss alone, computed across 2 ranks, teaches a long-range dependency. What it does "
        "not: this",
        "is a toy task on a model trained from scratch, not alignment of a pretrained model.",
    ]))


def grpo_example() -> str:
    name = "grpo-passkey-2026-11-26.json"
    data = _json(name)
    runs = data["runs"]
    acc = [100 * r["accuracy"] for r in runs]
    first = [r["reward_first_10"] for r in runs]
    last = [r["reward_last_10"] for r in runs]
    minutes = [r["train_s"] / 60 for r in runs]
    seeds = ", ".join(str(r["seed"]) for r in runs)
    return _wrap("grpo-example", "\n".join([
        f"Measured by `python {data['command']}` on a 2-core x86_64 CPU on {data['date']}",
        f"(`benchmarks/results/{name}`), seeds {seeds}: passkey retrieval at",
        "272-320 tokens (teacher-forced exact match of the key, 320 samples over 4 lengths x 5",
        f"depths) goes from **{100 * data['before']:.1f}% before GRPO to "
        f"{span(acc, '.1f')}% after**; the mean reward of the",
        f"rollouts from {span(first, '.2f')} over the first 10 steps to {span(last, '.2f')} "
        f"over the last 10; {span(minutes, '.1f')} min",
        "per run (the machine was shared with other work). A modest, consistent gain, on a "
        "model of",
        "377K parameters: the example shows the machinery learning, not what GRPO does for a "
        "real",
        "model.",
    ]))


ROLLOUT = "rollout-2026-11-28.json"


def rollout_speed() -> str:
    """GRPO's sampler against the model's own decoding (benchmarks/rollout.py)."""
    from benchmarks.rollout import table

    data = _json(ROLLOUT)
    return _wrap("rollout-speed", "\n".join([
        table(data), "",
        f"`python benchmarks/rollout.py`, {data['machine']}, {data['date']} "
        f"(`benchmarks/results/{ROLLOUT}`).",
    ]))


def peers_run(name: str, *files: str) -> Callable[[], str]:
    """A block of saved peers.py runs of the same rows: each run's table, its command,
    machine and date (several files: the same command on different days)."""
    from benchmarks.peers import table

    def render() -> str:
        parts = []
        for file in files:
            data = _json(file)
            parts.append(f"{table(data['results'])}\n\n`{data['command']}`, {data['machine']}, "
                         f"{data['date']}, {data['total_s'] / 60:.0f} min "
                         f"(`benchmarks/results/{file}`).")
        return _wrap(name, "\n\n".join(parts) + "\n\nThe limit is plain HF's time per step "
                     "over the 2 ranks.")
    return render


def reach_table() -> str:
    from benchmarks.reach import table

    record = _json("reach-2026-11-27.json")
    return _wrap("reach", table(record["summary"], record["budget_gib"], record.get("verified")))


def live_table() -> str:
    from benchmarks.live_activations import table

    record = _json("live-activations-lean-2026-11-27.json")
    return _wrap("live-activations", table(record["tokens"], record["results"]))


ACCOUNT = "live-activations-account-2026-12-03.json"
RING_BACKWARD = "live-activations-ring72-{when}-{tokens}-2026-12-03.json"


def memory_account() -> str:
    from benchmarks.live_activations import account_table

    return _wrap("memory-account", account_table(_json(ACCOUNT)))


def memory_moments() -> str:
    from benchmarks.live_activations import moments_table

    return _wrap("memory-moments", moments_table(_json(ACCOUNT)))


def ring_backward() -> str:
    """The llama3 ring's live per-token peak before and after its backward wrote over its
    inputs, beside Ulysses' (one record per length and side)."""
    def cell(result: dict) -> str:
        return f"{result['bytes_per_token_per_rank']:,} ({result['token_bytes'] / 2**20:,.1f} MiB)"

    rows = []
    for tokens in (8192, 16384, 32768):
        before, after = (_json(RING_BACKWARD.format(when=when, tokens=tokens))["results"]
                         for when in ("before", "after"))
        rows.append([f"{tokens // 1024}K", cell(before["longctx-ring"]),
                     cell(after["longctx-ring"]), cell(after["longctx-ulysses"])])
    return _wrap("ring-backward", markdown_table(
        ["row", "ring before", "ring after", "Ulysses (unchanged)"], rows, right=(1, 2, 3)))


def peers_rows(name: str, stem: str) -> Callable[[], str]:
    def render() -> str:
        from benchmarks.peers import table

        return _wrap(name, table(_json(stem)["results"]))
    return render


QUICKSTART_RUN = "quickstart-run-2026-11-28.json"


def quickstart_run() -> str:
    """What one Quickstart run's `longctx eval` and `generate` printed: the run whose
    training log docs/training.md shows."""
    data = _json(QUICKSTART_RUN)
    passkey, loss = data["passkey"], data["position_loss"]
    model, by_position = passkey["models"][0], loss["models"][0]
    cell = {(c["context_len"], c["depth"]): c for c in model["cells"]}
    lengths = passkey["context_lengths"]
    by_depth = markdown_table(
        ["depth", *(f"{n} tok" for n in lengths)],
        ([f"{depth:.0%}", *(f"{cell[n, depth]['correct']}/{cell[n, depth]['total']}"
                            for n in lengths)] for depth in passkey["depths"]))
    by_place = markdown_table(["held-out loss at positions", "tokens", "loss"], [
        *([f"{b['start']}-{b['end'] - 1}", f"{b['tokens']:,}", f"{b['loss']:.4f}"]
          for b in by_position["buckets"] if b["tokens"]),
        ["all", f"{by_position['tokens']:,}", f"{by_position['overall_loss']:.4f}"]])
    return _wrap("quickstart-run", "\n".join([
        f"Seed {data['seed']}, {data['machine']}, {data['date']} "
        f"(`benchmarks/results/{QUICKSTART_RUN}`). Passkey retrieval, exact match of the key, "
        "correct / total per cell:",
        "",
        by_depth,
        "",
        by_place,
        "",
        f"Overall retrieval {model['accuracy']:.1%}. `longctx generate` printed "
        f"`{data['generate_printed']}`.",
    ]))


def train_log() -> str:
    """The Quickstart's `longctx train` output as docs/training.md shows it: every line of
    the recorded run's log but the step lines, of which the first two, those with a held-out
    evaluation and the last."""
    data = _json(QUICKSTART_RUN)
    lines = (ROOT / data["train_log"]).read_text().splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
    shown = lines[:steps[0]] + [lines[i] for i in steps[:2]]
    for i in steps[2:-1]:
        if "eval_loss" in lines[i]:
            shown += ["...", lines[i]]
    shown += ["...", lines[steps[-1]], *lines[steps[-1] + 1:]]
    seconds = data.get("seconds", {}).get("train")
    took = f", {seconds / 60:.1f} min from the command to its end" if seconds else ""
    return _wrap("train-log", "\n".join([
        f"One run of the commit `{data['commit'][:9]}` on a {data['machine']}, {data['date']}"
        f"{took}.",
        f"Its whole log is `{data['train_log']}` (recorded by "
        "`python benchmarks/quickstart.py --record-run`).",
        "",
        "<!-- log: longctx train examples/tiny_passkey.yaml --nproc-per-node 2 -->",
        "```", *shown, "```",
        "<!-- /log -->",
    ]))


# ---- docs/context.md: a real model past its native context ---------------------------------

CONTEXT_EXTENSION = "context_extension-2026-11-25.json"
CONTEXT_FINETUNE = "context_finetune-2026-11-26.json"


def context_extension() -> str:
    data = _json(CONTEXT_EXTENSION)
    plain, yarn = data["results"]["none"], data["results"]["yarn auto"]
    lines = ["| positions | tokens | loss, no scaling | loss, yarn x2 |", "|---|---|---|---|"]
    for a, b in zip(plain["buckets"], yarn["buckets"], strict=True):
        lines.append(f"| {a['start']:,}-{a['end']:,} | {a['tokens']:,} | {a['loss']:.3f} | "
                     f"{b['loss']:.3f} |")
    native = [(a["loss"], b["loss"]) for a, b in zip(plain["buckets"], yarn["buckets"], strict=True)
              if a["end"] <= data["native"]]
    cost = [100 * (b / a - 1) for a, b in native]
    minutes = [r["seconds"] / 60 for r in (plain, yarn)]
    return _wrap("context-extension", "\n".join([
        *lines,
        f"| cost of yarn inside the native {data['native']:,} positions | | | "
        f"{span(cost, '.1f', '%')} |",
        "",
        f"{data['documents']} documents of {data['length']:,} tokens, {data['machine']}, "
        f"{data['date']}, {span(minutes, '.1f', ' min')} per evaluation "
        f"(`benchmarks/results/{CONTEXT_EXTENSION}`).",
    ]))


def context_finetune() -> str:
    data = _json(CONTEXT_FINETUNE)
    depths = sorted(data["rows"][0]["by_depth"], key=float)
    names = {"base": "SmolLM2 as it is"}
    rows = []
    for row in data["rows"]:
        name = names.get(row["model"], row["model"])
        if row["model"] == "base" and row["scaling"] != "none":
            name = "SmolLM2 + yarn x2"
        rope = "its own" if row["scaling"] == "none" else "yarn, `factor: auto`"
        losses = row.get("losses")
        loss = f"{losses[0]:.3f} / {losses[-1]:.3f}" if losses else "-"
        rows.append([name, rope, row["training"], f"{row['correct']}/{row['total']}",
                     *("{}/{}".format(*row["by_depth"][d]) for d in depths), loss])
    train = [r["train_seconds"] / 60 for r in data["rows"] if "train_seconds" in r]
    evals = [r["eval_seconds"] / 60 for r in data["rows"]]
    return _wrap("context-finetune", "\n".join([
        markdown_table(["model", "RoPE", "training", "keys found",
                        *(f"needle at {float(d):.0%}" for d in depths),
                        "loss, first / last step"], rows),
        "",
        f"{data['machine']}, {data['date']}: {span(train, '.0f', ' min')} of training per "
        f"seed, {span(evals, '.1f', ' min')} per evaluation "
        f"(`benchmarks/results/{CONTEXT_FINETUNE}`).",
    ]))


GRPO_SHARING = "grpo-sharing-2026-11-26.json"


def grpo_sharing() -> str:
    data = _json(GRPO_SHARING)
    rows = data["rows"]
    unshared, shared = rows["unshared"], rows["shared"]

    def cells(row: dict) -> str:
        return (f"{span(row['update_s'], '.1f', ' s')} | "
                f"{statistics.median(row['rollout_s']):.1f} s | "
                f"{span(row['peak_mib'], ',.0f', ' MiB')}")

    cut = 1 - statistics.median(shared["update_s"]) / statistics.median(unshared["update_s"])
    same = all(abs(a - b) < 1e-6 for a, b in zip(shared["losses"], unshared["losses"], strict=True))
    return _wrap("grpo-sharing", "\n".join([
        "| | update, s/step (per run) | rollouts, median s/step | peak resident set per rank |",
        "|---|---|---|---|",
        f"| each completion after its own prompt copy | {cells(unshared)} |",
        f"| the prompt once per group | {cells(shared)} |",
        f"| the update's time saved, at the medians | {cut:.0%} | | |",
        "",
        f"`python {data['command']}`, {data['machine']}, {data['date']}, {data['runs']} "
        f"alternated runs of {data['steps']} steps; the losses "
        f"{'equal' if same else 'NOT equal'} at every step "
        f"(`benchmarks/results/{GRPO_SHARING}`).",
    ]))


# ---- benchmarks/README.md: the CPU benchmarks' own tables -----------------------------------


def bench_table(name: str, module: str, stem: str, key: str) -> Callable[[], str]:
    """The table `benchmarks/<module>.py` prints for `results/<stem>` (its `table()` over
    the JSON's `key`)."""
    def render() -> str:
        table = importlib.import_module(f"benchmarks.{module}").table
        return _wrap(name, f"{table(_json(stem)[key])}\n\n`results/{stem}`")
    return render


VALIDATE_TIME = "validate-time-2026-11-28.json"


def validate_time() -> str:
    data = _json(VALIDATE_TIME)
    runs = data["runs"]
    first = [r["first_output_s"] for r in runs]
    total = [r["total_s"] for r in runs]
    loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
    return _wrap("validate-time", "\n".join([
        markdown_table([f"`{data['command']}`", f"{len(runs)} runs"], [
            ["the plan's first line",
             f"{span(first, '.2f', ' s')} (median {statistics.median(first):.2f} s)"],
            ["done, the fidelity probe included",
             f"{span(total, '.1f', ' s')} (median {statistics.median(total):.1f} s)"]]),
        "",
        f"Timed by `python benchmarks/figures.py --time-validate {len(runs)}` on a "
        f"{data['machine']}, {data['date']}, 1-minute load average {span(loads, '.1f')} "
        f"(`benchmarks/results/{VALIDATE_TIME}`).",
    ]))


# ---- the registry ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: str
    name: str
    render: Callable[[], str]


VLM_EXAMPLE = "vlm-example-2026-11-28.json"


def vlm_example() -> str:
    """What the vision-language example learns over seeds (benchmarks/vlm_example.py)."""
    from benchmarks.vlm_example import table

    data = _json(VLM_EXAMPLE)
    after = [r["after"] for r in data["runs"]]
    return _wrap("vlm-example", "\n".join([
        table(data), "",
        f"Chance is {data['chance']:.0%}. After training, accuracy is "
        + (f"{after[0]:.0%} for each of the {len(after)} seeds." if len(set(after)) == 1
           else f"{min(after):.0%}-{max(after):.0%} over {len(after)} seeds."),
        f"`python benchmarks/vlm_example.py`, {data['machine']}, {data['date']}, load "
        f"average {data['load_average']:.1f} (`benchmarks/results/{VLM_EXAMPLE}`).",
    ]))


VLM_TOWER_MEMORY = "vlm-tower-memory-2026-11-28.json"


def vlm_tower_memory() -> str:
    """The tower's memory per rank, measured, against the plan's estimate
    (benchmarks/vlm_tower_memory.py)."""
    from benchmarks.vlm_tower_memory import summary, table

    data = _json(VLM_TOWER_MEMORY)
    return _wrap("vlm-tower-memory", "\n".join([
        table(data), "",
        f"{summary(data)} Saved: what autograd keeps for backward during the tower's "
        "forward, parameters excluded, each storage once; peak: the most bytes live during "
        "that forward, the rank's pixels included; both the max over ranks, each rank "
        "simulated in one process. Estimate: `VisionTower.activation_bytes` for the same "
        f"patches (the plan counts {data['saved_per_hidden']} values per patch, hidden unit "
        "and layer).",
        f"`python benchmarks/vlm_tower_memory.py`, {data['machine']}, {data['date']}, "
        f"{data['seconds'] / 60:.1f} min (`benchmarks/results/{VLM_TOWER_MEMORY}`).",
    ]))


BLOCKS = [
    Block("README.md", "status", status_box),
    Block("README.md", "quickstart-time", quickstart_time),
    Block("README.md", "peers", peers_table),
    Block("docs/results.md", "quickstart-run", quickstart_run),
    Block("docs/results.md", "example-results", example_results),
    Block("docs/results.md", "peers-ulysses-exchange",
          peers_run("peers-ulysses-exchange", "peers-ulysses-exchange-2026-11-27.json")),
    Block("docs/results.md", "peers-quiet",
          peers_run("peers-quiet", "peers-quiet-2026-12-04.json", "peers-quiet2-2026-12-04.json")),
    Block("docs/results.md", "peers-8k", peers_rows("peers-8k", "peers-2026-11-26.json")),
    Block("docs/results.md", "peers-32k", peers_rows("peers-32k", "peers-32k-2026-11-27.json")),
    Block("docs/results.md", "reach", reach_table),
    Block("docs/results.md", "live-activations", live_table),
    Block("docs/memory.md", "memory-account", memory_account),
    Block("docs/memory.md", "memory-moments", memory_moments),
    Block("docs/memory.md", "ring-backward", ring_backward),
    Block("docs/eval.md", "example-ruler", example_ruler),
    Block("docs/parallelism.md", "hybrid-bench", hybrid_bench),
    Block("docs/parallelism.md", "balance", balance_table),
    Block("docs/preference.md", "prefix-sharing-results", prefix_sharing),
    Block("docs/preference.md", "preference-results", preference_results),
    Block("docs/rl.md", "grpo-example", grpo_example),
    Block("docs/rl.md", "rollout-speed", rollout_speed),
    Block("docs/cli.md", "validate-time", validate_time),
    Block("docs/training.md", "train-log", train_log),
    Block("docs/gpu.md", "gpu-summary", gpu_summary),
    Block("docs/gpu.md", "gpu-h100-first",
          gpu_file("gpu-h100-first", "gpu-nvidia-h100-80gb-hbm3-2026-11-27.json")),
    Block("docs/gpu.md", "gpu-h100-second",
          gpu_file("gpu-h100-second", "gpu-nvidia-h100-80gb-hbm3-2026-11-27-remeasured.json")),
    Block("docs/gpu.md", "gpu-h200-first",
          gpu_file("gpu-h200-first", "gpu-nvidia-h200-2026-11-27.json")),
    Block("docs/gpu.md", "gpu-h200-second",
          gpu_file("gpu-h200-second", "gpu-nvidia-h200-2026-11-27-second.json")),
    Block("docs/context.md", "context-extension", context_extension),
    Block("docs/context.md", "context-finetune", context_finetune),
    Block("docs/rl.md", "grpo-sharing", grpo_sharing),
    Block("docs/vlm.md", "vlm-example", vlm_example),
    Block("docs/vlm.md", "vlm-tower-memory", vlm_tower_memory),
    *(Block("benchmarks/README.md", name, bench_table(name, module, stem, key))
      for name, module, stem, key in [
          ("attention", "attention", "attention.json", "results"),
          ("attention-16k-rerun", "attention", "attention_16k_rerun.json", "results"),
          ("attention-16k-idle", "attention", "attention_16k_idle.json", "results"),
          ("strategies", "attention_strategies", "attention_strategies.json", "rows"),
          ("strategies-sp2-rerun", "attention_strategies", "attention_strategies_sp2_rerun.json",
           "rows"),
          ("strategies-16k-idle", "attention_strategies", "attention_strategies_16k_idle.json",
           "rows"),
          ("train-step", "train_step", "train_step.json", "results"),
          ("train-step-16k-idle", "train_step", "train_step_16k_idle.json", "results"),
          ("max-len", "max_len", "max_len.json", "results"),
          ("max-len-p2p", "max_len", "max_len_p2p.json", "results"),
          ("p2p-ring", "p2p_ring", "p2p_ring.json", "rows"),
          ("tp", "tp", "tp.json", "results"),
      ]),
]
# Pages other work owns (their blocks are checked when registered here; a new block of theirs
# is not an error of this script's).
OTHERS = {"docs/gpu.md", "docs/axolotl.md"}
MARKER = re.compile(r"<!-- ([\w-]+):start -->")


def shown(page: str, name: str) -> str | None:
    text = (ROOT / page).read_text()
    start, end = _markers(name)
    if start not in text or end not in text:
        return None
    return text[text.index(start):text.index(end) + len(end)]


def stale() -> list[str]:
    """Every block that is not what its renderer writes now, and every unregistered block on
    the README or a page of the front door's."""
    problems = []
    for block in BLOCKS:
        page = shown(block.page, block.name)
        if page is None:
            problems.append(f"{block.page}: no `{block.name}` block")
            continue
        fresh = block.render()
        if page != fresh:
            problems.append(f"{block.page}: `{block.name}` is not what its JSON holds now:\n"
                            f"shown:\n{page}\nfrom the JSON:\n{fresh}")
    known = {(b.page, b.name) for b in BLOCKS}
    for path in [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
                 *sorted((ROOT / "docs").glob("*.md"))]:
        page = str(path.relative_to(ROOT))
        if page in OTHERS:
            continue
        for name in MARKER.findall(re.sub(r"`[^`\n]*`", "", path.read_text())):
            if (page, name) not in known:
                problems.append(f"{page}: block `{name}` has no renderer in benchmarks/figures.py")
    return problems


def rewrite() -> list[str]:
    changed = []
    for block in BLOCKS:
        old = shown(block.page, block.name)
        fresh = block.render()
        if old is not None and old != fresh:
            path = ROOT / block.page
            path.write_text(path.read_text().replace(old, fresh))
            changed.append(f"{block.page}: {block.name}")
    return changed


def time_validate(runs: int) -> Path:
    from benchmarks.quickstart import _first_output

    command = ["longctx", "validate", "examples/tiny_passkey.yaml", "--nproc-per-node", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    record = []
    for _ in range(runs):
        before = os.getloadavg()[0]
        first, total = _first_output(command, ROOT, env)
        record.append({"first_output_s": first, "total_s": total,
                       "load_before": round(before, 2), "load_after": round(os.getloadavg()[0], 2)})
        print(f"plan after {first:.2f} s, done in {total:.2f} s", flush=True)
    date = time.strftime("%Y-%m-%d")
    return write_results(RESULTS / f"validate-time-{date}.json", {
        "command": " ".join(["longctx", *command[1:]]), "date": date,
        "machine": f"{os.cpu_count()}-core {cpu_model() or 'CPU'}", "runs": record})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 where a block is stale")
    parser.add_argument("--time-validate", type=int, metavar="RUNS", default=0)
    args = parser.parse_args()
    if args.time_validate:
        print(f"wrote {time_validate(args.time_validate).relative_to(ROOT)}")
        return
    if args.check:
        problems = stale()
        print("\n\n".join(problems) or "every generated block is its JSON's")
        sys.exit(1 if problems else 0)
    for name in rewrite():
        print(f"rewrote {name}")


if __name__ == "__main__":
    main()
