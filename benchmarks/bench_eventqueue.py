"""Event queue benchmark: cmb_dagster.eventqueue vs procrastinate, same Postgres, same task.

Two kinds of run, each engine with its own worker processes:
- the full no-op run (no --wait): throughput with 1 and 4 worker processes over a backlog loaded beforehand
  (handler starts per second); latency from emit to handler start (p50/p99) with one worker: at a steady --rate
  with LISTEN/NOTIFY on, at --low-rate with it on, and at --rate with notifications off (polling only);
- a run whose handlers wait (--wait SECONDS, --kind sync|async): one worker a side drains a backlog, the sides
  taking turns --rounds times; handler ends per second, median and each round, against the ideal rate
  concurrency / wait. --wait 0 runs a no-op handler of --kind the same way (one worker, rounds).

How each side is set up (the same in every run unless said):
- cmb: ``EventWorker`` with ``WorkerSettings`` defaults (batch_size 100) except ``worker_concurrency`` = --concurrency,
  ``sweep_interval`` = --poll-interval and ``listen`` (off in the polling run). The no-op handler is a plain
  function; with --wait, a function calling ``time.sleep`` (--kind sync) or an ``async def`` awaiting
  ``asyncio.sleep`` (--kind async).
- procrastinate (the version installed): ``App.run_worker_async`` with ``concurrency`` = --concurrency (its
  sub-workers), ``fetch_job_polling_interval`` = --poll-interval and ``listen_notify`` (off in the polling run),
  other options at their defaults (``delete_jobs`` "never": a finished job stays as a row marked succeeded);
  ``PsycopgConnector`` pool ``max_size`` = concurrency + 1, as its docs advise for short jobs (the listening
  connection is outside the pool), at most PEER_POOL_MAX (its docs: the longer the jobs, the smaller the pool
  may be; one worker fetches one job at a time). The no-op task is ``async def`` (its fastest, and its docs'
  recommended form for concurrency); with --wait, the task is of --kind, as on our side: procrastinate runs a
  sync task in a thread of its event loop's default executor (asgiref ``sync_to_async``), sized here to
  --peer-threads (default --concurrency; asyncio's own default is min(32, cores + 4), which would cap the
  calls in flight below the concurrency).
- Both handlers append one line to a file of the worker's own: (emit time, start time) for the no-op, (start,
  end) for a handler that waits.

How it is measured:
- Each run starts from truncated tables (VACUUM ANALYZE). A throughput run loads its backlog first (cmb
  ``emit_many``, procrastinate ``batch_defer``, LOAD_BATCH a transaction, with an ANALYZE of the table every
  ANALYZE_EVERY events in place of autovacuum), then ANALYZEs both engines' tables. Each engine has a backlog
  large enough for a drain of MIN_DRAIN seconds or more; a shorter drain is flagged. No-op: a backlog of each
  engine's own size (--events, --peer-events). With --wait > 0: the same for both, sized for MIN_DRAIN seconds
  at the ideal rate (within WAIT_BACKLOG) unless --events is given; a side far below the ideal is given up at
  the latest of 120 s, a second per 20 events and three times the ideal drain plus 30 s, or after STALL seconds
  without a record, and its undone events are flagged.
- Workers start behind a gate: each process imports its engine, builds its worker, opens its connections
  (cmb: registers its handlers; procrastinate: opens its pool) and waits on its stdin; the gate opens for all
  at once. Throughput counts from the gate to the last record (the last start for the no-op, the last end for
  a handler that waits), so process start-up is not counted. A run whose handlers wait also reports the most
  calls seen in flight at once (from the recorded intervals; flagged below the concurrency). A latency run
  opens the gate and waits SETTLE seconds before its producers start.
- Over the same window (the gate to the moment the driver saw the last record; in a latency run, from just
  before its producers start to the moment the driver saw its last start or gave up after CATCH_UP seconds):
  each side's worker CPU (process CPU seconds, per event and as a share of a core), the Postgres server's CPU in
  cores (its postmaster and children, live and ended, read from /proc: the server must run on this machine,
  and it counts every database's sessions) and the 1-minute load average at the start and the end.
- Latency producers: PRODUCERS threads with one connection each, one transaction per event on both sides (cmb
  ``emit`` on an autocommit connection, procrastinate ``defer`` through a pool of one connection). A run that
  handled fewer events than it sent, or whose median latency grew from its first quarter of events to its last
  by more than the polling interval (NOTIFIED_GROWTH with notifications on), is flagged: that engine did not
  keep up with the rate. So is a run whose producers sent less than 90% of the rate (a busy machine).

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/bench_eventqueue.py [--url postgresql://...] [--events N] [--peer-events N]
        [--seconds S]
    .venv/bin/python benchmarks/bench_eventqueue.py --wait 0.05 --kind async --concurrency 10 [--rounds 3]

Runs in a database of its own (a random name, dropped at the end). Prints a summary, then one JSON line last.
benchmarks/README.md keeps the figures of dated runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psycopg
from proc_cpu import cpu_seconds, find_postmaster, postgres_cpu_seconds
from psycopg import sql

if TYPE_CHECKING:
    from cmb_dagster.eventqueue import EventWorker

HERE = Path(__file__).resolve()
DEFAULT_CONCURRENCY = 10  # calls one worker runs at once: cmb WorkerSettings.worker_concurrency, procrastinate's
PEER_POOL_MAX = 30  # procrastinate's pool at concurrency 100: a job holds a connection to fetch and to finish
PRODUCERS = 8  # threads, one connection each: a commit (fsync) per event caps what one producer can send
LOAD_BATCH = 1_000  # events a transaction when loading a backlog
ANALYZE_EVERY = 20_000  # events loaded between two ANALYZEs of the table
MIN_DRAIN = 5.0  # seconds a throughput drain should last for a steady figure
WAIT_BACKLOG = (500, 50_000)  # bounds of the backlog of a run whose handlers wait
STALL = 30.0  # seconds without a handler's record after which a run whose handlers wait is given up
READY_TIMEOUT = 120.0
SETTLE = 1.0  # seconds between the gate and the first event of a latency run
CATCH_UP = 15.0  # seconds a latency run waits for its last events after the producers end
NOTIFIED_GROWTH = 0.25  # seconds the latency may grow over a run with notifications on before it counts as behind
WATCH = 0.02  # seconds between the driver's looks at the workers' files


# -- worker processes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """What each handler does and how many calls one worker runs at once, on both sides.

    ``wait`` None: the no-op handler of the full run (it records emit time and start time; cmb's is a function,
    procrastinate's ``async def``). Otherwise each handler waits ``wait`` seconds (``kind`` sync:
    ``time.sleep``; async: ``async def`` with ``asyncio.sleep``) and records its start and end."""

    wait: float | None = None
    kind: str = "sync"
    concurrency: int = DEFAULT_CONCURRENCY
    peer_threads: int = DEFAULT_CONCURRENCY  # threads of procrastinate's event loop for sync tasks; 0: asyncio's

    @property
    def peer_pool(self) -> int:
        """procrastinate's pool max_size: concurrency + 1 as its docs advise for short jobs, at most PEER_POOL_MAX."""
        return min(self.concurrency + 1, PEER_POOL_MAX)

    @property
    def ideal(self) -> float | None:
        """Events per second of one worker whose calls all overlap and cost nothing but their wait."""
        return self.concurrency / self.wait if self.wait else None

    def args(self) -> list[str]:
        """The options that give a worker process this work."""
        waits = ["--wait", repr(self.wait), "--kind", self.kind, "--peer-threads", str(self.peer_threads)]
        return [*(waits if self.wait is not None else []), "--concurrency", str(self.concurrency)]


