"""Callbacks benchmark: create throughput, a burst of events due at once and a steady 1,000 events/s, side by
side with PgQueuer.

    .venv/bin/python benchmarks/bench_callbacks.py [--quick] [--only create burst steady] [--signed]
        [--burst N] [--rate N] [--seconds S] [--create-seconds S]

Runs on CMB_DATABASE_URL (or the embedded server) in a database of its own (a random name), dropped at the end.
Callbacks go to a local HTTP sink on 127.0.0.1 in a process of its own (so the producers' threads here cannot
delay its clock readings); the cmb worker (``cmb-dagster callbacks worker``) and the PgQueuer consumer run as
separate processes, one at a time.

- create: one event per commit on both sides, from 1 and from 16 producers: cmb's unbuffered client
  (``CallbackClient(..., buffered=False).create``, a pool connection per thread) against PgQueuer's single
  ``enqueue`` (an asyncpg connection per producer, in one event loop); the ratios compare these. cmb's default
  client, which writes several creates per commit, is reported on its own, never against PgQueuer.
- burst: ``--burst`` events created on both sides (cmb ``create_many`` and PgQueuer's batched ``enqueue``,
  1,000 a commit each, alternating), made due at once, drained by one worker until every call reached the sink
  and its outcome is recorded; the run flags a drain under 5 s (raise ``--burst``).
- steady: ``--rate`` events/s for ``--seconds`` from 8 producers (20% due at once, 30% within the next poll, 50%
  created 4-6 s ahead); lateness is the sink's arrival time minus the event's run_at, once the consumer has
  called a warm-up probe (a long-running consumer). cmb's producers use its default (buffered) client. PgQueuer
  runs twice: with its default re-poll floor (``QueueManager.min_dequeue_poll_interval``, 0.1 s), which sets
  the lateness of its events created ahead (a deferred job's wait is rounded up to it), and with 0.01 s.

PgQueuer (pip install pgqueuer; only needed here) is set up as its docs recommend: the asyncpg driver, a direct
connection of its own for the ``QueueManager``, ``batch_size=50`` (short jobs), ``max_concurrent_tasks=200``
(at least twice the batch size; cmb's worker calls 128 at once), ``dequeue_timeout`` equal to cmb's poll
interval (1 s), one aiohttp session reading whole responses.

Each run ANALYZEs after loading, CHECKPOINTs before each timed phase, and reports the CPU seconds of each side's
processes (workers, consumers, or this process for the producers) and of the Postgres server (its postmaster's
processes named postgres, from /proc; none for a server on another machine), and the 1-minute load average at
the start and the end. Run it alone on the machine: other load moves every figure. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proc_cpu import Meter, find_postmaster  # noqa: E402

from cmb_dagster.callbacks import CallbackClient, CallbackSettings  # noqa: E402
from cmb_dagster.callbacks.sink import CallbackSink  # noqa: E402
from cmb_dagster.database import Database  # noqa: E402
from cmb_dagster.settings import Settings  # noqa: E402

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
LOCAL = CallbackSettings(allowed_hosts=["127.0.0.1"])  # the sink: private addresses are closed by default
LOG_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / f"cmb-bench-{os.getpid()}"
PGQUEUER_BATCH_SIZE = 50
PGQUEUER_MAX_CONCURRENT_TASKS = 200
MIN_DRAIN_S = 5.0
BURST_LEAD_S = 6  # a burst is due this long after it is set, time for the consumer to start


def server_url() -> str:
    from cmb_dagster.embedded import embedded_url

    settings = Settings.from_env()
    return settings.database_url or embedded_url(settings.home)


@contextmanager
def bench_database() -> Iterator[Database]:
    """A database of its own on the benchmark's server, migrated, dropped on the way out."""
    server = server_url()
    name = f"cmb_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    db = Database(urlsplit(server)._replace(path=f"/{name}").geturl())
    try:
        db.ensure_ready()
        yield db
    finally:
        db.close()
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def wait_for(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- CPU -----------------------------------------------------------------------------------------


def cpu_text(figures: dict[str, Any], *names: str) -> str:
    return ", ".join(
        f"{name} CPU {figures[f'{name}_cpu_ms_per_event']:.3f} ms/event ({figures[f'{name}_cores']:.2f} cores)"
        if figures[f"{name}_cpu_s"] is not None
        else f"{name} CPU not measured"
        for name in (*names, "postgres")
    )


# -- the database between phases ------------------------------------------------------------------


def vacuum(url: str, table: str | None = None) -> None:
    """VACUUM ANALYZE ``table`` (default: the whole database): what was just loaded or deleted, counted."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {table or ''}")


def checkpoint(url: str) -> None:
    """Flush what earlier phases wrote, so that no side's timed phase pays for a checkpoint of another's WAL."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def clear_events(db: Database, peer: bool) -> None:
    """Empty both sides' tables, counted again, before the next phase."""
    with db.connection() as conn:
        conn.execute("DELETE FROM callback_events")
    if peer:
        clear_pgqueuer(db.url)
    else:
        vacuum(db.url)


def clear_pgqueuer(url: str) -> None:
    """Empty PgQueuer's queue and log, counted again."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM pgqueuer")
        conn.execute("DELETE FROM pgqueuer_log")
    vacuum(url)


def autovacuum_counts(url: str) -> dict[str, int]:
    """Per table, how many times autovacuum vacuumed or analyzed it so far."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT schemaname || '.' || relname, autovacuum_count + autoanalyze_count FROM pg_stat_user_tables"
        ).fetchall()
    return dict(rows)


