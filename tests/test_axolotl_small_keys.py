"""Small Axolotl keys that used to turn its examples away: SwanLab's tracker keys, a
dataset's `drop_system_message`, `unfrozen_parameters` with an adapter, `revision_of_model`,
`optimizer: muon`, added tokens, and Axolotl's cloud-launcher configs."""

from __future__ import annotations

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.errors import UserError

BASE = {"model_config": {"model_type": "llama"}, "tokenizer": "byte"}


def _error(data: dict) -> str:
    with pytest.raises(UserError) as exc:
        config_from_dict({**BASE, **data})
    return " ".join(str(exc.value).split())


def _notes(data: dict) -> dict[str, str]:
    return dict(config_from_dict({**BASE, **data}).axolotl_notes)


def test_swanlab_keys_of_axolotls_examples_are_ignored_tracker_keys() -> None:
    theirs = {"use_swanlab": True, "swanlab_project": "p", "swanlab_experiment_name": "run-1",
              "swanlab_description": "d", "swanlab_workspace": "w", "swanlab_mode": "cloud",
              "swanlab_log_model": False, "swanlab_log_completions": True,
              "swanlab_completion_log_interval": 100, "swanlab_completion_max_buffer": 128}
    notes = _notes(theirs)
    assert all("ignored" in notes[k] and "Weights & Biases" in notes[k] for k in theirs), notes
