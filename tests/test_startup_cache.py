"""Start-up without redone work: a warm data cache confirmed from its inputs, handed to the
ranks, and ranks that import only what their run uses.

The launcher confirms a warm cache by its inputs key (no tokenizer, no `datasets`) once a
full check recorded that key in the entry; any change to what decides the rows (a data
file, a config key, the tokenizer's files or special tokens) gives another key, so the full
check runs again. A rank reads the entry handed to it only when its own witness of the
inputs matches the launcher's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from longctx_cli.config.load import config_from_dict
from longctx_cli.data import cache
from longctx_cli.data.prepare import prepare
from longctx_cli.launcher.startup import needs_torchao
from longctx_cli.runtime import distributed
from longctx_cli.train.run import confirm_data_cache
from tests.train_helpers import TINY_LLAMA, write_documents


def _settings(tmp_path: Path, data: Path, **overrides) -> dict:
    return {
        "model_config": TINY_LLAMA, "tokenizer": "byte", "dtype": "float32",
        "datasets": [{"path": str(data), "type": "completion", "field": "text"}],
        "sequence_len": 128, "sample_packing": True,
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"), **overrides,
    }


def _config(tmp_path: Path, data: Path, **overrides):
    return config_from_dict(_settings(tmp_path, data, **overrides))


@pytest.fixture
def data(tmp_path):
    return write_documents(tmp_path / "docs.jsonl", count=24)


@pytest.fixture
def warm(tmp_path, data):
    """A config whose cache the launcher built and keyed (the first `longctx train`)."""
    config = _config(tmp_path, data)
    entry = confirm_data_cache(config)
    assert entry is not None and (entry.path / cache.INPUTS_DIR / f"{entry.key}.json").is_file()
    return config, entry


def test_a_keyed_cache_is_confirmed_without_tokenizer_or_datasets(tmp_path, data, warm):
    config, entry = warm
    again = cache.confirm_warm(config)
    assert again == entry
    # What a fresh launcher process imports to confirm it: neither `datasets` nor the
    # tokenizer's library (transformers), nor torch.
    code = (
        "import sys\n"
        "from longctx_cli.config.load import config_from_dict\n"
        "from longctx_cli.data.cache import confirm_warm\n"
        f"config = config_from_dict({_settings(tmp_path, data)!r})\n"
        "print(confirm_warm(config) is not None,"
        " sorted(m for m in ('datasets', 'transformers', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout.strip().splitlines()[-1] == "True []"


def test_the_entry_is_the_one_the_full_check_finds(tmp_path, warm):
    config, entry = warm
    prepared = prepare(config, progress=False)
    assert prepared.reused and Path(prepared.path) == entry.path


@pytest.mark.parametrize("change", ["data", "config", "special_tokens", "tokenizer_folder"])
def test_any_change_of_the_inputs_misses(tmp_path, data, change):
    overrides = {}
    if change == "tokenizer_folder":  # a saved tokenizer folder, edited after the key
        from longctx_cli.data.tokenizer import byte_tokenizer

        byte_tokenizer().save_pretrained(tmp_path / "tok")
        overrides = {"tokenizer": str(tmp_path / "tok")}
    config = _config(tmp_path, data, **overrides)
    assert confirm_data_cache(config) is not None
    assert cache.confirm_warm(config) is not None
    if change == "data":
        data.write_text(data.read_text() + json.dumps({"text": "one more"}) + "\n")
    elif change == "config":
        config = _config(tmp_path, data, **overrides, sequence_len=256)
    elif change == "special_tokens":
        config = _config(tmp_path, data, **overrides, special_tokens={"pad_token": "<unk>"})
    else:
        settings = tmp_path / "tok" / "tokenizer_config.json"
        fields = json.loads(settings.read_text())
        settings.write_text(json.dumps({**fields, "model_max_length": 77}))
    assert cache.confirm_warm(config) is None
    assert confirm_data_cache(config) is not None  # checked in full, then keyed again
    assert cache.confirm_warm(config) is not None


def test_an_entry_that_lost_a_file_is_not_confirmed(warm):
    config, entry = warm
    arrow = next((entry.path / cache.TRAIN_DIR).glob("*.arrow"))
    arrow.unlink()
    assert cache.confirm_warm(config) is None


def test_no_key_is_recorded_when_the_inputs_changed_during_the_check(tmp_path, data):
    config = _config(tmp_path, data)
    witness, key = cache.witness(config), cache.inputs_key(config)
    prepared = prepare(config, progress=False)
    data.write_text(data.read_text() + json.dumps({"text": "late"}) + "\n")
    path = Path(prepared.path)
    assert cache.remember_inputs(config, path, path.name, key, witness) is None
    assert not (path / cache.INPUTS_DIR).exists()


def test_a_hub_tokenizer_is_always_checked_in_full(tmp_path, data):
    config = _config(tmp_path, data, tokenizer="some-org/some-tokenizer")
    assert cache.inputs_parts(config) is None and cache.witness(config) is None


def test_a_rank_trusts_a_handed_entry_only_when_its_witness_matches(tmp_path, data, warm,
                                                                    monkeypatch):
    config, entry = warm
    monkeypatch.setenv(cache.DATA_CACHE_ENV, cache.handed_over(entry))
    assert cache.entry_handed_to_this_rank(config) == entry
    other = _config(tmp_path, data, dataset_prepared_path=str(tmp_path / "elsewhere"))
    assert cache.entry_handed_to_this_rank(other) is None
    assert cache.entry_handed_to_this_rank(_config(tmp_path, data, seed=1)) is None
    os.utime(data, ns=(1, 1))  # the data file is not the one the launcher saw
    assert cache.entry_handed_to_this_rank(config) is None
    monkeypatch.setenv(cache.DATA_CACHE_ENV, "{not json")
    assert cache.entry_handed_to_this_rank(config) is None


def test_load_rows_reads_the_handed_entry_without_checking_again(tmp_path, warm, monkeypatch):
    """One rank: with the launcher's entry handed over, `prepare` (the tokenizer fingerprint,
    hashing the data) is not run; without it, it is."""
    config, entry = warm
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr("longctx_cli.data.prepare.prepare", counted)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setenv(cache.DATA_CACHE_ENV, cache.handed_over(entry))
        train_rows, _ = distributed.load_rows(config, tokenizer=None)
        assert calls == [] and len(train_rows) > 0
        monkeypatch.delenv(cache.DATA_CACHE_ENV)
        from longctx_cli.data.tokenizer import load_tokenizer

        again, _ = distributed.load_rows(config, load_tokenizer(config))
        assert calls == [1] and list(again["input_ids"]) == train_rows["input_ids"]
    finally:
        dist.destroy_process_group()


def test_a_handed_entry_is_read_row_for_row_as_datasets_reads_it(warm):
    """`Rows` (pyarrow over the saved files) against `datasets.load_from_disk` of the same
    split: every row, a selection with repeats, iteration, columns and the files."""
    import datasets

    from longctx_cli.data.rows import Rows

    _, entry = warm
    light = cache.read_entry(entry.path, entry.fingerprint).train
    full = datasets.load_from_disk(str(entry.path / cache.TRAIN_DIR))
    assert isinstance(light, Rows) and len(light) == len(full) > 2
    assert [light[i] for i in range(len(light))] == [full[i] for i in range(len(full))]
    assert light[-1] == full[len(full) - 1]
    picked = [2, 0, 2]
    assert list(light.select(picked)) == list(full.select(picked))
    assert list(light) == list(full) and light.column_names == full.column_names
    assert light.cache_files == [{"filename": f["filename"]} for f in full.cache_files]
    with pytest.raises(IndexError):
        light[len(light)]


def test_a_split_saved_with_a_format_is_read_by_datasets(tmp_path):
    """A split `Rows` would not read as `datasets` does (a format set) is left to `datasets`."""
    import datasets

    from longctx_cli.data.rows import Rows

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})
    ds.save_to_disk(str(tmp_path / "plain"))
    ds.with_format("torch").save_to_disk(str(tmp_path / "torch"))
    assert Rows.read(tmp_path / "plain")[1] == {"input_ids": [3]}
    assert Rows.read(tmp_path / "torch") is None
    assert Rows.read(tmp_path / "missing") is None


def test_a_rank_reads_its_handed_rows_without_importing_datasets_or_pandas(warm):
    _, entry = warm
    code = ("import sys; from pathlib import Path; from longctx_cli.data import cache; "
            f"p = cache.read_entry(Path({str(entry.path)!r}), {entry.fingerprint!r}); "
            "assert p is not None and len(p.train) > 0; "
            "rows = p.train.select([1, 0, 1]); "
            "assert [r['input_ids'] for r in rows] == [p.train[i]['input_ids'] "
            "for i in (1, 0, 1)]; "
            "assert 'datasets' not in sys.modules, 'datasets imported'; "
            "assert 'pandas' not in sys.modules, 'pandas imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---- what a rank imports ---------------------------------------------------------------------


def test_torchao_is_needed_only_by_its_optimizers_or_its_checkpoints(tmp_path, data):
    plain = _config(tmp_path, data)
    assert not needs_torchao(plain, optimizer_uses_it=False)
    assert needs_torchao(plain, optimizer_uses_it=True)
    quantized = {**TINY_LLAMA, "quantization_config": {"quant_method": "torchao"}}
    assert needs_torchao(_config(tmp_path, data, model_config=quantized), False)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    from_folder = _config(tmp_path, data, model_config=None, base_model=str(folder))
    assert not needs_torchao(from_folder, False)
    (folder / "config.json").write_text(json.dumps(quantized))
    assert needs_torchao(from_folder, False)
    # A hub id whose config is not at hand could be anything.
    assert needs_torchao(_config(tmp_path, data, model_config=None,
                                 base_model="some-org/not-cached-model"), False)


def test_a_rank_without_torchao_builds_its_model():
    """After `hide_torchao`, transformers' model code imports and builds a model without
    importing torchao (a fresh interpreter, as a rank is)."""
    code = (
        "import sys\n"
        "from longctx_cli.launcher.startup import hide_torchao\n"
        "assert hide_torchao()\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        f"config = AutoConfig.for_model(**{TINY_LLAMA!r})\n"
        "AutoModelForCausalLM.from_config(config)\n"
        "print(sys.modules.get('torchao', 'absent'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "None"


def test_an_error_every_rank_raised_alike_names_the_lowest_rank(tmp_path):
    """Ranks that read a handed entry reach their first checks together, so which of them
    reports an error they all raise first is a matter of clocks: the line names the lowest."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from longctx_cli.launcher.launch import describe_failure

    def failure(rank: int, message: str, at: float) -> ProcessFailure:
        path = tmp_path / f"error-{rank}.json"
        path.write_text(json.dumps({"message": message, "timestamp": int(at),
                                    "longctx": {"user_error": True, "time": at}}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=2,
                              error_file=str(path))

    now = time.time()
    alike = "datasets: the training set has 15 packed rows"
    assert describe_failure({0: failure(0, alike, now + 0.2),
                             1: failure(1, alike, now)}) == f"rank 0: {alike}"
    assert describe_failure({0: failure(0, "other", now + 0.2),
                             1: failure(1, alike, now)}) == f"rank 1: {alike}"
