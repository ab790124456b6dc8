"""Calling events back: HTTP POSTs over reused connections, Dagster launches, fast retries, due-time waits.

Stdlib ``http.client`` with one keep-alive connection per thread and host: on this workload it makes about
3.5x the calls per CPU second of httpx (see benchmarks/bench_callbacks.py), and CPU is what a worker runs
out of first. Calls run on a fixed pool of threads that take events in due order and wait for their time.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import urlsplit

from cmb_dagster.callbacks.models import CallbackSettings, RetryPolicy, dagster_job_name

log = logging.getLogger("cmb_dagster.callbacks")

REJECT_HEADERS = ("X-Ya-CallMeBack-Notify-Reject", "X-CallMeBack-Notify-Reject")

NOTIFIED = "notified"
REJECTED = "rejected"
FAILED = "failed"  # permanent: retrying cannot help (host not allowed, unknown job)
RETRY = "retry"  # main retry: reschedule in the database
ABANDONED = "abandoned"  # not called: the lease could lapse first, or the worker is stopping


class JobLauncher(Protocol):
    """Starts a Dagster run for a ``dagster://<job>`` event; the Dagster shell provides it.

    ``run_key`` identifies the event: launching twice with one key must start one run only.
    Raise ``LookupError`` for a job that does not exist (the event fails without retries).
    """

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str: ...


@dataclass(eq=False)
class Delivery:
    """One event handed to the pool: what to call, and (once done) how it went."""

    bucket_id: int
    event_id: int
    run_at: datetime
    originally_run_at: datetime
    owner_client_id: str
    group_key: str
    event_key: str
    cb_url: str
    context: Any
    retry: RetryPolicy
    attempts: int
    main_retries: int
    due: float  # time.monotonic() at which run_at arrives, by the database's clock
    lease_deadline: Callable[[], float]  # monotonic time after which this worker may no longer hold the bucket
    on_done: Callable[[Delivery], None]
    outcome: str | None = None
    tries: int = 0
    error: str | None = None
    retry_delay: float = 0.0
    finished: float = 0.0
    _seq: int = field(default_factory=itertools.count().__next__)

    @property
    def position(self) -> tuple[datetime, int]:
        """The event's place in the poller's (run_at, event_id) order."""
        return (self.run_at, self.event_id)

    def body(self) -> bytes:
        """The JSON the callback receives."""
        return json.dumps(
            {
                "event_id": self.event_id,
                "owner_client_id": self.owner_client_id,
                "group_key": self.group_key,
                "event_key": self.event_key,
                "run_at": self.run_at.isoformat(),
                "originally_run_at": self.originally_run_at.isoformat(),
                "context": self.context,
                "attempt": self.attempts + self.tries,  # this call, counted from 1
            },
            separators=(",", ":"),
        ).encode()


class HttpSender:
    """POSTs JSON, keeping one connection per (thread, scheme, host, port) alive between calls."""

    def __init__(self, settings: CallbackSettings) -> None:
        self.settings = settings
        self._local = threading.local()
        self._tls = ssl.create_default_context()

    def post(self, url: str, body: bytes) -> tuple[str, str | None]:
        """Return (outcome, error): notified on 2xx, rejected on a reject header, retry otherwise."""
        parts = urlsplit(url)
        if not parts.hostname or not self.settings.host_allowed(parts.hostname):
            return FAILED, f"host {parts.hostname!r} is not in the allowed hosts"
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        headers = {"Content-Type": "application/json", "User-Agent": "cmb-dagster-callbacks"}
        for reused in (True, False):
            conn, was_open = self._connection(parts.scheme, parts.hostname, parts.port)
            try:
                conn.request("POST", target, body, headers)
                response = conn.getresponse()
                response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self._drop(parts.scheme, parts.hostname, parts.port)
                if reused and was_open:
                    continue  # the server closed an idle keep-alive connection: not the callback's fault
                return RETRY, f"{type(exc).__name__}: {exc}"
            except (OSError, http.client.HTTPException) as exc:
                self._drop(parts.scheme, parts.hostname, parts.port)
                return RETRY, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if response.will_close:
                self._drop(parts.scheme, parts.hostname, parts.port)
            if any(response.getheader(h) is not None for h in REJECT_HEADERS):
                return REJECTED, f"HTTP {response.status} with a reject header"
            if 200 <= response.status < 300:
                return NOTIFIED, None
            return RETRY, f"HTTP {response.status} {response.reason}"
        raise AssertionError("unreachable")

    def _connection(self, scheme: str, host: str, port: int | None) -> tuple[http.client.HTTPConnection, bool]:
        conns = self._local.__dict__.setdefault("conns", {})
        key = (scheme, host, port)
        conn = conns.get(key)
        if conn is not None:
            return conn, True
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=self.settings.timeout, context=self._tls)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.settings.timeout)
        conns[key] = conn
        return conn, False

    def _drop(self, scheme: str, host: str, port: int | None) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((scheme, host, port), None)
        if conn is not None:
            conn.close()


class DeliveryPool:
    """Threads that take deliveries in due order, wait for their time and call them (with fast retries)."""

    def __init__(self, settings: CallbackSettings, launcher: JobLauncher | None = None) -> None:
        self.settings = settings
        self.sender = HttpSender(settings)
        self.launcher = launcher
        self._launch_lock = threading.Lock()
        self._heap: list[tuple[float, int, Delivery]] = []
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._loop, name=f"cmb-callback-{i}", daemon=True) for i in range(settings.concurrency)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, delivery: Delivery) -> None:
        """Call ``delivery`` at its due time; its ``on_done`` runs when it has an outcome."""
        with self._cond:
            heapq.heappush(self._heap, (delivery.due, delivery._seq, delivery))
            self._cond.notify()

    def abandon_waiting(self) -> None:
        """Give every delivery not started yet back as abandoned (the worker is stopping)."""
        with self._cond:
            waiting, self._heap = self._heap, []
        for _, _, delivery in waiting:
            self._finish(delivery, ABANDONED, None)

    @property
    def busy(self) -> int:
        """Deliveries waiting or being called."""
        with self._cond:
            return len(self._heap) + self._running

    def close(self, timeout: float = 30.0) -> None:
        """Abandon waiting deliveries, let running calls end, stop the threads."""
        self.abandon_waiting()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._heap:
                        wait = self._heap[0][0] - time.monotonic()
                        if wait <= 0:
                            _, _, delivery = heapq.heappop(self._heap)
                            self._running += 1
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
            try:
                self._call(delivery)
            except Exception as exc:
                log.exception("callback %s crashed", delivery.event_id)
                self._finish(delivery, RETRY, f"internal error: {exc}")
            finally:
                with self._cond:
                    self._running -= 1

    def _call(self, delivery: Delivery) -> None:
        fast_retries = delivery.retry.fast_retries
        pause = self.settings.fast_retry_pause
        error: str | None = None
        for attempt in range(fast_retries + 1):
            if attempt:
                time.sleep(pause * 2 ** (attempt - 1))
            if time.monotonic() + self.settings.timeout >= delivery.lease_deadline():
                if delivery.tries == 0:
                    self._finish(delivery, ABANDONED, None)
                    return
                break
            delivery.tries += 1
            outcome, error = self._attempt(delivery)
            if outcome != RETRY:
                self._finish(delivery, outcome, error)
                return
        delivery.retry_delay = delivery.retry.main_retry_delay(delivery.main_retries)
        self._finish(delivery, RETRY, error)

    def _attempt(self, delivery: Delivery) -> tuple[str, str | None]:
        job_name = dagster_job_name(delivery.cb_url)
        if job_name is None:
            return self.sender.post(delivery.cb_url, delivery.body())
        if self.launcher is None:
            return RETRY, "dagster:// callbacks need a worker with a Dagster launcher (the Dagster worker job)"
        context = delivery.context if isinstance(delivery.context, dict) else {}
        tags = {str(k): str(v) for k, v in (context.get("tags") or {}).items()}
        tags.update({"cmb/callback": f"{delivery.owner_client_id}/{delivery.group_key}/{delivery.event_key}"})
        try:
            with self._launch_lock:
                self.launcher.launch(
                    job_name,
                    run_key=f"cmb-callback-{delivery.event_id}",
                    run_config=context.get("run_config") or {},
                    tags=tags,
                )
        except LookupError as exc:
            return FAILED, f"no Dagster job {job_name!r}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any launch failure is retried by the policy
            return RETRY, f"Dagster launch failed: {type(exc).__name__}: {exc}"
        return NOTIFIED, None

    def _finish(self, delivery: Delivery, outcome: str, error: str | None) -> None:
        delivery.outcome = outcome
        delivery.error = error
        delivery.finished = time.monotonic()
        delivery.on_done(delivery)
