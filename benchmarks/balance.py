"""Load balance of the SP sharding layouts, counted without a GPU.

    python benchmarks/balance.py                      # sp 2 4 8 16 -> results/balance.json
    python benchmarks/balance.py --readme             # also print docs/parallelism.md's table

Per strategy, SP degree and workload: the query-key pairs each SP rank computes under the
causal *document* mask (a query at global position ``i`` of document ``[s, e)`` attends keys
``s..i``), counted by the queries the rank owns, and ``max / mean`` over the ranks (1.0 =
perfect balance). Which queries a rank owns comes from the project itself:
``Layout.local_ranges`` (the ranges ``shard_batch`` slices), rows padded to
``Layout.row_multiple`` with the padding tail as a document of its own (as ``shard_batch``
does), packed rows built by the project's first-fit-decreasing ``ffd_bins`` and concatenated
in bin order (as ``make_row`` does). The count is in closed form per (range, document)
overlap, so a 1M-token row takes milliseconds.

Ulysses is not a sharding of the attention work: after the all-to-all every rank computes the
whole row for ``heads / sp`` heads, so each rank's work is exactly ``total / sp`` (balance 1.0
by construction); its row is computed from that fact, not counted.

This counts the pairs the mask allows, the useful work. A kernel that works in tiles computes
some masked pairs on the diagonal tiles too; that overhead is not counted here. Workload (b)
reports two numbers: ``aggregate`` (per-rank work summed over all rows, max / mean: the
brief's metric) and ``per-row`` (sum over rows of the busiest rank's work / sum of the mean:
the slowdown when ranks wait for each other on every row, as they do every layer).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import RESULTS, markdown_table, write_results

from longctx_cli.data.pack import ffd_bins
from longctx_cli.layout import Layout


@dataclass(frozen=True)
class Strategy:
    name: str
    mode: str
    sharding: str
    ring_attn_func: str
    note: str = ""

    def layout(self, sp: int) -> Layout:
        return Layout(sp=sp, mode=self.mode, sharding=self.sharding,
                      ring_attn_func=self.ring_attn_func)

    @property
    def analytic(self) -> bool:
        return self.mode == "ulysses"


STRATEGIES = (
    Strategy("llama3 ring, contiguous", "ring", "contiguous", "varlen_llama3"),
    Strategy("llama3 ring, zigzag", "ring", "zigzag", "varlen_llama3"),
    Strategy("P2P batch_ring (contiguous)", "ring", "contiguous", "batch_ring"),
    Strategy("P2P batch_zigzag", "ring", "zigzag", "batch_zigzag"),
    Strategy("P2P batch_stripe (default)", "ring", "stripe", "batch_stripe"),
    Strategy("Ulysses (all-to-all)", "ulysses", "contiguous", "varlen_llama3",
             note="not counted: every rank computes the whole row for heads/sp heads, so its "
                  "work is exactly total/sp"),
)


# ---- counting ------------------------------------------------------------------------------


def padded_documents(doc_lengths: list[int], layout: Layout) -> list[int]:
    """The documents of the row ``shard_batch`` builds: the given ones, then the padding to a
    multiple of ``layout.row_multiple`` as a document of its own (positions restart there)."""
    extra = -sum(doc_lengths) % layout.row_multiple
    return list(doc_lengths) + ([extra] if extra else [])


def overlap_work(a: int, b: int, s: int, e: int) -> int:
    """Pairs computed by the queries ``[a, b)`` that lie in document ``[s, e)``: query ``i``
    attends the ``i - s + 1`` keys ``s..i``; summed in closed form over the overlap."""
    lo, hi = max(a, s), min(b, e)
    if hi <= lo:
        return 0
    n = hi - lo
    return n * (lo - s + 1) + n * (n - 1) // 2


class RowWork:
    """Closed-form prefix ``F(x)``: the pairs computed by the queries ``[0, x)`` of a row.

    ``F(x) = (full documents before x) + n(n+1)/2`` for the ``n`` queries of x's document
    below x, so the work of queries ``[a, b)`` is ``F(b) - F(a)``, the sum of
    :func:`overlap_work` over the documents the range overlaps.
    """

    def __init__(self, doc_lengths: list[int]):
        lengths = np.asarray(doc_lengths, dtype=np.int64)
        if (lengths < 1).any():
            raise ValueError("every document needs at least one token")
        self.bounds = np.concatenate([[0], np.cumsum(lengths)])  # cu_seqlens
        self.before = np.concatenate([[0], np.cumsum(lengths * (lengths + 1) // 2)])
        self.total_len = int(self.bounds[-1])
        self.total = int(self.before[-1])
        self._table: np.ndarray | None = None

    def prefix(self, x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(self.bounds, x, side="right") - 1
        n = x - self.bounds[k]
        return self.before[k] + n * (n + 1) // 2

    def of_ranges(self, ranges: np.ndarray) -> int:
        """Pairs computed by the queries of ``ranges`` (``[k, 2]`` array of ``[a, b)``)."""
        if len(ranges) > 4096:  # e.g. stripe: F at every position once per row, then gather
            if self._table is None:
                self._table = self.prefix(np.arange(self.total_len + 1, dtype=np.int64))
            t = self._table
            return int(t[ranges[:, 1]].sum() - t[ranges[:, 0]].sum())
        return int(self.prefix(ranges[:, 1]).sum() - self.prefix(ranges[:, 0]).sum())


class _RangeCache:
    """``Layout.local_ranges`` of every SP rank as arrays, per (layout, row length); small LRU
    (a stripe row at 128K is 128K ranges)."""

    def __init__(self, size: int = 32):
        self.size, self.data = size, OrderedDict()

    def get(self, layout: Layout, total_len: int) -> list[np.ndarray]:
        key = (layout, total_len)
        if key in self.data:
            self.data.move_to_end(key)
            return self.data[key]
        value = [np.asarray(layout.local_ranges(total_len, r), dtype=np.int64).reshape(-1, 2)
                 for r in range(layout.sp)]
        self.data[key] = value
        if len(self.data) > self.size:
            self.data.popitem(last=False)
        return value


_CACHE = _RangeCache()


def rank_work(layout: Layout, doc_lengths: list[int]) -> list[int]:
    """Pairs each SP rank computes on one row made of ``doc_lengths`` (padded as the trainer
    pads it), by the queries the rank owns."""
    work = RowWork(padded_documents(doc_lengths, layout))
    return [work.of_ranges(r) for r in _CACHE.get(layout, work.total_len)]


def strategy_work(strategy: Strategy, sp: int, doc_lengths: list[int]) -> list[int | float]:
    """Per-rank work of one row; Ulysses from the fact that it splits heads, not pairs."""
    layout = strategy.layout(sp)
    if strategy.analytic:
        total = RowWork(padded_documents(doc_lengths, layout)).total
        return [total / sp] * sp
    return rank_work(layout, doc_lengths)


def imbalance(per_rank: list[int | float]) -> float:
    """max / mean over ranks; 1.0 = perfect balance."""
    return max(per_rank) * len(per_rank) / sum(per_rank)


# ---- workloads -----------------------------------------------------------------------------


def longtail_lengths(docs: int, median: float, sigma: float, lo: int, hi: int,
                     seed: int) -> list[int]:
    """Lognormal document lengths (``exp(N(ln median, sigma))``, rounded), clipped."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=docs)
    return np.clip(np.rint(raw), lo, hi).astype(np.int64).tolist()


