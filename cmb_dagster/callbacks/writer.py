"""Writing new events: one multi-row insert per batch, under the lock that orders event ids."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import psycopg
from psycopg.rows import dict_row

from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.errors import CallbackConflict
from cmb_dagster.callbacks.models import CallbackSettings, NewCallback, RetryPolicy, context_json
from cmb_dagster.database import Database

log = logging.getLogger("cmb_dagster.callbacks")


class EventWriter:
    """Buffers creates from many threads and writes each batch as one multi-row insert.

    A batch is written when ``write_batch_size`` creates are waiting, or when ``write_linger`` seconds
    passed since the first (0, the default, is group commit: write at once, and let creates that arrive
    meanwhile form the next batch). Each caller gets its id only after its batch committed.
    """

    def __init__(self, db: Database, settings: CallbackSettings) -> None:
        self.db = db
        self.settings = settings
        self._queue: queue.SimpleQueue[tuple[NewCallback, Future[int]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.soon = settings.poll_interval + settings.lookahead  # creates due sooner wake their bucket's worker

    def write(self, event: NewCallback) -> int:
        """Queue ``event`` and wait until it is committed; return its id (or raise its error)."""
        future: Future[int] = Future()
        self._ensure_started()
        self._queue.put((event, future))
        return future.result()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None

    def _ensure_started(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="cmb-callback-writer", daemon=True)
                    self._thread.start()

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            deadline = time.monotonic() + self.settings.write_linger
            while len(batch) < self.settings.write_batch_size:
                try:
                    wait = deadline - time.monotonic()
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._flush(batch)
            if stop:
                return

    def _flush(self, batch: list[tuple[NewCallback, Future[int]]]) -> None:
        try:
            with self.db.connection() as conn:
                results = insert_events(conn, [event for event, _ in batch], soon=self.soon)
        except Exception as exc:  # noqa: BLE001 - the batch is retried one row at a time: only bad rows fail
            if len(batch) == 1:
                batch[0][1].set_exception(exc)
                return
            log.warning("a batch of %d creates failed (%s): writing them one at a time", len(batch), exc)
            for item in batch:
                self._flush([item])
            return
        for (_, future), result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


def insert_events(
    conn: psycopg.Connection, events: Sequence[NewCallback], schedule_id: int | None = None, *, soon: float = 3.0
) -> list[int | Exception]:
    """Insert ``events`` in ``conn``'s transaction under the event-id lock; per event, its id or a conflict."""
    conn.execute(sql.LOCK_EVENT_IDS)
    params: dict[str, Any] = {
        "owners": [e.owner_client_id for e in events],
        "groups": [e.group_key for e in events],
        "keys": [e.event_key for e in events],
        "run_ats": [e.run_at for e in events],
        "urls": [e.cb_url for e in events],
        "contexts": [None if e.context is None else context_json(e.context) for e in events],
        "retries": [_policy_json(e.retry) for e in events],
        "schedule_ids": [schedule_id] * len(events),
    }
    params["soon"] = soon
    inserted = {(o, g, k): i for i, o, g, k, _ in conn.execute(sql.INSERT_EVENTS_NOTIFY, params)}
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
            results.append(CallbackConflict(f"event {'/'.join(key)} exists with another run_at, cb_url, context or retry"))
    return results


@functools.lru_cache(maxsize=256)
def _policy_json(policy: RetryPolicy) -> str:
    return policy.model_dump_json()  # policies are frozen and mostly shared: dumped once each


def _same_event(event: NewCallback, other: NewCallback) -> bool:
    return (event.run_at, event.cb_url, event.context, event.retry) == (
        other.run_at, other.cb_url, other.context, other.retry)


def _same_payload(event: NewCallback, row: dict[str, Any]) -> bool:
    return (
        row["originally_run_at"] == event.run_at
        and row["cb_url"] == event.cb_url
        and row["context"] == event.context
        and RetryPolicy.model_validate(row["retry"]) == event.retry
    )
