"""CTL keys, values and recorded changes."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AwareDatetime, BaseModel, ConfigDict, StringConstraints

from cmb_dagster.triggers.models import ParameterKey

Name = Annotated[str, StringConstraints(min_length=1, max_length=200)]


class CtlKey(BaseModel):
    """A CTL parameter: ``(entity, parameter)``."""

    model_config = ConfigDict(frozen=True)

    entity: Name
    parameter: Name


class CtlValue(CtlKey):
    """A value to write: an aware datetime for one parameter."""

    value: AwareDatetime


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
