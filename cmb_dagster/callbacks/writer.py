"""Writing new events: one multi-row insert per batch, under the lock that orders event ids."""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import UTC
from typing import Any

import psycopg
import psycopg_pool
import pydantic_core
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.errors import CallbackConflict, CallbackTimeout
from cmb_dagster.callbacks.models import ENVELOPE, CallbackSettings, NewCallback, RetryPolicy
from cmb_dagster.database import Database, OwnConnection, joined

log = logging.getLogger("cmb_dagster.callbacks")


class EventWriter:
    """Buffers creates from many threads and writes each batch as one multi-row insert.

    ``write_connections`` threads take turns: one gathers a batch while the others write theirs, so
    several commits wait for the disk at once. A batch is written when ``write_batch_size`` creates are
    waiting, or when ``write_linger`` seconds passed since its first (0, the default: at once). Each
    caller gets its id only after its batch committed, or CallbackTimeout after ``create_timeout``.
    """

    def __init__(self, db: Database, settings: CallbackSettings) -> None:
        self.db = db
        self.settings = settings
        self._queue: queue.SimpleQueue[tuple[NewCallback, Future[int]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._gathering = threading.Lock()  # one thread gathers a batch at a time

    def write(self, event: NewCallback) -> int:
        """Queue ``event`` and wait until it is committed; return its id (or raise its error)."""
        future: Future[int] = Future()
        self._ensure_started()
        self._queue.put((event, future))
        try:
            return future.result(timeout=self.settings.create_timeout)
        except TimeoutError:
            if future.cancel():
                raise CallbackTimeout(_timed_out(self.settings, "nothing was written")) from None
            try:  # being written: it may yet commit
                return future.result(timeout=0)
            except TimeoutError:
                raise CallbackTimeout(_timed_out(self.settings, "it may still be written")) from None

    def close(self) -> None:
        """Write what is queued, then stop the writer threads."""
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
            for thread in self._threads:
                thread.join()
            self._threads = []

    def _ensure_started(self) -> None:
        if not self._threads:
            with self._lock:
                if not self._threads:
                    self._threads = [
                        threading.Thread(target=self._loop, name=f"cmb-callback-writer-{n}", daemon=True)
                        for n in range(self.settings.write_connections)
                    ]
                    for thread in self._threads:
                        thread.start()

    def _loop(self) -> None:
        own = OwnConnection(self.db)  # in autocommit: a batch is one statement, one round trip with its commit
        try:
            while True:
                with self._gathering:
                    batch, stop = self._gather()
                if batch:
                    self._flush(own, batch)
                if stop:
                    return
        finally:
            own.close()

    def _gather(self) -> tuple[list[tuple[NewCallback, Future[int]]], bool]:
        first = self._queue.get()
        if first is None:
            return [], True
        batch = [first]
        deadline = time.monotonic() + self.settings.write_linger
        while len(batch) < self.settings.write_batch_size:
            try:
                wait = deadline - time.monotonic()
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _flush(self, own: OwnConnection, batch: list[tuple[NewCallback, Future[int]]]) -> None:
        batch = [item for item in batch if item[1].set_running_or_notify_cancel()]  # timed out callers are gone
        if not batch:
            return
        try:
            results = self._insert(own, [event for event, _ in batch])
        except CallbackTimeout as exc:
            for _, future in batch:
                future.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 - the batch is retried one row at a time: only bad rows fail
            if len(batch) == 1:
                batch[0][1].set_exception(exc)
                return
            log.warning("a batch of %d creates failed (%s): writing them one at a time", len(batch), exc)
            for event, future in batch:
                self._flush_alone(own, event, future)
            return
        for (_, future), result in zip(batch, results, strict=True):
            _settle(future, result)

    def _flush_alone(self, own: OwnConnection, event: NewCallback, future: Future[int]) -> None:
        try:
            result = self._insert(own, [event])[0]
        except Exception as exc:  # noqa: BLE001 - this caller's own error
            result = exc
        _settle(future, result)

    def _insert(self, own: OwnConnection, events: list[NewCallback]) -> list[int | Exception]:
        """Insert on ``own``; a connection that broke is replaced and the batch sent once more (creates are
        idempotent by key: a batch that did commit returns the same ids)."""
        settings = self.settings
        write = functools.partial(insert_events, soon=settings.wake_within, lock_timeout=settings.create_timeout)
        with _lock_wait_limited(self.settings):
            try:
                return write(own.get(), events)
            except (psycopg.OperationalError, psycopg.InterfaceError):
                if not own.lost:
                    raise  # the statement failed, not the connection
                return write(own.get(), events)


def _settle(future: Future[int], result: int | Exception) -> None:
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


@contextmanager
def create_connection(
    db: Database, settings: CallbackSettings, caller: psycopg.Connection | None = None
) -> Iterator[psycopg.Connection]:
    """The ``caller``'s connection joined (see :func:`~cmb_dagster.database.joined`), or a pooled connection for
    creates, in autocommit (see :meth:`Database.connection`): waiting longer than ``create_timeout`` for it, or
    for a lock in it (see :func:`insert_events`), raises CallbackTimeout, and nothing is written."""
    try:
        if caller is not None:
            with _lock_wait_limited(settings), joined(caller, db.schema) as conn:
                yield conn
            return
        with _lock_wait_limited(settings), db.connection(timeout=settings.create_timeout, autocommit=True) as conn:
            yield conn
    except psycopg_pool.PoolTimeout:
        raise CallbackTimeout(_timed_out(settings, "no database connection was free; nothing was written")) from None


@contextmanager
def _lock_wait_limited(settings: CallbackSettings) -> Iterator[None]:
    """A lock waited for longer than ``create_timeout`` (see :func:`insert_events`) raises CallbackTimeout."""
    try:
        yield
    except psycopg.errors.LockNotAvailable:
        raise CallbackTimeout(_timed_out(settings, "a lock was held meanwhile; nothing was written")) from None


def _timed_out(settings: CallbackSettings, what: str) -> str:
    return f"create timed out after {settings.create_timeout:g}s (CallbackSettings.create_timeout): {what}"


def insert_new_events(
    conn: psycopg.Connection, chunks: Iterable[Sequence[NewCallback]], *, soon: float = 3.0, lock_timeout: float = 0.0
) -> list[int]:
    """Insert the events of ``chunks``, whose keys must all be new and distinct, in one transaction (a
    savepoint if ``conn`` is in one); their ids.

    One chunk on a connection in autocommit is one statement, committed in the round trip that sends it. More
    go in pipeline mode, each chunk's statement sent as soon as the chunk is ready, so Postgres inserts one
    chunk while the next is still being prepared; the transaction commits once the pipeline has synced. A
    key already taken (in the table or earlier in ``chunks``) raises UniqueViolation, an error in ``chunks``
    raises itself, and either way nothing is written.
    """
    chunks = iter(chunks)
    first = next(chunks, [])
    second = next(chunks, None)
    if second is None and conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        return list(conn.execute(sql.INSERT_NEW_EVENTS, _insert_params(first, None, soon, lock_timeout)).fetchone()[0])
    sent = []
    with conn.transaction(), conn.pipeline():
        for events in itertools.chain([first], [second] if second is not None else [], chunks):
            sent.append(conn.execute(sql.INSERT_NEW_EVENTS, _insert_params(events, None, soon, lock_timeout)))
    return [event_id for cursor in sent for event_id in cursor.fetchone()[0]]


def insert_events(
    conn: psycopg.Connection,
    events: Sequence[NewCallback],
    schedule_id: int | None = None,
    *,
    soon: float = 3.0,
    lock_timeout: float = 0.0,
    some_taken: bool = False,
) -> list[int | Exception]:
    """Insert ``events`` in ``conn``'s transaction; per event, its id or a conflict.

    New keys go in one statement. If a key is taken (or ``some_taken`` says so beforehand), the events whose keys
    are free are inserted and the others compared with the stored events. Waiting longer than ``lock_timeout``
    seconds (0: no limit) for a lock raises LockNotAvailable.
    """
    params = _insert_params(events, schedule_id, soon, lock_timeout)
    if not some_taken:
        new_ids = _insert_new_rows(conn, params)
        if new_ids is not None:  # every key new and distinct
            return list(new_ids)
    return _insert_skipping_taken(conn, events, params)


def _insert_skipping_taken(
    conn: psycopg.Connection, events: Sequence[NewCallback], params: dict[str, Any]
) -> list[int | Exception]:
    """Insert the events whose keys are not taken, and compare the others with the stored events; per event, its id
    or a conflict."""
    inserted = {(o, g, k): i for i, o, g, k, _ in conn.execute(sql.INSERT_EVENTS, params).fetchall()}
    missing = [e for e in events if (e.owner_client_id, e.group_key, e.event_key) not in inserted]
    existing: dict[tuple[str, str, str], dict[str, Any]] = {}
    if missing:
        keys = {
            "owners": [e.owner_client_id for e in missing],
            "groups": [e.group_key for e in missing],
            "keys": [e.event_key for e in missing],
        }
        for row in conn.cursor(row_factory=dict_row).execute(sql.SELECT_EXISTING, keys):
            existing[(row["owner_client_id"], row["group_key"], row["event_key"])] = row
    results: list[int | Exception] = []
    first: dict[tuple[str, str, str], NewCallback] = {}  # the event of the batch that inserted a key
    for event in events:
        key = (event.owner_client_id, event.group_key, event.event_key)
        row = existing.get(key)
        if row is None:
            same = first.setdefault(key, event) is event or _same_event(event, first[key])
        else:
            same = _same_payload(event, row)
        if same:
            results.append(inserted[key] if row is None else row["event_id"])
        else:
            conflict = (
                f"event {'/'.join(key)} exists with another run_at, cb_url, context, retry, priority or on_failure"
            )
            results.append(CallbackConflict(conflict))
    return results


def _insert_params(
    events: Sequence[NewCallback], schedule_id: int | None, soon: float, lock_timeout: float
) -> dict[str, Any]:
    policies, indexes = _distinct_policies(events)
    rows = [
        {
            "o": e.owner_client_id,
            "g": e.group_key,
            "k": e.event_key,
            "t": e.run_at.astimezone(UTC),
            "u": e.cb_url,
            "c": e.context,
            "r": r,
            **({} if e.body == ENVELOPE else {"b": e.body}),
            **({"p": e.priority} if e.priority else {}),
            **({"f": e.on_failure} if e.on_failure is not None else {}),
            **({"e": e.endpoint} if e.endpoint is not None else {}),
        }
        for e, r in zip(events, indexes, strict=True)
    ]
    return {
        "rows": pydantic_core.to_json(rows).decode(),  # contexts were checked to be JSON; datetimes in UTC
        "policies": "[" + ",".join(_policy_json(policy) for policy in policies) + "]",
        "schedule_id": schedule_id,
        "soon": soon,
        "lock_timeout": f"{round(lock_timeout * 1000)}ms",
    }


def _distinct_policies(events: Sequence[NewCallback]) -> tuple[list[RetryPolicy], list[int]]:
    """The distinct retry policies of ``events``, and each event's index among them (events mostly share
    one policy object, which is then compared once, not once per event)."""
    distinct: dict[RetryPolicy, int] = {}
    by_object: dict[int, int] = {}
    indexes = []
    for event in events:
        index = by_object.get(id(event.retry))
        if index is None:
            index = by_object[id(event.retry)] = distinct.setdefault(event.retry, len(distinct))
        indexes.append(index)
    return list(distinct), indexes


def _insert_new_rows(conn: psycopg.Connection, params: dict[str, Any]) -> list[int] | None:
    """Insert as new keys; their ids in order, or None if a key is taken, and then nothing was written (a
    savepoint undoes the attempt when ``conn`` is in a transaction; in autocommit the failed statement left
    nothing)."""
    savepoint = not conn.autocommit
    if savepoint:
        conn.execute("SAVEPOINT cmb_new_events")
    try:
        return conn.execute(sql.INSERT_NEW_EVENTS, params).fetchone()[0]
    except psycopg.errors.UniqueViolation:
        if savepoint:
            conn.execute("ROLLBACK TO SAVEPOINT cmb_new_events")
        return None


@functools.lru_cache(maxsize=256)
def _policy_json(policy: RetryPolicy) -> str:
    return policy.model_dump_json()  # policies are frozen and mostly shared: dumped once each


def _same_event(event: NewCallback, other: NewCallback) -> bool:
    fields = ("run_at", "cb_url", "context", "body", "retry", "priority", "on_failure", "endpoint")
    return all(getattr(event, name) == getattr(other, name) for name in fields)


def _same_payload(event: NewCallback, row: dict[str, Any]) -> bool:
    return (
        row["originally_run_at"] == event.run_at
        and row["cb_url"] == event.cb_url
        and row["context"] == event.context
        and row["body"] == event.body
        and row["priority"] == event.priority
        and row["on_failure"] == event.on_failure
        and row["endpoint_name"] == event.endpoint
        and RetryPolicy.model_validate(row["retry"]) == event.retry
    )
