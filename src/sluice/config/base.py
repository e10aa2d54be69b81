"""The building blocks of the config models: the frozen base model, field types, units,
names, and the errors a validator raises to name the field that failed."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict

from sluice.units import parse_duration_ms, parse_size_bytes

DurationMs = Annotated[int, BeforeValidator(parse_duration_ms)]
SizeBytes = Annotated[int, BeforeValidator(parse_size_bytes)]
FIELD_TYPES = ("string", "long", "int", "double", "float", "boolean")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FieldType(_Model):
    """One schema field: `long`, or `string?` for a field that may be missing."""

    type: str
    nullable: bool = False

    @classmethod
    def parse(cls, spec: str) -> FieldType:
        nullable = spec.endswith("?")
        base = spec[:-1] if nullable else spec
        if base not in FIELD_TYPES:
            raise ValueError(
                f"unknown field type {spec!r}; expected one of {', '.join(FIELD_TYPES)}"
                " (add '?' for a field that may be missing)"
            )
        return cls(type=base, nullable=nullable)


def check_stream_name(v: str) -> str:
    if not v or any(c in v for c in "{}\n ") or len(v) > 200:
        raise ValueError(f"stream name {v!r} must be non-empty, <=200 chars, no spaces or braces")
    return v


def check_schema(v: dict[str, str]) -> dict[str, str]:
    if not v:
        raise ValueError("schema must name at least one field")
    for name, spec in v.items():
        if not NAME_RE.match(name):
            raise ValueError(f"field name {name!r} must match {NAME_RE.pattern}")
        if name.startswith("_"):
            raise ValueError(f"field name {name!r} must not start with '_' (reserved)")
        FieldType.parse(str(spec))
    return {k: str(s) for k, s in v.items()}


class _FieldError(ValueError):
    """A cross-field check that failed; `field` names the field within the model that failed."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class _PathError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(message)


def _at(path: str, message: str) -> _PathError:
    return _PathError(path, message)
