"""Producing events: capture triggers on any table, and publish() for the transactional outbox."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Composable, Identifier
from psycopg.sql import Literal as SQLLiteral

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.inputs import check_int, check_text, refused_input, to_json
from cmb_dagster.pubsub import sql
from cmb_dagster.pubsub.errors import InvalidPubSubInput, StreamRestored
from cmb_dagster.pubsub.models import CaptureSpec
from cmb_dagster.settings import Settings

_TRANSITION = {"insert": "NEW", "update": "NEW", "delete": "OLD"}
MAX_TOPIC_LENGTH = 500
NO_EVENTS_TABLE = (
    "schema: no pubsub_events table on the search_path; "
    "check CMB_SCHEMA (or pass schema=) and that cmb_dagster's migrations ran here"
)


def install_capture(
    conn: psycopg.Connection,
    table: str,
    branch: str = "0",
    *,
    key: Sequence[str] | None = None,
    columns: Sequence[str] | None = None,
    topic: str | None = None,
    ops: Sequence[Literal["insert", "update", "delete"]] = ("insert", "update"),
    schema: str | None = None,
) -> CaptureSpec:
    """Make every insert/update (and, if asked, delete) of ``table`` an event, in the writer's transaction.

    ``branch`` is an SQL expression over the row's columns (and ``TG_OP``) giving the event's branch id;
    when it is NULL the row makes no event. Installing again replaces the previous capture.
    ``schema`` is the cmb schema (default: the one on ``conn``'s search_path).
    """
    spec = CaptureSpec(
        table=table,
        branch=branch,
        key=None if key is None else tuple(key),
        columns=None if columns is None else tuple(columns),
        topic=topic,
        ops=tuple(ops),
    )
    cmb = Identifier(cmb_schema(conn, schema))
    with conn.transaction():
        info = conn.execute(sql.TABLE_INFO, {"table": spec.table}).fetchone()
        if info is None or info[2] not in ("r", "p"):
            raise InvalidPubSubInput(f"table: no table named {spec.table!r} on the search_path")
        table_schema, table_name, _ = info
        qualified = Identifier(table_schema, table_name)
        existing = [row[0] for row in conn.execute(sql.TABLE_COLUMNS, {"table": spec.table})]
        key_columns = (
            spec.key
            if spec.key is not None
            else tuple(row[0] for row in conn.execute(sql.PRIMARY_KEY_COLUMNS, {"table": spec.table}))
        )
        for field, names in (("key", key_columns), ("columns", spec.columns or ())):
            missing = [name for name in names if name not in existing]
            if missing:
                raise InvalidPubSubInput(f"{field}: no column {missing[0]!r} in table {table_schema}.{table_name}")
        branch_sql = SQL(spec.branch)
        try:
            with conn.transaction():
                conn.execute(sql.CHECK_BRANCH.format(branch=branch_sql, table=qualified))
        except psycopg.Error as exc:
            reason = (exc.diag.message_primary or str(exc)).strip()
            raise InvalidPubSubInput(
                f"branch: {spec.branch!r} is not a bigint expression over {table_name}'s columns ({reason})"
            ) from None
        function = Identifier(_function_name(table_schema, table_name))
        conn.execute(
            sql.CAPTURE_FUNCTION.format(
                cmb=cmb,
                function=function,
                table_schema=Identifier(table_schema),
                topic=SQLLiteral(spec.topic or f"{table_schema}.{table_name}"),
                branch=branch_sql,
                key=_json_object(key_columns),
                payload=_json_object(spec.columns) if spec.columns else SQL("to_jsonb(captured_row)"),
            )
        )
        for op in ("insert", "update", "delete"):
            trigger = Identifier(f"cmb_pubsub_{op}")
            conn.execute(sql.DROP_TRIGGER.format(trigger=trigger, table=qualified))
            if op in spec.ops:
                conn.execute(
                    sql.CAPTURE_TRIGGER.format(
                        trigger=trigger,
                        op=SQL(op.upper()),
                        table=qualified,
                        transition=SQL(_TRANSITION[op]),
                        cmb=cmb,
                        function=function,
                    )
                )
    return spec


def remove_capture(conn: psycopg.Connection, table: str, *, schema: str | None = None) -> None:
    """Remove what :func:`install_capture` installed on ``table`` (its past events stay on the stream)."""
    cmb = Identifier(cmb_schema(conn, schema))
    with conn.transaction():
        info = conn.execute(sql.TABLE_INFO, {"table": table}).fetchone()
        if info is None:
            raise InvalidPubSubInput(f"table: no table named {table!r} on the search_path")
        qualified = Identifier(info[0], info[1])
        for op in ("insert", "update", "delete"):
            conn.execute(sql.DROP_TRIGGER.format(trigger=Identifier(f"cmb_pubsub_{op}"), table=qualified))
        conn.execute(sql.DROP_CAPTURE_FUNCTION.format(cmb=cmb, function=Identifier(_function_name(info[0], info[1]))))


def publish(
    branch_id: int | psycopg.Connection,
    payload: Any,
    *legacy: Any,
    topic: str = "default",
    key: dict[str, Any] | None = None,
    conn: psycopg.Connection | None = None,
    db: DatabaseSource | None = None,
    schema: str | None = None,
) -> int:
    """Publish ``payload`` (JSON) on ``branch_id``; return the event's id.

    With ``conn`` (any connection of yours) the event is written in its transaction: it exists only if that
    commits (a refusal aborts that transaction). Otherwise it commits at once on ``db`` (default: the database
    of the environment). ``schema`` is the cmb schema (default: ``db``'s, else ``CMB_SCHEMA``).

    Raises :class:`StreamRestored` (and writes nothing) after a pg_dump/pg_restore into another
    cluster until ``cmb-dagster pubsub reset`` has run; captured tables refuse their writes likewise.
    ``publish(conn, branch_id, payload)`` is deprecated: ``publish(branch_id, payload, conn=conn)``."""
    legacy_form = isinstance(branch_id, psycopg.Connection)
    if len(legacy) != int(legacy_form):
        raise TypeError("publish() takes branch_id and payload as its positional arguments (conn= as a keyword)")
    if legacy_form:
        warnings.warn(
            "publish(conn, branch_id, payload) is deprecated: publish(branch_id, payload, conn=conn)",
            DeprecationWarning,
            stacklevel=2,
        )
        conn, branch_id, payload = branch_id, payload, legacy[0]
    check_int(branch_id, "branch_id", error=InvalidPubSubInput)
    check_text(topic, "topic", max_length=MAX_TOPIC_LENGTH, error=InvalidPubSubInput)
    if key is not None and not isinstance(key, dict):
        raise InvalidPubSubInput(f"key: must be a JSON object or None, not {type(key).__name__}")
    database = Database.of(db) if db is not None else None
    schema = schema or (database.schema if database is not None else Settings.from_env().schema_name)
    params = {
        "branch_id": branch_id,
        "topic": topic,
        "key": None if key is None else to_json(key, "key", error=InvalidPubSubInput),
        "payload": to_json(payload, "payload", error=InvalidPubSubInput),
    }
    if conn is not None:
        return _publish(conn, schema, params)
    with (database or Database.shared()).connection(autocommit=True) as own:  # one statement, its own commit
        return _publish(own, schema, params)


def _publish(conn: psycopg.Connection, schema: str, params: dict[str, Any]) -> int:
    """The insert of one event, the table named with its schema: on any connection, in its transaction."""
    events = Identifier(schema, "pubsub_events")
    try:
        with refused_input(InvalidPubSubInput, "event", conn=conn):
            statement = sql.PUBLISH.format(events=events)
            return conn.cursor(row_factory=tuple_row).execute(statement, params).fetchone()[0]
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:
        raise StreamRestored(f"{exc.diag.message_primary}; stop the producers, run it once, then start again") from None
    except psycopg.errors.UndefinedTable:
        raise InvalidPubSubInput(NO_EVENTS_TABLE) from None


def cmb_schema(conn: psycopg.Connection, schema: str | None = None) -> str:
    """``schema``, or the schema of the ``pubsub_events`` table on ``conn``'s search_path."""
    if schema is not None:
        return schema
    row = conn.execute(sql.EVENTS_TABLE).fetchone()
    if row is None:
        raise InvalidPubSubInput(NO_EVENTS_TABLE)
    return row[0]


def _json_object(columns: Sequence[str]) -> Composable:
    if not columns:
        return SQL("NULL::jsonb")
    pairs = SQL(", ").join(SQL("{}, captured_row.{}").format(SQLLiteral(name), Identifier(name)) for name in columns)
    return SQL("jsonb_build_object({})").format(pairs)


IDENTIFIER_BYTES = 63  # Postgres keeps this many bytes of a name and drops the rest


def _function_name(table_schema: str, table_name: str) -> str:
    """The table's own trigger function: a hash of the qualified name first, then as much of the name as fits."""
    digest = hashlib.sha256(f"{table_schema}\0{table_name}".encode()).hexdigest()[:16]
    head = f"pubsub_capture_{digest}_"
    room = IDENTIFIER_BYTES - len(head)
    readable = table_name.encode()[:room].decode(errors="ignore")  # cut at a character boundary
    return head + readable
