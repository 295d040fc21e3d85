"""Hybrid models (convolutions, Mamba2 and gated delta-net scans beside attention) under SP and
packing (`parallel/token_mixing.py`): the row arithmetic, that a packed row needs it, sp4
training against the model's own per-document training, and generation."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longctx_cli.families import HYBRID_MODEL_TYPES
from longctx_cli.parallel.sharding import make_sp_meta, slice_sequence, to_global_order
from longctx_cli.parallel.token_mixing import mixer_rows
from tests import family_matrix as fm
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state

DOCS = (9, 1, 30, 5, 19)  # 64 tokens: one-token and long documents, crossing every rank
SHARDINGS = [
    {"layout": "contiguous"},
    {"layout": "zigzag"},
    {"layout": "stripe"},
]


def _positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in DOCS])


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: s["layout"])
def test_rank_slices_gathered_in_rank_order_come_back_in_global_order(sp, sharding) -> None:
    tokens = torch.arange(64)
    metas = [make_sp_meta(_positions(), rank_state(r, sp, **sharding)) for r in range(sp)]
    gathered = torch.cat([slice_sequence(tokens, m.ctx) for m in metas])  # all_gather's order
    assert torch.equal(to_global_order(gathered, metas[0]), tokens)


def _pools(metas: list, all_rows: list) -> list[torch.Tensor]:
    """Each rank's pool of token values (here: global token ids), as `token_pool` builds it
    from this rank's tokens and one all-gather."""
    locals_ = [slice_sequence(torch.arange(64), m.ctx) for m in metas]
    if len(metas) == 1:
        return locals_
    if all_rows[0].send is None:  # the whole row, gathered
        return [torch.cat([mine, torch.arange(64)]) for mine in locals_]
    sent = torch.cat([mine[rows.send] for mine, rows in zip(locals_, all_rows, strict=True)])
    return [torch.cat([mine, sent]) for mine in locals_]


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: s["layout"])
def test_each_local_token_reads_its_document_prefix_or_halo(sp, sharding, window) -> None:
    pos = _positions()
    doc_of = torch.cumsum(pos == 0, 0) - 1
    metas = [make_sp_meta(pos, rank_state(r, sp, **sharding)) for r in range(sp)]
    all_rows = [mixer_rows(m, window) for m in metas]
    for r, (meta, rows, pool) in enumerate(zip(metas, all_rows, _pools(metas, all_rows),
                                               strict=True)):
        # What each batch cell holds (global token, -1 for padding), as the hook fills it.
        cells = torch.full((len(rows.starts) * rows.width,), -1, dtype=torch.long)
        cells[rows.target] = pool[rows.source]
        cells = cells.view(len(rows.starts), rows.width)
        local = slice_sequence(torch.arange(64), meta.ctx)
        assert torch.equal(cells.flatten()[rows.take], local)  # every local token read back
        for row in cells:
            real = row[row >= 0]
            assert torch.equal(real, torch.arange(int(real[0]), int(real[0]) + len(real)))
            assert len(set(doc_of[real].tolist())) == 1  # one document per row
            assert (row[len(real):] == -1).all()  # padding only after the real tokens
        # Every local token is preceded in its row by its whole document's prefix (a scan)
        # or by the `window` tokens before it within its document (a convolution).
        flat = cells.flatten()
        for token, cell in zip(local.tolist(), rows.take.tolist(), strict=True):
            row, col = divmod(cell, rows.width)
            before = cells[row, :col]
            doc_start = int((doc_of == doc_of[token]).nonzero()[0])
            need = token - doc_start if window is None else min(window, token - doc_start)
            assert flat[cell] == token and col >= need, (r, token, col, need)
            assert torch.equal(before[col - need:], torch.arange(token - need, token))
        if window is not None and sp > 1 and sharding["layout"] != "stripe":
            # A convolution receives halos only: `window` tokens per piece at most.
            assert rows.slots <= window * len(meta.local_ranges), rows.slots


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("sharding", SHARDINGS[:2], ids=lambda s: s["layout"])
def test_state_relay_calls_cover_each_rank_and_chain_up(sp, sharding) -> None:
    from longctx_cli.parallel.state_relay import relay_applies, relay_calls

    pos = _positions()
    metas = [make_sp_meta(pos, rank_state(r, sp, **sharding)) for r in range(sp)]
    sent, received = [], []
    for r, meta in enumerate(metas):
        assert relay_applies(meta)
        calls = relay_calls(meta)
        covered = [t for call in calls for a, b in call.pieces for t in range(a, b)]
        assert covered == list(range(meta.local_len))  # every local token once, in order
        for call in calls:
            if call.state_to is not None:
                assert len(call.pieces) == 1  # the state comes from an unpadded row
                sent.append((r, call.state_to))
            if call.state_from is not None:
                received.append((call.state_from, r))
    # Every state sent is received by the rank it goes to, and one crosses each boundary a
    # document runs across (DOCS: the 30-token document spans ranks at sp 2 and 4).
    assert sorted(sent) == sorted(received) and sent


