"""Backfills: the existing rows of a table published into a branch as ``snapshot`` events, batch after batch in
primary key order, while its live changes keep flowing; resumable after a crash from the last batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn

import psycopg
from psycopg.sql import SQL, Composed, Identifier
from psycopg.sql import Literal as SQLLiteral
from psycopg.types.json import Jsonb

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.inputs import shorten
from cmb_dagster.isolation import describe_error
from cmb_dagster.pubsub import sql
from cmb_dagster.pubsub.admin import backfill_progress
from cmb_dagster.pubsub.errors import BackfillFailed, InvalidPubSubInput
from cmb_dagster.pubsub.filters import FILTER_ERRORS, ROW_VARIABLES, check_filter
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
    again: bool = False,
    on_progress: Callable[[BackfillProgress], None] | None = None,
) -> BackfillProgress:
    """Publish the rows of ``table`` (those the SQL/JSON path predicate ``where`` is true for, ``$`` being the row)
    into ``branch_id`` as ``snapshot`` events (topic: ``topic``, default ``'schema.table'``; key: the primary key;
    payload: the row), ``batch_size`` rows per transaction in primary key order; return its progress.

    ``table`` is a name the catalog finds, that the role may read, outside cmb's own schemas and the system's.
    Each batch locks its rows ``FOR SHARE`` and writes their events and its progress in one transaction, so
    the event's id is the row's version (docs/pubsub.md, "Backfill") and a run killed mid-batch leaves
    nothing of that batch. Calling it again with the same table, branch, topic and ``where`` resumes an
    unfinished (interrupted or failed) backfill after its last batch, and returns a done one as it is unless
    ``again`` (then it starts over); concurrent calls take turns per batch. A batch waiting more than
    ``lock_timeout`` seconds for a row a writer holds is rolled back and tried again. A row the filter raises on
    is passed over and counted (``rows_skipped``, ``last_skip``). ``on_progress`` is called after each batch.
    Raises :class:`BackfillFailed` (recorded) on an error.
    """
    spec = BackfillSpec(
        table=table, branch_id=branch_id, where=where, batch_size=batch_size, topic=topic, lock_timeout=lock_timeout
    )
    db = Database.of(database)
    with db.connection() as conn:
        table_schema, table_name = _source(conn, spec.table, db.schema)
        key_columns = [row[0] for row in conn.execute(sql.PRIMARY_KEY_COLUMNS, {"table": spec.table})]
        qualified = f"{table_schema}.{table_name}"
        if not key_columns:
            raise InvalidPubSubInput(f"table: {qualified} has no primary key; a backfill pages through its rows by it")
        check_filter(conn, spec.where, field="where", variables=ROW_VARIABLES)
    statements = _batch_statements(Identifier(table_schema, table_name), key_columns)
    params = {
        "branch_id": spec.branch_id,
        "topic": spec.topic or qualified,
        "limit": spec.batch_size,
        "where": spec.where,
    }
    with db.connection() as conn:
        backfill_id, state = conn.execute(
            sql.START_BACKFILL,
            {
                "table": qualified,
                "branch_id": spec.branch_id,
                "topic": params["topic"],
                "predicate": spec.where,
                "batch_size": spec.batch_size,
                "key_columns": key_columns,
                "again": again,
            },
        ).fetchone()
    if state == "done":
        progress = backfill_progress(db, backfill_id)
        log.info(
            "backfill %s of %s into branch %s was done at %s; again=True (`--again`) publishes its rows again",
            backfill_id,
            qualified,
            spec.branch_id,
            progress.finished_at,
        )
        return progress
    timeout = f"{round(spec.lock_timeout * 1000)}ms"
    waits = 0
    judge_each = False  # after the filter raised on the next batch: judge its rows one by one
    while True:
        try:
            with db.connection() as conn:
                conn.execute(sql.LOCK_TIMEOUT, {"timeout": timeout})
                last_key, state = conn.execute(sql.LOCK_BACKFILL, {"id": backfill_id}).fetchone()
                if state == "done":  # a concurrent call finished it
                    break
                statement = statements[judge_each, last_key is None]
                rows, new_key, skipped, skip, finished = conn.execute(
                    statement, {**params, "last_key": Jsonb(last_key)}
                ).fetchone()
                conn.execute(
                    sql.BACKFILL_PROGRESS,
                    {
                        "id": backfill_id,
                        "rows": rows,
                        "last_key": Jsonb(new_key),
                        "skipped": skipped,
                        "skip": skip,
                        "finished": finished,
                    },
                )
            waits, judge_each = 0, False
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
            waits += 1
            if waits >= MAX_LOCK_RETRIES:
                _failed(db, backfill_id, exc)
            time.sleep(PARTITION_BACKOFF.delay(waits - 1))
            continue
        except FILTER_ERRORS as exc:
            if spec.where is None or judge_each:
                _failed(db, backfill_id, exc)
            log.warning(
                "backfill %s: the filter raised on a row of the next batch (%s); judging its rows one by one",
                backfill_id,
                describe_error(exc),
            )
            judge_each = True
            continue
        except psycopg.Error as exc:
            _failed(db, backfill_id, exc)
        if skipped:
            log.warning(
                "backfill %s: passed over %s rows the filter raised on (the last: %s)", backfill_id, skipped, skip
            )
        progress = backfill_progress(db, backfill_id)
        if on_progress is not None:
            on_progress(progress)
        if progress.state == "done":
            break
    progress = backfill_progress(db, backfill_id)
    log.info("backfill %s of %s into branch %s: %s rows", backfill_id, qualified, spec.branch_id, progress.rows_done)
    return progress


def _source(conn: psycopg.Connection, table: str, cmb_schema: str) -> tuple[str, str]:
    """The schema and name of the table a backfill may read as ``table``, or :class:`InvalidPubSubInput`."""
    try:
        with conn.transaction():
            info = conn.execute(sql.BACKFILL_SOURCE, {"table": table, "schema": cmb_schema}).fetchone()
    except (psycopg.DataError, psycopg.ProgrammingError, psycopg.NotSupportedError) as exc:  # not a name: "a b",
        # too many dots, another database's: Postgres's parser says why
        reason = exc.diag.message_primary
        raise InvalidPubSubInput(f"table: no table named {shorten(table)} on the search_path ({reason})") from None
    if info is None or info[2] not in ("r", "p"):
        raise InvalidPubSubInput(f"table: no table named {shorten(table)} on the search_path")
    table_schema, table_name, _, reserved, readable = info
    if reserved:
        raise InvalidPubSubInput(
            f"table: {table_schema}.{table_name} belongs to cmb or the system; a backfill publishes your own tables"
        )
    if not readable:
        raise InvalidPubSubInput(f"table: the role may not read {table_schema}.{table_name} (SELECT)")
    return table_schema, table_name


def _failed(db: Database, backfill_id: int, exc: BaseException) -> NoReturn:
    error = describe_error(exc)
    with db.connection() as conn:
        conn.execute(sql.BACKFILL_FAILED, {"id": backfill_id, "error": error})
    raise BackfillFailed(f"backfill {backfill_id} stopped: {error}; the same call resumes it") from exc


def _batch_statements(table: Identifier, key_columns: list[str]) -> dict[tuple[bool, bool], Composed]:
    """The batch statements of ``table`` (its key ``key_columns``) by (judged one by one, first batch): the first
    batch, or one after ``%(last_key)s``."""
    keys = [Identifier(name) for name in key_columns]
    from_last = SQL(", ").join(SQL("(SELECT {} FROM last)").format(key) for key in keys)
    key_object = SQL("jsonb_build_object({})").format(
        SQL(", ").join(SQL("{}, (cmb_row).{}").format(SQLLiteral(name), Identifier(name)) for name in key_columns)
    )
    parts = {
        "table": table,
        "key_order": SQL(", ").join(keys),
        "key_object": key_object,
        "last_order": SQL(", ").join(SQL("(cmb_row).{} DESC").format(key) for key in keys),
        "judged_key": SQL(", ").join(SQL("(cmb_row).{}").format(key) for key in keys),
    }
    return {
        (judged, first): (sql.BACKFILL_JUDGED_BATCH if judged else sql.BACKFILL_BATCH).format(
            after=SQL("TRUE") if first else SQL("({}) > ({})").format(SQL(", ").join(keys), from_last), **parts
        )
        for judged in (False, True)
        for first in (True, False)
    }