def autovacuumed_since(url: str, before: dict[str, int]) -> list[str]:
    """The tables autovacuum visited since ``before`` was read (its work shares the machine with the run)."""
    return sorted(t for t, n in autovacuum_counts(url).items() if n > before.get(t, 0))


def dead_tuples(url: str, table: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s", (table,)).fetchone()
    return int(row[0]) if row else 0


def errors_logged(name: str) -> int:
    path = LOG_DIR / name
    if not path.exists():
        return 0
    text = path.read_text(errors="replace")
    return text.count("Traceback") + text.count(" ERROR ")


# -- the sink, in a process of its own ----------------------------------------------------------


def _serve_sink(control: Connection) -> None:
    with CallbackSink() as sink:
        control.send(sink.url)
        while (command := control.recv()) != "stop":
            if command == "count":
                control.send(len(sink.received))
            elif command == "calls":
                control.send(list(sink.received))
            elif command == "clear":
                sink.received.clear()
                control.send(None)


class SinkProcess:
    """A :class:`CallbackSink` in a child process: ``url``, ``count()``, ``calls()`` and ``clear()``."""

    def __init__(self) -> None:
        self._control, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(target=_serve_sink, args=(child,), daemon=True)

    def __enter__(self) -> Self:
        self._process.start()
        self.url = self._control.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        self._control.send("stop")
        self._process.join(10)

    def _ask(self, command: str) -> Any:
        self._control.send(command)
        return self._control.recv()

    def count(self) -> int:
        return self._ask("count")

    def calls(self) -> list:  # type: ignore[type-arg]
        return self._ask("calls")

    def clear(self) -> None:
        self._ask("clear")


# -- create throughput ---------------------------------------------------------------------------


def cmb_create(db: Database, postmaster: int | None, producers: int, seconds: float, buffered: bool) -> dict[str, Any]:
    """cmb's ``create`` from ``producers`` threads for ``seconds``: buffered (several creates per commit) or not
    (one commit per event, on a pool connection per thread, connected before the clock starts)."""
    far = datetime.now(UTC) + timedelta(days=1)
    own = Database(db.url, schema=db.schema, max_pool_size=producers)
    done = [0] * producers
    try:
        with CallbackClient(own, LOCAL, buffered=buffered) as client, ThreadPoolExecutor(producers) as pool:
            client.create("bench", "warm-up", str(producers), far, "http://127.0.0.1:9/x")
            barrier = threading.Barrier(producers)

            def connect(_: int) -> None:
                with own.connection() as conn:
                    conn.execute("SELECT 1")
                    barrier.wait(30)

            list(pool.map(connect, range(producers)))
            checkpoint(db.url)

            def produce(n: int, stop: float) -> None:
                i = 0
                while time.monotonic() < stop:
                    client.create("bench", "create", f"{n}-{i}", far, "http://127.0.0.1:9/x")
                    i += 1
                done[n] = i

            with Meter(postmaster, producers=os.getpid()) as meter:
                stop = time.monotonic() + seconds
                list(pool.map(produce, range(producers), [stop] * producers))
    finally:
        own.close()
    clear_events(db, peer=False)
    return {"events_per_s": round(sum(done) / meter.wall), **meter.figures(sum(done))}


def pgqueuer_create(url: str, postmaster: int | None, producers: int, seconds: float) -> dict[str, Any]:
    """PgQueuer's single ``enqueue`` (one job, one commit) from ``producers`` asyncpg connections for ``seconds``,
    connected before the clock starts."""
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    run_at = (datetime.now(UTC) + timedelta(days=1)).isoformat()

    async def part(queries: Queries, n: int, stop: float) -> int:
        i = 0
        while time.monotonic() < stop:
            payload = json.dumps({"event_id": f"{n}-{i}", "run_at": run_at}).encode()
            await queries.enqueue("callback", payload, 0, timedelta(days=1))
            i += 1
        return i

    async def go() -> tuple[int, Meter]:
        conns = [await asyncpg.connect(url) for _ in range(producers)]
        try:
            queries = [Queries(AsyncpgDriver(conn)) for conn in conns]
            await queries[0].enqueue("callback", b"{}", 0, timedelta(days=1))  # warm-up, as cmb's
            checkpoint(url)
            with Meter(postmaster, producers=os.getpid()) as meter:
                stop = time.monotonic() + seconds
                done = sum(await asyncio.gather(*(part(q, n, stop) for n, q in enumerate(queries))))
            return done, meter
        finally:
            for conn in conns:
                await conn.close()

    done, meter = asyncio.run(go())
    clear_pgqueuer(url)
    return {"events_per_s": round(done / meter.wall), **meter.figures(done)}


def bench_create(db: Database, postmaster: int | None, seconds: float, peer: bool) -> dict[str, Any]:
    """One commit per event on both sides from 1 and 16 producers; then cmb's buffered client alone."""
    results: dict[str, Any] = {}

    def report(label: str, figures: dict[str, Any], note: str = "") -> None:
        results[label] = figures
        print(f"  create {label:32s} {figures['events_per_s']:>8,} events/s{note}; {cpu_text(figures, 'producers')}")

    for producers in (1, 16):
        report(f"cmb_one_commit_per_event_{producers}", cmb_create(db, postmaster, producers, seconds, buffered=False))
        if peer:
            report(f"pgqueuer_enqueue_{producers}", pgqueuer_create(db.url, postmaster, producers, seconds))
    for producers in (1, 16):
        report(
            f"cmb_buffered_{producers}",
            cmb_create(db, postmaster, producers, seconds, buffered=True),
            " (buffered: several creates per commit, not compared)",
        )
    return results


# -- burst -----------------------------------------------------------------------------------------


def start_cmb_worker(url: str, log_name: str) -> subprocess.Popen:
    env = {**os.environ, "CMB_DATABASE_URL": url}
    log = open(LOG_DIR / log_name, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [*CLI, "callbacks", "worker", "--no-materialize", "--allow-host", "127.0.0.1"], env=env, stdout=log, stderr=log
    )


def stop_process(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def create_burst_events(db: Database, sink: SinkProcess, count: int, peer: bool) -> dict[str, float]:
    """The burst's events, created for cmb (``create_many``) and PgQueuer (batched enqueue) in batches of
    1,000 that alternate, so both sides meet the same moments of the machine; creates per second of each."""
    far = datetime.now(UTC) + timedelta(days=1)
    events = [
        {
            "owner_client_id": "bench",
            "group_key": "burst",
            "event_key": str(i),
            "run_at": far,
            "cb_url": f"{sink.url}/cb",
        }
        for i in range(count)
    ]
    payloads = [json.dumps({"event_id": i, "run_at": far.isoformat()}).encode() for i in range(count)]
    elapsed = {"cmb": 0.0, "pgqueuer": 0.0}
    loop = asyncio.new_event_loop()
    peer_conn = None
    try:
        if peer:
            import asyncpg
            from pgqueuer.db import AsyncpgDriver
            from pgqueuer.queries import Queries

            peer_conn = loop.run_until_complete(asyncpg.connect(db.url))
            queries = Queries(AsyncpgDriver(peer_conn))
        with CallbackClient(db, LOCAL, buffered=False) as client:
            with db.connection() as conn:  # connected before the clock starts, as PgQueuer's side is
                conn.execute("SELECT 1")
            for start in range(0, count, 1000):
                started = time.monotonic()
                client.create_many(events[start : start + 1000])
                elapsed["cmb"] += time.monotonic() - started
                if peer:
                    part = payloads[start : start + 1000]
                    started = time.monotonic()
                    loop.run_until_complete(
                        queries.enqueue(
                            ["callback"] * len(part), part, [0] * len(part), [far - datetime.now(UTC)] * len(part)
                        )
                    )
                    elapsed["pgqueuer"] += time.monotonic() - started
    finally:
        if peer_conn is not None:
            loop.run_until_complete(peer_conn.close())
        loop.close()
    rates = {side: round(count / seconds) for side, seconds in elapsed.items() if seconds}
    print(
        f"  create_many in batches of 1,000 (one commit per batch on both sides, alternating): cmb {rates['cmb']:,} "
        "events/s" + (f", PgQueuer enqueue {rates['pgqueuer']:,} events/s" if peer else "")
    )
    return rates


def drain_burst(
    name: str,
    url: str,
    sink: SinkProcess,
    count: int,
    due: datetime,
    start: Callable[[], subprocess.Popen],
    settled: str,
    postmaster: int | None,
) -> dict[str, Any]:
    """Start a consumer (``start()`` returns its process), measure it draining ``count`` events due at ``due``
    until every call reached the sink and the ``settled`` query (one boolean) says each outcome is recorded."""
    checkpoint(url)
    sink.clear()
    consumer = start()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            late = time.time() > due.timestamp() - 0.2
            time.sleep(max(0.0, due.timestamp() - time.time() - 0.2))
            with Meter(postmaster, consumer=consumer.pid) as meter:
                finished = wait_for(lambda: sink.count() >= count, timeout=600) and wait_for(
                    lambda: conn.execute(settled).fetchone()[0], timeout=60
                )
    finally:
        stop_process(consumer)
    calls = sink.calls()
    drain = max(c.started for c in calls) - due.timestamp()
    figures = {
        "events_per_s": round(count / drain),
        "drain_s": round(drain, 2),
        "backlog_under_5s": drain < MIN_DRAIN_S,
        "setup_late": late,
        "complete": finished,
        "first_call_after_due_s": round(min(c.started for c in calls) - due.timestamp(), 3),
        "duplicate_calls": len(calls) - len({c.body["event_id"] for c in calls}),
        "early_calls": sum(1 for c in calls if c.started < due.timestamp()),
        **meter.figures(count),
    }
    print(
        f"  {name} burst of {count:,}: {figures['events_per_s']:,} events/s, drained in {drain:.1f}s"
        + (" (UNDER 5 s: raise --burst)" if figures["backlog_under_5s"] else "")
        + (" (set up after the due time)" if late else "")
        + ("" if finished else " (INCOMPLETE: calls or recorded outcomes missing at the time limit)")
        + f"; first call {figures['first_call_after_due_s']:+.2f}s after due, {figures['duplicate_calls']} "
        f"duplicate calls, {figures['early_calls']} early; {cpu_text(figures, 'consumer')}"
    )
    return figures


def bench_cmb_burst(db: Database, sink: SinkProcess, count: int, postmaster: int | None) -> dict[str, Any]:
    with db.connection() as conn:
        due = conn.execute(
            "UPDATE callback_events SET run_at = now() + make_interval(secs => %s), originally_run_at = now() + "
            "make_interval(secs => %s) RETURNING run_at",
            (BURST_LEAD_S, BURST_LEAD_S),
        ).fetchone()[0]
    vacuum(db.url, f"{db.schema}.callback_events")
    figures = drain_burst(
        "cmb",
        db.url,
        sink,
        count,
        due,
        lambda: start_cmb_worker(db.url, "cmb-worker-burst.log"),
        f"SELECT count(*) = {count} FROM {db.schema}.callback_events WHERE status = 'notified'",
        postmaster,
    )
    with db.connection() as conn:
        conn.execute("DELETE FROM callback_events")
    vacuum(db.url, f"{db.schema}.callback_events")
    figures["errors_logged"] = errors_logged("cmb-worker-burst.log")
    return figures


def bench_pgqueuer_burst(
    url: str, sink: SinkProcess, count: int, postmaster: int | None, repoll: float
) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:  # due as for cmb
        due = conn.execute(
            "UPDATE pgqueuer SET execute_after = now() + make_interval(secs => %s) RETURNING execute_after",
            (BURST_LEAD_S,),
        ).fetchone()[0]
    vacuum(url, "pgqueuer")
    figures = drain_burst(
        "PgQueuer",
        url,
        sink,
        count,
        due,
        lambda: start_pgqueuer_consumer(url, sink.url, repoll, "pgqueuer-burst.log"),
        "SELECT NOT EXISTS (SELECT FROM pgqueuer)",  # a job done is deleted (and logged)
        postmaster,
    )
    clear_pgqueuer(url)
    figures["errors_logged"] = errors_logged("pgqueuer-burst.log")
    return figures


# -- steady ----------------------------------------------------------------------------------------


def steady_run_ats(rate: int, seconds: float):  # type: ignore[no-untyped-def]
    """Yield (create_at_monotonic, delay_s) for a steady stream: 20% due at once, 30% due within the next
    poll (0.1-1 s later), 50% created ahead of time (4-6 s later, past the poll and its lookahead)."""
    rng = random.Random(7)
    start = time.monotonic() + 0.5
    for i in range(int(rate * seconds)):
        kind = rng.random()
        delay = 0.0 if kind < 0.2 else rng.uniform(0.1, 1.0) if kind < 0.5 else rng.uniform(4.0, 6.0)
        yield start + i / rate, delay


def warmed_up(sink: SinkProcess) -> None:
    """Wait for the probe the consumer just got to reach the sink, then forget it: the steady figures are
    those of a consumer already running (started, connected, listening), as a deployment's is."""
    if not wait_for(lambda: sink.count() >= 1, timeout=60):
        raise RuntimeError("the consumer did not call the warm-up probe within 60 s")
    sink.clear()


LATENESS_KINDS = ("due_at_creation", "due_within_next_poll", "ahead_of_time")  # as lateness_summary sorts them


def lateness_summary(name: str, calls: list) -> dict[str, Any]:  # type: ignore[type-arg]
    latenesses = [c.started - datetime.fromisoformat(c.body["run_at"]).timestamp() for c in calls]
    delays = [c.body["context"]["delay"] for c in calls]
    kinds = {
        "due_at_creation": [x for x, d in zip(latenesses, delays, strict=True) if d == 0.0],
        "due_within_next_poll": [x for x, d in zip(latenesses, delays, strict=True) if 0.0 < d < 3.0],
        "ahead_of_time": [x for x, d in zip(latenesses, delays, strict=True) if d >= 3.0],
    }
    summary = {
        "events": len(latenesses),
        "p50_s": round(percentile(latenesses, 50), 3),
        "p99_s": round(percentile(latenesses, 99), 3),
        "max_s": round(max(latenesses), 3) if latenesses else float("nan"),
        **{f"{kind}_p50_s": round(percentile(values, 50), 3) for kind, values in kinds.items()},
        **{f"{kind}_p99_s": round(percentile(values, 99), 3) for kind, values in kinds.items()},
        "early_calls": sum(1 for x in latenesses if x < 0),
    }
    print(
        f"  {name} steady: {summary['events']:,} events, lateness p50 {summary['p50_s']:.3f}s, "
        f"p99 {summary['p99_s']:.3f}s, max {summary['max_s']:.3f}s; p50/p99 by kind: "
        + ", ".join(f"{kind} {summary[f'{kind}_p50_s']:.3f}/{summary[f'{kind}_p99_s']:.3f}s" for kind in kinds)
        + f"; {summary['early_calls']} early"
    )
    return summary


def steady_tail(name: str, url: str, table: str, summary: dict[str, Any], lags: list[float], meter: Meter) -> None:
    """Add to ``summary`` what was measured around the run: producers' lag, CPU, autovacuum, dead tuples."""
    summary["producer_lag_p99_s"] = round(percentile(lags, 99), 3)
    summary.update(meter.figures(summary["events"]))
    summary["dead_tuples_end"] = dead_tuples(url, table)
    print(
        f"  {name}: create returned p99 {summary['producer_lag_p99_s']:.3f}s after its planned moment; "
        f"{cpu_text(summary, 'consumer', 'producers')}; dead tuples in {table} {summary['dead_tuples_start']:,} "
        f"before, {summary['dead_tuples_end']:,} after; autovacuum: {', '.join(summary['autovacuumed']) or 'none'}"
    )


def bench_cmb_steady(
    db: Database, sink: SinkProcess, rate: int, seconds: float, postmaster: int | None
) -> dict[str, Any]:
    checkpoint(db.url)
    sink.clear()
    worker = start_cmb_worker(db.url, "cmb-worker-steady.log")
    lags: list[float] = []  # how late each create returned, against its planned moment
    try:
        with CallbackClient(db, LOCAL) as client, ThreadPoolExecutor(8) as pool:
            client.create("bench", "warm-up", "probe", datetime.now(UTC), f"{sink.url}/cb")
            warmed_up(sink)
            schedule: list[tuple[float, float]] = []

            def produce(part: int) -> None:
                for n, (at, delay) in enumerate(schedule[part::8]):
                    pause = at - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    client.create(
                        "bench",
                        "steady",
                        f"{part}-{n}",
                        datetime.now(UTC) + timedelta(seconds=delay),
                        f"{sink.url}/cb",
                        {"delay": delay},
                    )
                    lags.append(time.monotonic() - at)

            dead_start = dead_tuples(db.url, "callback_events")
            maintenance = autovacuum_counts(db.url)
            with Meter(postmaster, consumer=worker.pid, producers=os.getpid()) as meter:
                schedule.extend(steady_run_ats(rate, seconds))
                list(pool.map(produce, range(8)))
                wait_for(lambda: sink.count() >= len(schedule), timeout=60)
    finally:
        stop_process(worker)
    summary = lateness_summary("cmb", sink.calls())
    summary["dead_tuples_start"] = dead_start
    summary["autovacuumed"] = autovacuumed_since(db.url, maintenance)
    summary["errors_logged"] = errors_logged("cmb-worker-steady.log")
    steady_tail("cmb (producers on the default, buffered client)", db.url, "callback_events", summary, lags, meter)
    return summary


def bench_pgqueuer_steady(
    url: str, sink: SinkProcess, rate: int, seconds: float, postmaster: int | None, repoll: float
) -> dict[str, Any]:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    name = f"PgQueuer (re-poll floor {repoll * 1000:g} ms)"
    log_name = f"pgqueuer-steady-{repoll * 1000:g}ms.log"
    checkpoint(url)
    sink.clear()
    consumer = start_pgqueuer_consumer(url, sink.url, repoll, log_name)

    async def probe() -> None:
        conn = await asyncpg.connect(url)
        payload = json.dumps({"event_id": "probe", "run_at": datetime.now(UTC).isoformat(), "context": None})
        await Queries(AsyncpgDriver(conn)).enqueue("callback", payload.encode(), 0)
        await conn.close()

    lags: list[float] = []

    async def produce() -> int:  # 8 producers, connected before the schedule starts, as cmb's 8 threads
        conns = [await asyncpg.connect(url) for _ in range(8)]
        schedule = list(steady_run_ats(rate, seconds))

        async def part(n: int) -> None:
            queries = Queries(AsyncpgDriver(conns[n]))
            for i, (at, delay) in enumerate(schedule[n::8]):
                pause = at - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                run_at = datetime.now(UTC) + timedelta(seconds=delay)
                payload = json.dumps({"event_id": i, "run_at": run_at.isoformat(), "context": {"delay": delay}})
                await queries.enqueue("callback", payload.encode(), 0, timedelta(seconds=delay))
                lags.append(time.monotonic() - at)

        try:
            await asyncio.gather(*(part(n) for n in range(8)))
        finally:
            for conn in conns:
                await conn.close()
        return len(schedule)

    try:
        asyncio.run(probe())
        warmed_up(sink)
        dead_start = dead_tuples(url, "pgqueuer")
        maintenance = autovacuum_counts(url)
        with Meter(postmaster, consumer=consumer.pid, producers=os.getpid()) as meter:
            expected = asyncio.run(produce())
            wait_for(lambda: sink.count() >= expected, timeout=60)
    finally:
        stop_process(consumer)
    summary = lateness_summary(name, sink.calls())
    summary["repoll_floor_s"] = repoll
    summary["dead_tuples_start"] = dead_start
    summary["autovacuumed"] = autovacuumed_since(url, maintenance)
    summary["errors_logged"] = errors_logged(log_name)
    steady_tail(name, url, "pgqueuer", summary, lags, meter)
    return summary


# -- PgQueuer ------------------------------------------------------------------------------------


async def _pgqueuer_consumer(url: str, sink_url: str, repoll: float) -> None:
    """PgQueuer as its docs set it up (see the module's docstring), re-polling at least ``repoll`` s apart."""
    import aiohttp
    import asyncpg
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    qm.min_dequeue_poll_interval = timedelta(seconds=repoll)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=PGQUEUER_MAX_CONCURRENT_TASKS))
    target = f"{sink_url}/cb"

    @qm.entrypoint("callback")
    async def callback(job) -> None:  # type: ignore[no-untyped-def]
        async with session.post(target, data=job.payload, headers={"Content-Type": "application/json"}) as response:
            await response.read()  # the whole response, as a callback client must
            if response.status // 100 != 2:
                raise RuntimeError(f"HTTP {response.status}")

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    try:
        await qm.run(
            batch_size=PGQUEUER_BATCH_SIZE,
            max_concurrent_tasks=PGQUEUER_MAX_CONCURRENT_TASKS,
            dequeue_timeout=timedelta(seconds=LOCAL.poll_interval),
        )
    finally:
        await session.close()


