"""The base of every user-facing options and settings model, the one backoff every engine uses, and the deprecated
iteration of status models."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cmb_dagster.errors import InvalidInput

T = TypeVar("T")


def describe(exc: ValidationError) -> str:
    """A validation error as one line: ``field: problem; field: problem``."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
    )


def deprecated_iteration(rows: Iterable[T], message: str) -> Iterator[T]:
    """An iterator over ``rows`` that warns the code iterating a status model (deprecated) with ``message``."""
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return iter(rows)


LAUNCHED_BY_TAG = "cmb/launched_by"
"""Tag of a run an engine launched (a callback, an event queue handler): which engine and which item."""
MAX_TAG_VALUE = 63
"""Longest tag value the engines write (Dagster's limit for a tag that is also a label)."""


class Options(BaseModel):
    """Options or settings of one engine: unknown or invalid fields raise the engine's :class:`InvalidInput`
    (``error``), one line naming each field; every number has both bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    error: ClassVar[type[InvalidInput]] = InvalidInput
    DEPRECATED_NAMES: ClassVar[Mapping[str, str]] = {}
    """Field names of the last release (old -> new), read for one more with a DeprecationWarning."""

    @model_validator(mode="before")
    @classmethod
    def _deprecated_names(cls, values: Any) -> Any:
        if not cls.DEPRECATED_NAMES or not isinstance(values, dict):
            return values
        values = dict(values)
        for old, new in cls.DEPRECATED_NAMES.items():
            if old in values and new not in values:  # both given: the old one is refused as unknown
                warnings.warn(
                    f"{cls.__name__}({old}=...) is deprecated: {new}=...",
                    DeprecationWarning,
                    stacklevel=_callers_level(),
                )
                values[new] = values.pop(old)
        return values

    def __init__(self, /, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            error = self.error(f"{type(self).__name__}: {describe(exc)}")
            error.field_path = field_path(exc)
            raise error from None


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside this package and pydantic: the code that gave the values.
    (Python 3.11 has no ``skip_file_prefixes``; the depth of pydantic's validation varies with the nesting.)"""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("cmb_dagster", "pydantic")):
        frame, level = frame.f_back, level + 1
    return level


def field_path(exc: Exception) -> tuple[str | int, ...]:
    """Where the first problem of a validation error is, through the options nested in the options validated."""
    if not isinstance(exc, ValidationError):
        return getattr(exc, "field_path", ())
    first = exc.errors()[0]
    inner = first.get("ctx", {}).get("error")
    return (*first["loc"], *getattr(inner, "field_path", ()))


class Backoff(Options):
    """Seconds to wait after failures in a row: ``first``, then ``factor`` times longer each time, at most ``max``."""

    first: float = Field(default=1.0, ge=0, le=30 * 86400, description="Seconds after the first failure.")
    factor: float = Field(default=2.0, ge=1, le=1000, description="Growth per further failure in a row.")
    max: float = Field(default=300.0, ge=0, le=30 * 86400, description="Longest wait.")

    def delay(self, failures_before: int) -> float:
        """Seconds to wait after a failure that ``failures_before`` failures in a row preceded."""
        steps = max(failures_before, 0)
        if self.first >= self.max or self.first == 0 or self.factor == 1:
            return min(self.max, self.first)
        if steps * math.log(self.factor) >= math.log(self.max / self.first):  # past max (and no float overflow)
            return self.max
        return self.first * self.factor**steps
