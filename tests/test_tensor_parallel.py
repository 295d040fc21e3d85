"""TP-sp (tensor_parallel_size) is exact: vocab-parallel CE, one step's gradients, whole runs.

All multi-process on CPU with gloo, fp32. Whole runs compare against the single-process run
of the same config (tests/train_helpers.py): tp2, tp2 x sp2, dp2 x tp2 (FSDP2), LoRA, resume.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import (
    TINY_LLAMA,
    assert_same_run,
    final_tensors,
    read_metrics,
    relative_error,
    train,
    write_config,
    write_documents,
)

# ---- vocab-parallel cross-entropy -----------------------------------------------------------


def _ce_worker(rank: int, world: int) -> float:
    import torch.nn.functional as F

    from longctx_cli.parallel.tensor_parallel import _VocabParallelCE

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 12, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 12, (10,), generator=gen)
    labels[[2, 7]] = -100
    weights = torch.rand(10, generator=gen, dtype=torch.float64)  # a per-token grad_output
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, labels, ignore_index=-100, reduction="none")
    (want * weights).sum().backward()
    cols = 12 // world
    local = logits[:, rank * cols : (rank + 1) * cols].clone().requires_grad_()
    got = _VocabParallelCE.apply(local, labels, rank * cols, torch.distributed.group.WORLD)
    # Each rank takes the loss of different tokens; the backward sums what they take.
    mine = torch.arange(10) % world == rank
    (got * weights * mine).sum().backward()
    assert torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-6), (got, want)
    grad_want = full.grad[:, rank * cols : (rank + 1) * cols]
    return float((local.grad - grad_want).abs().max())


def test_vocab_parallel_cross_entropy_matches_torch():
    for err in run_distributed(_ce_worker, 2, timeout_s=120):
        assert err < 1e-6


# ---- one forward/backward against the single-process model -------------------------------


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}
# Per family: what its tiny config needs besides TINY (qwen3's q_norm / k_norm: a per-head
# norm, replicated over the TP group, whose weight gradient is summed over it).
FAMILY_FIELDS = {"llama": {}, "qwen3": {"head_dim": 8}}


def _step_worker(rank: int, world: int, family: str, tp: int, sp: int, mode: str,
                 chunk: int | None, lora: bool) -> tuple[float, float, float, int, int]:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.parallel import tensor_parallel as T
    from longctx_cli.parallel.attention import ATTN_IMPLEMENTATION, register_sp_attention
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.head import model_head
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.train.step import sum_gradients
    from tests.layouts import rank_state, sp_state

    register_sp_attention()
    cfg = AutoConfig.for_model(family, **TINY, **FAMILY_FIELDS[family])
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION,
                                           dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
        for name, p in ref.named_parameters():
            if "lora_B" in name:  # B starts at zero; make it non-zero so A gets gradients
                torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():  # norms start at one: perturb them so a wrong gradient shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 384, (64,), generator=gen)
    # Three documents; boundaries fall inside SP shards and inside TP slices.
    pos = torch.cat([torch.arange(21), torch.arange(30), torch.arange(13)])

    def loss_of(m, ctx, tpc):
        base = m.get_base_model() if lora else m
        batch = shard_batch(ids, pos, ids.clone(), ctx)
        hidden = base.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                            sp_meta=batch.sp_meta).last_hidden_state
        head = model_head(base.lm_head, cfg)
        if tpc is None:
            return lm_loss_sum(head, hidden.reshape(-1, 32), batch.shift_labels)
        return T.tp_loss_sum(head, hidden, batch.shift_labels, tpc, chunk)

    loss_ref = loss_of(ref, rank_state(), None)
    loss_ref.backward()

    ctx = tpc = sp_state(sp=sp, mode=mode, tp=tp, kernel="torch")
    base = model.get_base_model() if lora else model
    T.apply_tensor_parallel(base.model, base.lm_head, tpc, cfg)
    loss = loss_of(model, ctx, tpc)
    loss.backward()
    sum_gradients([p for p in model.parameters() if p.grad is not None], tpc)
    total = loss.detach().clone()
    dist.all_reduce(total)  # each rank summed the loss of its own tokens
    worst, compared = 0.0, 0
    for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.requires_grad == q.requires_grad  # a LoRA base stays frozen under TP
        if q.grad is None:
            continue
        compared += 1
        worst = max(worst, relative_error(p.grad.full_tensor(), q.grad))
    trainable = sum(q.requires_grad for q in ref.parameters())
    return float(total), float(loss_ref.detach()), worst, compared, trainable


@pytest.mark.parametrize(
    ("family", "tp", "sp", "mode", "chunk", "lora"),
    [
        ("llama", 2, 1, "ring", None, False),
        pytest.param("llama", 2, 2, "ring", 8, False, marks=pytest.mark.slow),  # as qwen3's
        ("llama", 2, 2, "ulysses", None, False),
        # LoRA under TP-sp: -m slow, for the suite's time (TP-sp itself stays by default).
        pytest.param("llama", 2, 2, "ring", 8, True, marks=pytest.mark.slow),
        ("qwen3", 2, 2, "ring", 8, False),
    ],
    ids=["tp2", "tp2_sp2_ring_chunked", "tp2_sp2_ulysses", "tp2_sp2_lora",
         "qwen3_tp2_sp2_ring_chunked"],
)
def test_one_step_gradients_match_single_process(family, tp, sp, mode, chunk, lora):
    results = run_distributed(_step_worker, tp * sp, family, tp, sp, mode, chunk, lora,
                              timeout_s=240)
    for total, want, worst, compared, trainable in results:
        assert abs(total - want) <= 1e-5 * abs(want), (total, want)
        assert worst < 1e-5, worst
        assert compared == trainable  # every trainable tensor had a gradient to compare


# c10d's in-place collectives by the functional names torch's CommDebugMode reports.
_FUNCTIONAL_NAMES = {"_allgather_base_": "all_gather_into_tensor",
                     "_reduce_scatter_base_": "reduce_scatter_tensor"}


def _collective_counter():
    """A dispatch mode counting the collectives run under it, by name (CommDebugMode's own
    module tracker fails on transformers 5.25's rotary layer, a hub-kernel module)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.namespace in ("c10d", "_c10d_functional"):
                self.counts[_FUNCTIONAL_NAMES.get(func._opname, func._opname)] += 1
            return func(*args, **(kwargs or {}))

    return CollectiveCounter()


def _comm_worker(rank: int, world: int) -> dict[int, dict[str, int]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.parallel import tensor_parallel as T
    from longctx_cli.parallel.attention import ATTN_IMPLEMENTATION, register_sp_attention
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.head import model_head
    from tests.layouts import sp_state

    register_sp_attention()
    counts = {}
    for layers in (1, 2):
        cfg = AutoConfig.for_model("llama", **{**TINY, "num_hidden_layers": layers})
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION)
        ctx = sp_state(sp=1, tp=2, kernel="torch")
        T.apply_tensor_parallel(model.model, model.lm_head, ctx, cfg)
        ids = torch.arange(64) % 384
        batch = shard_batch(ids, torch.arange(64), ids.clone(), ctx)
        with _collective_counter() as mode:
            hidden = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                 sp_meta=batch.sp_meta).last_hidden_state
            T.tp_loss_sum(model_head(model.lm_head, cfg), hidden, batch.shift_labels,
                          ctx).backward()
        counts[layers] = dict(mode.counts)
    return counts


