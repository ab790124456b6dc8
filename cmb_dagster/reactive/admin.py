"""Operator functions of the reactive scheduler: inspect task state, fix it by hand."""

from __future__ import annotations

from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.database import Database
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.models import TaskState


def task_states(database: Database, scheduler: str | None = None, name: str | None = None) -> list[TaskState]:
    """Stored state of reactive tasks (all, one scheduler's, or one task's)."""
    with database.connection() as conn:
        cursor = conn.execute(sql.TASK_STATUS, {"scheduler": scheduler, "name": name})
        columns = [c.name for c in cursor.description or ()]
        return [TaskState(**dict(zip(columns, row, strict=True))) for row in cursor.fetchall()]


def forget_last_values(database: Database, scheduler: str, name: str, parameter: ParameterKey | None = None) -> bool:
    """Forget what a task's last run saw (all, or one parameter), e.g. after a CTL value moved backwards.

    The task is evaluated again on the next tick; a Delta-type trigger then fires as on a first release.
    """
    path = list(parameter) if parameter else None
    with database.connection() as conn:
        row = conn.execute(sql.FORGET_LAST_VALUES, {"scheduler": scheduler, "name": name, "parameter": path}).fetchone()
    return row is not None
