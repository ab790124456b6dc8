"""Prometheus metrics of every engine's status, read from Postgres for the scrapes (``cmb-dagster metrics``).

:class:`StatusCollector` turns each engine's status (callbacks, stages, event queue, pub/sub, reactive) and the
worker leases into metric families; an engine whose read fails is left out of that scrape and counted in
``cmb_scrape_errors``. :func:`serve` runs prometheus_client's HTTP server with it.

A scrape answers within :data:`SCRAPE_DEADLINE_S` whatever the database does (down, gone, frozen, locked): each
engine's read gives up after :data:`READ_TIMEOUT_S` (connecting, waiting for the connection, each statement), a
database found away is not asked again for the other engines, and an engine not read by the deadline counts as
failed in that scrape. Scrapes share one reading, made in a thread of its own: those that arrive while it runs, or
within :data:`CACHE_S` after it ended, get its figures. The metrics read; they never migrate the schema.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import ThreadingHTTPServer
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psycopg
from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector, CollectorRegistry
from psycopg_pool import PoolTimeout

from cmb_dagster.callbacks import admin as callbacks_admin
from cmb_dagster.callbacks.models import MAX_BUCKETS
from cmb_dagster.database import Database
from cmb_dagster.errors import ConfigError, DatabaseUnavailable
from cmb_dagster.eventqueue import admin as eventqueue_admin
from cmb_dagster.pubsub import admin as pubsub_admin
from cmb_dagster.reactive import admin as reactive_admin
from cmb_dagster.secrets import scrub
from cmb_dagster.stages import admin as stages_admin
from cmb_dagster.vacuum import status as vacuum_status
from cmb_dagster.workers import list_leases

log = logging.getLogger("cmb_dagster.metrics")

ENGINES = ("callbacks", "stages", "eventqueue", "pubsub", "reactive", "workers", "database")
"""What a scrape reads, in this order; each is read on its own, so one failing leaves the others."""

DEFAULT_PORT = 9464
DEFAULT_HOST = "127.0.0.1"

READ_TIMEOUT_S = 3.0
"""Seconds an engine's read may wait to connect, for its connection, and for each statement."""
SCRAPE_DEADLINE_S = 8.0
"""Seconds after a reading began when its scrapes answer with the engines read so far: within Prometheus's default
scrape timeout (10 s)."""
CACHE_S = 2.0
"""Seconds a finished reading still answers scrapes (several Prometheus servers scraping at once share it)."""
WAITING_CONNECTIONS = 1024
"""Connections the endpoint's socket holds until it accepts them: scrapes arriving at once all get in (beyond the
standard library's 5, a connection is dropped and retried by its client seconds later)."""


_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def check_host(host: str) -> str:
    """``host`` if it is an IP address or a host name, else ConfigError."""
    if isinstance(host, str):
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            if _HOSTNAME.fullmatch(host) and not host.rsplit(".", 1)[-1].isdigit():
                return host  # a name whose last label is all digits would be a malformed address
    raise ConfigError(f"host: expected an IP address or a host name, not {host!r}")