def test_tp_sp_sends_four_collectives_per_layer_each_way():
    """Megatron-SP: per layer, all-gather + reduce-scatter around attention and around the
    MLP in forward, the reverse in backward; no all-reduce of activations."""
    counts = run_distributed(_comm_worker, 2, timeout_s=120)[0]
    per_layer = {k: counts[2].get(k, 0) - counts[1].get(k, 0) for k in counts[2]}
    assert per_layer.get("all_gather_into_tensor") == 4, per_layer
    assert per_layer.get("reduce_scatter_tensor") == 4, per_layer
    assert per_layer.get("allreduce_", 0) == 0, per_layer


# ---- against the model's own Hugging Face training ------------------------------------------


def _hf_reference_worker(rank: int, world: int) -> dict[str, dict]:
    """TP-sp training of the families whose TP path is new (Qwen3's per-head norms, tied
    embeddings) against the model's own training: eager attention, forward(labels=) per
    document (tests/family_matrix.py)."""
    from tests import family_matrix as fm

    families = [next(f for f in fm.FAMILIES if f.name == "qwen3"),
                fm.Family("llama (tied embeddings)", "llama", {"tie_word_embeddings": True})]
    out = {}
    for family in families:
        run = fm.longctx_training(family, {"tensor_parallel_size": 2})
        if rank == 0:
            out[family.name] = fm.compare(run, fm.reference_training(family))
    return out


