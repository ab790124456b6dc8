"""Emitting events: one statement for any number of events, inside the caller's transaction when given one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import psycopg

from cmb_dagster.database import DatabaseSource, connection_for
from cmb_dagster.eventqueue import sql
from cmb_dagster.eventqueue.errors import InvalidEventQueueInput, UnknownHandler
from cmb_dagster.eventqueue.models import (
    DEFAULT_MODIFIER,
    DEFAULT_MODULE,
    MAX_BATCH_BYTES,
    check_name,
    check_priority,
    delay_seconds,
    to_json,
)
from cmb_dagster.inputs import refused_input

_FIELDS = {"namespace", "handler", "value", "module", "modifier", "delay", "priority"}


def emit(
    namespace: str,
    handler: str,
    value: Any,
    *,
    module: str = DEFAULT_MODULE,
    modifier: str = DEFAULT_MODIFIER,
    delay: float | timedelta | None = None,
    priority: int = 0,
    conn: psycopg.Connection | None = None,
    db: DatabaseSource | None = None,
) -> int:
    """Emit ``value`` (JSON) to ``handler`` in ``namespace``; return the event id.

    With ``conn`` (any connection of the application) the event is part of that connection's transaction: it
    exists only if that commits. Otherwise it commits at once on ``db`` (default: the database of the
    environment). ``delay`` (seconds or a timedelta) holds it back; ``priority`` (-1000..1000) puts it before
    the events of lower priorities ready at the same time. An unknown handler raises :class:`UnknownHandler`
    and writes nothing.
    """
    event = {
        "namespace": namespace,
        "handler": handler,
        "value": value,
        "module": module,
        "modifier": modifier,
        "delay": delay,
        "priority": priority,
    }
    return _emit([event], conn, db, prefixed=False)[0]


def emit_many(
    events: Iterable[Mapping[str, Any]],
    *,
    conn: psycopg.Connection | None = None,
    db: DatabaseSource | None = None,
) -> list[int]:
    """Emit many events in one statement (all or none); each a mapping with the keywords of :func:`emit`."""
    return _emit(events, conn, db, prefixed=True)


def _emit(
    events: Iterable[Mapping[str, Any]], conn: psycopg.Connection | None, db: DatabaseSource | None, *, prefixed: bool
) -> list[int]:
    columns: dict[str, list[Any]] = {
        k: [] for k in ("namespaces", "modules", "handlers", "modifiers", "values", "delays", "priorities")
    }
    for index, event in enumerate(events):
        where = f"events[{index}]." if prefixed else ""
        extra = set(event) - _FIELDS
        if extra:
            raise InvalidEventQueueInput(f"{where}{min(extra)}: unknown field (expected {sorted(_FIELDS)})")
        for key in ("namespace", "handler", "value"):
            if key not in event:
                raise InvalidEventQueueInput(f"{where}{key}: missing")
        columns["namespaces"].append(check_name(f"{where}namespace", event["namespace"]))
        columns["handlers"].append(check_name(f"{where}handler", event["handler"]))
        columns["modules"].append(check_name(f"{where}module", event.get("module", DEFAULT_MODULE)))
        columns["modifiers"].append(check_name(f"{where}modifier", event.get("modifier", DEFAULT_MODIFIER)))
        columns["values"].append(to_json(event["value"], f"{where}value"))
        columns["delays"].append(delay_seconds(event.get("delay")))
        columns["priorities"].append(check_priority(event.get("priority", 0), f"{where}priority"))
    if not columns["namespaces"]:
        return []
    handlers = set(columns["handlers"])
    params = {
        **columns,
        "payload": next(iter(handlers)) if len(handlers) == 1 else "",
        "max_batch_bytes": MAX_BATCH_BYTES,
    }
    # on a connection of ours, one statement: one round trip with its commit
    with (
        refused_input(InvalidEventQueueInput, "events" if prefixed else "event", conn=conn),
        connection_for(conn, db, autocommit=True) as writing,
    ):
        return _insert(writing, params)


def _insert(conn: psycopg.Connection, params: dict[str, Any]) -> list[int]:
    # several events: planned for their arrays each time (a generic plan, which psycopg's statement preparation
    # brings after five runs on a connection, costs a large queue time for each event); one event: prepared
    # (planning the statement costs more than running it)
    single = len(params["handlers"]) == 1
    unknown, ids, _ = conn.execute(sql.EMIT, params, prepare=None if single else False).fetchone()
    if unknown is not None:
        raise UnknownHandler(
            f"handler: no handler named {unknown!r} is registered (a worker or `cmb-dagster events register` "
            "records handlers); nothing was emitted"
        )
    return list(ids)