# Families whose covered layer is the twin of a matrix row's (same module interface), with
# the fields their default config lacks. Their tiny copy is the fidelity probe's own.
TWINS = {
    "qwen3_5_text": {},
    "kimi_linear": {},
    "lara_mini": {},
    "lfm3": {},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"],
                 "num_hidden_layers": 4},
}


# Qwen3-Next with every layer a gated delta-net: a hybrid config without any attention.
ALL_LINEAR = "qwen3_next (every layer linear attention)"
# Models without attention at sp 2: Mamba2's scan passes its state, Mamba's and
# Falcon-Mamba's rerun document prefixes (they take no starting state).
ATTENTION_FREE = ("mamba2", "mamba", "falcon_mamba", ALL_LINEAR)


def _tiny_config(name: str):
    """The matrix row's config, or the probe's tiny copy of a twin family."""
    from transformers import AutoConfig

    if name == ALL_LINEAR:
        row = next(f for f in fm.FAMILIES if f.name == "qwen3_next")
        # No cache: transformers' own cache cannot count the tokens of linear layers alone.
        return AutoConfig.for_model("qwen3_next", **{
            **fm.BASE, **row.fields, "layer_types": ["linear_attention"] * 2,
            "use_cache": False})
    if name in TWINS:
        from longctx_cli.checks.fidelity import shrink_config

        return shrink_config(AutoConfig.for_model(name, **TWINS[name]))
    family = next(f for f in fm.FAMILIES if f.name == name)
    return AutoConfig.for_model(family.model_type, **{**fm.BASE, **family.fields})


def _relay_worker(rank: int, world: int, sharding: dict,
                  family_name: str = "falcon_h1") -> tuple[float, int, dict]:
    """(rel. error of the gathered hidden states against the model's own per-document
    forward, states this rank received, the calls each loaded kernel stand-in recorded)."""
    from transformers import AutoModelForCausalLM

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.parallel.sharding import gather_sequence, shard_batch
    from longctx_cli.parallel.token_mixing import attach_token_mixing
    from longctx_cli.runtime.model import decoder_and_head, sp_hidden_states

    cfg = _tiny_config(family_name)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                            attn_implementation=register_sp_attention())
    ours.load_state_dict(reference.state_dict())
    hooks = attach_token_mixing(ours)
    ids = torch.randint(3, 128, (sum(DOCS),), generator=torch.Generator().manual_seed(5))
    state = sp_state(sp=world, **sharding)
    with torch.no_grad():
        want = torch.cat([decoder_and_head(reference)[0](input_ids=d[None]).last_hidden_state[0]
                          for d in torch.split(ids, list(DOCS))])
        batch = shard_batch(ids, _positions(), ids.clone(), state)
        got = gather_sequence(sp_hidden_states(decoder_and_head(ours)[0], batch), state)
    standins = {name: list(sys.modules[name].CALLS)
                for name in ("causal_conv1d", "fla", "mamba_ssm") if name in sys.modules}
    return (float((got - want).norm() / want.norm()), sum(len(h._relay.received) for h in hooks),
            standins)