def packed_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of document lengths, as ``prepare`` packs them: ``ffd_bins``, in bin order."""
    return [[lengths[i] for i in b] for b in ffd_bins(lengths, capacity)]


def one_document(strategies, sps, row_len: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for s in strategies:
        results[s.name] = {}
        for sp in sps:
            per_rank = strategy_work(s, sp, [row_len])
            results[s.name][str(sp)] = {
                "max_over_mean": imbalance(per_rank),
                "per_rank": per_rank,
            }
    return {"description": f"one causal document of {row_len} tokens per row",
            "row_len": row_len, "results": results}


def packed(strategies, sps, args) -> dict[str, Any]:
    lengths = longtail_lengths(args.docs, args.median, args.sigma, args.min_len, args.row_len,
                               args.seed)
    rows = packed_rows(lengths, args.row_len)
    rows.sort(key=sum)  # same row lengths together: the range cache hits
    results: dict[str, Any] = {}
    for s in strategies:
        results[s.name] = {}
        for sp in sps:
            totals: list[int | float] = [0] * sp
            busiest = mean = 0.0
            for row in rows:
                per_rank = strategy_work(s, sp, row)
                totals = [t + w for t, w in zip(totals, per_rank, strict=True)]
                busiest += max(per_rank)
                mean += sum(per_rank) / sp
            results[s.name][str(sp)] = {
                "max_over_mean": imbalance(totals),
                "per_row_max_over_mean": busiest / mean,
                "per_rank": totals,
            }
    arr = np.asarray(lengths)
    tokens = int(arr.sum())
    return {
        "description": (
            f"{args.docs} documents, lengths lognormal(median {args.median:g}, sigma "
            f"{args.sigma:g}) rounded and clipped to [{args.min_len}, {args.row_len}], numpy "
            f"default_rng({args.seed}); packed first-fit-decreasing (longctx_cli.data.pack."
            f"ffd_bins) into rows of at most {args.row_len} tokens, documents in bin order "
            "(longest first); each row padded to the layout's row_multiple, the padding a "
            "document of its own; work summed over all rows per rank"),
        "distribution": {
            "kind": "lognormal", "median": args.median, "sigma": args.sigma,
            "numpy_call": f"default_rng({args.seed}).lognormal(mean=log({args.median:g}), "
                          f"sigma={args.sigma:g}, size={args.docs})",
            "rounding": "np.rint", "clip": [args.min_len, args.row_len], "seed": args.seed,
            "docs": args.docs,
        },
        "packing": {"algorithm": "first-fit-decreasing (longctx_cli.data.pack.ffd_bins)",
                    "capacity": args.row_len, "rows": len(rows),
                    "fill": tokens / (len(rows) * args.row_len)},
        "doc_lengths": {
            "tokens": tokens, "mean": float(arr.mean()),
            "quantiles": {q: int(np.quantile(arr, float(q)))
                          for q in ("0.1", "0.5", "0.9", "0.99", "1.0")},
            "share_of_tokens_in_docs_over_16k": float(arr[arr > 16384].sum() / tokens),
            "docs_at_row_len": int((arr == args.row_len).sum()),
        },
        "results": results,
    }


# ---- output --------------------------------------------------------------------------------


def _ratio(x: float) -> str:
    return f"{x:.4f}"


def print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sps = report["sp"]
    names = [s["name"] for s in report["strategies"]]
    blocks = [(w["description"], w["results"], "max_over_mean")
              for key, w in report["workloads"].items() if key.startswith("one_doc")]
    pk = report["workloads"]["packed"]
    rows = pk["packing"]["rows"]
    blocks += [(f"packed long-tail, aggregate over {rows} rows: {pk['description']}",
                pk["results"], "max_over_mean"),
               ("packed long-tail, per row: sum over rows of the busiest rank's work / sum "
                "of the mean rank's", pk["results"], "per_row_max_over_mean")]
    for title, results, key in blocks:
        table = Table(title=f"max/mean attention work over SP ranks — {title}",
                      title_justify="left")
        table.add_column("strategy")
        for sp in sps:
            table.add_column(f"sp={sp}", justify="right")
        for name in names:
            table.add_row(name, *(_ratio(results[name][str(sp)][key]) for sp in sps))
        console.print(table)
    console.print("Ulysses: not counted; each rank computes the whole row for heads/sp heads, "
                  "so its work is total/sp exactly (1.0 by construction).")


def readme_table(report: dict[str, Any]) -> str:
    sps = report["sp"]
    one = report["workloads"][f"one_doc_{report['row_len']}"]["results"]
    pk = report["workloads"]["packed"]
    head = ["strategy"] + [f"1 doc sp={sp}" for sp in sps] + [f"packed sp={sp}" for sp in sps]
    rows = []
    for s in report["strategies"]:
        name = s["name"] + (" (total/sp, not counted)" if s["mode"] == "ulysses" else "")
        cells = [f"{one[s['name']][str(sp)]['max_over_mean']:.3f}" for sp in sps]
        cells += [f"{pk['results'][s['name']][str(sp)]['max_over_mean']:.3f}" for sp in sps]
        rows.append([name, *cells])
    d = pk["distribution"]
    lines = [markdown_table(head, rows, right=range(1, len(head))), ""]
    lines.append(
        f"max/mean over SP ranks of the query-key pairs each computes under the causal document "
        f"mask (1.000 = perfect). 1 doc: one {report['row_len']}-token document per row. "
        f"Packed: {d['docs']} documents, lognormal lengths (median {d['median']:g}, sigma "
        f"{d['sigma']:g}, clipped to [{d['clip'][0]}, {d['clip'][1]}], seed {d['seed']}), "
        f"first-fit-decreasing into {pk['packing']['rows']} rows of {report['row_len']}, work "
        f"summed over rows. `{report['command']}` -> `results/balance.json`.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--row-len", type=int, default=131072, help="row length / packing capacity")
    p.add_argument("--long-len", type=int, nargs="*", default=[1048576],
                   help="more one-document row lengths to check")
    p.add_argument("--docs", type=int, default=8192, help="documents in the packed workload")
    p.add_argument("--median", type=float, default=1024.0)
    p.add_argument("--sigma", type=float, default=2.0)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "balance.json")
    p.add_argument("--readme", action="store_true", help="also print docs/parallelism.md's table")
    args = p.parse_args(argv)

    strategies = STRATEGIES
    workloads = {f"one_doc_{n}": one_document(strategies, args.sp, n)
                 for n in [args.row_len, *args.long_len]}
    workloads["packed"] = packed(strategies, args.sp, args)
    report = {
        "benchmark": "balance",
        "command": shlex.join(["python", "benchmarks/balance.py",
                               *(sys.argv[1:] if argv is None else argv)]),
        "unit": "query-key pairs under the causal document mask (per head and layer), "
                "counted by the queries each SP rank owns",
        "metric": "max over SP ranks / mean over SP ranks (1.0 = perfect balance)",
        "sp": args.sp,
        "row_len": args.row_len,
        "strategies": [{"name": s.name, "mode": s.mode, "sharding": s.sharding,
                        "ring_attn_func": s.ring_attn_func, "counted": not s.analytic,
                        **({"note": s.note} if s.note else {})} for s in strategies],
        "workloads": workloads,
    }
    print_tables(report)
    if args.readme:
        print()
        print(readme_table(report))
    write_results(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
