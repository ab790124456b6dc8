"""Backfills: the existing rows of a table published into a branch as ``snapshot`` events, batch after batch in
primary key order, while its live changes keep flowing; resumable after a crash from the last batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psycopg
from psycopg.sql import SQL, Composed, Identifier
from psycopg.sql import Literal as SQLLiteral
from psycopg.types.json import Jsonb

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.isolation import describe_error
from cmb_dagster.pubsub import sql
from cmb_dagster.pubsub.admin import backfill_progress
from cmb_dagster.pubsub.engine import check_predicate
from cmb_dagster.pubsub.errors import BackfillFailed, InvalidPubSubInput
from cmb_dagster.pubsub.models import BackfillProgress, BackfillSpec
from cmb_dagster.workers import PARTITION_BACKOFF

log = logging.getLogger("cmb_dagster.pubsub")

MAX_LOCK_RETRIES = 50  # batches in a row that waited too long for a row lock (or met a deadlock) before giving up


def backfill(
    database: DatabaseSource,
    table: str,
    branch_id: int = 0,
    *,
    where: str | None = None,
    batch_size: int = 1000,
    topic: str | None = None,
    lock_timeout: float = 0.5,
    on_progress: Callable[[BackfillProgress], None] | None = None,
) -> BackfillProgress:
    """Publish the rows of ``table`` (those ``where``, an SQL expression over its columns, is true for) into
    ``branch_id`` as ``snapshot`` events (topic: ``topic``, default ``'schema.table'``; key: the primary key;
    payload: the row), ``batch_size`` rows per transaction in primary key order; return its progress.

    Each batch locks its rows ``FOR SHARE`` and writes their events and its progress in one transaction, so
    the event's id is the row's version (docs/pubsub.md, "Backfill") and a run killed mid-batch leaves
    nothing of that batch. Calling it again with the same table, branch, topic and ``where`` resumes an
    unfinished (interrupted or failed) backfill after its last batch; concurrent calls take turns per batch.
    A batch waiting more than ``lock_timeout`` seconds for a row a writer holds is rolled back and tried
    again. ``on_progress`` is called after each batch. Raises :class:`BackfillFailed` (recorded) on an error.
    """
    spec = BackfillSpec(
        table=table, branch_id=branch_id, where=where, batch_size=batch_size, topic=topic, lock_timeout=lock_timeout
    )
    db = Database.of(database)
    with db.connection() as conn:
        info = conn.execute(sql.TABLE_INFO, {"table": spec.table}).fetchone()
        if info is None or info[2] not in ("r", "p"):
            raise InvalidPubSubInput(f"table: no table named {spec.table!r} on the search_path")
        table_schema, table_name, _ = info
        key_columns = [row[0] for row in conn.execute(sql.PRIMARY_KEY_COLUMNS, {"table": spec.table})]
    qualified = f"{table_schema}.{table_name}"
    if not key_columns:
        raise InvalidPubSubInput(f"table: {qualified} has no primary key; a backfill pages through its rows by it")
    batch = {
        first: _batch_statement(Identifier(table_schema, table_name), key_columns, spec.where, first=first)
        for first in (True, False)
    }
    params = {"branch_id": spec.branch_id, "topic": spec.topic or qualified, "limit": spec.batch_size}
    check_predicate(db, batch[False], {**params, "last_key": None}, field="where", predicate=spec.where)
    with db.connection() as conn:
        backfill_id = conn.execute(
            sql.START_BACKFILL,
            {
                "table": qualified,
                "branch_id": spec.branch_id,
                "topic": params["topic"],
                "predicate": spec.where,
                "batch_size": spec.batch_size,
                "key_columns": key_columns,
            },
        ).fetchone()[0]
        conn.execute(sql.RESUME_BACKFILL, {"id": backfill_id, "batch_size": spec.batch_size})
    timeout = f"{round(spec.lock_timeout * 1000)}ms"
    waits = 0
    while True:
        try:
            with db.connection() as conn:
                conn.execute(sql.LOCK_TIMEOUT, {"timeout": timeout})
                last_key, state = conn.execute(sql.LOCK_BACKFILL, {"id": backfill_id}).fetchone()
                if state == "done":  # a concurrent call finished it
                    break
                statement = batch[last_key is None]
                rows, new_key = conn.execute(statement, {**params, "last_key": Jsonb(last_key)}).fetchone()
                conn.execute(
                    sql.BACKFILL_PROGRESS,
                    {"id": backfill_id, "rows": rows, "last_key": Jsonb(new_key), "finished": rows < spec.batch_size},
                )
            waits = 0
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
            waits += 1
            if waits >= MAX_LOCK_RETRIES:
                _failed(db, backfill_id, exc)
            time.sleep(PARTITION_BACKOFF.delay(waits - 1))
            continue
        except psycopg.Error as exc:
            _failed(db, backfill_id, exc)
        progress = backfill_progress(db, backfill_id)
        if on_progress is not None:
            on_progress(progress)
        if progress.state == "done":
            break
    progress = backfill_progress(db, backfill_id)
    log.info("backfill %s of %s into branch %s: %s rows", backfill_id, qualified, spec.branch_id, progress.rows_done)
    return progress


def _failed(db: Database, backfill_id: int, exc: BaseException) -> None:
    error = describe_error(exc)
    with db.connection() as conn:
        conn.execute(sql.BACKFILL_FAILED, {"id": backfill_id, "error": error})
    raise BackfillFailed(f"backfill {backfill_id} stopped: {error}; the same call resumes it") from exc


def _batch_statement(table: Identifier, key_columns: list[str], where: str | None, *, first: bool) -> Composed:
    """``sql.BACKFILL_BATCH`` for ``table`` (its key ``key_columns``, the predicate ``where``): the first batch,
    or one after ``%(last_key)s``."""
    keys = [Identifier(name) for name in key_columns]
    from_last = SQL(", ").join(SQL("(SELECT {} FROM last)").format(key) for key in keys)
    after = SQL("TRUE") if first else SQL("({}) > ({})").format(SQL(", ").join(keys), from_last)
    key_object = SQL("jsonb_build_object({})").format(
        SQL(", ").join(SQL("{}, (cmb_row).{}").format(SQLLiteral(name), Identifier(name)) for name in key_columns)
    )
    return sql.BACKFILL_BATCH.format(
        table=table,
        after=after,
        where=SQL(where) if where else SQL("TRUE"),  # type: ignore[arg-type]
        key_order=SQL(", ").join(keys),
        key_object=key_object,
        last_order=SQL(", ").join(SQL("(cmb_row).{} DESC").format(key) for key in keys),
    )
