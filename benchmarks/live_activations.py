"""What grows with the row: live tensors with a token dimension at each tool's peak, longctx
against DeepSpeed ALST, each with its full memory recipe (`reach.py`'s), one row at sp 2.

    python benchmarks/live_activations.py                    # a 16K row, 2.5 min on 2 cores
    python benchmarks/live_activations.py --tokens 4096      # the count does not depend on it
    python benchmarks/live_activations.py --table results/live-activations-2026-11-27.json
    python benchmarks/live_activations.py --account --lengths 8192 16384 32768

`--account` explains the resident set instead: at each length every rank also reads its
resident set and glibc's allocator statistics after every operator (`census_worker.py
--account`), and at the resident set's highest point splits it into the census's tensors
with a token dimension, its other tensors (weights, gradients, optimizer state), what the
allocator has handed out beyond those tensors (storages under the census's 256 KiB floor,
Python objects, buffers outside autograd), what it holds freed, and what lies outside it
(code, the interpreter's own arenas, stacks). A line through the lengths gives each part's
bytes per token per rank: the resident slope, term by term. ALST runs with longctx's glibc
mmap threshold there, the same allocator for both.

`reach.py` measures each rank's resident set, which holds what does not grow with the row
too: between 8K and 32K tokens ALST's peak is in its loss (shards of `[tokens / shards,
vocab]` float32 logits, their gradients and two float32 copies of the embedding-sized
weights), and longctx's at 8K and 16K is its fused loss's logits block, so a line through
those peaks measures where each peak happens more than what a token costs. Here every
rank runs under `census_worker.py`, which sums the live tensors with a dimension of the
rank's tokens (or the row's) after every 20 operators and records all live tensors at the
highest such sum; that sum over the rank's tokens is the bytes a token costs at the moment
it costs most, and the record says what they are. One training step (full fine-tuning,
float32, the weights and row of `peers.py`'s Llama); every tool's loss must agree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml
from common import ROOT, markdown_table, save_record

from benchmarks import peers, reach

TOOLS = ("longctx-ulysses", "longctx-ring", "alst-zero0")
# The resident set's parts (`--account`), in the order they add up to it: the census's
# storages of every size by kind (census_worker.py's KINDS), then what malloc holds beyond them.
PARTS = {"weights": "weights",
         "gradients": "gradients",
         "optimizer_state": "optimizer state (AdamW's moments)",
         "activations": "activations (float storages with a token dimension)",
         "data_side": "data side (integer storages: the batch, the row's SP metadata)",
         "other_floats": "other floats (no token dimension: MLP tiles, the head's gradient "
                         "block, AdamW's temporaries)",
         "untracked_in_use": "handed out by malloc beyond the tensors (Python objects, buffers)",
         "heap_free": "freed but kept by malloc",
         "outside_malloc": "outside malloc (code, interpreter arenas, stacks)"}
# The step's moments of the memory estimate (`MemoryEstimate.moments`) and the census phases
# each covers.
MOMENTS = {"the loss": "loss", "a decoder layer's backward": "backward: layer",
           "the optimizer update": "optimizer update"}
CENSUS = ROOT / "benchmarks" / "census_worker.py"
MiB = 2**20


def command(tool: str, tokens: int, work: Path, model_dir: Path, configs: dict[str, Path],
            out: Path, peer_python: Path | None, timeline: bool = False,
            account: bool = False) -> list[str]:
    census = [f"--nproc-per-node={peers.SP}", str(CENSUS), "--out", str(out),
              "--tokens-per-rank", str(tokens // peers.SP), "--sp", str(peers.SP),
              *(["--timeline"] if timeline else []), *(["--account"] if account else []),
              "--"]
    if tool.startswith("longctx"):
        return [sys.executable, "-m", "torch.distributed.run", *census, "longctx", "train",
                str(configs[tool])]
    return [str(peer_python), "-m", "torch.distributed.run", *census,
            *peers.alst_worker_args(tool, work, model_dir, 2 if account else 1,
                                    out / "result.json",
                                    reach.worker_flags(tool, tokens, None))]


def first_loss(tool: str, configs: dict[str, Path], out: Path) -> float:
    if tool.startswith("longctx"):
        return peers.longctx_steps(configs[tool])[0]["loss"]
    return json.loads((out / "result.json").read_text())["losses"][0]


def measure(tool: str, tokens: int, work: Path, model_dir: Path, configs: dict[str, Path],
            peer_python: Path | None, timeline: bool = False, account: bool = False) -> dict:
    out = work / f"census-{tool}"
    shutil.rmtree(out, ignore_errors=True)
    if tool.startswith("longctx"):  # a fresh run: the rank checks output_dir itself
        shutil.rmtree(yaml.safe_load(configs[tool].read_text())["output_dir"],
                      ignore_errors=True)
    log = work / f"census-{tool}.log"
    with log.open("w") as f:
        argv = command(tool, tokens, work, model_dir, configs, out, peer_python, timeline,
                       account)
        threshold = reach.THRESHOLD_MIB << 20 if account and tool.startswith("alst") else None
        with reach.allocator_threshold(threshold):  # the same allocator as longctx's ranks
            code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                                  env=peers.one_thread_env(), cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"{tool} failed ({code}); see {log}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("census-*.json"))]
    top = max(ranks, key=lambda r: r["token_bytes"])
    made_by: Counter = Counter()
    for t in top["live"]:
        if t["per_token"]:
            made_by[f"{t['made_by']} {tuple(t['shape'])}"] += t["bytes"]
    per_rank = tokens // peers.SP
    parts = phases = None
    if account:  # the rank with the higher resident set, at its highest point
        a = max((r["account"] for r in ranks), key=lambda a: a["rss"])
        parts = {**{k: v for k, v in a.items() if k != "live"},
                 "other_tensors": a["tensors"] - a["token_tensors"],
                 "live": a.get("live", [])[:12]}
        # Each rank's moments of its last step (the steady one: AdamW's state held through it).
        phases = [[{k: v for k, v in m.items() if k != "step"} for m in r["phases"]
                   if m["step"] == r["steps"] - 1] for r in ranks]
    return {"account": parts, "phases": phases, "token_bytes": top["token_bytes"],
            "all_bytes": top["all_bytes"], "at": top["at"],
            "bytes_per_token_per_rank": round(top["token_bytes"] / per_rank),
            "hidden_units": round(top["token_bytes"] / per_rank / (4 * peers.LLAMA["hidden_size"]),
                                  1),
            "made_by": [[name, b] for name, b in made_by.most_common()],
            "loss": first_loss(tool, configs, out)}


def table(tokens: int, results: dict[str, dict]) -> str:
    alst = results.get("alst-zero0")
    rows = []
    for tool, r in results.items():
        ratio = (f"{r['bytes_per_token_per_rank'] / alst['bytes_per_token_per_rank']:.2f}x"
                 if alst else "-")
        rows.append([tool, f"{r['token_bytes'] / MiB:,.1f}", f"{r['bytes_per_token_per_rank']:,}",
                     r["hidden_units"], ratio, f"`{r['at']}`"])
    return markdown_table(["tool", f"live per-token tensors at the peak, {tokens // 1024}K row "
                           "(MiB per rank)", "bytes per token per rank",
                           "in hidden-size float32 vectors", "vs ALST", "the peak is at"], rows)


def backward_account(result: dict) -> dict:
    """The resident set's parts at the highest resident set during the decoder layers'
    backward (the rank where it is highest): the moment that grows with the row."""
    return max((m["rss_peak"] for phases in result["phases"] for m in phases
                if m["phase"].startswith(MOMENTS["a decoder layer's backward"])),
               key=lambda a: a["rss"])


def moment_peaks(phases: list[dict]) -> dict[str, int]:
    """One rank's most live tensor bytes in each of the step's moments and in the whole step."""
    peaks = {name: max((m["tensor_peak"]["tensors"] for m in phases
                        if m["phase"].startswith(prefix)), default=0)
             for name, prefix in MOMENTS.items()}
    return {**peaks, "the step": max(m["tensor_peak"]["tensors"] for m in phases)}


def estimate_of(record: dict, tokens: int, tool: str):
    """`longctx validate`'s estimate (a `MemoryEstimate`) of a recorded longctx run."""
    from transformers import AutoConfig

    from longctx_cli.config import config_from_dict
    from longctx_cli.config.memory_estimate import estimate_memory
    from longctx_cli.config.plan import layout_for
    from longctx_cli.config.shape import ModelShape

    mode = {"sequence_parallel_mode": "ulysses"} if tool == "longctx-ulysses" else record["ring"]
    config = config_from_dict({
        "model_config": record["model"], "dtype": "float32", "sequence_len": tokens,
        "sample_packing": True, "sequence_parallel_degree": record["sp"],
        "world_size": record["sp"], "micro_batch_size": 1, "gradient_accumulation_steps": 1,
        "optimizer": "adamw_torch", **record["longctx_memory"], **mode})
    shape = ModelShape.from_hf_config(AutoConfig.for_model(**record["model"]))
    layout = layout_for(config, record["sp"], None)
    return estimate_memory(config, shape, record["sp"], layout, host_is_device=True)[0]


