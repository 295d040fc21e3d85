"""What every part of the schema shares: strict models (an unknown key is an error) that
never read `true` as a number, and the section a concern's keys live in."""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _admits(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field's annotation accepts any of `kinds` (looking inside unions)."""
    if annotation in kinds:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits(a, kinds) for a in typing.get_args(annotation))
    return False


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 for an int field; `sequence_parallel_degree: true` is a
        # mistake (Axolotl's boolean switches look alike), never a number.
        if isinstance(value, bool) and info.field_name:
            annotation = cls.model_fields[info.field_name].annotation
            if _admits(annotation, (int, float)) and not _admits(annotation, (bool,)):
                raise ValueError("a number is needed, not true/false")
        return value


class Section(StrictModel):
    """One concern's keys. The YAML is flat: `Config` hands each section its own keys, and
    a section's validators see only them (rules across sections are `Config`'s)."""

    title: ClassVar[str]  # the heading its keys are listed under in docs/config.md
