"""`processor_type` as Axolotl writes it: AutoProcessor, or a processor class name, which the
model folder's processor must be."""

from __future__ import annotations

from pathlib import Path

import pytest

from longctx_cli.config import config_from_dict
from longctx_cli.data import vision
from longctx_cli.data.tokenizer import check_processor_class
from longctx_cli.errors import UserError
from tests.vlm_fixtures import write_tiny_qwen_vl_processor

BASE = {"model_config": {"model_type": "llama"}, "tokenizer": "byte"}


def test_a_processor_class_name_is_a_value_and_a_made_up_one_is_not() -> None:
    for name in ("AutoProcessor", "Qwen2_5_VLProcessor", "Llama4Processor"):
        assert config_from_dict({**BASE, "processor_type": name}).vision.processor_type == name
    with pytest.raises(UserError) as exc:
        config_from_dict({**BASE, "processor_type": "Qwen9Processor"})
    message = " ".join(str(exc.value).split())
    assert "`Qwen9Processor` is not a processor class transformers has" in message
    assert "AutoProcessor" in message


def test_the_folder_must_hold_the_named_class(tmp_path: Path) -> None:
    folder = write_tiny_qwen_vl_processor(tmp_path / "proc")
    processor = vision.load_processor(str(folder)).processor
    for named in (None, "AutoProcessor", "Qwen2_5_VLProcessor"):
        check_processor_class(processor, named, str(folder))  # the folder's class (or a base)
    with pytest.raises(UserError) as exc:
        check_processor_class(processor, "LlavaProcessor", str(folder))
    message = " ".join(str(exc.value).split())
    assert "`processor_type: LlavaProcessor`" in message and "Qwen2_5_VLProcessor" in message
