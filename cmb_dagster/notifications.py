"""Postgres LISTEN/NOTIFY as a hint that wakes workers early; the tables stay the truth.

A lost notification (listener down, connection silently dead, server restart) only delays work until
the worker's own poll or sweep finds it. The listener checks its connection every ``heartbeat``
seconds, reconnects by itself, and after every (re)connect calls ``on_notify(channel, None)``: "you may
have missed something, look everywhere".

Logging rules: a lost or refused connection is one warning line when it is lost (with a traceback only
for an error that is no database or network error), then retried quietly with a delay from
``retry_delay`` doubling up to 30 s; the reconnect is one info line. A failing ``on_notify`` is logged
with its traceback, at most once a minute per distinct error, and the listener goes on.

Producers notify with ``SELECT pg_notify(%s, %s)`` (one per transaction is enough: Postgres delivers
notifications only on commit and folds identical ones of a transaction into one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import psycopg
from psycopg import sql

from cmb_dagster.database import Database
from cmb_dagster.errors import CmbError

log = logging.getLogger("cmb_dagster.notifications")

MAX_RETRY_DELAY = 30.0
"""Longest wait between two connection attempts (unless ``retry_delay`` is longer)."""
CALLBACK_ERROR_INTERVAL = 60.0
"""Seconds during which the same callback error is not logged again."""

OnNotify = Callable[[str, "str | None"], None]


def channel_name(db: Database, name: str) -> str:
    """The channel ``name`` of this deployment (schema-qualified, so two deployments don't wake each other)."""
    return f"{db.schema}.{name}"


class Listener:
    """A daemon thread that LISTENs on ``channels`` and calls ``on_notify(channel, payload)``.

    It connects to the server itself (:meth:`Database.connect_direct`): through a transaction-pooling PgBouncer,
    a LISTEN would stay on a server connection lent for one statement, and notifications would be lost."""

    def __init__(
        self,
        db: Database,
        channels: Sequence[str],
        on_notify: OnNotify,
        *,
        heartbeat: float = 5.0,
        retry_delay: float = 1.0,
    ) -> None:
        if not channels:
            raise ValueError("a listener needs at least one channel")
        self.db = db
        self.channels = list(channels)
        self.on_notify = on_notify
        self.heartbeat = heartbeat
        self.retry_delay = retry_delay
        self.connected = threading.Event()
        self.connections = 0  # successful (re)connects so far
        self._stop = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._thread: threading.Thread | None = None
        self._logged_errors: dict[str, float] = {}  # callback error -> when it was last logged

    def start(self) -> Listener:
        """Start listening in the background; returns self."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cmb-listener", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening and close the connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> Listener:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        delay = self.retry_delay
        lost_at: float | None = None  # when the connection was lost or first refused, until the next connect
        while not self._stop.is_set():
            try:
                with self.db.connect_direct(autocommit=True) as conn:  # LISTEN lives in the session
                    for channel in self.channels:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    if lost_at is not None:
                        log.info("notification listener reconnected after %.1f s", time.monotonic() - lost_at)
                    lost_at, delay = None, self.retry_delay
                    self.connections += 1
                    self.connected.set()
                    for channel in self.channels:
                        self._notify(channel, None)
                    self._listen(conn)
            except Exception as exc:  # the listener outlives every error; it retries
                if lost_at is None and not self._stop.is_set():
                    lost_at = time.monotonic()
                    state = "lost its connection" if self.connected.is_set() else "cannot connect"
                    log.warning(
                        "notification listener %s (%s: %s); retrying",
                        state,
                        type(exc).__name__,
                        _first_line(exc),
                        exc_info=not isinstance(exc, CmbError | psycopg.Error | OSError),
                    )
            finally:
                self.connected.clear()
            self._stop.wait(delay)
            delay = min(delay * 2, max(MAX_RETRY_DELAY, self.retry_delay))

    def _notify(self, channel: str, payload: str | None) -> None:
        """``on_notify(channel, payload)``; a failure is logged (see the module's logging rules), not raised."""
        try:
            self.on_notify(channel, payload)
        except Exception as exc:  # a failing callback must not end the listener
            error = f"{type(exc).__name__}: {exc}"
            now = time.monotonic()
            self._logged_errors = {e: t for e, t in self._logged_errors.items() if now - t < CALLBACK_ERROR_INTERVAL}
            if error not in self._logged_errors:
                self._logged_errors[error] = now
                log.exception("notification callback failed (not logged again for %.0f s)", CALLBACK_ERROR_INTERVAL)

    def _listen(self, conn: psycopg.Connection) -> None:
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            for notify in conn.notifies(timeout=min(self.heartbeat, 0.5), stop_after=1000):
                quiet_since = time.monotonic()
                self._notify(notify.channel, notify.payload)
            if time.monotonic() - quiet_since >= self.heartbeat:
                conn.execute("SELECT 1")  # heartbeat: a silently dead connection raises here
                quiet_since = time.monotonic()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
