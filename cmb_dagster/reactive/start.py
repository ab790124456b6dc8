"""A reactive tick's first step: it starts (its token replaces the tick before's) and stores the tasks' definitions
unless stored already, marking the tasks that are new or whose trigger or deadline changed."""

from __future__ import annotations

import json
from datetime import datetime

import psycopg

from cmb_dagster.reactive import sql
from cmb_dagster.reactive.catalog import TaskCatalog
from cmb_dagster.reactive.errors import SchedulerConflict
from cmb_dagster.reactive.tick import Tick
from cmb_dagster.workers import Leases


def start_tick(
    conn: psycopg.Connection, tick: Tick, catalog: TaskCatalog, location: str | None, token: str
) -> tuple[bool, str | None]:
    """Start the tick of ``token``; store the definitions unless stored already. Return whether they were, and the
    token of the tick before. Raises :class:`SchedulerConflict` when another code location keeps the scheduler's
    name with other tasks."""
    params = {**tick.params, "location": location, "token": token}
    row = conn.execute(sql.START_TICK, {**params, "hash": catalog.definitions_hash}).fetchone()
    previous = None if row is None else row[3]
    if row is not None:
        _refuse_a_foreign_name(tick, catalog, location, *row[:3])
    if row is not None and row[0] == catalog.definitions_hash:
        if location is not None and row[1] != location:
            conn.execute(sql.MOVE_SCHEDULER, params)
        return False, previous
    with conn.transaction():
        row = conn.execute(sql.LOCK_SCHEDULER_ROW, params).fetchone()
        if row is not None:
            _refuse_a_foreign_name(tick, catalog, location, *row)
        if row is not None and row[0] == catalog.definitions_hash:
            return False, previous
        Leases.check(conn, tick.lease)
        if row is None:
            others = conn.execute(sql.OTHER_SCHEDULERS_WITH_STATE, params).fetchall()
            if others:
                names = ", ".join(f"{name!r} ({count} task(s))" for name, count in others)
                tick.report.warnings.append(
                    f"scheduler {tick.scheduler!r} starts with no remembered state, but {names} "
                    "in the same schema has some: if this code location was renamed, pass that name as "
                    "ReactiveOptions(name=...) to keep the tasks' last-seen values (otherwise every "
                    "Delta-type trigger fires again as on a first release)"
                )
        conn.execute(sql.SAVE_DEFINITIONS_HASH, {**params, "hash": catalog.definitions_hash})
        specs = sorted(catalog.tasks.values(), key=lambda t: t.name)
        conn.execute(
            sql.UPSERT_TASKS,
            {
                **params,
                "names": [t.name for t in specs],
                "triggers": [t.trigger_json for t in specs],
                "hashes": [t.trigger_hash for t in specs],
                "priorities": [t.priority for t in specs],
                "timezones": [t.timezone for t in specs],
                "produces": [json.dumps(t.produces) for t in specs],
                "deadlines": [t.deadline_json for t in specs],
            },
        )
        conn.execute(sql.UNDEFINE_MISSING_TASKS, {**params, "names": [t.name for t in specs]})
    tick.report.definitions_synced = True
    return True, previous


def _refuse_a_foreign_name(
    tick: Tick,
    catalog: TaskCatalog,
    location: str | None,
    definitions_hash: str,
    stored_location: str | None,
    ticked_at: datetime | None,
) -> None:
    """Two code locations whose scheduler names are the same (e.g. 'team a' and 'team_a') with other tasks."""
    if location is None or stored_location is None or stored_location == location:
        return
    if definitions_hash == catalog.definitions_hash:
        return  # the same tasks: a copy of the same code, nothing to fight over
    if ticked_at is not None and ticked_at > tick.now - tick.settings.takeover_after:
        raise SchedulerConflict(
            f"reactive scheduler name {tick.scheduler!r} is used by code location {stored_location!r} with other "
            f"tasks (it ticked at {ticked_at:%Y-%m-%d %H:%M:%S %Z}); code location {location!r} refuses to tick "
            "so the two do not rewrite each other's tasks. Give one of them its own "
            "ReactiveOptions(name=...); if the location was renamed, this one takes over once the old one "
            f"has not ticked for {tick.settings.takeover_after}"
        )
