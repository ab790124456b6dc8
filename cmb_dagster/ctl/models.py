"""CTL keys, values and recorded changes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, AwareDatetime, BaseModel, BeforeValidator, ConfigDict, ValidationInfo

from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.inputs import check_text
from cmb_dagster.triggers.models import ParameterKey

MAX_NAME_LENGTH = 200
"""Longest entity, parameter, actor or feed name."""
EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
LATEST = datetime(9999, 12, 30, 23, 59, 59, 999999, tzinfo=UTC)
"""CTL values lie in [EARLIEST, LATEST]: a day inside Python's years 1-9999, so that any time zone
(a session's, a chunk trigger's) shows them as a ``datetime`` again."""


def check_name(value: object, field: str) -> str:
    """``value`` if it is an entity, parameter, actor or feed name: 1-200 characters Postgres can store;
    :class:`InvalidCtlInput` naming ``field`` otherwise."""
    return check_text(value, field, max_length=MAX_NAME_LENGTH, error=InvalidCtlInput)


def _name(value: object, info: ValidationInfo) -> str:
    return check_name(value, info.field_name or "name")


def _in_range(value: datetime) -> datetime:
    if not EARLIEST <= value <= LATEST:
        raise ValueError(
            f"must lie between {EARLIEST.date().isoformat()} and {LATEST.date().isoformat()} (UTC), "
            f"got {value.isoformat()}"
        )
    return value


Name = Annotated[str, BeforeValidator(_name)]
Moment = Annotated[AwareDatetime, AfterValidator(_in_range)]


class CtlChange(BaseModel):
    """One recorded change of a CTL value; ``old_value`` is None for a parameter's first value."""

    model_config = ConfigDict(frozen=True)

    id: int
    entity: str
    parameter: str
    old_value: datetime | None
    new_value: datetime
    backwards: bool
    changed_at: datetime
    changed_by: str

    @property
    def key(self) -> ParameterKey:
        return (self.entity, self.parameter)

    def payload(self) -> dict[str, object]:
        """The change as it appears in a CTL event's ``changes`` on the pub/sub stream."""
        return {
            "history_id": self.id,
            "entity": self.entity,
            "parameter": self.parameter,
            "old": self.old_value.isoformat() if self.old_value else None,
            "new": self.new_value.isoformat(),
            "backwards": self.backwards,
            "by": self.changed_by,
        }