def _recorder(out: str) -> Callable[[float, float], None]:
    fd = os.open(os.path.join(out, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(first: float, second: float) -> None:
        os.write(fd, f"{first:.6f} {second:.6f}\n".encode())  # one write a line: threads never interleave

    return record


def handler(out: str, work: Work, kind: str) -> Callable[[float], Any]:
    """The handler of one worker, called with the emit time: ``kind`` "sync" gives a function, "async" an
    ``async def``. It appends (emitted, started) to the worker's file for the no-op, (started, ended) otherwise."""
    import asyncio

    record, wait = _recorder(out), work.wait
    if wait is None:

        def noop(t: float) -> None:
            record(t, time.time())

        async def noop_async(t: float) -> None:
            record(t, time.time())

        return noop if kind == "sync" else noop_async

    def waits(t: float) -> None:
        started = time.time()
        if wait:
            time.sleep(wait)
        record(started, time.time())

    async def waits_async(t: float) -> None:
        started = time.time()
        if wait:
            await asyncio.sleep(wait)
        record(started, time.time())

    return waits if kind == "sync" else waits_async


def _ready_then_wait() -> None:
    """Tell the driver this worker is ready, then wait for the gate (a line on stdin)."""
    print("ready", flush=True)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, sys.stdout.fileno())  # nobody reads the pipe past this line
    os.close(quiet)
    sys.stdin.readline()


def run_cmb_worker(url: str, out: str, listen: bool, poll: float, work: Work) -> None:
    from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings

    fn = handler(out, work, "sync" if work.wait is None else work.kind)
    registry = HandlerRegistry()
    if work.kind == "async" and work.wait is not None:

        async def call(event):  # type: ignore[no-untyped-def]
            await fn(event.value["t"])

    else:

        def call(event):  # type: ignore[no-untyped-def]
            fn(event.value["t"])

    registry.add("noop", call)
    settings = WorkerSettings(listen=listen, sweep_interval=poll, worker_concurrency=work.concurrency)
    worker = EventWorker(url, EventQueueOptions(handlers=registry, worker=settings))
    serve_until_stopped(worker)


def serve_until_stopped(worker: EventWorker) -> None:
    """Register the worker's handlers, wait for the go, then run it until SIGTERM or SIGINT."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop())
    worker.register()
    _ready_then_wait()
    worker.run()


def procrastinate_app(url: str, **pool: int):  # type: ignore[no-untyped-def]
    import logging

    import procrastinate

    logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)  # "App is instantiated in the main module"

    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url, **pool))


def run_procrastinate_worker(url: str, out: str, listen: bool, poll: float, work: Work) -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    app = procrastinate_app(url, max_size=work.peer_pool)
    app.task(name="noop")(handler(out, work, "async" if work.wait is None else work.kind))

    async def run() -> None:
        if work.wait is not None and work.kind == "sync" and work.peer_threads:
            # its sync tasks run in the loop's default executor (asgiref sync_to_async)
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=work.peer_threads))
        async with app.open_async():
            await asyncio.to_thread(_ready_then_wait)
            await app.run_worker_async(
                queues=["default"],
                concurrency=work.concurrency,
                listen_notify=listen,
                fetch_job_polling_interval=poll,
                wait=True,
            )

    asyncio.run(run())


# -- measures -------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    at: float
    load: float
    workers: float
    server: float | None

    @classmethod
    def take(cls, procs: list[subprocess.Popen[bytes]], postmaster: int | None) -> Snapshot:
        return cls(
            time.time(), os.getloadavg()[0], sum(cpu_seconds(p.pid) for p in procs), postgres_cpu_seconds(postmaster)
        )


def usage(before: Snapshot, after: Snapshot, workers: int) -> dict[str, float | None]:
    """CPU and load over the window between two snapshots."""
    wall = after.at - before.at
    server = after.server - before.server if after.server is not None and before.server is not None else None
    return {
        "window_seconds": round(wall, 3),
        "worker_cpu_seconds": round(after.workers - before.workers, 2),
        "worker_cpu_share": round((after.workers - before.workers) / wall / workers, 3),
        "server_cpu_seconds": round(server, 2) if server is not None else None,
        "server_cores": round(server / wall, 3) if server is not None else None,
        "load_start": round(before.load, 2),
        "load_end": round(after.load, 2),
    }


class Lines:
    """Counts the complete lines the workers have written so far, reading only what is new."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.offsets: dict[Path, int] = {}
        self.count = 0

    def update(self) -> int:
        for path in self.out.glob("*.log"):
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is counted once complete
            self.count += data.count(b"\n", 0, end)
            self.offsets[path] = self.offsets.get(path, 0) + end
        return self.count

    def wait(self, n: int, timeout: float, stall: float | None = None) -> int:
        """Wait for ``n`` lines, at most ``timeout`` seconds, and at most ``stall`` seconds without a new line."""
        deadline = time.monotonic() + timeout
        seen, last_new = 0, time.monotonic()
        while self.update() < n and time.monotonic() < deadline:
            if self.count > seen:
                seen, last_new = self.count, time.monotonic()
            elif stall is not None and time.monotonic() - last_new > stall:
                break
            time.sleep(WATCH)
        return self.count


def records(out: str) -> list[tuple[float, float]]:
    """(emitted, started) of each complete line the workers wrote; a line being written is skipped."""
    found = []
    for path in Path(out).glob("*.log"):
        for line in path.read_text().split("\n")[:-1]:  # the last piece has no newline yet (or is empty)
            fields = line.split()
            if len(fields) == 2:
                found.append((float(fields[0]), float(fields[1])))
    return found


# -- driver ---------------------------------------------------------------------------------------------


def with_db(url: str, name: str) -> str:
    return urlsplit(url)._replace(path=f"/{name}").geturl()


def server_info(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return {
            k: conn.execute(f"SHOW {k}").fetchone()[0]
            for k in (
                "server_version",
                "autovacuum",
                "fsync",
                "synchronous_commit",
                "shared_buffers",
                "max_connections",
            )
        }


def prepare(url: str) -> None:
    """Install both engines' schemas and register cmb's handler."""
    from cmb_dagster.database import Database
    from cmb_dagster.eventqueue import HandlerRegistry, register

    db = Database(url)
    db.upgrade()
    registry = HandlerRegistry()
    registry.add("noop", print)
    register(db, registry)
    db.close()
    app = procrastinate_app(url)
    with app.open():
        app.schema_manager.apply_schema()


TABLES = {"cmb": "cmb.eventqueue_events", "procrastinate": "procrastinate_jobs"}


def reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE cmb.eventqueue_events")
        conn.execute("TRUNCATE procrastinate_jobs CASCADE")
        for table in TABLES.values():
            conn.execute(f"VACUUM ANALYZE {table}")


def analyze(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for table in TABLES.values():
            conn.execute(f"ANALYZE {table}")


@dataclass
class Workers:
    """Worker processes started behind a gate: ``open()`` releases them all at once."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    @classmethod
    def start(cls, engine: str, url: str, out: str, n: int, listen: bool, poll: float, work: Work) -> Workers:
        command = [sys.executable, str(HERE), "--role", f"{engine}-worker", "--url", url, "--out", out]
        command += ["--listen", "1" if listen else "0", "--poll-interval", str(poll), *work.args()]
        workers = cls([], [Path(out, f"worker-{i}.err") for i in range(n)])
        try:
            for log in workers.logs:
                with log.open("wb") as err:
                    workers.procs.append(
                        subprocess.Popen(command, bufsize=0, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
                    )
            workers.wait_ready()
        except BaseException:
            workers.stop()
            raise
        return workers

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for proc, log in zip(self.procs, self.logs, strict=True):
            assert proc.stdout is not None
            while True:  # the worker prints one line once ready; end of file: it died
                waiting, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = proc.stdout.readline() if waiting else b""
                if line.strip() == b"ready":
                    break
                if not line:
                    raise RuntimeError(f"a worker did not get ready: {log.read_text()[-2000:]}")

    def open(self) -> None:
        for proc in self.procs:
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.write(b"go\n")
                proc.stdin.close()

    def stop(self) -> int:
        """Stop the workers; return how many error lines they logged."""
        for proc in self.procs:
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()  # a worker still at the gate goes on, to see the signal
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        return sum(
            1
            for log in self.logs
            if log.exists()
            for line in log.read_text(errors="replace").splitlines()
            if "Traceback" in line or " ERROR " in line or ("error" in line.lower() and "0 errors" not in line)
        )


def preload(engine: str, url: str, n: int) -> None:
    """Load ``n`` events, LOAD_BATCH a transaction, with an ANALYZE of the engine's table every ANALYZE_EVERY
    events (what autovacuum would do; the plans of cmb's emit go wrong past ~100,000 events without)."""
    # custom plans: past ~10,000 queued events, the generic plan of a prepared cmb emit takes seconds a batch
    options = "-c search_path=cmb,public -c plan_cache_mode=force_custom_plan"
    with psycopg.connect(url, autocommit=True, options=options) as conn:
        if engine == "cmb":
            from cmb_dagster.eventqueue import emit_many

            def send(size: int) -> None:
                emit_many([{"namespace": "bench", "handler": "noop", "value": {"t": 0.0}}] * size, conn=conn)

            load(conn, TABLES[engine], n, send)
        else:
            app = procrastinate_app(url)

            @app.task(name="noop")
            async def noop(t: float) -> None: ...

            with app.open():
                load(conn, TABLES[engine], n, lambda size: noop.batch_defer(*[{"t": 0.0}] * size))


def load(conn: psycopg.Connection, table: str, n: int, send: Callable[[int], object]) -> None:
    """Call ``send`` with the size of each batch of ``n`` events, and ANALYZE ``table`` on the way."""
    for start in range(0, n, LOAD_BATCH):
        send(min(LOAD_BATCH, n - start))
        if (start + LOAD_BATCH) % ANALYZE_EVERY == 0:
            conn.execute(f"ANALYZE {table}")


def in_flight(intervals: list[tuple[float, float]]) -> int:
    """The most calls running at one moment, from each call's (start, end)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = running = 0
    for _, step in edges:  # at equal times an end (-1) sorts first: calls that touch do not overlap
        running += step
        peak = max(peak, running)
    return peak


def throughput(
    engine: str, url: str, postmaster: int | None, n_events: int, n_workers: int, poll: float, work: Work
) -> dict:
    """Drain a backlog loaded beforehand: events/s from the gate to the last handler's record (its start for the
    no-op, its end for a handler that waits)."""
    reset(url)
    preload(engine, url, n_events)
    analyze(url)
    # a side far below the ideal is cut at 3x the ideal drain and reported with the events it left undone
    timeout = max(120.0, n_events / 20, 3 * n_events * (work.wait or 0) / (work.concurrency * n_workers) + 30)
    with tempfile.TemporaryDirectory() as out:
        workers = Workers.start(engine, url, out, n_workers, listen=True, poll=poll, work=work)
        try:
            before = Snapshot.take(workers.procs, postmaster)
            workers.open()
            Lines(out).wait(n_events, timeout=timeout, stall=None if work.wait is None else STALL + work.wait)
            after = Snapshot.take(workers.procs, postmaster)
        finally:
            errors = workers.stop()
        found = records(out)
    last = max((s for _, s in found), default=float("nan"))
    drain = last - before.at
    run = {
        "events": len(found),
        "backlog": n_events,
        "per_second": round(len(found) / drain, 1) if found else float("nan"),
        "seconds": round(drain, 3),
        **usage(before, after, n_workers),
        "worker_cpu_ms_per_event": round(1000 * (after.workers - before.workers) / len(found), 3) if found else None,
        "errors": errors,
    }
    if work.ideal:  # handlers that wait: their calls should overlap
        run["peak_in_flight"] = in_flight(found)
        run["share_of_ideal"] = round(run["per_second"] / (work.ideal * n_workers), 3) if found else 0.0
    return run


def produce(engine: str, url: str, rate: float, n: int) -> float:
    """Send ``n`` events at ``rate`` per second in total, one transaction each; return the rate achieved."""
    began = time.monotonic() + 0.5

    def producer(index: int) -> None:
        if engine == "cmb":
            from cmb_dagster.eventqueue import emit

            conn = psycopg.connect(url, autocommit=True, options="-c search_path=cmb,public")

            def send() -> None:
                emit("bench", "noop", {"t": time.time()}, conn=conn)

            close = conn.close
        else:
            app = procrastinate_app(url, min_size=1, max_size=1)

            @app.task(name="noop")
            async def noop(t: float) -> None: ...

            app.open()

            def send() -> None:
                noop.defer(t=time.time())

            close = app.close
        for i in range(index, n, PRODUCERS):
            pause = began + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            send()
        close()

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(PRODUCERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n / (time.monotonic() - began)


def latency(
    engine: str, url: str, postmaster: int | None, rate: float, seconds: float, listen: bool, poll: float, work: Work
) -> dict:
    reset(url)
    n = int(rate * seconds)
    with tempfile.TemporaryDirectory() as out:
        workers = Workers.start(engine, url, out, 1, listen=listen, poll=poll, work=work)
        try:
            workers.open()
            time.sleep(SETTLE)  # the worker is up and idle
            before = Snapshot.take(workers.procs, postmaster)
            achieved = produce(engine, url, rate, n)
            Lines(out).wait(n, timeout=CATCH_UP)  # an engine that cannot keep up is reported as such
            after = Snapshot.take(workers.procs, postmaster)
        finally:
            errors = workers.stop()
        found = records(out)
    lat = sorted((s - e) * 1000 for e, s in found)
    q = statistics.quantiles(lat, n=100) if len(lat) > 2 else [float("nan")] * 99
    by_emit = [(s - e) * 1000 for e, s in sorted(found)]
    quarter = max(1, len(by_emit) // 4)
    growth = statistics.median(by_emit[-quarter:]) - statistics.median(by_emit[:quarter]) if found else 0.0
    return {
        "events": len(found),
        "sent": n,
        "rate": rate,
        "kept_up": len(found) == n and growth <= (NOTIFIED_GROWTH if listen else poll) * 1000,
        "latency_growth_ms": round(growth, 1),
        "achieved_rate": round(achieved, 1),
        "p50_ms": round(q[49], 2),
        "p99_ms": round(q[98], 2),
        "max_ms": round(lat[-1], 2) if lat else float("nan"),
        **usage(before, after, 1),
        "errors": errors,
    }


def flags(run: dict, concurrency: int) -> list[str]:
    """What weakens a run's figure."""
    if "sent" in run:  # a latency run
        found = [] if run["kept_up"] else ["did not keep up: backlog grew"]
        if run["achieved_rate"] < 0.9 * run["rate"]:
            found.append(f"producers sent only {run['achieved_rate']:g}/s")
        return found
    found = [f"left {run['backlog'] - run['events']} events undone"] if run["events"] < run["backlog"] else []
    if not run["seconds"] >= MIN_DRAIN:
        found.append(f"drained in under {MIN_DRAIN:g}s: noisy")
    if run.get("peak_in_flight", concurrency) < concurrency:
        found.append(f"never {concurrency} calls at once")
    return found


def setup(poll: float, work: Work) -> dict[str, object]:
    from cmb_dagster.eventqueue import WorkerSettings

    waiting = work.wait is not None
    listen = "on" if waiting else "on; off in latency_poll"
    return {
        **({} if waiting else {"producer_threads": PRODUCERS}),
        "cmb": {
            "worker": "EventWorker",
            "concurrency": work.concurrency,
            "batch_size": WorkerSettings().batch_size,
            "handler": f"{work.kind} def" if waiting else "sync function",
            "sweep_interval": poll,
            "listen": listen,
            **({} if waiting else {"producer": "emit, autocommit, a connection per thread"}),
        },
        "procrastinate": {
            "version": version("procrastinate"),
            "worker": "App.run_worker_async",
            "task": f"{work.kind} def" if waiting else "async def",
            "concurrency": work.concurrency,
            **(
                {"threads_for_sync_tasks": work.peer_threads or "asyncio default"}
                if waiting and work.kind == "sync"
                else {}
            ),
            "pool_max_size": work.peer_pool,
            "fetch_job_polling_interval": poll,
            "listen_notify": listen,
            "delete_jobs": "never (default)",
            **({} if waiting else {"producer": "defer, a pool of one connection per thread"}),
        },
    }


def server_line(info: dict[str, str], postmaster: int | None) -> str:
    return (
        f"server: Postgres {info['server_version']}, autovacuum={info['autovacuum']}, fsync={info['fsync']}, "
        f"synchronous_commit={info['synchronous_commit']}; {os.cpu_count()} cores; server CPU "
        f"{'measured from /proc' if postmaster else 'not measured (the server is not on this machine)'}"
    )


def full_run(url: str, postmaster: int | None, args: argparse.Namespace, work: Work) -> dict[str, dict[str, dict]]:
    """The no-op run: throughput with 1 and 4 workers, then latency at two rates and with polling only."""
    poll = args.poll_interval
    backlog = {"cmb": args.events or 250_000, "procrastinate": args.peer_events or 6_000}
    results: dict[str, dict[str, dict]] = {"cmb": {}, "procrastinate": {}}
    for engine in ("cmb", "procrastinate"):
        for workers in (1, 4):
            results[engine][f"throughput_{workers}"] = throughput(
                engine, url, postmaster, backlog[engine], workers, poll, work
            )
        results[engine]["latency_notify"] = latency(engine, url, postmaster, args.rate, args.seconds, True, poll, work)
        results[engine]["latency_notify_low"] = latency(
            engine, url, postmaster, args.low_rate, args.low_seconds, True, poll, work
        )
        results[engine]["latency_poll"] = latency(engine, url, postmaster, args.rate, args.seconds, False, poll, work)
        for run in results[engine].values():
            run["flags"] = flags(run, work.concurrency)
    return results


def full_report(
    results: dict[str, dict[str, dict]],
    info: dict[str, str],
    postmaster: int | None,
    args: argparse.Namespace,
    work: Work,
    took: float,
) -> dict:
    poll = args.poll_interval
    print(server_line(info, postmaster))
    print(
        f"cmb: EventWorker, concurrency {work.concurrency}, sweep {poll:g}s; procrastinate {version('procrastinate')}: "
        f"async task, concurrency {work.concurrency}, pool max_size {work.peer_pool}, polling {poll:g}s; "
        f"LISTEN/NOTIFY on for both except in the polling run; {took:.0f}s in all"
    )
    ratios = {}
    for key, label, field, better in [
        ("throughput_1", "throughput, 1 worker (events/s)", "per_second", "higher"),
        ("throughput_4", "throughput, 4 workers (events/s)", "per_second", "higher"),
        ("latency_notify", f"emit->start p50 at {args.rate:.0f}/s, notify (ms)", "p50_ms", "lower"),
        ("latency_notify", f"emit->start p99 at {args.rate:.0f}/s, notify (ms)", "p99_ms", "lower"),
        ("latency_notify_low", f"emit->start p50 at {args.low_rate:.0f}/s, notify (ms)", "p50_ms", "lower"),
        ("latency_notify_low", f"emit->start p99 at {args.low_rate:.0f}/s, notify (ms)", "p99_ms", "lower"),
        ("latency_poll", f"emit->start p50 at {args.rate:.0f}/s, polling {poll:g}s (ms)", "p50_ms", "lower"),
        ("latency_poll", f"emit->start p99 at {args.rate:.0f}/s, polling {poll:g}s (ms)", "p99_ms", "lower"),
    ]:
        ours, theirs = results["cmb"][key][field], results["procrastinate"][key][field]
        ratio = (ours / theirs if better == "higher" else theirs / ours) if ours and theirs else float("nan")
        ratios[f"{key}.{field}"] = round(ratio, 2)
        notes = [f"{e} {flag}" for e in results for flag in results[e][key]["flags"]]
        note = f"  ({'; '.join(notes)})" if notes else ""
        print(f"  {label:58} cmb {ours:>9}   procrastinate {theirs:>9}   cmb advantage x{ratio:.2f}{note}")
    for engine in results:
        for key, value in results[engine].items():
            print(f"  {engine:13} {key:18} {value}")
    return {
        "benchmark": "eventqueue",
        "sizes": {
            "backlog_cmb": results["cmb"]["throughput_1"]["backlog"],
            "backlog_procrastinate": results["procrastinate"]["throughput_1"]["backlog"],
            "rate": args.rate,
            "low_rate": args.low_rate,
            "seconds": args.seconds,
            "low_seconds": args.low_seconds,
        },
        "results": results,
        "ratios": ratios,
    }


def wait_backlog(work: Work) -> int:
    """Events that keep one worker busy MIN_DRAIN seconds at the ideal rate, within WAIT_BACKLOG."""
    assert work.ideal is not None
    low, high = WAIT_BACKLOG
    return min(high, max(low, math.ceil(MIN_DRAIN * work.ideal)))


def wait_run(url: str, postmaster: int | None, args: argparse.Namespace, work: Work) -> dict[str, list[dict]]:
    """One worker a side drains its backlog, the sides taking turns, --rounds times."""
    if work.wait:
        events = args.events or wait_backlog(work)
        backlog = {"cmb": events, "procrastinate": args.peer_events or events}
    else:
        backlog = {"cmb": args.events or 250_000, "procrastinate": args.peer_events or 6_000}
    rounds: dict[str, list[dict]] = {"cmb": [], "procrastinate": []}
    for _ in range(args.rounds):
        for engine in rounds:
            run = throughput(engine, url, postmaster, backlog[engine], 1, args.poll_interval, work)
            run["flags"] = flags(run, work.concurrency)
            rounds[engine].append(run)
    return rounds


def median_of(runs: list[dict], field: str) -> float | None:
    values = [r[field] for r in runs if r.get(field) is not None]
    return round(statistics.median(values), 3) if values else None


def wait_report(
    rounds: dict[str, list[dict]],
    info: dict[str, str],
    postmaster: int | None,
    args: argparse.Namespace,
    work: Work,
    took: float,
) -> dict:
    poll = args.poll_interval
    how = {"sync": "time.sleep", "async": "asyncio.sleep"}[work.kind]
    wait = f"wait {work.wait * 1000:g} ms ({how})" if work.wait else "no-op"
    threads = f", its sync tasks in {work.peer_threads or 'the default number of'} threads" * (work.kind == "sync")
    print(server_line(info, postmaster))
    print(
        f"handlers: {work.kind}, {wait}; concurrency {work.concurrency} a side, one worker each; "
        f"procrastinate {version('procrastinate')}{threads}, pool max_size {work.peer_pool}; polling {poll:g}s, "
        f"LISTEN/NOTIFY on; backlogs {rounds['cmb'][0]['backlog']} / {rounds['procrastinate'][0]['backlog']}; "
        f"rounds: {args.rounds}, {took:.0f}s in all"
    )
    ideal = work.ideal
    for i in range(args.rounds):
        parts = []
        for engine, runs in rounds.items():
            run = runs[i]
            note = f" ({'; '.join(run['flags'])})" if run["flags"] else ""
            peak = f", peak {run['peak_in_flight']} in flight" if "peak_in_flight" in run else ""
            parts.append(
                f"{engine} {run['per_second']:>9}/s in {run['seconds']:.1f}s, CPU {run['worker_cpu_seconds']:.2f}s"
                f"{peak}{note}"
            )
        print(f"  round {i + 1}: " + "   ".join(parts))
    median = {
        engine: {
            field: median_of(runs, field)
            for field in (
                "per_second",
                "share_of_ideal",
                "worker_cpu_seconds",
                "worker_cpu_ms_per_event",
                "server_cpu_seconds",
            )
        }
        for engine, runs in rounds.items()
    }
    ours, theirs = median["cmb"]["per_second"], median["procrastinate"]["per_second"]
    ratio = round(ours / theirs, 2) if ours and theirs else None
    for engine, m in median.items():
        share = f" = {m['share_of_ideal']:.0%} of the ideal {ideal:g}/s" if ideal and m["share_of_ideal"] else ""
        print(
            f"  median {engine:13} {m['per_second']:>9} events/s{share}; worker CPU {m['worker_cpu_seconds']}s "
            f"({m['worker_cpu_ms_per_event'] or '-'} ms an event), server CPU {m['server_cpu_seconds']}s"
        )
    print(f"  cmb / procrastinate: x{ratio}")
    return {
        "benchmark": "eventqueue_wait",
        "work": {
            "wait": work.wait,
            "kind": work.kind,
            "concurrency": work.concurrency,
            "peer_threads": work.peer_threads if work.kind == "sync" else None,
            "peer_pool": work.peer_pool,
        },
        "ideal_per_second": ideal,
        "median": median,
        "ratio": ratio,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--listen", default="1", help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help="server to run on (default: the cmb database's)")
    parser.add_argument("--poll-interval", type=float, default=2.0, help="cmb sweep = procrastinate polling (s)")
    parser.add_argument(
        "--wait",
        type=float,
        default=None,
        help="seconds each handler waits (0: a no-op of --kind); runs one worker a side, --rounds times, in place "
        "of the full no-op run",
    )
    parser.add_argument(
        "--kind",
        choices=("sync", "async"),
        default=None,
        help="with --wait: handlers are functions calling time.sleep (procrastinate runs them in threads) or "
        "async def calling asyncio.sleep (default sync)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="calls one worker runs at once, each side"
    )
    parser.add_argument(
        "--peer-threads",
        type=int,
        default=None,
        help="with --kind sync: threads of procrastinate's event loop, where its sync tasks run (default: "
        "--concurrency; 0: asyncio's default, min(32, cores + 4))",
    )
    parser.add_argument("--rounds", type=int, default=None, help="with --wait: turns of each side (default 3)")
    parser.add_argument(
        "--events",
        type=int,
        default=None,
        help="cmb's backlog per throughput run (default 250,000; with --wait > 0: both sides', sized by default "
        f"for {MIN_DRAIN:g}s at the ideal rate, within {WAIT_BACKLOG[0]}-{WAIT_BACKLOG[1]})",
    )
    parser.add_argument(
        "--peer-events", type=int, default=None, help="procrastinate's backlog per throughput run (default 6,000)"
    )
    parser.add_argument("--rate", type=float, default=500.0, help="events/s of the latency runs")
    parser.add_argument("--low-rate", type=float, default=50.0, help="a rate both engines can sustain")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each latency run at --rate")
    parser.add_argument("--low-seconds", type=float, default=20.0, help="length of the latency run at --low-rate")
    args = parser.parse_args()
    for option, value, low, high in [
        ("--wait", args.wait, 0, 60),
        ("--concurrency", args.concurrency, 1, 1_000),
        ("--peer-threads", args.peer_threads, 0, 1_000),
        ("--rounds", args.rounds, 1, 20),
        ("--events", args.events, 1, 10_000_000),
        ("--peer-events", args.peer_events, 1, 10_000_000),
    ]:
        if value is not None and not low <= value <= high:
            parser.error(f"{option} must be between {low} and {high}")
    if args.wait is None and (args.kind or args.rounds or args.peer_threads is not None):
        parser.error("--kind, --rounds and --peer-threads go with --wait (the full no-op run keeps its handlers)")
    args.kind, args.rounds = args.kind or "sync", args.rounds or 3
    threads = args.concurrency if args.peer_threads is None else args.peer_threads
    work = Work(args.wait, args.kind, args.concurrency, threads)
    if args.role == "cmb-worker":
        return run_cmb_worker(args.url, args.out, args.listen == "1", args.poll_interval, work)
    if args.role == "procrastinate-worker":
        return run_procrastinate_worker(args.url, args.out, args.listen == "1", args.poll_interval, work)

    from cmb_dagster.database import Database

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the workers and drop the database on the way out
    server = args.url or Database.from_settings().url
    info = server_info(server)
    postmaster = find_postmaster(server)
    name = f"cmb_bench_eventqueue_{secrets.token_hex(4)}"
    began = time.monotonic()
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = with_db(server, name)
        prepare(url)
        if work.wait is None:
            full = full_run(url, postmaster, args, work)
        else:
            rounds = wait_run(url, postmaster, args, work)
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    took = time.monotonic() - began
    if work.wait is None:
        figures = full_report(full, info, postmaster, args, work, took)
    else:
        figures = wait_report(rounds, info, postmaster, args, work, took)
    report = {
        "benchmark": figures.pop("benchmark"),
        "server": {**info, "cpu_measured": postmaster is not None},
        "machine": {"cores": os.cpu_count()},
        "setup": setup(args.poll_interval, work),
        **figures,
        "seconds": round(took, 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