@pytest.mark.parametrize("sharding", [pytest.param(SHARDINGS[0], marks=pytest.mark.slow),
                                      SHARDINGS[1]], ids=lambda s: s["layout"])
def test_scans_pass_their_state_between_ranks(sharding) -> None:
    # Falcon-H1's Mamba2 mixers on contiguous and zigzag rows: states cross the ranks (each
    # rank after the first receives at least one) and the hidden states are the model's own
    # per-document forward.
    results = run_distributed(_relay_worker, 2, sharding, timeout_s=300)
    for err, _, _ in results:
        assert err < 1e-5, results
    assert results[1][1] > 0, results


def _twins_worker(rank: int, world: int, layout: str) -> dict:
    return {(name, layout): _relay_worker(rank, world, {"layout": layout}, name)[:2]
            for name in TWINS}


def _own_handoff_error(name: str) -> float:
    """How far the model's own forward moves when it hands its state over itself: a
    40-token document as one forward against 20 tokens, then the other 20 from the cache
    (rel. error of the second half's hidden states). The delta rule runs in float32 inside
    the model's own code, and a state hand-off changes its chunking, so this is the noise
    floor of any exact state passing."""
    from transformers import AutoModelForCausalLM

    from longctx_cli.runtime.model import decoder_and_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(name), attn_implementation="eager")
    decoder = decoder_and_head(model.eval())[0]
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = decoder(input_ids=ids).last_hidden_state[0, 20:]
        first = decoder(input_ids=ids[:, :20], use_cache=True)
        second = decoder(input_ids=ids[:, 20:], cache=first.past_key_values,
                         use_cache=True).last_hidden_state[0]
    return float((second - whole).norm() / whole.norm())


