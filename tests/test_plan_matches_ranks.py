"""What `validate` prints is what the ranks run: the `Layout` in the plan built by
`validate`'s code is the one every rank builds (through the same `check_run`, on the
torchrun world) and builds its process groups from."""

from __future__ import annotations

import os
from typing import Any

import torch

from longctx_cli.config import config_from_dict
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.plan import build_plan
from tests.distributed import run_distributed

MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
         "vocab_size": 128}

CASES = {
    "ring_zigzag_dp2_sp2": {"sequence_parallel_degree": 2, "sp_sharding": "zigzag",
                            "heads_k_stride": 2},
    "ulysses_sp4": {"sequence_parallel_degree": 4, "sequence_parallel_mode": "ulysses"},
    "hybrid_2x2": {"sequence_parallel_degree": 4, "sequence_parallel_mode": "hybrid",
                   "ulysses_degree": 2},
    "batch_zigzag_dp2_sp2": {"sequence_parallel_degree": 2, "ring_attn_func": "batch_zigzag"},
    "batch_stripe_sp4": {"sequence_parallel_degree": 4, "ring_attn_func": "batch_stripe"},
}


def _config(overrides: dict[str, Any]):
    return config_from_dict({"model_config": MODEL, "tokenizer": "byte", "dtype": "float32",
                             "sequence_len": 256, "attention_kernel": "auto", **overrides})


def _rank_layouts(rank: int, world_size: int) -> dict[str, Any]:
    """Each case's layout as this rank builds it at start-up, and its SP group's ranks."""
    import torch.distributed as dist

    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.preflight import check_run

    os.environ["WORLD_SIZE"] = str(world_size)  # what torchrun sets for every rank
    out = {}
    for name, overrides in CASES.items():
        _, plan = check_run(_config(overrides), "train", world_checks=False)  # as a rank does
        state = build_parallel_state(plan.layout, torch.device("cpu"))
        sp_ranks = dist.get_process_group_ranks(state.sp_group) if state.sp_group else [rank]
        out[name] = (state.layout, state.sp_rank, sp_ranks)
    return out


def test_the_ranks_run_the_layout_validate_prints() -> None:
    plans = {}
    for name, overrides in CASES.items():
        config = _config(overrides)
        plans[name] = build_plan(config, 4, read_model_config(config))  # validate's code
    for rank, layouts in enumerate(run_distributed(_rank_layouts, 4)):
        for name, (layout, sp_rank, sp_ranks) in layouts.items():
            plan = plans[name]
            assert layout == plan.layout, (name, rank)
            # The groups are the layout's: this rank's SP group holds the ranks of its
            # (dp, tp) coordinates, in SP order.
            d, c, t = layout.coords(rank)
            assert sp_rank == c, (name, rank)
            assert sp_ranks == [(d * layout.sp + i) * layout.tp + t
                                for i in range(layout.sp)], (name, rank)