def check_port(port: int) -> int:
    """``port`` if it is 0 (any free port) to 65535, else ConfigError."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port: expected 0 (any free port) to 65535, not {port!r}")
    return port


def _gauge(name: str, doc: str, labels: Iterable[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class StatusCollector(Collector):
    """The status of every engine as metric families, read for the scrapes (:meth:`collect`) through a connection of
    its own (:meth:`Database.bounded`), one reading at a time."""

    def __init__(self, db: Database, *, bucket_sets: int = 1) -> None:
        self.db = db
        self.reader = db.bounded(READ_TIMEOUT_S)
        self.bucket_sets = bucket_sets
        self._readers: dict[str, Callable[[], list[Metric]]] = {
            "callbacks": self._callbacks,
            "stages": self._stages,
            "eventqueue": self._eventqueue,
            "pubsub": self._pubsub,
            "reactive": self._reactive,
            "workers": self._workers,
            "database": self._database,
        }
        self._lock = threading.Lock()
        self._reading: _Reading | None = None
        self._closed = False

    def describe(self) -> list[Metric]:
        """Nothing: registering must not read the database."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Each engine's families, then ``cmb_scrape_errors`` and ``cmb_scrape_duration_seconds`` per engine:
        those of the current reading (started now unless one runs or ended less than :data:`CACHE_S` ago), once
        it ends or its deadline passes."""
        reading = self._current_reading()
        reading.done.wait(max(0.0, reading.deadline - time.monotonic()))
        return iter(reading.families())

    def close(self) -> None:
        """Start no more readings and close the connection (once a reading under way has ended)."""
        with self._lock:
            self._closed = True
            busy = self._reading is not None and not self._reading.done.is_set()
        if not busy:
            self.reader.close()

    def _current_reading(self) -> _Reading:
        with self._lock:
            reading = self._reading
            if reading is None or (reading.done.is_set() and time.monotonic() - reading.ended > CACHE_S):
                reading = self._reading = _Reading()
                if self._closed:
                    reading.finish()
                else:
                    thread = threading.Thread(target=self._read, args=(reading,), name="cmb-metrics", daemon=True)
                    thread.start()
            return reading

    def _read(self, reading: _Reading) -> None:
        """Read each engine in turn into ``reading``; once the database is found away, the others are not asked."""
        try:
            for index, engine in enumerate(ENGINES):
                started = time.perf_counter()
                try:
                    families = self._readers[engine]()
                except Exception as exc:  # noqa: BLE001 - the other engines are still reported
                    reason = scrub(f"{type(exc).__name__}: {exc}", self.db.url)
                    log.warning("metrics: the %s status could not be read: %s", engine, reason)
                    reading.add(engine, [], time.perf_counter() - started, failed=True)
                    if _database_away(exc) and index + 1 < len(ENGINES):
                        others = ", ".join(ENGINES[index + 1 :])
                        log.warning("metrics: the %s status not read: the database did not answer", others)
                        break
                else:
                    reading.add(engine, families, time.perf_counter() - started)
        finally:
            with self._lock:
                reading.finish()
                closed = self._closed
            if closed:
                self.reader.close()

    def _callbacks(self) -> list[Metric]:
        labels = ["bucket_set"]
        pending = _gauge("cmb_callbacks_pending", "Pending callback events (estimated when exact is 0).", labels)
        overdue = _gauge("cmb_callbacks_overdue", "Pending callback events past their run_at.", labels)
        oldest = _gauge("cmb_callbacks_oldest_overdue_seconds", "Age of the oldest overdue event.", labels)
        exact = _gauge("cmb_callbacks_depth_exact", "1 if pending and overdue were counted, 0 if estimated.", labels)
        for row in callbacks_admin.depths(self.reader, bucket_sets=self.bucket_sets):
            key = [str(row.bucket_set)]
            pending.add_metric(key, row.pending)
            overdue.add_metric(key, row.overdue)
            oldest.add_metric(key, row.oldest_overdue_seconds)
            exact.add_metric(key, int(row.exact))
        endpoints = _gauge("cmb_callbacks_endpoints", "Endpoints whose circuit breaker is open or disabled.", ["state"])
        health = callbacks_admin.endpoint_counts(self.reader)
        endpoints.add_metric(["open"], health.open)
        endpoints.add_metric(["disabled"], health.disabled)
        return [pending, overdue, oldest, exact, endpoints]

    def _stages(self) -> list[Metric]:
        report = stages_admin.status(self.reader)
        shards = _gauge("cmb_stages_shards", "The stage scheduler's shard count.", [])
        shards.add_metric([], report.shard_count)
        gauges = {
            "queued": "Main-queue entries due now.",
            "timers": "Main-queue entries due later (timers).",
            "low_priority": "Low-priority (rescan) queue entries.",
            "parked": "Entries parked after their last attempt (retried by hand).",
            "failing": "Entries with a failed attempt, not parked.",
            "oldest_seconds": "Age of the oldest due main-queue entry.",
        }
        counters = {
            "processed": "Entries processed.",
            "changed": "Processed entries that changed their entity or state.",
            "conflicts": "Optimistic-check conflicts.",
            "errors": "Process calls that failed.",
            "capped": "Entries dropped by the re-trigger cap.",
        }
        families: dict[str, Metric] = {
            name: _gauge(f"cmb_stages_{name}", doc, ["stage"]) for name, doc in gauges.items()
        } | {name: CounterMetricFamily(f"cmb_stages_{name}", doc, labels=["stage"]) for name, doc in counters.items()}
        for row in report.stages:
            for name, family in families.items():
                family.add_metric([row.stage], getattr(row, name))
        return [shards, *families.values()]

    def _eventqueue(self) -> list[Metric]:
        labels = ["handler", "kind"]
        docs = {
            "queued": "Events due and not claimed.",
            "delayed": "Events delayed to a later time.",
            "locked": "Events claimed by a worker.",
            "held": "Events held by a pause or block rule.",
            "dead": "Dead-lettered events.",
            "oldest_queued_seconds": "Age of the oldest queued event.",
        }
        families = {name: _gauge(f"cmb_eventqueue_{name}", doc, labels) for name, doc in docs.items()}
        rules = _gauge("cmb_eventqueue_rules", "Pause and block rules on the handler.", labels)
        for row in eventqueue_admin.status(self.reader).handlers:
            key = [row.handler, row.kind]
            for name, family in families.items():
                family.add_metric(key, getattr(row, name))
            rules.add_metric(key, len(row.rules))
        return [*families.values(), rules]

    def _pubsub(self) -> list[Metric]:
        labels = ["consumer_id", "branch"]
        events = _gauge("cmb_pubsub_lag_events", "Events committed and not yet delivered to the consumer.", labels)
        seconds = _gauge("cmb_pubsub_lag_seconds", "Age of the oldest event not yet delivered.", labels)
        parked = _gauge("cmb_pubsub_parked", "Events the consumer parked, not replayed yet.", labels)
        failing = _gauge(
            "cmb_pubsub_failing_attempts", "Failed attempts at the event the consumer is stuck on (0: none).", labels
        )
        for lag in pubsub_admin.status(self.reader).consumers:
            key = [lag.consumer_id, str(lag.branch_id)]
            events.add_metric(key, lag.events)
            seconds.add_metric(key, lag.seconds)
            parked.add_metric(key, lag.parked)
            failing.add_metric(key, lag.attempts if lag.failing_event is not None else 0)
        return [events, seconds, parked, failing]

    def _reactive(self) -> list[Metric]:
        tasks = _gauge("cmb_reactive_tasks", "Reactive tasks per status.", ["scheduler", "state"])
        failures = _gauge(
            "cmb_reactive_task_failures", "Failed runs of the task in a row.", ["scheduler", "task", "state"]
        )
        slack = _gauge(
            "cmb_reactive_deadline_slack_seconds",
            "Seconds until the task's deadline passes without a successful run (negative: how late it is).",
            ["scheduler", "task"],
        )
        counts: dict[tuple[str, str], int] = {}
        report = reactive_admin.status(self.reader)
        now = datetime.now(UTC)
        for task in report.tasks:
            counts[(task.scheduler, task.status)] = counts.get((task.scheduler, task.status), 0) + 1
            failures.add_metric([task.scheduler, task.name, task.status], task.attempts)
            deadline = task.deadline_state(now)
            if deadline is not None:
                slack.add_metric([task.scheduler, task.name], deadline.slack.total_seconds())
        for (scheduler, state), count in sorted(counts.items()):
            tasks.add_metric([scheduler, state], count)
        tick = _gauge(
            "cmb_reactive_tick_age_seconds",
            "Seconds since the scheduler's last tick (absent: never ticked).",
            ["scheduler"],
        )
        duration = _gauge(
            "cmb_reactive_tick_duration_seconds", "How long the scheduler's last tick took.", ["scheduler"]
        )
        for scheduler in report.schedulers:
            if scheduler.ticked_at is not None:
                tick.add_metric([scheduler.name], max(0.0, (now - scheduler.ticked_at).total_seconds()))
            if scheduler.tick_seconds is not None:
                duration.add_metric([scheduler.name], scheduler.tick_seconds)
        return [tasks, failures, slack, tick, duration]

    def _workers(self) -> list[Metric]:
        labels = ["kind", "partition", "owner"]
        expiry = _gauge(
            "cmb_worker_lease_expires_in_seconds",
            "Seconds until the lease its owner holds expires unless renewed (negative: expired; none: not held).",
            labels,
        )
        fence = _gauge("cmb_worker_lease_fence", "The lease's fence (grows at each change of owner).", labels)
        for lease in list_leases(self.reader):
            if lease.expires_in == -math.inf:  # released: nobody holds it (a reactive scheduler between its ticks)
                continue
            key = [lease.kind, lease.partition, lease.owner]
            expiry.add_metric(key, lease.expires_in)
            fence.add_metric(key, lease.fence)
        return [expiry, fence]

    def _database(self) -> list[Metric]:
        found = vacuum_status(self.reader)
        labels = ["kind", "pid", "name"]
        seconds = _gauge(
            "cmb_vacuum_horizon_age_seconds",
            "Seconds the oldest snapshot in the database has been held (absent: none held, or its age unknown).",
            labels,
        )
        xids = _gauge(
            "cmb_vacuum_horizon_age_xids", "Transactions begun since the oldest snapshot in the database.", labels
        )
        if found.holder is not None:
            holder = found.holder
            key = [holder.kind, "" if holder.pid is None else str(holder.pid), holder.name]
            xids.add_metric(key, holder.age_xids)
            if holder.age_seconds is not None:
                seconds.add_metric(key, holder.age_seconds)
        live = _gauge("cmb_table_live_rows", "Live rows of the cmb table, as last counted.", ["table"])
        dead = _gauge("cmb_table_dead_rows", "Dead rows of the cmb table not yet removed by vacuum.", ["table"])
        for table in found.tables:
            live.add_metric([table.table], table.live)
            dead.add_metric([table.table], table.dead)
        return [seconds, xids, live, dead]


class _Reading:
    """One reading of every engine's status: what each read gave as it comes in, and whether all were read."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + SCRAPE_DEADLINE_S
        self.ended = math.inf
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._read: dict[str, tuple[list[Metric], float, bool]] = {}

    def add(self, engine: str, families: list[Metric], seconds: float, *, failed: bool = False) -> None:
        """What reading ``engine`` gave, in ``seconds``."""
        with self._lock:
            self._read[engine] = (families, seconds, failed)

    def finish(self) -> None:
        """Every read has ended (or none will start)."""
        self.ended = time.monotonic()
        self.done.set()

    def families(self) -> list[Metric]:
        """The families read so far, then ``cmb_scrape_errors`` (1 for an engine that failed or is not read) and
        ``cmb_scrape_duration_seconds`` (for each engine read)."""
        errors = _gauge("cmb_scrape_errors", "1 if the engine's status could not be read in this scrape.", ["engine"])
        seconds = _gauge("cmb_scrape_duration_seconds", "Seconds reading the engine's status took.", ["engine"])
        with self._lock:
            read = dict(self._read)
        families: list[Metric] = []
        for engine in ENGINES:
            if engine not in read:
                errors.add_metric([engine], 1)
                continue
            engine_families, took, failed = read[engine]
            families += engine_families
            errors.add_metric([engine], int(failed))
            seconds.add_metric([engine], took)
        return [*families, errors, seconds]