def test_tp2_equals_the_models_own_training():
    from tests import family_matrix as fm

    cells = run_distributed(_hf_reference_worker, 2, timeout_s=300)[0]
    assert set(cells) == {"qwen3", "llama (tied embeddings)"}
    for name, cell in cells.items():
        assert "refused" not in cell, (name, cell)
        assert cell["loss"] < fm.LOSS_TOL and cell["weights"] < fm.WEIGHT_TOL, (name, cell)


# ---- whole training runs ----------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp")
    return path, write_documents(path / "docs.jsonl")


def _run(workdir, name: str, nproc: int, **overrides):
    path, data = workdir
    train(write_config(path, name, data, **overrides), nproc)
    return path / name


def assert_same_adam_run(run, reference, adapter: bool = False) -> None:
    """Per-step loss within 1e-5, final weights within 1e-5 as one vector.

    TP sums matmuls in another order (row-parallel halves); AdamW's first updates divide a
    gradient by its own magnitude, so an entry whose gradient is ~0 turns that last-bit noise
    into an O(lr) difference of that one entry (seen: 1 of 2048 entries of a down_proj, 3e-5).
    The SGD run below compares every tensor at 1e-5, where no such amplification exists.
    """
    got, want = read_metrics(run), read_metrics(reference)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"], (g, w)
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (g, w)
        if "eval_loss" in w:
            assert abs(g["eval_loss"] - w["eval_loss"]) <= 1e-5 * abs(w["eval_loss"]), (g, w)
    got_w, want_w = final_tensors(run, adapter), final_tensors(reference, adapter)
    assert got_w.keys() == want_w.keys()
    keys = sorted(want_w)
    flat = torch.cat([got_w[k].reshape(-1) for k in keys])
    flat_want = torch.cat([want_w[k].reshape(-1) for k in keys])
    assert relative_error(flat, flat_want) < 1e-5
    for k in keys:
        assert relative_error(got_w[k], want_w[k]) < 1e-4, k


@pytest.fixture(scope="module")
def reference(workdir):
    return _run(workdir, "ref", 1)


@pytest.mark.slow
def test_tp2_sgd_matches_single_process_per_tensor(workdir):
    ref = _run(workdir, "ref_sgd", 1, optimizer="sgd", learning_rate=0.5)
    run = _run(workdir, "tp2_sgd", 2, optimizer="sgd", learning_rate=0.5,
               tensor_parallel_size=2)
    assert_same_run(run, ref, tol=1e-5)


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        # TP training stays by default in test_tp2_equals_the_models_own_training (in
        # process) and in the tied-embeddings TP x SP x FSDP run through the CLI.
        pytest.param("tp2", 2, {"tensor_parallel_size": 2}, marks=pytest.mark.slow),
        pytest.param("tp2_sp2_chunked_ckpt", 4, {
            "tensor_parallel_size": 2, "sequence_parallel_degree": 2, "chunked_loss": True,
            "loss_chunk_size": 16, "gradient_checkpointing": True}, marks=pytest.mark.slow),
        pytest.param("dp2_tp2_fsdp", 4, {
            "tensor_parallel_size": 2, "gradient_accumulation_steps": 2, "fsdp": True},
            marks=pytest.mark.slow),
        pytest.param("dp2_tp2", 4, {
            "tensor_parallel_size": 2, "gradient_accumulation_steps": 2},
            marks=pytest.mark.slow),
        pytest.param("tp2_sp2_ulysses_zigzag", 4, {
            "tensor_parallel_size": 2, "sequence_parallel_degree": 2,
            "sequence_parallel_mode": "ulysses", "sp_sharding": "zigzag"},
            marks=pytest.mark.slow),
    ],
)
def test_full_finetune_matches_single_process(workdir, reference, name, nproc, overrides):
    assert_same_adam_run(_run(workdir, name, nproc, **overrides), reference)


