"""Callbacks benchmark: create throughput, a burst of 20,000 events due at once and a steady 1,000 events/s,
side by side with PgQueuer.

    .venv/bin/python benchmarks/bench_callbacks.py [--quick] [--only create burst steady] [--signed]

Runs on CMB_DATABASE_URL (or the embedded server) in a database of its own, dropped at the end. Callbacks
go to a local HTTP sink on 127.0.0.1 in a process of its own (so the producers' threads here cannot delay its
clock readings); the cmb worker (``cmb-dagster callbacks worker``) and the PgQueuer consumer run as separate
processes, one at a time. Lateness is the sink's arrival time minus the event's run_at, measured once each
consumer has called a warm-up probe (a long-running consumer). PgQueuer (pip install pgqueuer) is only needed
here. Run it alone on the machine: other load moves every figure. The last line is JSON.
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
from collections.abc import Iterator
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

from cmb_dagster.callbacks import CallbackClient, CallbackSettings  # noqa: E402
from cmb_dagster.callbacks.sink import CallbackSink  # noqa: E402
from cmb_dagster.database import Database  # noqa: E402
from cmb_dagster.settings import Settings  # noqa: E402

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
LOCAL = CallbackSettings(allowed_hosts=["127.0.0.1"])  # the sink: private addresses are closed by default
LOG_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / f"cmb-bench-{os.getpid()}"


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


def bench_create(db: Database, seconds: float) -> dict[str, float]:
    results = {}
    far = datetime.now(UTC) + timedelta(days=1)
    for buffered in (True, False):
        for threads in (1, 16):
            label = f"{'buffered' if buffered else 'one_insert_per_event'}_{threads}_threads"
            done = [0] * threads
            stop = time.monotonic() + seconds
            with CallbackClient(db, LOCAL, buffered=buffered) as client:

                def produce(n: int, stop: float = stop, label: str = label, done: list[int] = done) -> None:
                    i = 0
                    while time.monotonic() < stop:
                        client.create("bench", label, f"{n}-{i}", far, "http://127.0.0.1:9/x")
                        i += 1
                    done[n] = i

                started = time.monotonic()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(produce, range(threads)))
                elapsed = time.monotonic() - started
            results[label] = round(sum(done) / elapsed)
            print(f"  create {label:36s} {results[label]:>8,} events/s")
    with db.connection() as conn:
        conn.execute("DELETE FROM callback_events")
    vacuum(db.url, f"{db.schema}.callback_events")
    return results


# -- cmb worker ----------------------------------------------------------------------------------


def start_cmb_worker(url: str) -> subprocess.Popen:
    env = {**os.environ, "CMB_DATABASE_URL": url}
    log = open(LOG_DIR / "cmb-worker.log", "ab")  # noqa: SIM115 - the child owns it
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


def vacuum(url: str, table: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"VACUUM {table}")


def checkpoint(url: str) -> None:
    """Flush what earlier phases wrote, so that no side's timed phase pays for a checkpoint of another's WAL."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


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
        f"  create_many in batches of 1,000 (alternating batches): cmb {rates['cmb']:,} events/s"
        + (f", PgQueuer enqueue {rates['pgqueuer']:,} events/s" if peer else "")
    )
    return rates


def bench_cmb_burst(db: Database, sink: SinkProcess, count: int) -> dict[str, float]:
    checkpoint(db.url)
    with db.connection() as conn:
        due = conn.execute(
            "UPDATE callback_events SET run_at = now() + interval '4 seconds', originally_run_at = now() + "
            "interval '4 seconds' RETURNING run_at"
        ).fetchone()[0]
    vacuum(db.url, f"{db.schema}.callback_events")
    sink.clear()
    worker = start_cmb_worker(db.url)
    try:
        time.sleep(max(0.0, due.timestamp() - time.time() - 0.2))
        cpu_before = cpu_seconds(worker.pid)
        finished = wait_for(lambda: sink.count() >= count, timeout=600)
        cpu = cpu_seconds(worker.pid) - cpu_before
    finally:
        stop_process(worker)
    calls = sink.calls()
    last = max(c.started for c in calls)
    first = min(c.started for c in calls)
    drain = last - due.timestamp()
    rate = count / drain
    with db.connection() as conn:
        notified = conn.execute("SELECT count(*) FROM callback_events WHERE status = 'notified'").fetchone()[0]
        conn.execute("DELETE FROM callback_events")
    vacuum(db.url, f"{db.schema}.callback_events")  # the steady phase starts from a clean table
    early = sum(1 for c in calls if c.started < due.timestamp())
    print(
        f"  cmb burst of {count:,}: {rate:,.0f} events/s (first call {first - due.timestamp():+.2f}s after due, "
        f"{notified:,} notified, {len(calls) - count} duplicate calls, {early} early); worker CPU "
        f"{cpu:.1f}s = {1000 * cpu / count:.2f} ms per call, {100 * cpu / drain:.0f}% of a core"
    )
    return {
        "events_per_s": round(rate),
        "complete": finished and notified == count,
        "early_calls": early,
        "cpu_ms_per_call": round(1000 * cpu / count, 3),
        "cpu_percent": round(100 * cpu / drain),
        "errors_logged": errors_logged("cmb-worker.log"),
    }


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