# Zigzag by default (state handed over between non-adjacent chunks); contiguous with -m slow.
@pytest.mark.parametrize("layout", ["zigzag", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_newer_families_twin_layers_are_exact_at_sp2(layout: str) -> None:
    # Qwen3.5, Kimi Linear, LaRA-mini (delta-net scans) and LFM3, LFM2-MoE (short
    # convolutions) at sp 2: the hidden states are the model's own per document, and the
    # scans' states cross the rank boundary. (Their sp 1 loss and gradients: the fidelity
    # probe, tests/test_fidelity.py.) A scan's error may reach the model's own when it hands
    # its state over to itself (a chunked prefill), not more.
    from transformers import AutoModelForCausalLM

    from longctx_cli.parallel.token_mixing import covered_mixers

    results = run_distributed(_twins_worker, 2, layout, timeout_s=500)
    for name in TWINS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_tiny_config(name))
        kinds = {kind.passes_state for _, _, kind in covered_mixers(model)}
        assert kinds, name  # the family's layer is covered
        passes = True in kinds
        tolerance = max(1e-5, 2 * _own_handoff_error(name)) if passes else 1e-5
        err, received = results[1][(name, layout)]
        assert err < tolerance, (name, layout, err, tolerance)
        if passes:  # rank 1 started from rank 0's state
            assert received > 0, (name, layout, results[1])


def _attention_free_worker(rank: int, world: int) -> dict:
    return {(name, layout): _relay_worker(rank, world, {"layout": layout}, name)[:2]
            for name in ATTENTION_FREE for layout in ("contiguous", "zigzag")}


def test_models_without_attention_are_exact_at_sp2() -> None:
    # No attention layer at all: the token mixers alone carry the row across ranks, on
    # contiguous and zigzag shards. Mamba2's and the delta-nets' states cross the rank
    # boundary (rank 1 receives them); Mamba's and Falcon-Mamba's scans take no starting
    # state and rerun document prefixes instead (nothing received). The hidden states are
    # the model's own per-document forward (a delta-net within its own hand-off noise).
    results = run_distributed(_attention_free_worker, 2, timeout_s=500)
    for (name, layout), (err, received) in results[1].items():
        passes = name in ("mamba2", ALL_LINEAR)
        # The delta-net's own hand-off noise, measured on the hybrid row's same layer (the
        # model's cache cannot hand over the state of linear layers alone).
        tolerance = (max(1e-5, 2 * _own_handoff_error("qwen3_next")) if name == ALL_LINEAR
                     else 1e-5)
        assert err < tolerance, (name, layout, err, tolerance)
        assert results[0][(name, layout)][0] < tolerance, (name, layout, results[0])
        assert (received > 0) == passes, (name, layout, received)


def _checkpointed_worker(rank: int, world: int) -> dict:
    settings = {"sequence_parallel_degree": 2, "gradient_checkpointing": True}
    return {name: fm.longctx_training(next(f for f in fm.FAMILIES if f.name == name), settings)
            for name in ("mamba", "mamba2")}


def test_mamba_blocks_recompute_with_the_rows_metadata() -> None:
    # Activation checkpointing recomputes each Mamba block in backward, after the model's
    # forward ended, and MambaModel calls its blocks without `sp_meta`: the recompute runs on
    # the row's document rows (MetaScope keeps its metadata), so the gradients are the
    # model's own per-document ones, and the scope holds nothing during a later forward.
    from transformers import AutoModelForCausalLM

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.parallel.mesh import ParallelState
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.parallel.token_mixing import attach_token_mixing
    from longctx_cli.runtime.model import decoder_and_head, enable_checkpointing, sp_hidden_states

    cfg = _tiny_config("mamba")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(cfg).train()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                            attn_implementation=register_sp_attention())
    ours.load_state_dict(reference.state_dict())
    hooks = attach_token_mixing(ours)
    enable_checkpointing(ours, {"use_reentrant": False})
    ours.train()
    ids = torch.randint(3, 128, (sum(DOCS),), generator=torch.Generator().manual_seed(5))
    # A random projection of the hidden states (a sum of squares of normed states nearly
    # cancels in its gradients, which would leave only float noise to compare).
    weight = torch.randn(sum(DOCS), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    own = [decoder_and_head(reference)[0](input_ids=d[None]).last_hidden_state[0]
           for d in torch.split(ids, list(DOCS))]
    (torch.cat(own) * weight).sum().backward()
    batch = shard_batch(ids, _positions(), ids.clone(), ParallelState())
    (sp_hidden_states(decoder_and_head(ours)[0], batch) * weight).sum().backward()
    assert hooks[0]._scope.current() is None  # outside the forward and any recompute
    for (name, want), got in zip(reference.named_parameters(), ours.parameters(), strict=True):
        if want.grad is not None:
            err = float((got.grad - want.grad).norm() / want.grad.norm().clamp_min(1e-30))
            assert err < 1e-5, (name, err)


@pytest.mark.slow  # the sp1 recompute above runs by default; the matrix trains sp2 without
def test_models_without_attention_train_exactly_with_checkpointing_at_sp2() -> None:
    # Activation checkpointing recomputes each Mamba block in backward, after the model's
    # forward ended: Mamba's blocks get no `sp_meta` from the model's code (MetaScope keeps
    # the row's for the recompute), and Mamba2's recompute reuses the states it received.
    (reference,) = run_distributed(_mamba_reference_worker, 1, timeout_s=300)
    results = run_distributed(_checkpointed_worker, 2, timeout_s=500)
    for name, run in results[0].items():
        cell = fm.compare(run, reference[name])
        assert "refused" not in cell, cell
        assert cell["loss"] < fm.LOSS_TOL and cell["weights"] < fm.WEIGHT_TOL, (name, cell)


def _mamba_reference_worker(rank: int, world: int) -> dict:
    return {name: fm.reference_training(next(f for f in fm.FAMILIES if f.name == name))
            for name in ("mamba", "mamba2")}


def test_plan_of_a_model_without_attention() -> None:
    # Contiguous shards by default (the P2P stripe ring is every other model's default);
    # what cannot apply is refused naming its key: a stripe, an attention kernel, TP.
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform
    from longctx_cli.errors import UserError

    row = next(f for f in fm.FAMILIES if f.name == "mamba2")
    cpu = Platform(cuda=False, ring_flash_attn=False)

    def plan(**settings):
        config = fm.make_config(row, {"sequence_parallel_degree": 2, **settings})
        return build_plan(config, 2, read_model_config(config), platform=cpu)

    layout = plan().layout
    assert (layout.sharding, layout.kernel) == ("contiguous", "torch"), layout
    assert plan(sp_sharding="zigzag").layout.sharding == "zigzag"
    assert plan(sequence_parallel_mode="ulysses").layout.sharding == "contiguous"
    for settings, key, says in [
        ({"sp_sharding": "stripe"}, "sp_sharding", "puts a boundary after every token"),
        ({"sp_sharding": "stripe"}, "sp_sharding", "leave `sp_sharding` and `ring_attn_func` out"),
        ({"ring_attn_func": "batch_stripe"}, "sp_sharding", "has no attention layer"),
        ({"attention_kernel": "torch_flash"}, "attention_kernel", "for the kernel to compute"),
        ({"tensor_parallel_size": 2, "sequence_parallel_degree": 1}, "tensor_parallel_size",
         "it has no attention layer"),
    ]:
        with pytest.raises(UserError) as err:
            plan(**settings)
        message = str(err.value)
        assert says in message and "Fix:" in message and "\n" not in message, message
        assert key in message, message


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm"])
def test_recurrences_without_a_state_handoff_are_refused_by_name(model_type: str) -> None:
    # Not a TypeError, nor "did not call the sequence-parallel attention": the reason.
    from transformers import AutoConfig

    from longctx_cli.config.shape import ModelShape
    from longctx_cli.errors import UserError

    with pytest.raises(UserError) as err:
        ModelShape.from_hf_config(AutoConfig.for_model(model_type))
    message = str(err.value)
    assert f"model type `{model_type}` has no attention heads" in message, message
    assert "cache interface" in message and "does not cover" in message, message
    assert "Fix:" in message and "\n" not in message


def _sp1_hidden(model_type: str, fields: dict, hooked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(longctx's sp1 hidden states on a packed row, the model's own per document)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.parallel.mesh import ParallelState
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.parallel.token_mixing import attach_token_mixing
    from longctx_cli.runtime.model import decoder_and_head, sp_hidden_states

    cfg = AutoConfig.for_model(model_type, **{**fm.BASE, **fields})
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                            attn_implementation=register_sp_attention())
    ours.load_state_dict(reference.state_dict())
    if hooked:
        attach_token_mixing(ours)
    ids = torch.randint(3, 128, (sum(DOCS),), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = torch.cat([decoder_and_head(reference)[0](input_ids=d[None]).last_hidden_state[0]
                          for d in torch.split(ids, list(DOCS))])
        batch = shard_batch(ids, _positions(), ids.clone(), ParallelState())
        got = sp_hidden_states(decoder_and_head(ours)[0], batch)
    return got, want


@pytest.mark.parametrize("family", ["lfm2", "qwen3_next", "falcon_h1"])
def test_packed_row_is_the_models_own_per_document_forward_only_with_token_mixing(
        family: str) -> None:
    fields = next(f for f in fm.FAMILIES if f.name == family).fields
    got, want = _sp1_hidden(family, fields, hooked=True)
    assert (got - want).norm() / want.norm() < 1e-5
    # Without it the layers run across document boundaries: the test can tell.
    got, want = _sp1_hidden(family, fields, hooked=False)
    assert (got - want).norm() / want.norm() > 1e-3


HYBRIDS = ["lfm2", "qwen3_next", "falcon_h1"]
LAYOUTS = {
    "ring sp2, gradient checkpointing": {"sequence_parallel_degree": 2,
                                         "ring_attn_func": "varlen_llama3",
                                         "gradient_checkpointing": True},
    "ring sp4": {"sequence_parallel_degree": 4, "ring_attn_func": "varlen_llama3"},
    "ring zigzag sp4": {"sequence_parallel_degree": 4, "sp_sharding": "zigzag"},
    "P2P stripe sp4": {"sequence_parallel_degree": 4},
    "Ulysses sp4": {"sequence_parallel_degree": 4, "sequence_parallel_mode": "ulysses"},
}


def _sp4_worker(rank: int, world: int) -> dict:
    out: dict = {}
    for family in (f for f in fm.FAMILIES if f.name in HYBRIDS):
        for name, settings in LAYOUTS.items():
            out[(family.name, name)] = fm.longctx_training(family, settings)
    return out


def _reference_worker(rank: int, world: int) -> dict:
    return {f.name: fm.reference_training(f) for f in fm.FAMILIES if f.name in HYBRIDS}


@pytest.mark.slow  # the family matrix's hybrid sp 4 cells run by default
def test_hybrid_families_train_exactly_at_sp4() -> None:
    # The family matrix covers sp2 and hybrid sp4 (docs/families.md); here every strategy
    # splits each row four ways, so scans cross three rank boundaries and conv halos come
    # from ranks that hold one token of every four (stripe). And once with the layers
    # recomputed in backward (the token mixers' hooks run again there).
    (references,) = run_distributed(_reference_worker, 1, timeout_s=300)
    runs = run_distributed(_sp4_worker, 4, timeout_s=600)[0]
    for (family, layout), run in runs.items():
        cell = fm.compare(run, references[family])
        assert "refused" not in cell, (family, layout, cell)
        assert cell["loss"] < fm.LOSS_TOL and cell["weights"] < fm.WEIGHT_TOL, (
            family, layout, cell)


def _generate_worker(rank: int, world: int) -> tuple[list[int], list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.parallel.token_mixing import attach_token_mixing
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.runtime.sampling import greedy_tokens

    family = next(f for f in fm.FAMILIES if f.name == "qwen3_next")
    cfg = AutoConfig.for_model("qwen3_next", **{**fm.BASE, **family.fields})
    torch.manual_seed(3)
    reference = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                             attn_implementation=register_sp_attention())
    model.load_state_dict(reference.state_dict())
    attach_token_mixing(model.eval())
    prompt = torch.randint(1, 128, (29,), generator=torch.Generator().manual_seed(8)).tolist()
    decoder, head = decoder_and_head(model)
    state = sp_state(sp=2, layout="zigzag")
    got = greedy_tokens(decoder, head, prompt, 8, state, 0, torch.device("cpu"), None)
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    return got, want


def test_hybrid_model_generates_under_sp_what_generate_does() -> None:
    # Its scan state is not kept across a sharded prefill: it decodes by full SP forwards.
    for got, want in run_distributed(_generate_worker, 2, timeout_s=300):
        assert got == want and len(set(want)) > 1


# ---- the example, as a user runs it ------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_hybrid.yaml"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", "from longctx_cli.cli import main; main()",
                           *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def test_validate_names_the_token_mixing_layers_and_their_cost(tmp_path) -> None:
    result = _run("validate", str(EXAMPLE), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "token mixing: 1 x Qwen3NextGatedDeltaNet" in out, out
    # Zigzag rows: the state passes, and its size is the module's own (qwen3_next's conv
    # state 128 x 4 and delta-rule state 4 x 16 x 16, in float32: 6 KiB).
    assert "pass their state from rank to rank (6.0 KiB over all of them per document" in out
    assert "fidelity probe: passed" in out
    stripe = _run("validate", str(EXAMPLE), "--sp-sharding", "stripe", "--fidelity-probe",
                  "false", cwd=tmp_path)
    out = " ".join(stripe.stdout.split())
    assert stripe.returncode == 0, stripe.stderr
    assert "gather their input over the SP group (0.2 MiB received per layer" in out, out
    assert "every rank reruns the prefix" in out, out


def test_validate_says_which_scans_pass_state_and_which_rerun_prefixes() -> None:
    from transformers import AutoModelForCausalLM

    from longctx_cli.parallel.token_mixing import describe

    def said(name: str, sharding: str) -> str:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_tiny_config(name))
        return describe(model, 2, sharding, 1024, model.config.hidden_size, 4)

    for name in ("jamba", "mamba", "falcon_mamba"):  # their Mamba takes no starting state
        text = said(name, "contiguous")
        assert "pass no state between ranks (the layer takes no starting state)" in text, text
    assert "2 scan layer(s) pass their state from rank to rank" in said("mamba2", "zigzag")
    jamba = said("jamba", "contiguous")
    assert "pass no state between ranks (the layer takes no starting state)" in jamba, jamba
    assert "instead" not in jamba and "from rank to rank" not in jamba, jamba
    bamba = said("bamba", "stripe")
    assert "(a stripe row would hand it over at every token)" in bamba, bamba
    assert "zigzag `sp_sharding` passes the state instead" in bamba, bamba
    assert "scan layer(s) pass their state from rank to rank" in said("bamba", "zigzag")


def test_the_hybrid_example_trains_under_sp_to_a_checkpoint_transformers_loads(tmp_path):
    # `world_size: 2` in the config, no launcher flags: what a user types.
    result = _run("train", str(EXAMPLE), "--max-steps", "4", "--save-steps", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "tiny_hybrid" / "final")
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "outputs" / "tiny_hybrid" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses and all(math.isfinite(x) for x in losses)


# ---- the optional kernels, through their stand-ins ---------------------------------------

STANDIN = Path(__file__).resolve().parent / "mixer_kernels_standin"


def _standin_env() -> dict:
    """The environment of a subprocess that imports the stand-ins as the real packages."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(STANDIN), str(Path(__file__).resolve().parents[1]),
         os.environ.get("PYTHONPATH", "")])}


KERNEL_CHECK = """
import torch
import causal_conv1d, fla
from tests.test_token_mixing import _sp1_hidden
from tests import family_matrix as fm
for family in ("lfm2", "qwen3_next"):
    fields = next(f for f in fm.FAMILIES if f.name == family).fields
    got, want = _sp1_hidden(family, fields, hooked=True)
    assert (got - want).norm() / want.norm() < 1e-5, family
print("conv", max(causal_conv1d.CALLS), "delta", max(fla.CALLS))
# State passing at sp 2: the delta rule starts rank 1's document from rank 0's state.
from tests.distributed import run_distributed
from tests.test_token_mixing import _relay_worker
results = run_distributed(_relay_worker, 2, {"layout": "contiguous"}, "qwen3_next",
                          timeout_s=240)
assert all(err < 1e-5 for err, _, _ in results), results
assert results[1][1] > 0 and all(calls["fla"] for _, _, calls in results), results
"""


@pytest.mark.slow  # GPU-only kernels' contract, like Mamba's below
def test_optional_kernels_run_the_document_rows_when_installed() -> None:
    # causal-conv1d and flash-linear-attention are CUDA/Triton packages; transformers uses
    # them when they import. Their CPU stand-ins (same signatures) must receive longctx's
    # batch of document rows (batch size > 1: several documents in one call) and give the
    # model's own per-document result.
    result = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True,
                            text=True, env=_standin_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = dict(zip(*[iter(result.stdout.split())] * 2, strict=True))
    assert int(counts["conv"]) > 1 and int(counts["delta"]) > 1, result.stdout


MAMBA_CHECK = """
import torch
import mamba_ssm
from transformers import AutoModelForCausalLM
from longctx_cli.parallel.token_mixing import covered_mixers
from tests.test_token_mixing import _sp1_hidden, _relay_worker, _tiny_config
from tests import family_matrix as fm
from tests.distributed import run_distributed
# The fused stand-in is transformers' own computation: in training without a cache a Mamba2
# mixer calls it; in eval mode the same mixer runs transformers' PyTorch steps (its chunked
# scan through the stand-in, which is transformers' reference function).
for family in ("falcon_h1", "bamba", "granitemoehybrid", "nemotron_h", "zamba2"):
    torch.manual_seed(0)
    _, mixer, _ = covered_mixers(AutoModelForCausalLM.from_config(_tiny_config(family)))[0]
    x = torch.randn(3, 21, mixer.in_proj.in_features)
    mamba_ssm.CALLS.clear()
    fused = mixer.train()(x)
    assert [f for f, _, _ in mamba_ssm.CALLS] == ["split_conv1d_scan"], mamba_ssm.CALLS
    torch_path = mixer.eval()(x)
    assert (fused - torch_path).norm() / torch_path.norm() < 1e-5, family
# sp 1, training mode: the packed row's documents go through the fused kernel, one batch row
# each.
for family, kernel in (("falcon_h1", "split_conv1d_scan"), ("bamba", "split_conv1d_scan"),
                       ("granitemoehybrid", "split_conv1d_scan"),
                       ("nemotron_h", "split_conv1d_scan"), ("zamba2", "split_conv1d_scan"),
                       ("jamba", "selective_scan")):
    fields = next(f for f in fm.FAMILIES if f.name == family).fields
    mamba_ssm.CALLS.clear()
    got, want = _sp1_hidden(family, fields, hooked=True)
    assert (got - want).norm() / want.norm() < 1e-5, family
    assert max(b for f, b, _ in mamba_ssm.CALLS if f == kernel) > 1, (family, mamba_ssm.CALLS)
# sp 2: contiguous rows pass the state through the chunked scan's initial and final states;
# stripe rows run the fused kernel on each document's prefix; Jamba's selective scan runs
# on document prefixes on contiguous rows too.
for layout in ("contiguous", "stripe"):
    results = run_distributed(_relay_worker, 2, {"layout": layout}, "falcon_h1",
                              timeout_s=240)
    assert all(err < 1e-5 for err, _, _ in results), (layout, results)
    calls = [c["mamba_ssm"] for _, _, c in results]
    if layout == "contiguous":
        assert results[1][1] > 0, results
        assert any(f == "chunk_scan" and given for f, _, given in calls[1]), calls
    else:
        assert all(any(f == "split_conv1d_scan" and b > 1 for f, b, _ in c) for c in calls)
results = run_distributed(_relay_worker, 2, {"layout": "contiguous"}, "jamba", timeout_s=240)
assert all(err < 1e-5 for err, _, _ in results), results
assert all(any(f == "selective_scan" and b > 1 for f, b, _ in c["mamba_ssm"])
           for _, _, c in results), results
print("ok")
"""


@pytest.mark.slow  # GPU-only kernels' contract; causal-conv1d and fla's runs by default
def test_mamba_kernels_run_the_document_rows_and_pass_state_when_installed() -> None:
    # mamba-ssm's kernels (Triton/CUDA, GPU only) are what transformers calls when the
    # package imports: Mamba2's fused conv-scan-norm kernel in training without a cache (sp 1
    # and the document-prefix path), its chunked scan with initial and final states under
    # state passing, and Jamba's selective scan on document prefixes. Their CPU stand-ins
    # take the same arguments; the hidden states must be the model's own per document.
    result = subprocess.run([sys.executable, "-c", MAMBA_CHECK], capture_output=True,
                            text=True, env=_standin_env(), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "ok", result.stdout


def test_validate_knows_every_model_type_whose_layers_are_covered() -> None:
    # validate describes token mixing only for HYBRID_MODEL_TYPES (to stay torch-free for
    # the rest): they must be exactly the causal-LM model types of transformers whose modeling
    # code defines a covered layer.
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from longctx_cli.parallel.token_mixing import COVERED

    defines: dict[str, set[str]] = {}  # model type -> the covered classes its code defines
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        try:
            code = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except Exception:  # a model whose optional dependency is missing
            continue
        if names := {name for name in COVERED if hasattr(code, name)}:
            defines[model_type] = names
    assert set(defines) == HYBRID_MODEL_TYPES
    assert set().union(*defines.values()) == set(COVERED)  # every covered class is some type's