def account_table(record: dict) -> str:
    """Each longctx tool's resident set at its layers' backward peak, part by part: bytes per
    token per rank (a least-squares line through the lengths) and MiB at the longest."""
    by_length = {int(n): r for n, r in record["results"].items()}
    longest = max(by_length)
    rows = []
    for tool in by_length[longest]:
        if not by_length[longest][tool].get("phases"):
            continue  # a tool without the step's phases (not longctx)
        at = {n: backward_account(by_length[n][tool]) for n in by_length}

        def slope(key: str, at: dict = at) -> float:
            return reach.fit([(n // record["sp"], at[n][key] / MiB) for n in sorted(at)])[1]
        rows.append([f"{tool}: resident set", f"{slope('rss'):,.0f}",
                     f"{at[longest]['rss'] / MiB:,.1f}"])
        for key, name in record["parts"].items():
            rows.append([f"  {name}", f"{slope(key):,.0f}", f"{at[longest][key] / MiB:,.1f}"])
    return markdown_table(["at the layers' backward peak", "bytes per token per rank (slope)",
                           f"MiB per rank at {longest // 1024}K"], rows, right=(1, 2))


def moments_table(record: dict) -> str:
    """Per length and longctx tool: each rank's most live tensor bytes in each of the step's
    moments against the estimate's, and the estimate's peak over the measured peak."""
    rows = []
    for n, results in record["results"].items():
        for tool, r in results.items():
            if not r.get("phases"):
                continue
            estimate = estimate_of(record, int(n), tool)
            planned = dict(estimate.moments())
            for rank, phases in enumerate(r["phases"]):
                peaks = moment_peaks(phases)
                rows.append([f"{int(n) // 1024}K", tool, str(rank), *(
                    f"{peaks[m] / MiB:,.1f} / {planned[m] / MiB:,.1f}" for m in MOMENTS),
                    f"{estimate.total / peaks['the step']:.2f}x"])
    return markdown_table(["row", "tool", "rank", *(f"{m}: measured / estimated MiB"
                                                    for m in MOMENTS),
                           "estimated peak / measured peak"], rows, right=(3, 4, 5, 6))


def run_account(args, peer_python: Path | None) -> None:
    begun = time.time()
    by_length: dict[int, dict[str, dict]] = {}
    for tokens in args.lengths:
        work = args.work / reach.row_name(tokens)
        # Two steps: the second holds AdamW's state through its forward and backward, the
        # steady peak (reach.py's), where one step peaks in its optimizer update.
        model_dir, configs = peers.prepare_workload(reach.row_name(tokens), work, 2)
        reach.with_memory_recipe(configs)
        by_length[tokens] = {}
        for tool in args.tools:
            r = measure(tool, tokens, work, model_dir, configs, peer_python, account=True)
            by_length[tokens][tool] = r
            print(f"{tokens}: {tool}: resident {r['account']['rss'] / MiB:,.1f} MiB at "
                  f"`{r['account']['at']}`, loss {r['loss']:.5f}", flush=True)
        losses = [r["loss"] for r in by_length[tokens].values()]
        if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
            raise SystemExit(f"the tools' losses differ at {tokens}: {losses}")
    record = {
        "command": " ".join(["python", "benchmarks/live_activations.py", *sys.argv[1:]]),
        "lengths": args.lengths, "sp": peers.SP, "model": peers.LLAMA,
        "longctx_memory": reach.LONGCTX_MEMORY, "ring": reach.RING_MEMORY,
        "alst_flags": list(reach.worker_flags("alst-zero0", max(args.lengths), None)),
        "alst_mmap_threshold_mib": reach.THRESHOLD_MIB, "parts": PARTS,
        "results": {str(n): r for n, r in by_length.items()},
        "total_s": round(time.time() - begun),
    }
    print(account_table(record))
    print(moments_table(record))
    save_record(args.stem + "-account", record)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="the row, over both SP ranks")
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "live_activations")
    p.add_argument("--stem", default="live-activations")
    p.add_argument("--table", type=Path, help="only print the table of a saved JSON")
    p.add_argument("--account", action="store_true", help="split the resident peak into its "
                   "parts at each of --lengths, and fit each part's slope")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768],
                   help="rows (over both SP ranks) for --account")
    p.add_argument("--timeline", action="store_true", help="also write each rank's per-token "
                   "bytes after every operator (census-<rank>.timeline.tsv in the work folder)")
    args = p.parse_args()
    if args.table:
        record = json.loads(args.table.read_text())
        if "lengths" in record:
            print(account_table(record))
            print(moments_table(record))
        else:
            print(table(record["tokens"], record["results"]))
        return
    peer_python = (peers.ensure_peer_venv() if any(t.startswith("alst") for t in args.tools)
                   else None)
    if args.account:
        run_account(args, peer_python)
        return
    begun = time.time()
    work = args.work / reach.row_name(args.tokens)
    model_dir, configs = peers.prepare_workload(reach.row_name(args.tokens), work, 1)
    reach.with_memory_recipe(configs)
    results = {}
    for tool in args.tools:
        results[tool] = measure(tool, args.tokens, work, model_dir, configs, peer_python,
                                args.timeline)
        print(f"{tool}: {results[tool]['token_bytes'] / MiB:,.1f} MiB of per-token tensors at "
              f"the peak ({results[tool]['bytes_per_token_per_rank']:,} bytes per token per "
              f"rank), loss {results[tool]['loss']:.5f}", flush=True)
    losses = [r["loss"] for r in results.values()]
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        raise SystemExit(f"the tools' losses differ: {losses}")
    print(table(args.tokens, results))
    save_record(args.stem, {
        "command": " ".join(["python", "benchmarks/live_activations.py", *sys.argv[1:]]),
        "tokens": args.tokens, "sp": peers.SP, "model": peers.LLAMA,
        "longctx_memory": reach.LONGCTX_MEMORY, "ring": reach.RING_MEMORY,
        "alst_flags": list(reach.worker_flags("alst-zero0", args.tokens, None)),
        "deepspeed": peers.DEEPSPEED, "results": results, "total_s": round(time.time() - begun),
    })


if __name__ == "__main__":
    main()