def lateness_summary(name: str, calls: list) -> dict[str, float]:  # type: ignore[type-arg]
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
        **{f"{kind}_p99_s": round(percentile(values, 99), 3) for kind, values in kinds.items()},
        "early_calls": sum(1 for x in latenesses if x < 0),
    }
    print(
        f"  {name} steady: {summary['events']:,} events, lateness p50 {summary['p50_s']:.3f}s, "
        f"p99 {summary['p99_s']:.3f}s, max {summary['max_s']:.3f}s; p99 by kind: "
        + ", ".join(f"{kind} {summary[f'{kind}_p99_s']:.3f}s" for kind in kinds)
        + f"; {summary['early_calls']} early"
    )
    return summary


def bench_cmb_steady(db: Database, sink: SinkProcess, rate: int, seconds: float) -> dict[str, float]:
    checkpoint(db.url)
    sink.clear()
    worker = start_cmb_worker(db.url)
    dead: list[int] = []
    lags: list[float] = []  # how late each create returned, against its planned moment
    try:
        with CallbackClient(db, LOCAL) as client, ThreadPoolExecutor(8) as pool:
            client.create("bench", "warm-up", "probe", datetime.now(UTC), f"{sink.url}/cb")
            warmed_up(sink)
            schedule = list(steady_run_ats(rate, seconds))
            expected = len(schedule)

            def produce(part: int) -> None:
                for n, (at, delay) in enumerate(schedule[part::8]):
                    pause = at - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    key = f"{part}-{n}"
                    client.create(
                        "bench",
                        "steady",
                        key,
                        datetime.now(UTC) + timedelta(seconds=delay),
                        f"{sink.url}/cb",
                        {"delay": delay},
                    )
                    lags.append(time.monotonic() - at)

            sampler_stop = threading.Event()

            def sample() -> None:
                while not sampler_stop.wait(2):
                    dead.append(dead_tuples(db.url, "callback_events"))

            threading.Thread(target=sample, daemon=True).start()
            maintenance = autovacuum_counts(db.url)
            cpu_before, started = cpu_seconds(worker.pid), time.monotonic()
            list(pool.map(produce, range(8)))
            wait_for(lambda: sink.count() >= expected, timeout=60)
            cpu = cpu_seconds(worker.pid) - cpu_before
            elapsed = time.monotonic() - started
            sampler_stop.set()
    finally:
        stop_process(worker)
    summary = lateness_summary("cmb", sink.calls())
    summary["producer_lag_p99_s"] = round(percentile(lags, 99), 3)
    print(f"  cmb producers: create returned p99 {summary['producer_lag_p99_s']:.3f}s after its planned moment")
    summary["cpu_percent"] = round(100 * cpu / elapsed)
    print(f"  cmb worker CPU during the steady run: {summary['cpu_percent']}% of a core")
    summary["autovacuumed"] = autovacuumed_since(db.url, maintenance)
    print(f"  autovacuum during the cmb steady run: {', '.join(summary['autovacuumed']) or 'none'}")
    summary["dead_tuples_max"] = max(dead, default=0)
    summary["dead_tuples_end"] = dead[-1] if dead else 0
    with db.connection() as conn:
        summary["table_mb"] = round(
            conn.execute("SELECT pg_total_relation_size('callback_events')").fetchone()[0] / 2**20, 1
        )
        summary["rows"] = conn.execute("SELECT count(*) FROM callback_events WHERE group_key = 'steady'").fetchone()[0]
    print(
        f"  cmb dead tuples in callback_events: max {summary['dead_tuples_max']:,}, end "
        f"{summary['dead_tuples_end']:,} ({summary['rows']:,} rows, {summary['table_mb']} MB with indexes)"
    )
    return summary


# -- PgQueuer ------------------------------------------------------------------------------------


async def _pgqueuer_consumer(url: str, sink_url: str) -> None:
    """PgQueuer as its docs set it up: asyncpg driver, one aiohttp session reading whole responses."""
    import aiohttp
    import asyncpg
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200))
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
        await qm.run(batch_size=50, max_concurrent_tasks=200, dequeue_timeout=timedelta(seconds=1))
    finally:
        await session.close()


