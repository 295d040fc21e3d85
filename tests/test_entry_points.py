"""Every entry point runs the checks `validate` runs (`preflight.check_run`).

Ranks started by a user's own `torchrun`, or by a SLURM-style launcher that sets RANK and
WORLD_SIZE itself, refuse a config `validate` refuses with the same paragraph, printed once,
exit status 2 and no traceback; `generate` and `eval` of a run trained at sp 2 give the same
tokens and scores on 1 and 2 ranks; a run's whole log is longctx's own lines.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_generate import hf_greedy
from tests.train_helpers import TINY_LLAMA, run_longctx, write_config, write_documents


def flat(text: str) -> str:
    """Rich wraps a paragraph to the terminal width: compare texts with spaces collapsed."""
    return re.sub(r"\s+", " ", text)


def _paragraph(stderr: str) -> str:
    """The text of the one `error:` paragraph in `stderr`."""
    found = re.findall(r"error: (.*?)(?=\n\S|\Z)", stderr, flags=re.S)
    assert len(found) == 1, stderr[-3000:]
    return flat(found[0]).strip()


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "LONGCTX_LAUNCHED"):
        env.pop(key, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_torchrun(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m longctx_cli ...`, as the SLURM docs show it."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "longctx_cli", *args],
        capture_output=True, text=True, timeout=timeout, env=_env(),
    )


def srun_style(*args: str, timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Two ranks started directly with RANK/WORLD_SIZE/MASTER_* set, as `srun` scripts do."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-m", "longctx_cli", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


# Configs `validate` refuses, each for a rule that needs the model or the world.
REFUSED = {
    "attention_dropout": ({"model_config": {**TINY_LLAMA, "attention_dropout": 0.1},
                           "sequence_parallel_degree": 2}, "attention_dropout = 0.1"),
    "ulysses_heads": ({"model_config": {**TINY_LLAMA, "num_attention_heads": 3,
                                        "num_key_value_heads": 1, "head_dim": 8},
                       "sequence_parallel_degree": 2, "sequence_parallel_mode": "ulysses"},
                      "3"),
    "sp_beyond_world": ({"sequence_parallel_degree": 4}, "`sequence_parallel_degree` = 4"),
}


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Path:
    return write_documents(tmp_path_factory.mktemp("docs") / "docs.jsonl")


# One refusal by default (each rule's message is validate's, tested there); all with -m slow.
@pytest.mark.parametrize("name", [
    name if name == "sp_beyond_world" else pytest.param(name, marks=pytest.mark.slow)
    for name in REFUSED])
def test_plain_torchrun_refuses_what_validate_refuses(tmp_path, documents, name):
    overrides, words = REFUSED[name]
    config = write_config(tmp_path, "run", documents, **overrides)
    validate = run_longctx("validate", str(config), "--nproc-per-node", "2")
    assert validate.returncode == 2, validate.stderr[-2000:]
    paragraph = _paragraph(validate.stderr)
    assert words in paragraph

    result = plain_torchrun("train", str(config))
    # The rank's paragraph, once; torchrun itself then reports the rank's exit status 2.
    assert flat(result.stderr).count(paragraph) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stdout
    assert not re.search(r"^\[rank\d+\]:", result.stderr, flags=re.M), result.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # the plain-torchrun refusals above run the same check path by default
def test_srun_style_ranks_refuse_once_with_status_2(tmp_path, documents):
    overrides, _ = REFUSED["attention_dropout"]
    config = write_config(tmp_path, "run", documents, **overrides)
    paragraph = _paragraph(run_longctx("validate", str(config), "--nproc-per-node", "2").stderr)
    rank0, rank1 = srun_style("train", str(config))
    assert rank0.returncode == 2 and rank1.returncode == 2, (rank0.stderr, rank1.stderr)
    assert _paragraph(rank0.stderr) == paragraph
    assert "error" not in rank1.stderr and "Traceback" not in rank1.stderr, rank1.stderr


@pytest.mark.slow  # the same check path as the refusals above, on the output_dir
def test_srun_style_ranks_check_the_output_dir(tmp_path, documents):
    """The launcher's output-folder check runs on ranks no longctx launcher started."""
    config = write_config(tmp_path, "run", documents, sequence_parallel_degree=2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    rank0, rank1 = srun_style("train", str(config))
    assert rank0.returncode == 2 and rank1.returncode == 2
    assert "already holds another run's results" in flat(rank0.stderr)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"  # nothing lost


# ---- inference at any scale -----------------------------------------------------------------

PROMPT = "The pass key is 4242. Remember it. " * 4 + "What is the pass key? The pass key is"
NEW = 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory, documents) -> tuple[Path, Path]:
    """A run trained at sp 2 through the CLI: (its config, its final/)."""
    tmp = tmp_path_factory.mktemp("trained")
    config = write_config(
        tmp, "run", documents, sequence_parallel_degree=2, max_steps=2,
        model_config={**TINY_LLAMA, "initializer_range": 0.2}, sequence_len=256,
        gradient_accumulation_steps=1, eval_steps=None,
        eval_tasks=["passkey", "position_loss"], eval_context_lengths=[176, 240],
        eval_samples_per_cell=2, eval_position_buckets=4,
    )
    result = run_longctx("train", str(config), "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return config, tmp / "run" / "final"


@pytest.mark.slow  # generate under SP = one process: test_generate.py, by default
def test_generate_of_an_sp2_run_on_one_and_two_ranks(tmp_path, trained):
    config, final = trained
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    tokens = {}
    for nproc in ("1", "2"):
        out = tmp_path / f"gen{nproc}"
        result = run_longctx("generate", str(config), "--checkpoint", str(final),
                             "--prompt-file", str(prompt), "--max-new-tokens", str(NEW),
                             "--nproc-per-node", nproc, "--output-dir", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"on {nproc} rank(s), sp {nproc}" in result.stderr
        tokens[nproc] = json.loads((out / "generate.json").read_text())["new_token_ids"]
    assert tokens["1"] == tokens["2"] == hf_greedy(final, PROMPT, NEW)


@pytest.mark.slow  # eval at sp 2 = sp 1: test_eval_parity.py, by default
def test_eval_of_an_sp2_run_on_one_and_two_ranks(tmp_path, trained):
    config, final = trained
    results = {}
    for nproc in ("1", "2"):
        out = tmp_path / f"eval{nproc}"
        result = run_longctx("eval", str(config), "--checkpoint", str(final),
                             "--nproc-per-node", nproc, "--output-dir", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        results[nproc] = (json.loads((out / "eval" / "passkey.json").read_text()),
                          json.loads((out / "eval" / "position_loss.json").read_text()))
    (grid1, loss1), (grid2, loss2) = results["1"], results["2"]
    assert grid1["models"][0]["samples"] == grid2["models"][0]["samples"]
    assert len(grid1["models"][0]["samples"]) >= 2 * 2 * 2  # lengths x depths x samples
    buckets1, buckets2 = loss1["models"][0]["buckets"], loss2["models"][0]["buckets"]
    assert [b["tokens"] for b in buckets1] == [b["tokens"] for b in buckets2]
    assert sum(b["tokens"] for b in buckets1) > 500
    for a, b in zip(buckets1, buckets2, strict=True):
        assert (a["loss"] is None) == (b["loss"] is None)
        if a["loss"] is not None:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)


@pytest.mark.slow
def test_eval_without_held_out_rows_runs_what_it_can(tmp_path, trained):
    config, final = trained
    out = tmp_path / "eval"
    result = run_longctx("eval", str(config), "--checkpoint", str(final), "--nproc-per-node",
                         "1", "--output-dir", str(out), "--val-set-size", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "position_loss skipped: it needs held-out rows" in flat(result.stderr)
    assert (out / "eval" / "passkey.json").is_file()
    assert not (out / "eval" / "position_loss.json").exists()


# ---- a quiet log ----------------------------------------------------------------------------

# Every line a training run prints, as longctx writes it (rank 0 only).
LONGCTX_LINES = (
    r"layout: dp \d+, sp \d+ .*", r"fidelity probe: passed: .*", r"Tokenizing .*",
    r"first step [\d.]+ s after the command \(launcher imports .*\)",
    r"Packing [\d,]+ samples into [\d,]+ rows", r"step \d+/\d+ loss .*",
    r"done: \d+ steps in .*", r"peak memory per rank \(resident set\): .*",
    r"outputs in .*", r"final model \(Hugging Face format\): .*",
)


def _foreign_lines(result: subprocess.CompletedProcess) -> list[str]:
    lines = (result.stdout + "\n" + result.stderr).replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip()
            and not any(re.fullmatch(p, line.strip()) for p in LONGCTX_LINES)]


@pytest.mark.slow
def test_a_lora_run_of_a_saved_model_prints_only_longctx_lines(tmp_path, documents):
    """A LoRA run with gradient checkpointing of a model loaded from a folder (the path a
    pretrained model takes): no third-party warning, bar or kernel message on any rank."""
    base = tmp_path / "base"
    torch.manual_seed(0)
    from transformers import AutoConfig

    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(base)
    config = write_config(tmp_path, "run", documents, model_config=None, base_model=str(base),
                          adapter="lora", lora_r=4, lora_alpha=8, max_steps=2, save_steps=1,
                          lora_target_modules=["q_proj", "v_proj"], gradient_checkpointing=True,
                          sequence_parallel_degree=2, eval_steps=None, val_set_size=0)
    started = time.time()
    result = run_longctx("train", str(config), "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _foreign_lines(result) == []
    assert result.stdout.count("step 2/2") == 1  # rank 0 alone reports
    # The way to the first step, phase by phase, from the launcher through the ranks.
    startup = json.loads((tmp_path / "run" / "startup.json").read_text())
    phases = startup["phases"]
    assert list(phases)[:4] == ["launcher imports", "launcher plan", "data cache", "torchrun"]
    assert {"plan", "fidelity probe", "data", "model"} <= phases.keys()
    assert all(s >= 0 for s in phases.values())
    assert abs(sum(phases.values()) - startup["seconds"]) < 0.01 * len(phases)
    assert startup["seconds"] < time.time() - started


@pytest.mark.slow
def test_the_quickstart_run_prints_only_longctx_lines(tmp_path):
    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_passkey.yaml"
    result = run_longctx("train", str(example), "--nproc-per-node", "2", "--max-steps", "6",
                         "--save-steps", "3", "--eval-steps", "3", "--output-dir",
                         str(tmp_path / "out"), "--dataset-prepared-path",
                         str(tmp_path / "prepared"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _foreign_lines(result) == []