def _database_away(exc: Exception) -> bool:
    """Whether ``exc`` says the server cannot be reached (no connection, or it broke), not that one read failed."""
    if isinstance(exc, DatabaseUnavailable | PoolTimeout):
        return True
    return isinstance(exc, psycopg.OperationalError) and exc.sqlstate is None


@dataclass
class MetricsServer:
    """A running HTTP endpoint (the metrics, a worker's liveness): its address and a way to stop it."""

    host: str
    port: int
    server: WSGIServer | ThreadingHTTPServer
    thread: threading.Thread
    path: str = "/metrics"
    on_stop: Callable[[], None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    def stop(self) -> None:
        """Stop serving and close the socket (then ``on_stop``)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
        if self.on_stop is not None:
            self.on_stop()


def serve(db: Database, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, bucket_sets: int = 1) -> MetricsServer:
    """Serve the metrics of ``db`` on http://host:port/ in a background thread (port 0: any free one)."""
    host, port = check_host(host), check_port(port)
    if isinstance(bucket_sets, bool) or not isinstance(bucket_sets, int) or not 1 <= bucket_sets <= MAX_BUCKETS:
        raise ConfigError(f"bucket_sets: expected 1 to {MAX_BUCKETS}, not {bucket_sets!r}")
    registry = CollectorRegistry(auto_describe=False)
    collector = StatusCollector(db, bucket_sets=bucket_sets)
    registry.register(collector)
    family, *_, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("ScrapeServer", (_ScrapeServer,), {"address_family": family})  # read when binding
    server = make_server(address[0], port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="cmb-metrics-http", daemon=True)
    thread.start()
    return MetricsServer(host=host, port=server.server_port, server=server, thread=thread, on_stop=collector.close)


class _ScrapeServer(ThreadingWSGIServer):
    request_queue_size = WAITING_CONNECTIONS


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Log no request."""
