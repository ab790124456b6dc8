"""Postgres LISTEN/NOTIFY as a hint that wakes workers early; the tables stay the truth.

A lost notification (listener down, connection silently dead, server restart) only delays work until
the worker's own poll or sweep finds it. The listener checks its connection every ``heartbeat``
seconds, reconnects by itself, and after every (re)connect calls ``on_notify(channel, None)``: "you may
have missed something, look everywhere".

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

log = logging.getLogger("cmb_dagster.notifications")

OnNotify = Callable[[str, "str | None"], None]


def channel_name(db: Database, name: str) -> str:
    """The channel ``name`` of this deployment (schema-qualified, so two deployments don't wake each other)."""
    return f"{db.schema}.{name}"


class Listener:
    """A daemon thread that LISTENs on ``channels`` and calls ``on_notify(channel, payload)``."""

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
        while not self._stop.is_set():
            try:
                with self.db.connect(autocommit=True) as conn:
                    for channel in self.channels:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self.connections += 1
                    self.connected.set()
                    for channel in self.channels:
                        self.on_notify(channel, None)
                    self._listen(conn)
            except (psycopg.Error, OSError) as exc:
                if not self._stop.is_set():
                    log.warning("notification listener lost its connection (%s); reconnecting", type(exc).__name__)
            except Exception:  # noqa: BLE001 - a failing callback must not end the listener
                log.exception("notification callback failed; listener restarts")
            finally:
                self.connected.clear()
            self._stop.wait(self.retry_delay)

    def _listen(self, conn: psycopg.Connection) -> None:
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            for notify in conn.notifies(timeout=min(self.heartbeat, 0.5), stop_after=1000):
                quiet_since = time.monotonic()
                self.on_notify(notify.channel, notify.payload)
            if time.monotonic() - quiet_since >= self.heartbeat:
                conn.execute("SELECT 1")  # heartbeat: a silently dead connection raises here
                quiet_since = time.monotonic()
