"""Operator functions: scheduling rules (pause/block), status, the dead-letter table and replay."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import psycopg
from psycopg.rows import class_row

from cmb_dagster import flow
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.eventqueue import sql
from cmb_dagster.eventqueue.errors import InvalidEventQueueInput, NotDead, UnknownHandler
from cmb_dagster.eventqueue.handlers import HandlerRegistry, scope
from cmb_dagster.eventqueue.models import DEFAULT_MODULE, DeadEvent, EventQueueStatus, HandlerStatus, Rule, check_name
from cmb_dagster.eventqueue.worker import WORKER_KIND
from cmb_dagster.inputs import BIGINT, check_int, check_seconds, refused_input

log = logging.getLogger("cmb_dagster.eventqueue")

WAIT_FOR_WORKERS = 30.0
"""Seconds pause() and block() wait at most for the live workers to apply a new rule."""
MAX_LISTED = 100_000
"""Dead letters one call lists at most."""


def pause(
    db: DatabaseSource,
    namespace: str,
    handler: str,
    event_space: str = DEFAULT_MODULE,
    *,
    wait: float = WAIT_FOR_WORKERS,
) -> bool:
    """Hold the handler's events of (namespace, event space) until :func:`unpause` (a user's rule).

    Returns once every live worker has applied the rule to the events it has claimed and not started
    (waiting ``wait`` seconds at most): no such event starts after that. False if the rule existed."""
    return _add_rule(db, "pause", namespace, handler, event_space, wait)


def unpause(db: DatabaseSource, namespace: str, handler: str, event_space: str = DEFAULT_MODULE) -> int:
    """Lift a pause; the held events become due again (unless also blocked). Returns how many were released."""
    return _drop_rule(db, "pause", namespace, handler, event_space)


def block(
    db: DatabaseSource,
    namespace: str,
    handler: str,
    event_space: str = DEFAULT_MODULE,
    *,
    wait: float = WAIT_FOR_WORKERS,
) -> bool:
    """Hold the handler's events of (namespace, event space) until :func:`unblock` (an admin's rule);
    returns as :func:`pause` does."""
    return _add_rule(db, "block", namespace, handler, event_space, wait)


def unblock(db: DatabaseSource, namespace: str, handler: str, event_space: str = DEFAULT_MODULE) -> int:
    """Lift a block; the held events become due again (unless also paused). Returns how many were released."""
    return _drop_rule(db, "block", namespace, handler, event_space)


def _rule_params(conn: psycopg.Connection, rule_type: str, namespace: str, handler: str, event_space: str) -> dict:
    params = {
        "rule_type": rule_type,
        "namespace": check_name("namespace", namespace),
        "handler": check_name("handler", handler),
        "event_space": check_name("event_space", event_space),
    }
    if conn.execute(sql.HANDLER_EXISTS, params).fetchone() is None:
        raise UnknownHandler(f"handler: no handler named {handler!r} is registered")
    return params


@refused_input(InvalidEventQueueInput, "arguments")
def _add_rule(db: DatabaseSource, rule_type: str, namespace: str, handler: str, event_space: str, wait: float) -> bool:
    check_seconds(wait, "wait", high=3600, error=InvalidEventQueueInput)
    database = Database.of(db)
    with database.connection() as conn:
        params = _rule_params(conn, rule_type, namespace, handler, event_space)
        added = conn.execute(sql.ADD_RULE, params).fetchone()
    if added is None:
        return False
    _wait_for_workers(database, added[0], wait)
    return True


def _wait_for_workers(database: Database, rule: int, wait: float) -> None:
    """Until every live worker has acknowledged ``rule`` (or ``wait`` seconds passed: then a warning names them)."""
    deadline = time.monotonic() + wait
    while True:
        with database.connection() as conn:
            behind = [row[0] for row in conn.execute(sql.UNACKNOWLEDGED, {"kind": WORKER_KIND, "rule": rule})]
        if not behind or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if behind:
        log.warning(
            "rule %s: %d worker(s) did not confirm it within %.0f s (%s); events they had already "
            "claimed may still start",
            rule,
            len(behind),
            wait,
            ", ".join(behind[:5]),
        )


@refused_input(InvalidEventQueueInput, "arguments")
def _drop_rule(db: DatabaseSource, rule_type: str, namespace: str, handler: str, event_space: str) -> int:
    with Database.of(db).connection() as conn:
        params = _rule_params(conn, rule_type, namespace, handler, event_space)
        conn.execute(sql.DELETE_RULE, params)
    with Database.of(db).connection() as conn:  # a new snapshot: sees what claimers parked until now
        return conn.execute(sql.RELEASE_HELD, params).fetchone()[0]


def rules(db: DatabaseSource) -> list[Rule]:
    """Every pause and block rule, with how many events each holds."""
    with Database.of(db).connection() as conn:
        return [Rule(*row) for row in conn.execute(sql.LIST_RULES)]


def status(db: DatabaseSource) -> EventQueueStatus:
    """Per registered handler: queued, delayed, locked, held, dead-lettered, oldest queued age, rules, key path and
    limits; and per limited key, its tokens and events in flight."""
    with Database.of(db).connection() as conn, conn.cursor(row_factory=class_row(HandlerStatus)) as cursor:
        handlers = cursor.execute(sql.STATUS).fetchall()
        keys = flow.usage(conn, [scope(h.handler) for h in handlers if h.rate_per_second or h.concurrency])
        return EventQueueStatus(handlers=handlers, keys=keys)


@refused_input(InvalidEventQueueInput, "arguments")
def dead_letters(db: DatabaseSource, handler: str | None = None, limit: int = 100) -> list[DeadEvent]:
    """Dead-lettered events (of ``handler``), oldest first, at most ``limit`` (1..100,000)."""
    params = {
        "handler": _handler_filter(handler),
        "limit": check_int(limit, "limit", low=1, high=MAX_LISTED, error=InvalidEventQueueInput),
    }
    with Database.of(db).connection() as conn:
        return [DeadEvent(*row) for row in conn.execute(sql.LIST_DEAD, params)]


@refused_input(InvalidEventQueueInput, "arguments")
def replay(db: DatabaseSource, ids: Iterable[int] | None = None, *, handler: str | None = None) -> list[int]:
    """Move dead-lettered events back into the queue with their ids, retries reset; return their ids.

    ``ids``: these events (each must be dead, else :class:`NotDead` and nothing moves); ``None``: all of
    them (of ``handler`` when given).
    """
    id_list: list[int] | None = None
    if ids is not None:
        id_list = [check_int(i, "ids", low=1, high=BIGINT[1], error=InvalidEventQueueInput) for i in ids]
        if not id_list:
            return []
    handler = _handler_filter(handler)
    with Database.of(db).connection() as conn:
        if id_list is not None:
            found = {r[0] for r in conn.execute(sql.LOCK_DEAD_IDS, {"ids": id_list})}
            missing = sorted(set(id_list) - found)
            if missing:
                raise NotDead(f"ids: event {missing[0]} is not in the dead-letter table; nothing was replayed")
        replayed, _ = conn.execute(sql.REPLAY, {"ids": id_list, "handler": handler}).fetchone()
        return list(replayed or [])


@refused_input(InvalidEventQueueInput, "handlers")
def register(db: DatabaseSource, handlers: object) -> list[str]:
    """Record handlers (a registry, ``"module:attr"`` or a list) in the database; return their names."""
    registry = HandlerRegistry.of(handlers)
    with Database.of(db).connection() as conn:
        registry.register(conn)
    return registry.names


def _handler_filter(handler: object) -> str | None:
    return None if handler is None else check_name("handler", handler)
