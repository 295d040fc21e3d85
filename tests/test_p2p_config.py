"""`ring_attn_func` and `sp_sharding`: how they relate, what validate refuses and prints."""

from __future__ import annotations

import pytest

from longctx_cli.config.memory_estimate import ring_buffer_bytes
from longctx_cli.config.shape import ModelShape
from longctx_cli.errors import UserError
from longctx_cli.layout import Layout, LayoutError
from tests.test_plan import CPU, GPU, cfg, plan, rule_error


@pytest.mark.parametrize(
    ("func", "layout"),
    [("batch_ring", "contiguous"), ("batch_zigzag", "zigzag"), ("batch_stripe", "stripe")],
)
def test_p2p_ring_implies_its_layout(func: str, layout: str) -> None:
    assert cfg(ring_attn_func=func).parallel.sp_sharding == layout
    assert cfg(ring_attn_func=func, sp_sharding=layout).parallel.sp_sharding == layout
    assert plan(sequence_parallel_degree=4, ring_attn_func=func).layout.sharding == layout


def test_contradictory_ring_and_layout_is_a_config_error() -> None:
    with pytest.raises(UserError) as exc:
        cfg(ring_attn_func="batch_zigzag", sp_sharding="contiguous")
    msg = str(exc.value)
    assert "`ring_attn_func: batch_zigzag` runs on `sp_sharding: zigzag`" in msg
    with pytest.raises(UserError, match="computed only by `ring_attn_func: batch_stripe`"):
        cfg(ring_attn_func="varlen_llama3", sp_sharding="stripe")


def test_llama3_keeps_both_layouts() -> None:
    assert cfg(ring_attn_func="varlen_llama3").parallel.sp_sharding == "contiguous"
    assert cfg(sp_sharding="zigzag").parallel.sp_sharding == "zigzag"
    assert cfg(sp_sharding="zigzag").parallel.ring_attn_func == "varlen_llama3"


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({}, ("batch_stripe", "stripe")),
        ({"sp_sharding": "stripe"}, ("batch_stripe", "stripe")),
        ({"sp_sharding": "zigzag"}, ("varlen_llama3", "zigzag")),
        ({"sp_sharding": "contiguous"}, ("varlen_llama3", "contiguous")),
        ({"heads_k_stride": 1}, ("varlen_llama3", "contiguous")),  # given: llama3's knob
        ({"ring_attn_func": "varlen_llama3"}, ("varlen_llama3", "contiguous")),
        ({"ring_attn_func": "batch_zigzag"}, ("batch_zigzag", "zigzag")),
        ({"sequence_parallel_mode": "hybrid", "ulysses_degree": 2},
         ("varlen_llama3", "contiguous")),
        ({"tensor_parallel_size": 2}, ("varlen_llama3", "contiguous")),
        ({"attention_kernel": "flash"}, ("varlen_llama3", "contiguous")),  # packed rows
    ],
)
def test_default_ring_is_the_balanced_one_where_it_runs(given: dict, want: tuple) -> None:
    """Unnamed, the ring is batch_stripe; what only llama3 has, or where a stripe cannot run,
    keeps the all-gather ring. The plan (validate) and the ranks read one Layout."""
    p = plan(world=8, platform=GPU, sequence_parallel_degree=4, **given)
    assert (p.layout.ring_attn_func, p.layout.sharding) == want
    notes = " ".join(p.notes)
    assert ("ring_attn_func unset: batch_stripe" in notes) == (given == {})


@pytest.mark.parametrize("mode", ["ulysses", "hybrid"])
def test_stripe_is_refused_outside_the_plain_ring(mode: str) -> None:
    extra = {"ulysses_degree": 2} if mode == "hybrid" else {}
    msg = rule_error(
        sequence_parallel_degree=4, sequence_parallel_mode=mode, ring_attn_func="batch_stripe",
        **extra,
    )
    assert f"`sp_sharding: stripe` (`ring_attn_func: batch_stripe`) is not supported by " \
           f"`sequence_parallel_mode: {mode}`" in msg
    assert "Fix:" in msg


def test_hybrid_with_p2p_ring_is_legal() -> None:
    p = plan(sequence_parallel_degree=4, sequence_parallel_mode="hybrid", ulysses_degree=2,
             ring_attn_func="batch_zigzag")
    lay = p.layout
    assert (lay.ulysses, lay.ring, lay.sharding, lay.ring_attn_func) == (2, 2, "zigzag",
                                                                         "batch_zigzag")


