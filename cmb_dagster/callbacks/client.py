"""The callbacks API: create, read, change and clean events and schedules."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Self

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError

from cmb_dagster._gc import cyclic_collection_paused
from cmb_dagster.callbacks import admin, sql
from cmb_dagster.callbacks.admin import set_bucket_count
from cmb_dagster.callbacks.errors import (
    CallbackConflict,
    CallbackInvalidState,
    CallbackNotFound,
    InvalidCallbackInput,
)
from cmb_dagster.callbacks.hosts import check_url
from cmb_dagster.callbacks.models import (
    ENVELOPE,
    MAX_TTL_DAYS,
    WAITING_STATUSES,
    Body,
    CallbackEvent,
    CallbackSchedule,
    CallbackSettings,
    CallbackStatus,
    CatchUp,
    EndpointHealth,
    EndpointPolicy,
    NewCallback,
    NewSchedule,
    RetryPolicy,
    check_context,
    check_key,
    check_many,
    check_run_at,
    validated,
)
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.worker import bucket_ids
from cmb_dagster.callbacks.writer import EventWriter, create_connection, insert_events, insert_new_events
from cmb_dagster.database import Database, DatabaseSource, connection_for
from cmb_dagster.inputs import check_int, refused_input

CLEAN_BATCH = 10_000
CREATE_CHUNK = 250  # events per insert statement of create_many
MAX_LISTED = 100_000  # events one list() returns at most


@dataclass(frozen=True)
class CleanReport:
    """What :meth:`CallbackClient.clean` removed."""

    events: int
    change_log: int
    fire_times: int


class CallbackClient:
    """Creates and manages callbacks in the cmb database (a :class:`Database` or a Postgres URL).

    ``create`` calls from many threads are buffered and written together (one multi-row insert per
    batch); each call returns once its own row is committed.
    """

    def __init__(
        self,
        database: DatabaseSource,
        settings: CallbackSettings | None = None,
        *,
        schema: str | None = None,
        buffered: bool = True,
    ) -> None:
        self.db = Database.of(database, schema=schema)
        self.settings = settings or CallbackSettings()
        self._writer = EventWriter(self.db, self.settings) if buffered else None

    def close(self) -> None:
        """Stop the write buffer (a database given by URL is the process's shared one: it stays open)."""
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- events ------------------------------------------------------------------------------------

    def create(
        self,
        owner_client_id: str,
        group_key: str,
        event_key: str,
        run_at: datetime,
        cb_url: str,
        context: Any = None,
        retry: RetryPolicy | dict[str, Any] | None = None,
        body: Body = ENVELOPE,
        priority: int = 0,
        on_failure: str | None = None,
        endpoint: str | None = None,
        *,
        conn: psycopg.Connection | None = None,
    ) -> int:
        """Schedule a call of ``cb_url`` at ``run_at`` (timezone-aware); return the event id.

        With ``conn`` (any connection of yours) the event is part of its transaction: it exists, and is called,
        only if that commits; so do :meth:`create_many`, :meth:`update` and :meth:`cancel`.

        The request's body is the envelope (the event's keys, times, attempt and ``context``), or with
        ``body="context"`` the context alone (a receiver with a fixed format, e.g. a chat webhook). Among
        callbacks due, those of higher ``priority`` (-1000 to 1000) are called first, within the limits.
        ``on_failure`` (an http(s) URL or ``dagster://<job>``; default: the owner's failure hook) is called once
        if the event fails for good. ``endpoint`` names the endpoint whose circuit breaker its calls count for (default:
        its URL without the query).

        Creating an existing key again with the same payload returns the existing id; with another
        payload it raises CallbackConflict. Waiting longer than ``settings.create_timeout`` (for a
        connection, a lock or the commit) raises CallbackTimeout.
        """
        event = self._new({k: v for k, v in locals().items() if k != "conn"})
        with refused_input(InvalidCallbackInput, "event", conn=conn):
            if conn is None and self._writer is not None:
                return self._writer.write(event)
            return self._insert([event], conn)[0]

    def create_many(
        self, events: Iterable[NewCallback | dict[str, Any]], *, conn: psycopg.Connection | None = None
    ) -> list[int]:
        """Create several events in one transaction: all of them, or (on any error) none.

        Waiting longer than ``settings.create_timeout`` for a connection or a lock raises CallbackTimeout.
        """
        with refused_input(InvalidCallbackInput, "events", conn=conn):
            return self._insert(events, conn)

    def _insert(self, events: Iterable[NewCallback | dict[str, Any]], caller: psycopg.Connection | None) -> list[int]:
        soon, lock_timeout = self.settings.wake_within, self.settings.create_timeout
        with cyclic_collection_paused():  # a batch's thousands of objects are freed when it returns
            events = list(events)
            if not events:
                return []
            with create_connection(self.db, self.settings, caller) as conn:
                try:  # Postgres inserts a chunk while the next is validated
                    return insert_new_events(conn, self._checked_chunks(events), soon=soon, lock_timeout=lock_timeout)
                except psycopg.errors.UniqueViolation:
                    pass  # a key exists, or comes twice: written again, each key compared with the stored one
                with conn.transaction():  # a conflict raised in it writes nothing
                    results = insert_events(
                        conn, self._new_many(events), soon=soon, lock_timeout=lock_timeout, some_taken=True
                    )
                    for result in results:
                        if isinstance(result, Exception):
                            raise result
        return results  # type: ignore[return-value]

    @refused_input(InvalidCallbackInput, "arguments")
    def get(self, owner_client_id: str, group_key: str, event_key: str) -> CallbackEvent:
        """The event with these keys (CallbackNotFound if there is none)."""
        with self.db.connection() as conn:
            keys = _keys(owner_client_id, group_key, event_key)
            row = conn.cursor(row_factory=dict_row).execute(sql.GET_EVENT, keys).fetchone()
        if row is None:
            raise CallbackNotFound(_missing(owner_client_id, group_key, event_key))
        return CallbackEvent.model_validate(row)

    @refused_input(InvalidCallbackInput, "arguments")
    def list(
        self,
        owner_client_id: str | None = None,
        group_key: str | None = None,
        status: CallbackStatus | str | None = None,
        limit: int = 100,
    ) -> list[CallbackEvent]:
        """Events by run_at, filtered by owner, group and status."""
        if status is not None:
            status = validated(_StatusFilter, {"status": status}).status.value
        params = {
            "owner": None if owner_client_id is None else check_key(owner_client_id, "owner_client_id"),
            "group": None if group_key is None else check_key(group_key, "group_key"),
            "status": status,
            "limit": check_int(limit, "limit", low=1, high=MAX_LISTED, error=InvalidCallbackInput),
        }
        with self.db.connection() as conn:
            rows = conn.cursor(row_factory=dict_row).execute(sql.LIST_EVENTS, params).fetchall()
        return [CallbackEvent.model_validate(r) for r in rows]

    @refused_input(InvalidCallbackInput, "arguments")
    def update(
        self,
        owner_client_id: str,
        group_key: str,
        event_key: str,
        *,
        run_at: datetime | None = None,
        originally_run_at: datetime | None = None,
        cb_url: str | None = None,
        context: Any = None,
        i_ensure_pending: bool = False,
        conn: psycopg.Connection | None = None,
    ) -> CallbackEvent:
        """Change a pending event's run_at, originally_run_at (defaults to the new run_at), cb_url or context (one
        held or disabled by its endpoint is pending again).

        A cancelled event can be changed too with ``i_ensure_pending=True``, which makes it pending again.
        """
        changes = validated(
            _Update, {"run_at": run_at, "originally_run_at": originally_run_at, "cb_url": cb_url, "context": context}
        )
        if changes.cb_url is not None:
            check_url(changes.cb_url, self.settings)
        for field in ("run_at", "originally_run_at"):
            if getattr(changes, field) is not None:
                check_run_at(getattr(changes, field), field)
        with connection_for(conn, self.db) as conn:
            conn.execute(sql.LOCK_EVENT_IDS, {"lock_timeout": "0"})  # before the new id is drawn
            before = self._lock(conn, owner_client_id, group_key, event_key)
            allowed = before["status"] in WAITING_STATUSES or (before["status"] == "cancelled" and i_ensure_pending)
            if not allowed:
                revivable = before["status"] == "cancelled"
                hint = " (pass i_ensure_pending=True to revive a cancelled one)" if revivable else ""
                raise CallbackInvalidState(
                    f"{_name(owner_client_id, group_key, event_key)} is {before['status']}: only pending events can be "
                    f"updated{hint}"
                )
            new_run_at = changes.run_at or before["run_at"]
            url = changes.cb_url or before["cb_url"]
            new_context = before["context"] if context is None else changes.context
            params = {
                "event_id": before["event_id"],
                "run_at": new_run_at,
                "originally_run_at": changes.originally_run_at or changes.run_at or before["originally_run_at"],
                "cb_url": url,
                "context": check_context(new_context, self.settings, url),
            }
            after = conn.cursor(row_factory=dict_row).execute(sql.UPDATE_EVENT, params).fetchone()
            _log(conn, "update", before, after)
            if after["run_at"] <= datetime.now(UTC) + timedelta(seconds=self.settings.wake_within):
                conn.execute(sql.NOTIFY, {"payload": f"{after['bucket_id']}:{after['run_at'].timestamp()}"})
        return CallbackEvent.model_validate(after)

    @refused_input(InvalidCallbackInput, "arguments")
    def cancel(
        self, owner_client_id: str, group_key: str, event_key: str, *, conn: psycopg.Connection | None = None
    ) -> CallbackEvent:
        """Cancel a pending event, or one held or disabled by its endpoint (CallbackInvalidState for any other
        status)."""
        with connection_for(conn, self.db) as conn:
            before = self._lock(conn, owner_client_id, group_key, event_key)
            if before["status"] not in WAITING_STATUSES:
                raise CallbackInvalidState(
                    f"{_name(owner_client_id, group_key, event_key)} is {before['status']}: "
                    "only pending events can be cancelled"
                )
            cursor = conn.cursor(row_factory=dict_row)
            after = cursor.execute(sql.CANCEL_EVENT, {"event_id": before["event_id"]}).fetchone()
            _log(conn, "cancel", before, after)
        return CallbackEvent.model_validate(after)

    @refused_input(InvalidCallbackInput, "arguments")
    def delete(self, owner_client_id: str, group_key: str, event_key: str, *, force: bool = False) -> None:
        """Delete an event; a pending one due within a minute only with ``force=True``."""
        with self.db.connection() as conn:
            before = self._lock(conn, owner_client_id, group_key, event_key)
            if before["status"] == "pending" and before["due_soon"] and not force:
                raise CallbackInvalidState(
                    f"{_name(owner_client_id, group_key, event_key)} is pending and due within 1 minute "
                    f"(run_at {before['run_at'].isoformat()}): pass force=True to delete it anyway"
                )
            conn.execute(sql.DELETE_EVENT, {"event_id": before["event_id"]})
            _log(conn, "delete", before, None)

    def change_log(self, owner_client_id: str, group_key: str, event_key: str) -> list[dict[str, Any]]:
        """User changes of this event, oldest first: action, time, and the event before and after."""
        with self.db.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(sql.CHANGE_LOG, _keys(owner_client_id, group_key, event_key)).fetchall()

    # -- endpoints (circuit breakers) ----------------------------------------------------------------

    def endpoints(
        self, owner_client_id: str | None = None, *, state: str | None = None, limit: int = 100
    ) -> list[EndpointHealth]:
        """The endpoints' health (of one owner, in one state: closed, open or disabled), disabled first."""
        return admin.endpoints(self.db, owner_client_id, state=state, limit=limit)

    def enable_endpoint(self, owner_client_id: str, endpoint: str) -> int:
        """Close the owner's endpoint (a URL of it) and send its held and disabled events again; return how many."""
        return admin.enable_endpoint(self.db, owner_client_id, endpoint)

    def disable_endpoint(self, owner_client_id: str, endpoint: str) -> int:
        """Keep the events of the owner's endpoint (a URL of it) as disabled until it is enabled."""
        return admin.disable_endpoint(self.db, owner_client_id, endpoint)

    def set_endpoint_policy(self, owner_client_id: str, policy: EndpointPolicy | None) -> None:
        """The circuit breaker policy of the owner's endpoints (None: the workers' default)."""
        admin.set_endpoint_policy(self.db, owner_client_id, policy)

    # -- dead letters, failure hooks, signing secrets -------------------------------------------------

    def failed(
        self,
        owner_client_id: str | None = None,
        group_key: str | None = None,
        event_key: str | None = None,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 1000,
    ) -> list[CallbackEvent]:
        """Events that failed for good (dead letters), oldest failure first, failed within [since, until): with
        their last error, status code and response excerpt."""
        return admin.failed(self.db, **_selection(locals()))

    def replay(
        self,
        owner_client_id: str | None = None,
        group_key: str | None = None,
        event_key: str | None = None,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 1000,
    ) -> int:
        """Send dead letters again (those :meth:`failed` lists, ``limit`` at most); return how many.

        Each is pending again, due now, for a new round of its retry policy with the same webhook-id
        (:func:`cmb_dagster.callbacks.admin.replay`).
        """
        return admin.replay(self.db, **_selection(locals()))

    def set_failure_hook(self, owner_client_id: str, url: str | None) -> None:
        """Call ``url`` once when an event of the owner without its own ``on_failure`` fails for good (None: no
        hook)."""
        admin.set_failure_hook(self.db, owner_client_id, url, self.settings)

    def rotate_secret(
        self,
        owner_client_id: str,
        secret: str | None = None,
        *,
        previous_valid_for: float | None = 86400.0,
        kind: admin.SecretKind | None = None,
    ) -> str:
        """Sign the owner's callbacks with ``secret`` (HMAC ``whsec_<base64>`` or ed25519 ``whsk_<base64>``;
        default: a new random one of ``kind``, HMAC unless told) and return what receivers verify with: the HMAC
        secret, or the ed25519 public key ``whpk_<base64>``. The previous secret signs too for
        ``previous_valid_for`` seconds (None: until retired)."""
        return admin.rotate_secret(self.db, owner_client_id, secret, previous_valid_for=previous_valid_for, kind=kind)

    def retire_secrets(self, owner_client_id: str, *, keep_newest: bool = True) -> int:
        """Stop signing with the owner's older secret (``keep_newest=False``: with any); return how many."""
        return admin.retire_secrets(self.db, owner_client_id, keep_newest=keep_newest)

    # -- schedules ---------------------------------------------------------------------------------

    @refused_input(InvalidCallbackInput, "schedule")
    def create_schedule(
        self,
        owner_client_id: str,
        group_key: str,
        schedule_key: str,
        cron: str,
        cb_url: str,
        *,
        timezone: str = "UTC",
        context: Any = None,
        retry: RetryPolicy | dict[str, Any] | None = None,
        horizon: float = 3600.0,
        catch_up: CatchUp = "latest",
        catch_up_limit: int = 100,
        misfire_grace: float = 60.0,
    ) -> CallbackSchedule:
        """Create a cron schedule: one event per fire time, materialized ``horizon`` seconds ahead.

        Fire times missed while no worker called them (their call not started ``misfire_grace`` seconds after
        them) follow ``catch_up``: ``"none"`` skips them, ``"latest"`` calls the most recent one, ``"all"`` the
        ``catch_up_limit`` most recent ones. The same keys with the same definition return the existing
        schedule; another definition conflicts.
        """
        data = {k: v for k, v in locals().items() if k != "self" and v is not None}
        new = validated(NewSchedule, data).check(self.settings)
        params = {
            "owner": new.owner_client_id,
            "group": new.group_key,
            "key": new.schedule_key,
            "cron": new.cron,
            "timezone": new.timezone,
            "cb_url": new.cb_url,
            "context": check_context(new.context, self.settings, new.cb_url),
            "retry": new.retry.model_dump_json(),
            "horizon": int(new.horizon),
            "catch_up": new.catch_up,
            "catch_up_limit": new.catch_up_limit,
            "misfire_grace": math.ceil(new.misfire_grace),
        }
        with self.db.connection() as conn:
            row = conn.cursor(row_factory=dict_row).execute(sql.INSERT_SCHEDULE, params).fetchone()
        if row is not None:
            return CallbackSchedule.model_validate(row)
        existing = self.get_schedule(new.owner_client_id, new.group_key, new.schedule_key)
        definition = {"cron", "timezone", "cb_url", "context", "retry", "horizon", "catch_up", "catch_up_limit"}
        wanted = new.model_dump(include=definition) | {"horizon": params["horizon"]}
        wanted["misfire_grace"] = params["misfire_grace"]
        same = existing.model_dump(include=definition | {"misfire_grace"}) == wanted
        if not same:
            raise CallbackConflict(
                f"schedule {new.owner_client_id}/{new.group_key}/{new.schedule_key} exists with another definition"
            )
        return existing

    def get_schedule(self, owner_client_id: str, group_key: str, schedule_key: str) -> CallbackSchedule:
        """The schedule with these keys (CallbackNotFound if there is none)."""
        with self.db.connection() as conn:
            row = (
                conn.cursor(row_factory=dict_row)
                .execute(sql.GET_SCHEDULE, _keys(owner_client_id, group_key, schedule_key, "schedule_key"))
                .fetchone()
            )
        if row is None:
            raise CallbackNotFound(f"no schedule {owner_client_id}/{group_key}/{schedule_key}")
        return CallbackSchedule.model_validate(row)

    def list_schedules(self, owner_client_id: str | None = None) -> list[CallbackSchedule]:
        """Schedules, optionally of one owner."""
        with self.db.connection() as conn:
            owner = None if owner_client_id is None else check_key(owner_client_id, "owner_client_id")
            rows = conn.cursor(row_factory=dict_row).execute(sql.LIST_SCHEDULES, {"owner": owner}).fetchall()
        return [CallbackSchedule.model_validate(r) for r in rows]

    def pause_schedule(self, owner_client_id: str, group_key: str, schedule_key: str) -> None:
        """Stop a schedule: its future events are removed until it is resumed."""
        self._change_schedule(owner_client_id, group_key, schedule_key, sql.PAUSE_SCHEDULE)

    def resume_schedule(self, owner_client_id: str, group_key: str, schedule_key: str) -> None:
        """Restart a paused schedule from now on (fire times missed while paused do not fire)."""
        self._change_schedule(owner_client_id, group_key, schedule_key, sql.RESUME_SCHEDULE)

    def delete_schedule(self, owner_client_id: str, group_key: str, schedule_key: str) -> None:
        """Delete a schedule and its future events (events already due or done stay)."""
        self._change_schedule(owner_client_id, group_key, schedule_key, sql.DELETE_SCHEDULE)

    def materialize_schedules(self) -> int:
        """Create the events of every active schedule up to its horizon; return how many were created."""
        return materialize_schedules(self.db)

    # -- buckets and cleanup -----------------------------------------------------------------------

    def bucket_ids(self) -> list[int]:
        """The buckets events are spread over."""
        return bucket_ids(self.db)

    def set_bucket_count(self, count: int) -> list[int]:
        """Set the number of buckets (1 to 4,096) while workers run; return the bucket ids.

        Raising adds empty buckets. Lowering moves the pending events of the removed ones to the rest,
        each called once (see :func:`cmb_dagster.callbacks.admin.set_bucket_count`).
        """
        return set_bucket_count(self.db, count, move_batch=self.settings.move_batch)

    def clean(self, ttl_days: int = 30) -> CleanReport:
        """Delete finished events whose run_at is older than ``ttl_days``, and change_log entries as old."""
        ttl = validated(_Clean, {"ttl_days": ttl_days}).ttl_days
        counts = []
        for statement in (sql.CLEAN_EVENTS, sql.CLEAN_CHANGE_LOG):
            total = 0
            while True:
                with self.db.connection() as conn:
                    deleted = conn.execute(statement, {"ttl_days": ttl, "limit": CLEAN_BATCH}).rowcount
                total += deleted
                if deleted < CLEAN_BATCH:
                    break
            counts.append(total)
        with self.db.connection() as conn:
            fire_times = conn.execute(sql.CLEAN_SCHEDULED_EVENTS, {"ttl_days": ttl}).rowcount
            conn.execute(sql.CLEAN_ENDPOINTS, {"ttl_days": ttl})
        return CleanReport(events=counts[0], change_log=counts[1], fire_times=fire_times)

    # -- helpers -----------------------------------------------------------------------------------

    def _new(self, data: dict[str, Any]) -> NewCallback:
        data = {k: v for k, v in data.items() if k != "self" and not (k == "retry" and v is None)}
        return validated(NewCallback, data).check(self.settings)

    def _new_many(self, events: list[NewCallback | dict[str, Any]]) -> list[NewCallback]:
        """Validate ``events`` in one pass; on a problem, one at a time, so the error names the bad field."""
        try:
            given = [e if isinstance(e, NewCallback) else _without_null_retry(e) for e in events]
            rows = _NEW_CALLBACKS.validate_python(given)
        except (ValidationError, TypeError, AttributeError):
            return [e.check(self.settings) if isinstance(e, NewCallback) else self._new(e) for e in events]
        return check_many(rows, self.settings)

    def _checked_chunks(self, events: list[NewCallback | dict[str, Any]]) -> Iterator[list[NewCallback]]:
        for start in range(0, len(events), CREATE_CHUNK):
            yield self._new_many(events[start : start + CREATE_CHUNK])

    def _lock(self, conn: psycopg.Connection, owner: str, group: str, key: str) -> dict[str, Any]:
        row = conn.cursor(row_factory=dict_row).execute(sql.LOCK_EVENT, _keys(owner, group, key)).fetchone()
        if row is None:
            raise CallbackNotFound(_missing(owner, group, key))
        return row

    def _change_schedule(self, owner: str, group: str, key: str, statement: str) -> None:
        with self.db.connection() as conn:
            row = conn.execute(sql.LOCK_SCHEDULE, _keys(owner, group, key, "schedule_key")).fetchone()
            if row is None:
                raise CallbackNotFound(f"no schedule {owner}/{group}/{key}")
            if statement in (sql.PAUSE_SCHEDULE, sql.DELETE_SCHEDULE):
                conn.execute(sql.DROP_FUTURE_EVENTS, {"schedule_id": row[0]})
            conn.execute(statement, {"schedule_id": row[0]})


_NEW_CALLBACKS = TypeAdapter(list[NewCallback])


def _selection(arguments: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~cmb_dagster.callbacks.models.DeadLetters` selection of a method's arguments."""
    return {k: v for k, v in arguments.items() if k != "self"}


def _without_null_retry(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "retry" or v is not None} if "retry" in event else event


def _log(conn: psycopg.Connection, action: str, before: dict[str, Any], after: dict[str, Any] | None) -> None:
    def snapshot(row: dict[str, Any] | None) -> Jsonb | None:
        if row is None:
            return None
        return Jsonb(CallbackEvent.model_validate(row).model_dump(mode="json"))

    conn.execute(
        sql.LOG_CHANGE,
        {
            "action": action,
            "event_id": before["event_id"],
            "owner": before["owner_client_id"],
            "group": before["group_key"],
            "key": before["event_key"],
            "before": snapshot(before),
            "after": snapshot(after),
        },
    )


def _keys(owner: str, group: str, key: str, key_field: str = "event_key") -> dict[str, str]:
    """The keys of an event (or a schedule, ``key_field`` naming its key) to look up, checked."""
    return {
        "owner": check_key(owner, "owner_client_id"),
        "group": check_key(group, "group_key"),
        "key": check_key(key, key_field),
    }


def _name(owner: str, group: str, key: str) -> str:
    return f"event {owner}/{group}/{key}"


def _missing(owner: str, group: str, key: str) -> str:
    return f"no {_name(owner, group, key)}"


class _Update(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_at: AwareDatetime | None
    originally_run_at: AwareDatetime | None
    cb_url: str | None = Field(min_length=1, max_length=2048)
    context: JsonValue = None

    def model_post_init(self, _: Any) -> None:
        if all(v is None for v in (self.run_at, self.originally_run_at, self.cb_url, self.context)):
            raise InvalidCallbackInput("update: give at least one of run_at, originally_run_at, cb_url, context")


class _StatusFilter(BaseModel):
    status: CallbackStatus


class _Clean(BaseModel):
    ttl_days: int = Field(ge=0, le=MAX_TTL_DAYS)
