"""The longest row that trains under a fixed memory cap per rank, for sp in {1, 2, 4}.

    python benchmarks/max_len.py --cap-mib 384 --option plain

Same model, processes and step as benchmarks/train_step.py. For each sp the peak memory per
rank (VmHWM growth over build + one full step) is measured at a few row lengths; memory per
rank is linear in the row length (attention keeps no T x T state), so a least-squares line
gives the longest row under the cap. That row (rounded down to a multiple of 2 x sp x 64) is
then trained for real; if its measured peak is over the cap the row shrinks by 5% until it
fits, so every reported length was trained and measured under the cap.
"""

from __future__ import annotations

import argparse

from common import markdown_table, write_results

from benchmarks.train_step import OPTIONS, STRATEGIES, Variant, init_rank, measure, spawn_ranks

SP_STRATEGY = {1: "sp1", 2: "sp2_zigzag", 4: "sp4_zigzag"}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    covariance = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = covariance / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def longest_row(
    sp: int, option: str, cap_mib: float, local: list[int], log: bool, strategy: str = ""
) -> dict:
    strategy = strategy or SP_STRATEGY[sp]
    points = [(sp * t, measure(Variant(strategy, option, sp * t))[1]) for t in local]
    intercept, slope = fit_line([float(t) for t, _ in points], [m for _, m in points])
    step = 2 * sp * 64
    row = int((cap_mib - intercept) / slope) // step * step
    checks = []
    while row >= step:
        peak = measure(Variant(strategy, option, row))[1]
        checks.append((row, peak))
        if log:
            print(f"  sp {sp}: row {row} -> {peak:.0f} MiB (cap {cap_mib:.0f})", flush=True)
        if peak <= cap_mib:
            break
        row = int(row * 0.95) // step * step
    return {"sp": sp, "strategy": strategy, "option": option, "points": points,
            "intercept_mib": intercept, "mib_per_token": slope, "checks": checks,
            "longest_row": checks[-1][0]}


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    init_rank(args.option)
    if args.strategies:  # named strategies (e.g. llama3 vs P2P rings at one sp)
        return [longest_row(STRATEGIES[s][0], args.option, args.cap_mib, args.local_tokens,
                            rank == 0, s) for s in args.strategies]
    return [longest_row(sp, args.option, args.cap_mib, args.local_tokens, rank == 0)
            for sp in args.sp]


def table(results: list[dict]) -> str:
    sp1 = next((r for r in results if r["sp"] == 1), None)
    return markdown_table(
        ["sp", "strategy", "fixed (MiB)", "MiB per 1K row tokens", "longest row under cap",
         "vs sp=1"],
        ([r["sp"], r.get("strategy", ""), f"{r['intercept_mib']:.0f}",
          f"{1024 * r['mib_per_token']:.1f}", r["longest_row"],
          f"{r['longest_row'] / sp1['longest_row']:.2f}x" if sp1 else "-"] for r in results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap-mib", type=float, default=384.0)
    parser.add_argument("--option", default="plain", choices=list(OPTIONS))
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 4])
    parser.add_argument("--local-tokens", type=int, nargs="+", default=[512, 1024, 2048],
                        help="tokens per rank of the rows measured for the fit")
    parser.add_argument("--strategies", nargs="*", default=[], choices=list(STRATEGIES),
                        help="measure these strategies instead of --sp (e.g. sp4_zigzag "
                        "sp4_batch_zigzag)")
    parser.add_argument("--out", default="benchmarks/results/max_len.json")
    args = parser.parse_args()
    results = spawn_ranks(worker, args)
    write_results(args.out, {"cap_mib": args.cap_mib, "option": args.option, "results": results})
    print(table(results))


if __name__ == "__main__":
    main()