def test_flash_with_p2p_zigzag_is_legal_on_gpu() -> None:
    p = plan(platform=GPU, sequence_parallel_degree=2, ring_attn_func="batch_zigzag",
             attention_kernel="flash", sample_packing=False)
    assert p.layout.kernel == "flash"
    auto = plan(platform=GPU, sequence_parallel_degree=2, ring_attn_func="batch_zigzag",
                sample_packing=False)
    assert auto.layout.kernel == "flash"
    # Packed rows: ring-flash-attn's P2P functions take one sequence; PyTorch's op runs.
    packed = plan(platform=GPU, sequence_parallel_degree=2, ring_attn_func="batch_zigzag")
    assert packed.layout.kernel == "torch_flash" and "packed rows" in packed.layout.kernel_reason
    assert "packed rows" in rule_error(platform=GPU, sequence_parallel_degree=2,
                                       ring_attn_func="batch_zigzag", attention_kernel="flash")
    assert "zigzag is not supported" in rule_error(
        platform=GPU, sequence_parallel_degree=2, sp_sharding="zigzag", attention_kernel="flash"
    ).replace("'zigzag' is not supported", "zigzag is not supported")


def test_unused_ring_settings_are_noted() -> None:
    notes = " ".join(plan(sequence_parallel_degree=4, sequence_parallel_mode="ulysses",
                          ring_attn_func="batch_zigzag").notes)
    assert "ring_attn_func batch_zigzag is unused" in notes
    notes = " ".join(plan(sequence_parallel_degree=4, ring_attn_func="batch_ring",
                          heads_k_stride=2).notes)
    assert "heads_k_stride is unused by a P2P ring" in notes


SHAPE = ModelShape(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=384,
    max_position_embeddings=65536, source="test",
)


def test_buffers_per_rank_by_ring() -> None:
    """llama3 holds the gathered row; a P2P rank two blocks of its own and accumulators."""
    t, sp, b = 65536, 4, 4
    llama3 = ring_buffer_bytes("varlen_llama3", SHAPE, b, t // sp, sp)
    p2p = ring_buffer_bytes("batch_zigzag", SHAPE, b, t // sp, sp)
    assert llama3 == 6 * 64 * t * b
    assert p2p == (6 * 64 * b + (4 + 2) * 64 * 4) * (t // sp)
    # The P2P share shrinks with sp, the gathered row does not.
    assert ring_buffer_bytes("batch_ring", SHAPE, b, t // 8, 8) * 2 == p2p
    assert ring_buffer_bytes("varlen_llama3", SHAPE, b, t // 8, 8) == llama3


def test_validate_prints_buffers_of_each_ring() -> None:
    p = plan(world=4, shape=SHAPE, platform=CPU, sequence_len=65536,
             sequence_parallel_degree=4, ring_attn_func="batch_zigzag", dtype="float32")
    by_ring = dict(p.attention_buffers_by_ring)
    assert set(by_ring) == {"varlen_llama3", "batch_*"}
    assert by_ring["batch_*"] == p.memory.attention_buffers
    rows = [r for _, rs in p._sections(p.model) for r in rs]
    assert ("ring_attn_func", "batch_zigzag") in rows
    assert any(name.strip() == "with varlen_llama3 instead" for name, _ in rows)


def test_the_layout_refuses_what_config_refuses() -> None:
    with pytest.raises(LayoutError, match="runs on `sp_sharding: zigzag`"):
        Layout(sp=2, ring_attn_func="batch_zigzag", sharding="contiguous")
    with pytest.raises(LayoutError, match="stripe` is computed only"):
        Layout(sp=2, ring_attn_func="varlen_llama3", sharding="stripe")
    with pytest.raises(LayoutError, match="stripe` .* is not supported by `sequence_parallel"):
        Layout(sp=4, mode="hybrid", ulysses=2, ring_attn_func="batch_stripe", sharding="stripe")
    # no ring: nothing to check
    Layout(sp=2, mode="ulysses", ring_attn_func="batch_zigzag", sharding="contiguous")
    assert Layout(sp=2, sharding="stripe", ring_attn_func="batch_stripe").kernel == "torch"
    with pytest.raises(LayoutError, match="not supported by `attention_kernel: flash`"):
        Layout(sp=2, sharding="zigzag", ring_attn_func="varlen_llama3", kernel="flash")
    assert Layout(sp=2, sharding="zigzag", ring_attn_func="batch_zigzag", kernel="flash").p2p