def pgqueuer_available() -> bool:
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


async def _pgqueuer_install(url: str) -> None:
    from pgqueuer.queries import Queries

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await Queries.from_psycopg_connection(conn).install()


def start_pgqueuer_consumer(url: str, sink_url: str) -> subprocess.Popen:
    log = open(LOG_DIR / "pgqueuer-consumer.log", "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen([sys.executable, __file__, "--pgqueuer-consumer", url, sink_url], stdout=log, stderr=log)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def errors_logged(name: str) -> int:
    path = LOG_DIR / name
    if not path.exists():
        return 0
    text = path.read_text(errors="replace")
    return text.count("Traceback") + text.count(" ERROR ")


def bench_pgqueuer_burst(url: str, sink: SinkProcess, count: int) -> dict[str, float]:
    checkpoint(url)
    with psycopg.connect(url, autocommit=True) as conn:  # due in 4 s, as for cmb
        due = conn.execute(
            "UPDATE pgqueuer SET execute_after = now() + interval '4 seconds' RETURNING execute_after"
        ).fetchone()[0]
    vacuum(url, "pgqueuer")
    sink.clear()
    consumer = start_pgqueuer_consumer(url, sink.url)
    try:
        time.sleep(max(0.0, due.timestamp() - time.time() - 0.2))
        cpu_before = cpu_seconds(consumer.pid)
        finished = wait_for(lambda: sink.count() >= count, timeout=600)
        cpu = cpu_seconds(consumer.pid) - cpu_before
    finally:
        stop_process(consumer)
    last = max(c.started for c in sink.calls())
    drain = last - due.timestamp()
    rate = count / drain
    errors = errors_logged("pgqueuer-consumer.log")
    print(
        f"  PgQueuer burst of {count:,}: {rate:,.0f} events/s; consumer CPU {cpu:.1f}s = {1000 * cpu / count:.2f} ms "
        f"per call, {100 * cpu / drain:.0f}% of a core; {errors} errors logged"
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM pgqueuer")
    vacuum(url, "pgqueuer")
    return {
        "events_per_s": round(rate),
        "complete": finished,
        "cpu_ms_per_call": round(1000 * cpu / count, 3),
        "cpu_percent": round(100 * cpu / drain),
        "errors_logged": errors,
    }


def bench_pgqueuer_single_enqueue(url: str, producers: int, seconds: float) -> int:
    """One job per enqueue from ``producers`` concurrent asyncpg connections (PgQueuer's single enqueue)."""

    async def go() -> int:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        stop = time.monotonic() + seconds
        run_at = (datetime.now(UTC) + timedelta(days=1)).isoformat()

        async def part(n: int) -> int:
            conn = await asyncpg.connect(url)
            queries = Queries(AsyncpgDriver(conn))
            i = 0
            while time.monotonic() < stop:
                payload = json.dumps({"event_id": f"{n}-{i}", "run_at": run_at}).encode()
                await queries.enqueue("callback", payload, 0, timedelta(days=1))
                i += 1
            await conn.close()
            return i

        return sum(await asyncio.gather(*(part(n) for n in range(producers))))

    started = time.monotonic()
    done = asyncio.run(go())
    rate = round(done / (time.monotonic() - started))
    print(f"  PgQueuer single enqueue, {producers} concurrent producers: {rate:>8,} events/s")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM pgqueuer")
    vacuum(url, "pgqueuer")
    return rate


def bench_pgqueuer_steady(url: str, sink: SinkProcess, rate: int, seconds: float) -> dict[str, float]:
    checkpoint(url)
    sink.clear()
    consumer = start_pgqueuer_consumer(url, sink.url)

    async def probe() -> None:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(url)
        payload = json.dumps({"event_id": "probe", "run_at": datetime.now(UTC).isoformat(), "context": None})
        await Queries(AsyncpgDriver(conn)).enqueue("callback", payload.encode(), 0)
        await conn.close()

    asyncio.run(probe())
    warmed_up(sink)
    schedule = list(steady_run_ats(rate, seconds))
    dead: list[int] = []
    lags: list[float] = []

    async def produce() -> None:  # 8 producers on connections of their own, as cmb's 8 threads
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        async def part(n: int) -> None:
            conn = await asyncpg.connect(url)
            queries = Queries(AsyncpgDriver(conn))
            for i, (at, delay) in enumerate(schedule[n::8]):
                pause = at - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                run_at = datetime.now(UTC) + timedelta(seconds=delay)
                payload = json.dumps({"event_id": i, "run_at": run_at.isoformat(), "context": {"delay": delay}})
                await queries.enqueue("callback", payload.encode(), 0, timedelta(seconds=delay))
                lags.append(time.monotonic() - at)
                if n == 0 and i % (rate // 4) == 0:
                    dead.append(dead_tuples(url, "pgqueuer"))
            await conn.close()

        await asyncio.gather(*(part(n) for n in range(8)))

    try:
        maintenance = autovacuum_counts(url)
        cpu_before, started = cpu_seconds(consumer.pid), time.monotonic()
        asyncio.run(produce())
        wait_for(lambda: sink.count() >= len(schedule), timeout=60)
        cpu = cpu_seconds(consumer.pid) - cpu_before
        elapsed = time.monotonic() - started
    finally:
        stop_process(consumer)
    summary = lateness_summary("PgQueuer", sink.calls())
    summary["producer_lag_p99_s"] = round(percentile(lags, 99), 3)
    print(f"  PgQueuer producers: create returned p99 {summary['producer_lag_p99_s']:.3f}s after its planned moment")
    summary["cpu_percent"] = round(100 * cpu / elapsed)
    summary["errors_logged"] = errors_logged("pgqueuer-consumer.log")
    print(
        f"  PgQueuer consumer CPU during the steady run: {summary['cpu_percent']}% of a core, "
        f"{summary['errors_logged']} errors logged"
    )
    summary["autovacuumed"] = autovacuumed_since(url, maintenance)
    print(f"  autovacuum during the PgQueuer steady run: {', '.join(summary['autovacuumed']) or 'none'}")
    summary["dead_tuples_max"] = max(dead, default=0)
    return summary


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
    parser.add_argument("--pgqueuer-consumer", nargs=2, metavar=("URL", "SINK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pgqueuer_consumer:
        asyncio.run(_pgqueuer_consumer(*args.pgqueuer_consumer))
        return
    burst, rate, seconds, create_seconds = (5_000, 200, 10, 2) if args.quick else (20_000, 1_000, 10, 3)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    peer = pgqueuer_available()
    results: dict[str, Any] = {
        "benchmark": "callbacks",
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "figures": list(args.only),
        "signed": args.signed,
    }
    ratios: dict[str, float] = {}
    with bench_database() as db:
        url = db.url
        with psycopg.connect(url, autocommit=True) as conn:
            server_info = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("server_version", "fsync", "synchronous_commit", "autovacuum")
            }
        results["server"] = server_info
        results["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
        print(
            f"callbacks benchmark on {db.display_url} ({os.cpu_count()} CPUs, shared), "
            + ", ".join(f"{k} {v}" for k, v in server_info.items())
        )
        if args.signed:
            with CallbackClient(db, LOCAL) as client:
                client.rotate_secret("bench")
        if peer:
            asyncio.run(_pgqueuer_install(url))
        else:
            print("  PgQueuer not installed (pip install pgqueuer): side-by-side skipped")
        if "create" in args.only:
            results["create_events_per_s"] = bench_create(db, create_seconds)
            if peer:
                results["pgqueuer_single_enqueue_16_per_s"] = bench_pgqueuer_single_enqueue(url, 16, create_seconds)
                ratios["create_16_threads_cmb_over_pgqueuer"] = (
                    results["create_events_per_s"]["buffered_16_threads"] / results["pgqueuer_single_enqueue_16_per_s"]
                )
        with SinkProcess() as sink:
            if "burst" in args.only:
                created = results["create_many_per_s"] = create_burst_events(db, sink, burst, peer)
                cmb = results["cmb_burst"] = bench_cmb_burst(db, sink, burst)
                if peer:
                    other = results["pgqueuer_burst"] = bench_pgqueuer_burst(url, sink, burst)
                    ratios["burst_drain_cmb_over_pgqueuer"] = cmb["events_per_s"] / other["events_per_s"]
                    ratios["create_many_cmb_over_pgqueuer"] = created["cmb"] / created["pgqueuer"]
                    ratios["cpu_per_call_cmb_over_pgqueuer"] = cmb["cpu_ms_per_call"] / max(
                        other["cpu_ms_per_call"], 1e-9
                    )
            if "steady" in args.only:
                cs = results["cmb_steady"] = bench_cmb_steady(db, sink, rate, seconds)
                if peer:
                    ps = results["pgqueuer_steady"] = bench_pgqueuer_steady(url, sink, rate, seconds)
                    ratios["lateness_p99_pgqueuer_over_cmb"] = ps["p99_s"] / max(cs["p99_s"], 1e-3)
                    for kind in LATENESS_KINDS:
                        ratios[f"{kind}_p99_pgqueuer_over_cmb"] = ps[f"{kind}_p99_s"] / max(cs[f"{kind}_p99_s"], 1e-3)
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
    print(json.dumps(results))


if __name__ == "__main__":
    main()
