"""The base of user-facing option models: bad values raise :class:`InvalidInput` naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from cmb_dagster.errors import InvalidInput


def describe(exc: ValidationError) -> str:
    """A validation error as one line: ``field: problem; field: problem``."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())


class Options(BaseModel):
    """Options of one engine in :func:`cmb_definitions`; unknown or invalid fields raise InvalidInput."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __init__(self, /, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise InvalidInput(f"{type(self).__name__}: {describe(exc)}") from None
