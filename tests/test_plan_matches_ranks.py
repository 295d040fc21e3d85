"""What `validate` prints is what the ranks run: the plan built by `validate`'s code and the
layout every rank builds from the same config agree on kernel, degrees, mode and sharding."""

from __future__ import annotations

from typing import Any

import pytest
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


def _rank_layout(rank: int, world_size: int, overrides: dict[str, Any]) -> dict[str, Any]:
    from longctx_cli.runtime.distributed import init_parallel

    parallel = init_parallel(_config(overrides), torch.device("cpu"))
    ctx = parallel.sp_ctx
    return {"kernel": ctx.kernel, "sp": ctx.sp_size, "dp": parallel.dp_size, "mode": ctx.mode,
            "sharding": ctx.layout, "ring_attn_func": ctx.ring_attn_func,
            "heads_k_stride": ctx.heads_k_stride,
            "hybrid_ulysses": ctx.ulysses_degree if ctx.mode == "hybrid" else None}


@pytest.mark.parametrize("name", CASES)
def test_the_ranks_run_the_plan_validate_prints(name: str) -> None:
    overrides = CASES[name]
    config = _config(overrides)
    plan = build_plan(config, 4, read_model_config(config))  # validate's code, this machine
    printed = {"kernel": plan.kernel, "sp": plan.sp, "dp": plan.dp, "mode": plan.mode,
               "sharding": plan.sharding, "ring_attn_func": plan.ring_attn_func,
               "heads_k_stride": plan.heads_k_stride,
               "hybrid_ulysses": plan.ulysses if plan.mode == "hybrid" else None}
    for rank, layout in enumerate(run_distributed(_rank_layout, 4, overrides)):
        assert layout == printed, (name, rank)
