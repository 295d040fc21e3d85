"""`benchmarks/balance.py`: its closed-form attention-work count against a brute-force count,
and the balance values that follow exactly from the layouts."""

from __future__ import annotations

import importlib.util
import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import IGNORE_INDEX, shard_batch

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("balance_benchmark",
                                                  ROOT / "benchmarks" / "balance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


balance = _load()
COUNTED = [s for s in balance.STRATEGIES if not s.analytic]
ROWS = [[64], [20, 7, 30, 3], [13, 40, 11], [1] * 9 + [50], [33, 1, 1, 5]]


def brute_force(layout, doc_lengths: list[int]) -> list[int]:
    """Pairs (query i, key j) with j <= i in the same document, for the queries each rank owns,
    on the row padded as `shard_batch` pads it (the padding tail its own document)."""
    n = sum(doc_lengths)
    total = n + (-n % layout.row_multiple)
    doc = [k for k, length in enumerate(doc_lengths) for _ in range(length)]
    doc += [len(doc_lengths)] * (total - n)
    out = []
    for r in range(layout.sp):
        owned = [i for a, b in layout.local_ranges(total, r) for i in range(a, b)]
        out.append(sum(1 for i in owned for j in range(i + 1) if doc[j] == doc[i]))
    return out


@pytest.mark.parametrize("strategy", COUNTED, ids=lambda s: s.name)
@pytest.mark.parametrize("sp", [1, 2, 4, 8])
def test_count_matches_brute_force(strategy, sp: int) -> None:
    layout = strategy.layout(sp)
    for docs in ROWS:
        got = balance.rank_work(layout, docs)
        assert got == brute_force(layout, docs), (strategy.name, sp, docs)
        assert sum(got) == balance.RowWork(balance.padded_documents(docs, layout)).total


def test_overlap_work_matches_brute_force() -> None:
    for s, e in [(0, 10), (5, 17), (30, 31)]:
        for a in range(0, 35, 3):
            for b in range(a, 36, 4):
                want = sum(i - s + 1 for i in range(max(a, s), min(b, e)))
                assert balance.overlap_work(a, b, s, e) == want


@pytest.mark.parametrize("strategy", COUNTED, ids=lambda s: s.name)
def test_rows_and_ranges_are_the_ones_shard_batch_builds(strategy) -> None:
    """The padded documents and the ranks' ranges are those of the trainer's `shard_batch`."""
    docs = [20, 7, 30, 3]  # 60 tokens: padded for every layout at sp=4 but contiguous/stripe
    layout = strategy.layout(4)
    pos = torch.cat([torch.arange(n) for n in docs])
    ids = torch.full_like(pos, 5)
    labels = torch.where(pos == 0, IGNORE_INDEX, ids)
    padded = balance.padded_documents(docs, layout)
    cu = [0] + torch.tensor(padded).cumsum(0).tolist()
    for r in range(4):
        meta = shard_batch(ids, pos, labels, ParallelState(layout, sp_rank=r)).sp_meta
        assert meta.cu_seqlens.tolist() == cu
        assert meta.local_ranges == layout.local_ranges(sum(padded), r)


@pytest.mark.parametrize("sp", [2, 4, 8, 16])
def test_zigzag_one_document_is_exactly_balanced(sp: int) -> None:
    for strategy in COUNTED:
        if strategy.sharding != "zigzag":
            continue
        for total in (2 * sp, 2 * sp * 3, 2 * sp * 37, 131072):
            work = balance.rank_work(strategy.layout(sp), [total])
            assert len(set(work)) == 1, (strategy.name, sp, total, work)
            assert balance.imbalance(work) == 1.0


@pytest.mark.parametrize("total", [64, 1000, 131072])
def test_contiguous_one_document_sp2(total: int) -> None:
    """Rank 0 owns queries 0..m-1 (m = T/2): m(m+1)/2 pairs of the m(2m+1); rank 1 the rest,
    m(3m+1)/2, so max/mean = (3m+1)/(2m+1): 97/65 at T = 64, 1.5 as T grows."""
    m = total // 2
    for strategy in COUNTED:
        if strategy.sharding != "contiguous":
            continue
        work = balance.rank_work(strategy.layout(2), [total])
        assert work == [m * (m + 1) // 2, m * (3 * m + 1) // 2]
        assert Fraction(max(work) * 2, sum(work)) == Fraction(3 * m + 1, 2 * m + 1)
    assert Fraction(97, 65) == Fraction(3 * 32 + 1, 2 * 32 + 1)


def test_ulysses_is_total_over_sp() -> None:
    ulysses = next(s for s in balance.STRATEGIES if s.analytic)
    work = balance.strategy_work(ulysses, 4, [20, 7, 30, 3])
    assert work == [sum(n * (n + 1) // 2 for n in [20, 7, 30, 3]) / 4] * 4


def test_script_writes_json_and_readme_table(tmp_path: Path, capsys) -> None:
    out = tmp_path / "balance.json"
    rc = balance.main(["--sp", "2", "4", "--row-len", "4096", "--long-len", "--docs", "200",
                       "--median", "256", "--out", str(out), "--readme"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python benchmarks/balance.py --sp 2 4")
    packed = report["workloads"]["packed"]
    assert packed["distribution"]["median"] == 256 and packed["packing"]["rows"] >= 1
    one = report["workloads"]["one_doc_4096"]["results"]
    assert one["llama3 ring, contiguous"]["2"]["max_over_mean"] == pytest.approx(1.5, abs=1e-3)
    assert one["P2P batch_zigzag"]["4"]["max_over_mean"] == 1.0
    for name, by_sp in packed["results"].items():
        for r in by_sp.values():
            assert r["max_over_mean"] >= 1.0 and r["per_row_max_over_mean"] >= 1.0, name
    printed = capsys.readouterr().out
    assert "| strategy | 1 doc sp=2 |" in printed and "| P2P batch_stripe (default) |" in printed


@pytest.mark.parametrize("platform", ["gpu", "gpu_no_packages", "cpu"])
@pytest.mark.parametrize("sp", [2, 4, 8, 16])
def test_default_layout_is_within_five_percent_of_even(platform: str, sp: int) -> None:
    """The layout `validate` plans (and the ranks run) for a config naming only
    `sequence_parallel_degree` spreads causal work within 1.05 of even, on one long document
    and on packed long-tail rows (aggregate and row by row)."""
    from longctx_cli.config.load import config_from_dict
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform

    machine = {"gpu": Platform(cuda=True, ring_flash_attn=True, capability=(9, 0)),
               "gpu_no_packages": Platform(cuda=True, ring_flash_attn=False, capability=(9, 0)),
               "cpu": Platform(cuda=False, ring_flash_attn=False)}[platform]
    config = config_from_dict({
        "model_config": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                         "num_hidden_layers": 2, "num_attention_heads": 8,
                         "num_key_value_heads": 8, "vocab_size": 128},
        "tokenizer": "byte", "sequence_len": 32768, "sequence_parallel_degree": sp})
    layout = build_plan(config, sp, read_model_config(config), platform=machine).layout
    assert balance.imbalance(balance.rank_work(layout, [32768])) <= 1.05
    lengths = balance.longtail_lengths(600, 1024, 2.0, 64, 32768, seed=0)
    totals, busiest, mean = [0] * sp, 0.0, 0.0
    for row in balance.packed_rows(lengths, 32768):
        work = balance.rank_work(layout, row)
        totals = [t + w for t, w in zip(totals, work, strict=True)]
        busiest, mean = busiest + max(work), mean + sum(work) / sp
    assert balance.imbalance(totals) <= 1.05
    assert busiest / mean <= 1.05
