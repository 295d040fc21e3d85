"""fp16 training: float32 master weights, autocast, loss scaling; bf16 and fp32 unchanged.

Runs the trainer's own `train_step` on CPU (autocast and GradScaler exist there too) in one
gloo process.
"""

from __future__ import annotations

import math

import pytest
import torch

from longctx_cli.config import config_from_dict
from longctx_cli.parallel import shard_batch
from longctx_cli.runtime.model import build_model, decoder_and_head
from longctx_cli.train.precision import setup_precision
from longctx_cli.train.step import train_step
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.train_helpers import (
    TINY_LLAMA,
    final_tensors,
    read_metrics,
    relative_error,
    train,
    write_config,
    write_documents,
)


def _config(dtype: str, **extra):
    return config_from_dict({
        "model_config": TINY_LLAMA, "dtype": dtype, "sequence_len": 64,
        "attention_kernel": "torch", "learning_rate": 1e-3, "seed": 3, "fidelity_probe": False,
        "max_grad_norm": 1.0, **extra,
    })


def _batch(ctx):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 384, (64,), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(24)])
    return shard_batch(ids, pos, ids, ctx)


def steps_worker(rank: int, world: int, dtype: str, init_scale: float | None) -> dict:
    config = _config(dtype)
    ctx = sp_state(sp=1, kernel="torch")
    model = build_model(config)
    device = torch.device("cpu")
    precision = setup_precision(model, config.model.dtype, device)
    if init_scale is not None and precision.scaler is not None:
        precision.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.training.learning_rate)
    results = []
    for _ in range(3):
        r = train_step(model, decoder, head, params, optimizer, [_batch(ctx)], config, ctx,
                       False, precision)
        results.append((r.loss, r.skipped))
    return {
        "results": results,
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "scale": None if precision.scaler is None else precision.scaler.get_scale(),
        "autocast": str(precision.autocast_dtype),
    }


def test_fp16_keeps_float32_master_weights_and_scales_the_loss() -> None:
    (fp32,) = run_distributed(steps_worker, 1, "float32", None, timeout_s=120)
    (fp16,) = run_distributed(steps_worker, 1, "float16", None, timeout_s=120)
    assert fp16["param_dtypes"] == ["torch.float32"] and fp16["autocast"] == "torch.float16"
    assert fp16["scale"] is not None and fp16["scale"] > 1
    for (a, _), (b, skipped) in zip(fp32["results"], fp16["results"], strict=True):
        assert not skipped and math.isfinite(b)
        assert abs(a - b) / abs(a) < 2e-2  # fp16 compute of the same steps
    assert fp32["scale"] is None and fp32["autocast"] == "None"


def test_fp16_overflow_skips_the_step_and_lowers_the_scale() -> None:
    (run,) = run_distributed(steps_worker, 1, "float16", 2.0**120, timeout_s=120)
    skipped = [s for _, s in run["results"]]
    assert skipped[0]  # the scaled gradients overflow: skipped, not an error
    assert run["scale"] < 2.0**120


def test_bf16_trains_native_bf16_weights() -> None:
    model = build_model(_config("bfloat16"))
    precision = setup_precision(model, "bfloat16", torch.device("cpu"))
    assert precision.scaler is None and precision.autocast_dtype is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _one_rank_overflows_worker(rank: int, world: int, sharded: bool) -> tuple[float, bool]:
    """Each rank holds its own part of the gradients (as under FSDP2 / TP); only rank 0's
    part overflows."""
    model = torch.nn.Linear(4, 4)
    precision = setup_precision(model, "float16", torch.device("cpu"), sharded_grads=sharded)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    precision.scale(torch.ones(()))  # the scaler sets its scale on first use
    for p in model.parameters():
        p.grad = torch.full_like(p, math.inf if rank == 0 else 1.0)
    precision.unscale(optimizer)
    precision.step(optimizer)
    precision.update()
    return precision.scaler.get_scale(), torch.equal(model.weight.detach(), before)


def test_fp16_overflow_on_one_rank_is_agreed_by_every_rank() -> None:
    results = run_distributed(_one_rank_overflows_worker, 2, True, timeout_s=120)
    assert results[0] == results[1], results  # the same scale; both skipped the step
    scale, unchanged = results[0]
    assert unchanged and scale < 2.0**16
    # Without the agreement the ranks part ways (what the sharded scaler is there for).
    plain = run_distributed(_one_rank_overflows_worker, 2, False, timeout_s=120)
    assert plain[0] != plain[1], plain


@pytest.mark.slow
def test_fp16_fsdp_run_equals_the_single_process_run(tmp_path) -> None:
    """fp16 with FSDP2: float32 master weights are kept before sharding, so the sharded run
    trains the same weights as one process (up to fp16 summation order)."""
    data = write_documents(tmp_path / "docs.jsonl")
    runs = {}
    for name, nproc, extra in (("one", 1, {}),
                               ("fsdp", 2, {"fsdp": True, "gradient_accumulation_steps": 2})):
        train(write_config(tmp_path, name, data, dtype="float16", **extra), nproc)
        runs[name] = tmp_path / name
    one, fsdp = read_metrics(runs["one"]), read_metrics(runs["fsdp"])
    assert [m["step"] for m in fsdp] == [m["step"] for m in one] == [1, 2, 3, 4, 5]
    for a, b in zip(one, fsdp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
    want, got = final_tensors(runs["one"]), final_tensors(runs["fsdp"])
    assert got.keys() == want.keys()
    flat = torch.cat([got[k].float().reshape(-1) for k in sorted(want)])
    flat_want = torch.cat([want[k].float().reshape(-1) for k in sorted(want)])
    assert relative_error(flat, flat_want) < 1e-3
