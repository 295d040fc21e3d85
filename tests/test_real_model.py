"""A real pretrained model through the CLI: SmolLM2-135M-Instruct (tests/real_model.py).

Its BPE tokenizer reads real text (standard-library docstrings) packed into rows; `longctx
train` fine-tunes it (every weight) at sp 1, under the default ring and `varlen_llama3` at
sp 2, and under Ulysses at sp 3 (9 heads / 3 KV heads). The reference is the model's own
Hugging Face training on the same rows: each document through `forward(labels=)` on its
own, eager attention, the same optimizer; per-step loss and final weights must agree within
the family matrix's tolerances. A `chat_template` dataset rendered with the model's own
ChatML template trains exactly the assistant turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.family_matrix import LOSS_TOL, WEIGHT_TOL, compare
from tests.real_model import real_documents, smollm2_folder
from tests.train_helpers import run_longctx

SEQUENCE_LEN = 384  # a short row (divisible by 2, 3 and 2 x 2 for zigzag): two steps in budget
STEPS = 2


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_folder()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "docs.jsonl"
    with path.open("w") as f:
        for text in real_documents(24):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def _config(tmp: Path, name: str, smollm2: Path, corpus: Path, **layout: Any) -> Path:
    config = {
        "base_model": str(smollm2),
        "dtype": "float32",
        "datasets": [{"path": str(corpus), "type": "completion", "field": "text"}],
        "sequence_len": SEQUENCE_LEN,
        "excess_length_strategy": "truncate",
        "sample_packing": True,
        "dataset_prepared_path": str(tmp / "prepared"),
        "attention_kernel": "torch",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "max_steps": STEPS,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "adam_epsilon": 1e-6,
        "seed": 3,
        "output_dir": str(tmp / name),
        "logging_steps": 1,
        "val_set_size": 0,
        "collective_timeout_s": 120,
        **layout,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _reference(config_path: Path) -> dict[str, Any]:
    """The model's own training on the rows `longctx train` read at each step."""
    from transformers import AutoModelForCausalLM

    from longctx_cli.config import load_config
    from longctx_cli.data.prepare import prepare
    from longctx_cli.train.optim import make_optimizer
    from longctx_cli.train.schedule import DataPosition
    from tests.own_training import own_training

    config = load_config(config_path)
    rows = prepare(config).train
    position = DataPosition(config, 1, rows, None)
    model = AutoModelForCausalLM.from_pretrained(config.model.base_model, dtype=torch.float32,
                                                 attn_implementation="eager").train()
    optimizer = make_optimizer(config, [p for p in model.parameters() if p.requires_grad])
    steps = []
    for step in range(STEPS):
        table, indices = position.step_rows(step)
        docs = []
        for i in indices:
            ids, pos, labels = (torch.tensor(table[i][k]) for k in
                                ("input_ids", "position_ids", "labels"))
            starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
            docs += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
        steps.append(docs)
    return own_training(model, optimizer, steps, config.training.max_grad_norm)


def _trained(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text()
              .splitlines() if line.strip() and "loss" in json.loads(line)]
    state = load_file(out / "final" / "model.safetensors")
    weights = {k: v.double().numpy() for k, v in state.items()}
    return {"losses": losses, "weights": weights}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, smollm2, corpus) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("real")
    config = _config(tmp, "ref", smollm2, corpus)
    return {"tmp": tmp, **_reference(config)}


LAYOUTS = {
    "sp1": (1, {}),
    "ring_sp2": (2, {"sequence_parallel_degree": 2}),
    "varlen_llama3_sp2": (2, {"sequence_parallel_degree": 2, "ring_attn_func": "varlen_llama3",
                              "sp_sharding": "zigzag"}),
    "ulysses_sp3": (3, {"sequence_parallel_degree": 3, "sequence_parallel_mode": "ulysses"}),
    # 9 heads / 3 KV heads over 2 ranks: 6 and 3 query heads (whole KV-head groups).
    "ulysses_sp2_uneven": (2, {"sequence_parallel_degree": 2,
                               "sequence_parallel_mode": "ulysses"}),
    # Over 4 ranks: KV head 0 replicated to two of them, 2, 1, 3, 3 query heads.
    "ulysses_sp4_uneven": (4, {"sequence_parallel_degree": 4,
                               "sequence_parallel_mode": "ulysses"}),
}


# The real model's loss through 30 float32 layers: the tiny models' LOSS_TOL (1e-5) is at
# its float noise here; an AMD EPYC's kernels put the P2P ring's step losses 1.04e-5 away
# (2026-12-02, weights 2.7e-7).
REAL_LOSS_TOL = 2 * LOSS_TOL
# By default ring sp 2; sp 1, Ulysses sp 3 and the llama3 ring with -m slow (every
# strategy's exactness on tiny models runs by default: test_train_parity, the family matrix).
DEFAULT_LAYOUTS = ("ring_sp2",)


@pytest.mark.parametrize("layout", [
    name if name in DEFAULT_LAYOUTS else pytest.param(name, marks=pytest.mark.slow)
    for name in LAYOUTS])
def test_smollm2_trains_as_its_own_training(reference, smollm2, corpus, layout):
    nproc, settings = LAYOUTS[layout]
    tmp = reference["tmp"]
    config = _config(tmp, layout, smollm2, corpus, **settings)
    result = run_longctx("train", str(config), "--nproc-per-node", str(nproc), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run = _trained(tmp / layout)
    assert len(run["losses"]) == STEPS
    # Tied embeddings: one weight under the model's own parameter name.
    run["weights"] = {k: run["weights"][k] for k in reference["weights"]}
    got = compare(run, reference)
    assert got["loss"] < REAL_LOSS_TOL and got["weights"] < WEIGHT_TOL, got
    assert reference["losses"][0] < 4.0  # a pretrained model reads English: not random


CHAT = [
    {"messages": [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "What does the zipfile module do?"},
        {"role": "assistant", "content": "It reads and writes ZIP archives."},
        {"role": "user", "content": "And tarfile?"},
        {"role": "assistant", "content": "It does the same for tar archives."},
    ]},
    {"messages": [
        {"role": "user", "content": "Name a sorting algorithm."},
        {"role": "assistant", "content": "Timsort, which Python's sorted uses."},
    ]},
]


def test_chat_template_trains_exactly_the_assistant_turns(tmp_path, smollm2):
    """Rendered with SmolLM2's own ChatML template; the trained tokens decode to the
    assistant turns, each with its end-of-turn token, and nothing else."""
    from transformers import AutoTokenizer

    from longctx_cli.config import load_config
    from longctx_cli.data.prepare import prepare

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    config = tmp_path / "chat.yaml"
    config.write_text(yaml.safe_dump({
        "base_model": str(smollm2), "datasets": [{"path": str(data), "type": "chat_template"}],
        "sequence_len": 256, "sample_packing": False, "output_dir": str(tmp_path / "out"),
        "dataset_prepared_path": str(tmp_path / "prepared")}))
    result = run_longctx("preprocess", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(smollm2)
    rows = prepare(load_config(config)).train
    assert len(rows) == len(CHAT)
    by_text = {}
    for row in rows:
        ids, labels = row["input_ids"], row["labels"]
        rendered = tok.decode(ids)
        trained = [tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab == i])]
        by_text[rendered] = trained[0]
    for record in CHAT:
        want = tok.apply_chat_template(record["messages"], tokenize=False)
        assert want in by_text, (want, list(by_text))
        turns = [m["content"] + "<|im_end|>" for m in record["messages"]
                 if m["role"] == "assistant"]
        assert by_text[want] == "".join(turns)