def pgqueuer_default_repoll() -> float | None:
    """PgQueuer's re-poll floor (seconds), or None if it is not installed or has no such setting."""
    try:
        from pgqueuer import QueueManager
    except ImportError:
        return None
    field = QueueManager.__dataclass_fields__.get("min_dequeue_poll_interval")
    return None if field is None else field.default.total_seconds()


async def _pgqueuer_install(url: str) -> None:
    from pgqueuer.queries import Queries

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await Queries.from_psycopg_connection(conn).install()


def start_pgqueuer_consumer(url: str, sink_url: str, repoll: float, log_name: str) -> subprocess.Popen:
    log = open(LOG_DIR / log_name, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, __file__, "--pgqueuer-consumer", url, sink_url, str(repoll)], stdout=log, stderr=log
    )


# -- main ----------------------------------------------------------------------------------------


FIGURES = ("create", "burst", "steady")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="Smaller numbers, for a smoke run.")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=FIGURES,
        default=FIGURES,
        help="Run only these figures (each with its PgQueuer side).",
    )
    parser.add_argument(
        "--signed",
        action="store_true",
        help="Give the events' owner a signing secret: each cmb call carries a Standard Webhooks signature.",
    )
    parser.add_argument("--burst", type=int, help="Events in the burst, each side (default 40,000; quick 5,000).")
    parser.add_argument("--rate", type=int, help="Events per second of the steady run (default 1,000; quick 200).")
    parser.add_argument("--seconds", type=float, help="Length of the steady run (default 10).")
    parser.add_argument("--create-seconds", type=float, help="Length of each create run (default 3; quick 2).")
    parser.add_argument("--pgqueuer-consumer", nargs=3, metavar=("URL", "SINK", "REPOLL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pgqueuer_consumer:
        url, sink_url, repoll = args.pgqueuer_consumer
        asyncio.run(_pgqueuer_consumer(url, sink_url, float(repoll)))
        return
    burst = args.burst or (5_000 if args.quick else 40_000)
    rate = args.rate or (200 if args.quick else 1_000)
    seconds = args.seconds or 10.0
    create_seconds = args.create_seconds or (2.0 if args.quick else 3.0)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    default_repoll = pgqueuer_default_repoll()
    peer = default_repoll is not None
    repolls = sorted({default_repoll, 0.01}, reverse=True) if peer else []
    results: dict[str, Any] = {
        "benchmark": "callbacks",
        "cpus": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "figures": list(args.only),
        "sizes": {"burst": burst, "rate": rate, "seconds": seconds, "create_seconds": create_seconds},
        "signed": args.signed,
    }
    ratios: dict[str, float] = {}
    with bench_database() as db:
        url = db.url
        postmaster = find_postmaster(url)
        with psycopg.connect(url, autocommit=True) as conn:
            server_info = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("server_version", "fsync", "synchronous_commit", "autovacuum")
            }
        results["server"] = server_info
        results["postgres_cpu_measured"] = postmaster is not None
        print(
            f"callbacks benchmark on {db.display_url} ({os.cpu_count()} CPUs, shared, load average "
            f"{results['load_average_start'][0]}), " + ", ".join(f"{k} {v}" for k, v in server_info.items())
        )
        if postmaster is None:
            print("  the server is not on this machine: its CPU is not measured")
        if args.signed:
            with CallbackClient(db, LOCAL) as client:
                client.rotate_secret("bench")
        if peer:
            asyncio.run(_pgqueuer_install(url))
            results["pgqueuer"] = {
                "driver": "asyncpg",
                "batch_size": PGQUEUER_BATCH_SIZE,
                "max_concurrent_tasks": PGQUEUER_MAX_CONCURRENT_TASKS,
                "dequeue_timeout_s": LOCAL.poll_interval,
                "repoll_floor_default_s": default_repoll,
            }
        else:
            print(
                "  PgQueuer not installed, or without min_dequeue_poll_interval (pip install -U pgqueuer): "
                "side-by-side skipped"
            )
        if "create" in args.only:
            created = results["create"] = bench_create(db, postmaster, create_seconds, peer)
            if peer:
                for producers in (1, 16):
                    ratios[f"create_one_commit_per_event_{producers}_producers_cmb_over_pgqueuer"] = (
                        created[f"cmb_one_commit_per_event_{producers}"]["events_per_s"]
                        / created[f"pgqueuer_enqueue_{producers}"]["events_per_s"]
                    )
        with SinkProcess() as sink:
            if "burst" in args.only:
                created = results["create_many_per_s"] = create_burst_events(db, sink, burst, peer)
                vacuum(url)  # loaded: counted before either side drains
                cmb = results["cmb_burst"] = bench_cmb_burst(db, sink, burst, postmaster)
                if peer:
                    other = results["pgqueuer_burst"] = bench_pgqueuer_burst(url, sink, burst, postmaster, repolls[0])
                    ratios["burst_drain_cmb_over_pgqueuer"] = cmb["events_per_s"] / other["events_per_s"]
                    ratios["create_many_cmb_over_pgqueuer"] = created["cmb"] / created["pgqueuer"]
                    ratios["consumer_cpu_per_call_cmb_over_pgqueuer"] = cmb["consumer_cpu_ms_per_event"] / max(
                        other["consumer_cpu_ms_per_event"], 1e-9
                    )
                    if postmaster is not None:
                        ratios["postgres_cpu_per_call_cmb_over_pgqueuer"] = cmb["postgres_cpu_ms_per_event"] / max(
                            other["postgres_cpu_ms_per_event"], 1e-9
                        )
            if "steady" in args.only:
                clear_events(db, peer)
                cs = results["cmb_steady"] = bench_cmb_steady(db, sink, rate, seconds, postmaster)
                for repoll in repolls:
                    label = f"pgqueuer_repoll_{repoll * 1000:g}ms"
                    clear_events(db, peer)
                    ps = results[f"{label}_steady"] = bench_pgqueuer_steady(
                        url, sink, rate, seconds, postmaster, repoll
                    )
                    ratios[f"lateness_p99_{label}_over_cmb"] = ps["p99_s"] / max(cs["p99_s"], 1e-3)
                    for kind in LATENESS_KINDS:
                        ratios[f"{kind}_p99_{label}_over_cmb"] = ps[f"{kind}_p99_s"] / max(cs[f"{kind}_p99_s"], 1e-3)
                if peer:
                    print(
                        f"  PgQueuer's lateness of events created ahead is set by its re-poll floor "
                        f"(min_dequeue_poll_interval, {default_repoll * 1000:g} ms by default: the wait for a deferred "
                        "job is never shorter); compare its runs at each floor"
                    )
                results["lateness_target_met"] = all(cs[f"{kind}_p99_s"] < 0.05 for kind in LATENESS_KINDS)
                print(
                    f"  lateness target (p99 < 50 ms at {rate}/s, every kind): "
                    f"{'met' if results['lateness_target_met'] else 'MISSED'}"
                )
        results["ratios"] = {k: round(v, 2) for k, v in ratios.items()}
        for key, value in results["ratios"].items():
            print(f"  {key}: {value}x")
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"  load average: start {results['load_average_start']}, end {results['load_average_end']}")
    sys.stdout.flush()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
