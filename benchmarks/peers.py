"""longctx against DeepSpeed ALST on the same work, with plain Hugging Face as the yardstick.

    python benchmarks/peers.py --rows llama-8k tied-vocab128k-8k   # 53 min on 2 cores
    python benchmarks/peers.py --rows llama-32k --runs 1 --steps 3 --warmup 1
    python benchmarks/peers.py --table benchmarks/results/peers-2026-11-26.json
    python benchmarks/peers.py --table PEERS.json --reach REACH.json --live LIVE.json  # README

Each row is one model and one row of tokens, trained by full fine-tuning with AdamW in
float32 for a few steps by each tool, from the same initial weights (a `save_pretrained`
folder) and the same tokens (longctx's prepared row, read back from its cache and handed to
the others):

- longctx, `sequence_parallel_mode: ulysses` and the default ring, at sp 2, through
  `longctx train` as a user runs it;
- DeepSpeed ALST (Ulysses SP for Hugging Face models) at sp 2 under torchrun, ZeRO stage 0,
  the loss tiled (`benchmarks/peer_worker.py`), from its own virtual environment
  (`~/.cache/longctx-bench/peers-deepspeed`, built on first use with the same torch and
  transformers versions, so DeepSpeed never becomes a dependency of longctx);
- plain transformers in one process: the model's own forward and loss over the whole row.

Every rank runs one compute thread, so sp 2 uses two cores and plain HF one: the limit for
sp 2 is plain HF's time per step / 2. Tools run alternately, run after run; a run's time per
step is the median of its steps after `--warmup`, and the table shows the min / median / max
of those medians over runs. Peak memory is each rank process's resident-set high-water mark
(VmHWM), read from /proc while it runs. The first step's loss of every tool must agree with
plain HF's (same weights, same tokens), and so must the third's (the updates agree too).
"First step after" is the time from the command to the start of the first step, recorded
for every run of every tool and printed as it finishes (longctx through its own launcher:
rank 0 records it with the phases before it in output_dir/startup.json, see
docs/training.md; ALST's script under torchrun and plain HF: their workers record when
their first step starts); the table shows its min / median / max over the runs.

What it does not show: GPU speed (kernels, NCCL and overlap differ there), other ZeRO
stages' memory at scale, or a model larger than a CPU can train in minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml
from common import ROOT, markdown_table, metrics_records, peak_bytes, save_record

# The runs' helpers import torch and transformers: loaded where a run needs them, so that
# `--table` (and benchmarks/figures.py) prints the README's table without them.

DEEPSPEED = "0.19.8"
PEER_VENV = Path.home() / ".cache" / "longctx-bench" / "peers-deepspeed"
WORKER = ROOT / "benchmarks" / "peer_worker.py"
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "vocab_size": 32000, "max_position_embeddings": 131072, "tie_word_embeddings": False}
# name -> (model config, tokens per row); the tied row has a large vocabulary, where the loss
# path (full logits or not, one weight for two roles) matters most.
ROWS = {
    "llama-8k": (LLAMA, 8192),
    "llama-32k": (LLAMA, 32768),
    "tied-vocab128k-8k": ({**LLAMA, "vocab_size": 128256, "tie_word_embeddings": True}, 8192),
}
TOOLS = ("longctx-ulysses", "longctx-ring", "alst-zero0", "hf")
SP = 2
LR = 1e-4
MAX_GRAD_NORM = 1.0


def ensure_peer_venv() -> Path:
    """The peer's own virtual environment: DeepSpeed with longctx's torch and transformers."""
    import torch
    import transformers

    python = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / "longctx-peers.txt"
    wanted = (f"torch=={torch.__version__.split('+')[0]} "
              f"transformers=={transformers.__version__} deepspeed=={DEEPSPEED}")
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"building the peer environment in {PEER_VENV}: {wanted}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *wanted.split()], check=True)
    stamp.write_text(wanted)
    return python


def one_thread_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    # This checkout first, so that every worker imports the code the caller runs (not an
    # editable install of another checkout); the caller's own entries are dropped.
    env["PYTHONPATH"] = str(ROOT)
    # Python's default: modules' bytecode cached after their first import. A sandbox that
    # turns it off makes every run compile whatever pip did not (an editable install's code).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


# ---- the workload ---------------------------------------------------------------------------

def longctx_config(work: Path, model_dir: Path, tokens: int, steps: int, mode: str) -> dict:
    return {
        "base_model": str(model_dir), "tokenizer": "byte", "dtype": "float32",
        "datasets": [{"path": str(work / "text.jsonl"), "type": "completion"}],
        "dataset_prepared_path": str(work / "prepared"),
        "sequence_len": tokens, "sample_packing": True, "val_set_size": 0,
        "sequence_parallel_degree": SP, "world_size": SP,
        **({"sequence_parallel_mode": mode} if mode else {}),
        "micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": steps,
        "optimizer": "adamw_torch", "learning_rate": LR, "lr_scheduler": "constant",
        "weight_decay": 0.0, "max_grad_norm": MAX_GRAD_NORM, "seed": 0,
        "output_dir": str(work / f"out-{mode or 'ring'}"), "save_strategy": "no",
        "logging_steps": 1,
    }


def prepare_workload(name: str, work: Path, steps: int) -> tuple[Path, dict[str, Path]]:
    """Initial weights, the row (as longctx prepares it) and longctx's configs of one row."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.config import load_config
    from longctx_cli.data.prepare import prepare

    model_config, tokens = ROWS[name]
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        config = AutoConfig.for_model(**model_config)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    # One document of printable bytes filling the row exactly (the byte tokenizer adds eos).
    text = "".join(chr(32 + (i * 7919 + i // 13) % 95) for i in range(tokens - 1))
    (work / "text.jsonl").write_text(json.dumps({"text": text}) + "\n")
    configs = {}
    for tool, mode in (("longctx-ulysses", "ulysses"), ("longctx-ring", "")):
        path = work / f"{tool}.yaml"
        path.write_text(yaml.safe_dump(longctx_config(work, model_dir, tokens, steps, mode)))
        configs[tool] = path
    prepared = prepare(load_config(configs["longctx-ring"]), progress=False)
    row = prepared.train[0]
    assert prepared.train.num_rows == 1 and len(row["input_ids"]) == tokens, prepared.train
    torch.save({k: torch.tensor(row[k]) for k in ("input_ids", "labels", "position_ids")},
               work / "row.pt")
    return model_dir, configs


# ---- running and watching one tool ------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            child = int(stat.parent.name)
            out += [child, *_children(child)]
    return out


def _peak_kib(pid: int) -> int | None:
    """The process's VmHWM in KiB, or None once it is gone."""
    try:
        return peak_bytes(pid) // 1024
    except (OSError, RuntimeError):
        return None


def _has_local_rank(pid: int) -> bool:
    try:
        return b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _is_rank(pid: int) -> bool:
    """A process torchrun started: LOCAL_RANK in its environment and not in its parent's
    (a rank's own helpers, e.g. a compiler building an op, inherit it)."""
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return _has_local_rank(pid) and not _has_local_rank(parent)


def _is_warm_rank(pid: int) -> bool:
    """A warm process of longctx's launcher (`launcher/warm_ranks.py`), which runs the rank the
    process torchrun started hands it (that one then only waits)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"longctx_cli.rank" in argv and b"--warm" in argv


def run_watched(cmd: list[str], log: Path) -> tuple[float, dict[int, int]]:
    """Run `cmd`; its wall start and every rank process's peak resident set (KiB). A rank is
    the warm process that ran it, else a process torchrun started (LOCAL_RANK in its
    environment), else the command itself."""
    peaks: dict[int, int] = {}
    ranks: set[int] = set()
    warm: set[int] = set()
    started = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=one_thread_env(),
                                cwd=ROOT)

        def watch() -> None:
            while proc.poll() is None:
                for pid in [proc.pid, *_children(proc.pid)]:
                    kib = _peak_kib(pid)
                    if kib is not None:
                        peaks[pid] = max(peaks.get(pid, 0), kib)
                        if pid not in ranks and _is_rank(pid):
                            ranks.add(pid)
                        if pid not in warm and _is_warm_rank(pid):
                            warm.add(pid)
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        code = proc.wait()
        watcher.join()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({code}); see {log}")
    chosen = warm or ranks or {proc.pid}
    return started, {pid: kib for pid, kib in peaks.items() if pid in chosen}


def longctx_steps(config_path: Path) -> list[dict]:
    """The step records (loss, tokens, tokens_per_sec) of the longctx run of `config_path`."""
    output_dir = Path(yaml.safe_load(config_path.read_text())["output_dir"])
    return [r for r in metrics_records(output_dir) if "tokens_per_sec" in r]


def alst_worker_args(tool: str, work: Path, model_dir: Path, steps: int, out: Path,
                     worker_flags: tuple[str, ...] = ()) -> list[str]:
    """peer_worker.py and its arguments for one ALST rank (`tool`: `alst-zero<stage>`)."""
    return [str(WORKER), "--tool", "alst", "--zero", tool.removeprefix("alst-zero"),
            *worker_common(work, model_dir, steps, out), *worker_flags]


def worker_common(work: Path, model_dir: Path, steps: int, out: Path) -> list[str]:
    return ["--model", str(model_dir), "--row", str(work / "row.pt"), "--steps", str(steps),
            "--lr", str(LR), "--max-grad-norm", str(MAX_GRAD_NORM), "--out", str(out)]


def run_tool(tool: str, name: str, work: Path, model_dir: Path, configs: dict[str, Path],
             steps: int, run: int, peer_python: Path | None,
             worker_flags: tuple[str, ...] = ()) -> dict:
    """One run of `tool`; `worker_flags`: more peer_worker.py flags for ALST or plain HF
    (reach.py's memory recipes)."""
    log = work / f"{tool}-run{run}.log"
    out = work / f"{tool}-run{run}.json"
    if tool.startswith("longctx"):
        cmd = [sys.executable, "-m", "longctx_cli", "train", str(configs[tool]), "--overwrite"]
        started, peaks = run_watched(cmd, log)
        steps_done = longctx_steps(configs[tool])
        seconds = [r["tokens"] / r["tokens_per_sec"] for r in steps_done]
        losses = [r["loss"] for r in steps_done]
        config = yaml.safe_load(configs[tool].read_text())
        startup = json.loads((Path(config["output_dir"]) / "startup.json").read_text())
        first_step = startup["first_step_at"] - started
    else:
        if tool == "hf":
            cmd = [sys.executable, str(WORKER), "--tool", "hf",
                   *worker_common(work, model_dir, steps, out), *worker_flags]
        else:
            cmd = [str(peer_python), "-m", "torch.distributed.run", f"--nproc-per-node={SP}",
                   *alst_worker_args(tool, work, model_dir, steps, out, worker_flags)]
        started, peaks = run_watched(cmd, log)
        result = json.loads(out.read_text())
        seconds, losses, startup = result["seconds"], result["losses"], None
        first_step = result["first_step_at"] - started
    return {"seconds": seconds, "losses": losses, "peak_mib": sorted(k / 1024 for k in
                                                                     peaks.values()),
            "startup": startup, "first_step_s": first_step}


# ---- the table ---------------------------------------------------------------------------------

def summarize(runs: list[dict], warmup: int) -> dict:
    medians = [statistics.median(r["seconds"][warmup:]) for r in runs]
    peaks = [p for r in runs for p in r["peak_mib"]]
    firsts = [r["first_step_s"] for r in runs if r["first_step_s"] is not None]
    return {"s_per_step": [min(medians), statistics.median(medians), max(medians)],
            "peak_mib": [min(peaks), max(peaks)], "losses": runs[0]["losses"][:3],
            "first_step_s": ([min(firsts), statistics.median(firsts), max(firsts)]
                             if firsts else None)}


def first_step_cell(first: list[float] | None) -> str:
    """min / median / max seconds to the first step (a record older than the median: min-max)."""
    if not first:
        return "-"
    if len(first) == 2:
        return f"{first[0]:.1f}-{first[1]:.1f}"
    return " / ".join(f"{x:.1f}" for x in first)


def table(rows: dict[str, dict]) -> str:
    cells = []
    for name, by_tool in rows.items():
        limit = by_tool["hf"]["s_per_step"][1] / SP
        for tool, s in by_tool.items():
            lo, med, hi = s["s_per_step"]
            losses = s["losses"]
            cells.append([name, tool, f"{lo:.2f} / {med:.2f} / {hi:.2f}",
                          "" if tool == "hf" else f"{limit / med:.1%}",
                          f"{s['peak_mib'][0]:,.0f}-{s['peak_mib'][1]:,.0f}",
                          first_step_cell(s["first_step_s"]),
                          f"{losses[0]:.5f} / {losses[2]:.5f}"])
    return markdown_table(["row", "tool", "s/step min / median / max", "of the limit",
                           "peak RSS per rank (MiB)", "first step after (s) min / median / max",
                           "step 1 / 3 loss"], cells)


# reach.py's ALST run with glibc's mmap threshold where longctx fixes its own.
ALST_AT_LONGCTX_THRESHOLD = "alst-zero0-at-longctx-threshold"
TOOL_NAMES = {"longctx-ring": "longctx, ring", "longctx-ulysses": "longctx, Ulysses",
              "longctx-ulysses-chunked": "longctx, Ulysses, 4 head chunks",
              "alst-zero0": "DeepSpeed ALST", "hf": "plain HF, one process"}


def side_by_side(row: dict[str, dict], reach: dict, live: dict | None = None,
                 tokens: int | None = None) -> str:
    """The README's table: one `peers.py` row's step time and start-up beside each tool's
    bytes per token from a `reach.py` record at the same allocator setting (longctx's
    `host_mmap_threshold_mib: 1`, and ALST's run with glibc's mmap threshold at the same
    1 MiB), and with `live`, a `live_activations.py` record's per-token tensors at each
    tool's peak (what a token costs where it costs most). ALST as it comes, at glibc's
    default threshold, is docs/results.md's: the allocator's effect, not the tools'."""
    per_token = {t: x["bytes_per_token_per_rank"] for t, x in reach["summary"].items()}
    at_peak = {t: x["bytes_per_token_per_rank"] for t, x in (live or {}).get("results",
                                                                             {}).items()}
    alst = per_token[ALST_AT_LONGCTX_THRESHOLD]
    where = "on CPU" + (f", {tokens:,} tokens, sp {SP}" if tokens else "")
    head = [where, "s/step, min / median / max", "command to first step",
            "bytes per token per rank, same allocator (vs ALST)",
            *(["live per-token tensors at the peak (vs ALST)"] if live else [])]
    rows = []
    for tool, s in row.items():
        lo, med, hi = s["s_per_step"]
        cells = [TOOL_NAMES[tool], f"{lo:.2f} / {med:.2f} / {hi:.2f}",
                 f"{first_step_cell(s['first_step_s'])} s"]
        mine = alst if tool == "alst-zero0" else (
            per_token.get(tool) if tool.startswith("longctx") else None)
        cells.append("-" if mine is None else f"{mine / 1000:,.1f} KB ({mine / alst:.2f}x)")
        if live:
            peak = at_peak.get(tool)
            cells.append("-" if peak is None else
                         f"{peak / 1000:,.1f} KB ({peak / at_peak['alst-zero0']:.2f}x)")
        rows.append(cells)
    return markdown_table(head, rows)


def check_losses(name: str, by_tool: dict[str, dict]) -> None:
    """Same weights and tokens: every tool's step 1 and step 3 loss match plain HF's."""
    ref = by_tool["hf"]["losses"]
    for tool, s in by_tool.items():
        for i in (0, 2):
            if abs(s["losses"][i] - ref[i]) > 1e-4 * abs(ref[i]) + 1e-5:
                raise SystemExit(f"{name}: {tool}'s step {i + 1} loss {s['losses'][i]:.6f} "
                                 f"differs from plain HF's {ref[i]:.6f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    p.add_argument("--runs", type=int, default=3, help="alternated runs per tool")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="untimed runs of each tool before the timed ones")
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "peers")
    p.add_argument("--stem", default="peers")
    p.add_argument("--table", type=Path, help="only print the table of a saved JSON")
    p.add_argument("--reach", type=Path,
                   help="with --table: its first row beside this reach.py record's bytes per "
                   "token (the README's table)")
    p.add_argument("--live", type=Path,
                   help="with --reach: and this live_activations.py record's per-token tensors "
                   "at each tool's peak")
    args = p.parse_args()
    if args.table:
        results = json.loads(args.table.read_text())["results"]
        if args.reach:
            reach = json.loads(args.reach.read_text())
            live = json.loads(args.live.read_text()) if args.live else None
            name, row = next(iter(results.items()))
            tokens = json.loads(args.table.read_text()).get("tokens", {}).get(name)
            print(side_by_side(row, reach, live, tokens))
        else:
            print(table(results))
        return
    assert args.steps > args.warmup >= 0 and args.steps >= 3 and "hf" in args.tools

    peer_python = ensure_peer_venv() if any(t.startswith("alst") for t in args.tools) else None
    results: dict[str, dict] = {}
    raw: dict[str, dict] = {}
    begun = time.time()
    for name in args.rows:
        work = args.work / name
        model_dir, configs = prepare_workload(name, work, args.steps)
        runs: dict[str, list[dict]] = {tool: [] for tool in args.tools}
        for warm in range(args.warmup_runs):  # untimed: page cache and bytecode, as on a box
            for tool in args.tools:            # where each tool has run before
                run_tool(tool, name, work, model_dir, configs, args.steps, -1 - warm,
                         peer_python)
        for run in range(args.runs):
            order = args.tools[run % len(args.tools):] + args.tools[:run % len(args.tools)]
            for tool in order:
                r = run_tool(tool, name, work, model_dir, configs, args.steps, run, peer_python)
                runs[tool].append(r)
                print(f"{name} run {run + 1}/{args.runs} {tool}: first step "
                      f"{r['first_step_s']:.1f} s after the command, "
                      f"{statistics.median(r['seconds'][args.warmup:]):.2f} s/step, peak "
                      f"{max(r['peak_mib']):,.0f} MiB, losses "
                      f"{', '.join(f'{x:.5f}' for x in r['losses'][:3])}", flush=True)
        results[name] = {tool: summarize(rs, args.warmup) for tool, rs in runs.items()}
        raw[name] = runs
        check_losses(name, results[name])
    print(table(results))
    save_record(args.stem, {
        "command": " ".join(["python", "benchmarks/peers.py", *sys.argv[1:]]),
        "sp": SP, "threads_per_rank": 1, "steps": args.steps, "warmup": args.warmup,
        "warmup_runs": args.warmup_runs,
        "runs": args.runs, "deepspeed": DEEPSPEED, "models": {n: ROWS[n][0] for n in args.rows},
        "tokens": {n: ROWS[n][1] for n in args.rows}, "results": results, "raw": raw,
        "total_s": round(time.time() - begun),
    })


if __name__ == "__main__":
    main()
