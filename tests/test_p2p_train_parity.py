"""A whole training run with a P2P ring equals sp=1 (fp32, CPU, gloo).

The same data, seed and 5 optimizer steps as `test_train_parity.py`: packed rows whose
documents cross rank boundaries. batch_ring, batch_zigzag and batch_stripe at sp=2,
batch_zigzag at sp=4 (marked slow), and hybrid (Ulysses 2 x P2P ring 2).
"""

from __future__ import annotations

import pytest

from tests.train_helpers import assert_same_run, train, write_config, write_documents


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("p2p_parity")
    return path, write_documents(path / "docs.jsonl")


@pytest.fixture(scope="module")
def reference(workdir):
    path, data = workdir
    train(write_config(path, "ref", data), 1)
    return path / "ref"


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        # All slow: the family matrix trains every family under the P2P rings at sp2 against
        # the model's own training (stripe and zigzag by default), and
        # tests/test_p2p_ring_attention.py checks each ring's attention at sp 2-4.
        pytest.param(
            "batch_ring_sp2", 2, {"sequence_parallel_degree": 2, "ring_attn_func": "batch_ring"},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "batch_zigzag_sp2",
            2,
            {"sequence_parallel_degree": 2, "ring_attn_func": "batch_zigzag"},
            marks=pytest.mark.slow,
        ),
        pytest.param(  # the family matrix's default column trains every family with it
            "batch_stripe_sp2",
            2,
            {"sequence_parallel_degree": 2, "ring_attn_func": "batch_stripe"},
            marks=pytest.mark.slow,
        ),
        pytest.param(  # like ring_sp4 in test_train_parity.py: a long extra
            "batch_zigzag_sp4",
            4,
            {"sequence_parallel_degree": 4, "ring_attn_func": "batch_zigzag"},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "hybrid_2x2_batch_zigzag",
            4,
            {
                "sequence_parallel_degree": 4,
                "sequence_parallel_mode": "hybrid",
                "ulysses_degree": 2,
                "ring_attn_func": "batch_zigzag",
            },
            marks=pytest.mark.slow,
        ),
    ],
)
def test_p2p_training_matches_sp1(workdir, reference, name, nproc, overrides):
    path, data = workdir
    cfg = write_config(path, name, data, **overrides)
    train(cfg, nproc)
    assert_same_run(path / name, reference)
