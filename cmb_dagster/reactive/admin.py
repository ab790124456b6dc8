"""Operator functions of the reactive scheduler: inspect task state, fix it by hand."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import datetime

import psycopg

from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import check_key, check_values, values_from_json
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.inputs import check_text, refused_input
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.errors import InvalidReactiveInput
from cmb_dagster.reactive.explanations import Explanation, stored_trigger
from cmb_dagster.reactive.models import ReactiveStatus, SchedulerState, SeenRun, TaskState
from cmb_dagster.triggers import evaluate, parameters, trigger_from_dict

MAX_NAME_LENGTH = 1000
"""Longest scheduler or task name an operator function looks up."""


@refused_input(InvalidReactiveInput, "arguments")
def status(database: DatabaseSource, scheduler: str | None = None, name: str | None = None) -> ReactiveStatus:
    """The stored state of reactive tasks (all, one scheduler's, or one task's) and of the schedulers."""
    params = {
        "scheduler": None if scheduler is None else _name(scheduler, "scheduler"),
        "name": None if name is None else _name(name, "name"),
    }
    with Database.of(database).connection() as conn:
        cursor = conn.execute(sql.TASK_STATUS, params)
        columns = [c.name for c in cursor.description or ()]
        tasks = [TaskState(**dict(zip(columns, row, strict=True))) for row in cursor.fetchall()]
        schedulers = [
            SchedulerState(name=n, location=loc, ticked_at=at, tick_seconds=seconds)
            for n, loc, at, seconds in conn.execute(sql.SCHEDULER_TICKS, params)
        ]
    return ReactiveStatus(tasks=tasks, schedulers=schedulers)


def current_values(
    conn: psycopg.Connection, keys: Sequence[ParameterKey]
) -> tuple[dict[ParameterKey, datetime], dict[ParameterKey, datetime]]:
    """The current CTL values of ``keys`` and when each was set (parameters without a value are left out)."""
    if not keys:
        return {}, {}
    params = {"entities": [k[0] for k in keys], "parameters": [k[1] for k in keys]}
    rows = conn.execute(sql.CURRENT_VALUES, params).fetchall()
    return {(e, p): value for e, p, value, _ in rows}, {(e, p): changed for e, p, _, changed in rows}


@refused_input(InvalidReactiveInput, "arguments")
def waits_on(database: DatabaseSource, task: TaskState, now: datetime) -> list[str]:
    """What the task's trigger waits on at ``now``, one line per CTL trigger that does not fire (from CTL only)."""
    trigger = trigger_from_dict(task.trigger)
    with Database.of(database).connection() as conn:
        current, changed = current_values(conn, sorted(parameters(trigger)))
    result = evaluate(
        trigger,
        now=now,
        current=current,
        last=values_from_json(task.last_values),
        timezone=task.timezone,
        changed=changed,
    )
    return result.waits_on


def task_states(database: DatabaseSource, scheduler: str | None = None, name: str | None = None) -> list[TaskState]:
    """Deprecated: ``status(database, scheduler, name).tasks``."""
    warnings.warn(
        "task_states() is deprecated: use status(database, scheduler, name).tasks", DeprecationWarning, stacklevel=2
    )
    return status(database, scheduler, name).tasks


@refused_input(InvalidReactiveInput, "arguments")
def forget_last_values(
    database: DatabaseSource, scheduler: str, name: str, parameter: ParameterKey | None = None
) -> bool:
    """Forget what a task's last run saw (all, or one parameter), e.g. after a CTL value moved backwards.

    The task is evaluated again on the next tick (a backoff ends); a Delta-type trigger then fires as on a first
    release.
    """
    params = {
        "scheduler": _name(scheduler, "scheduler"),
        "name": _name(name, "name"),
        "parameter": list(_parameter(parameter)) if parameter else None,
    }
    with Database.of(database).connection() as conn:
        row = conn.execute(sql.FORGET_LAST_VALUES, params).fetchone()
    return row is not None


@refused_input(InvalidReactiveInput, "arguments")
def retry_task(database: DatabaseSource, scheduler: str, name: str) -> bool:
    """Let a task parked for the crashes of its user code (or backing off) run again: it is evaluated on the
    next tick. False when there is no such task."""
    params = {"scheduler": _name(scheduler, "scheduler"), "name": _name(name, "name")}
    with Database.of(database).connection() as conn:
        return conn.execute(sql.RETRY_TASK, params).fetchone() is not None


@refused_input(InvalidReactiveInput, "arguments")
def set_last_value(
    database: DatabaseSource, scheduler: str, name: str, parameter: ParameterKey, value: datetime
) -> dict[str, dict[str, str]] | None:
    """Move one value a task's last run saw, into the past too; return the task's last-seen values (None: no task).

    The recovery of a Delta-type trigger after its CTL value moved backwards: set the last-seen value to (or
    before) the new current value and the trigger measures new data from there. The task is evaluated again on
    the next tick (a backoff ends).
    """
    try:
        [(key, moment)] = check_values({parameter: value}).items()
    except (InvalidCtlInput, TypeError) as exc:
        raise InvalidReactiveInput(
            f"set-last: --parameter ENTITY PARAMETER and an aware --value are needed ({exc})"
        ) from None
    params = {
        "scheduler": _name(scheduler, "scheduler"),
        "name": _name(name, "name"),
        "entity": key[0],
        "parameter": key[1],
        "value": moment.isoformat(),
    }
    with Database.of(database).connection() as conn:
        row = conn.execute(sql.SET_LAST_VALUE, params).fetchone()
    return None if row is None else row[0]


def launch_values(database: DatabaseSource, scheduler: str, run_key: str) -> dict[ParameterKey, datetime]:
    """The CTL values a reactive run was launched on, by its run_key (empty when no such launch is recorded)."""
    with Database.of(database).connection() as conn:
        row = conn.execute(sql.LAUNCH_VALUES, {"scheduler": scheduler, "run_key": run_key}).fetchone()
    return values_from_json(row[0]) if row else {}


def claim_launch_log(database: DatabaseSource, scheduler: str, run_key: str, run_id: str) -> SeenRun | None:
    """What to write into the log of run ``run_id`` of launch ``run_key`` (why it runs, on which values), if
    nobody wrote it yet; None when it was written already (or no such launch is recorded)."""
    with Database.of(database).connection() as conn:
        row = conn.execute(sql.CLAIM_LAUNCH_LOG, {"scheduler": scheduler, "run_key": run_key}).fetchone()
    if row is None:
        return None
    task, values, text, facts, trigger, trigger_hash, timezone = row
    defined = stored_trigger(trigger) if facts is not None else None
    why = Explanation.stored(text, facts, defined, trigger_hash, timezone or "UTC")
    return SeenRun(task, run_id, run_key, values_from_json(values), str(why))


def _name(value: object, field: str) -> str:
    return check_text(value, field, max_length=MAX_NAME_LENGTH, error=InvalidReactiveInput)


def _parameter(parameter: object) -> ParameterKey:
    """``parameter`` as an (entity, parameter) pair of CTL names."""
    try:
        return check_key(parameter)
    except InvalidCtlInput as exc:
        raise InvalidReactiveInput(f"parameter: {exc}") from None