@pytest.mark.slow
def test_qwen3_tp2_sp2_matches_single_process(workdir):
    """Qwen3's per-head q_norm / k_norm: each TP rank normalises its own heads with the
    replicated weight, whose gradient is summed over the group."""
    qwen3 = {"model_config": {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 8}}
    ref = _run(workdir, "ref_qwen3", 1, **qwen3)
    run = _run(workdir, "qwen3_tp2_sp2", 4, tensor_parallel_size=2, sequence_parallel_degree=2,
               **qwen3)
    assert_same_adam_run(run, ref)


TIED = {"model_config": {**TINY_LLAMA, "tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def tied_reference(workdir):
    return _run(workdir, "ref_tied", 1, **TIED)


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        # -m slow for the suite's time (FSDP2 under SP stays by default in test_train_parity).
        pytest.param("tied_sp2_fsdp", 2, {"sequence_parallel_degree": 2, "fsdp": True},
                     marks=pytest.mark.slow),
        pytest.param("tied_dp2_tp2_fsdp", 4, {
            "tensor_parallel_size": 2, "gradient_accumulation_steps": 2, "fsdp": True},
            marks=pytest.mark.slow),
    ],
)
def test_tied_embeddings_match_single_process(workdir, tied_reference, name, nproc,
                                              overrides):
    """One weight for the embedding and lm_head: FSDP2 keeps both with the root group, TP
    splits both by vocabulary and ties the shards again; the export stays tied."""
    run = _run(workdir, name, nproc, **TIED, **overrides)
    assert_same_adam_run(run, tied_reference)
    assert "lm_head.weight" not in final_tensors(run)  # saved once, as the model ties it


@pytest.mark.slow
def test_tied_fsdp_resume_equals_uninterrupted_run(workdir):
    """The shared weight goes through a sharded (DCP) checkpoint and comes back tied."""
    common = {**TIED, "sequence_parallel_degree": 2, "fsdp": True, "save_steps": 3,
              "max_steps": 5}
    straight = _run(workdir, "tied_straight", 2, **common)
    _run(workdir, "tied_resumed", 2, **{**common, "max_steps": 3})
    resumed = _run(workdir, "tied_resumed", 2, resume_from_checkpoint="auto", **common)
    assert_same_run(resumed, straight, tol=1e-6)


@pytest.mark.slow  # LoRA under TP x SP stays by default in the one-step gradient test
def test_lora_tp2_sp2_matches_single_process(workdir):
    lora = {"adapter": "lora", "lora_r": 4, "lora_target_modules": "all-linear"}
    ref = _run(workdir, "ref_lora", 1, **lora)
    run = _run(workdir, "lora_tp2_sp2", 4, tensor_parallel_size=2, sequence_parallel_degree=2,
               **lora)
    assert_same_adam_run(run, ref, adapter=True)


@pytest.mark.slow
def test_tp2_resume_equals_uninterrupted_run(workdir):
    common = {"tensor_parallel_size": 2, "save_steps": 3, "max_steps": 5}
    straight = _run(workdir, "tp2_straight", 2, **common)
    _run(workdir, "tp2_resumed", 2, **{**common, "max_steps": 3})
    resumed = _run(workdir, "tp2_resumed", 2, resume_from_checkpoint="auto", **common)
    assert_same_run(resumed, straight, tol=1e-6)
