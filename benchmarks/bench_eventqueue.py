"""Event queue benchmark: cmb_dagster.eventqueue vs procrastinate, same Postgres, same no-op task.

Measures, each engine with its own worker processes:
- throughput with 1 and 4 worker processes over a backlog loaded beforehand (handler starts per second);
- latency from emit to handler start (p50/p99) with one worker: at a steady --rate with LISTEN/NOTIFY on, at
  --low-rate with it on, and at --rate with notifications off (polling only).

How each side is set up (the same in every run unless said):
- cmb: ``EventWorker`` with ``WorkerSettings`` defaults (batch_size 100, handlers run in a thread of user code)
  except ``sweep_interval`` = --poll-interval and ``listen`` (off in the polling run); the handler is a plain
  function.
- procrastinate (the version installed): the task is ``async def``; ``App.run_worker_async`` with
  ``concurrency`` = PEER_CONCURRENCY, ``fetch_job_polling_interval`` = --poll-interval and ``listen_notify``
  (off in the polling run), other options at their defaults (``delete_jobs`` "never": a finished job stays as a
  row marked succeeded); ``PsycopgConnector`` pool ``max_size`` = concurrency + 1, as its docs advise for short
  jobs (the listening connection is outside the pool).
- Both handlers append one line (emit time, start time) to a file of the worker's own.

How it is measured:
- Each run starts from truncated tables (VACUUM ANALYZE). A throughput run loads its backlog first (cmb
  ``emit_many``, procrastinate ``batch_defer``, LOAD_BATCH a transaction, with an ANALYZE of the table every
  ANALYZE_EVERY events in place of autovacuum), then ANALYZEs both engines' tables. Each engine has a backlog
  of its own size (--events, --peer-events), large enough for a drain of MIN_DRAIN seconds or more; a shorter
  drain is flagged.
- Workers start behind a gate: each process imports its engine, builds its worker, opens its connections
  (cmb: registers its handlers; procrastinate: opens its pool) and waits on its stdin; the gate opens for all
  at once. Throughput counts from the gate to the last handler start, so process start-up is not counted. A
  latency run opens the gate and waits SETTLE seconds before its producers start.
- Over the same window (the gate to the moment the driver saw the last start; in a latency run, from just before
  its producers start to the moment the driver saw its last start or gave up after CATCH_UP seconds):
  each side's worker CPU share (CPU seconds / wall seconds / workers), the Postgres server's CPU in cores (its
  postmaster and children, live and ended, read from /proc: the server must run on this machine) and the
  1-minute load average at the start and the end.
- Latency producers: PRODUCERS threads with one connection each, one transaction per event on both sides (cmb
  ``emit`` on an autocommit connection, procrastinate ``defer`` through a pool of one connection). A run that
  handled fewer events than it sent, or whose median latency grew from its first quarter of events to its last
  by more than the polling interval (NOTIFIED_GROWTH with notifications on), is flagged: that engine did not
  keep up with the rate. So is a run whose producers sent less than 90% of the rate (a busy machine).

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/bench_eventqueue.py [--url postgresql://...] [--events N] [--peer-events N]
        [--seconds S]

Runs in a database of its own (a random name, dropped at the end). Prints a summary, then one JSON line last.
benchmarks/README.md keeps the figures of dated runs.
"""

from __future__ import annotations

import argparse
import json
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
from urllib.parse import urlsplit

import psycopg
from proc_cpu import cpu_seconds, find_postmaster, postgres_cpu_seconds
from psycopg import sql

HERE = Path(__file__).resolve()
PEER_CONCURRENCY = 10  # procrastinate's async sub-workers per worker process
PRODUCERS = 8  # threads, one connection each: a commit (fsync) per event caps what one producer can send
LOAD_BATCH = 1_000  # events a transaction when loading a backlog
ANALYZE_EVERY = 20_000  # events loaded between two ANALYZEs of the table
MIN_DRAIN = 5.0  # seconds a throughput drain should last for a steady figure
READY_TIMEOUT = 120.0
SETTLE = 1.0  # seconds between the gate and the first event of a latency run
CATCH_UP = 15.0  # seconds a latency run waits for its last events after the producers end
NOTIFIED_GROWTH = 0.25  # seconds the latency may grow over a run with notifications on before it counts as behind
WATCH = 0.02  # seconds between the driver's looks at the workers' files


# -- worker processes ---------------------------------------------------------------------------------


def _recorder(out: str):  # type: ignore[no-untyped-def]
    fd = os.open(os.path.join(out, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(emitted_at: float) -> None:
        os.write(fd, f"{emitted_at:.6f} {time.time():.6f}\n".encode())

    return record


def _ready_then_wait() -> None:
    """Tell the driver this worker is ready, then wait for the gate (a line on stdin)."""
    print("ready", flush=True)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, sys.stdout.fileno())  # nobody reads the pipe past this line
    os.close(quiet)
    sys.stdin.readline()


def run_cmb_worker(url: str, out: str, listen: bool, poll: float) -> None:
    from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings

    record = _recorder(out)
    registry = HandlerRegistry()
    registry.add("noop", lambda event: record(event.value["t"]))
    worker = EventWorker(
        url, EventQueueOptions(handlers=registry, worker=WorkerSettings(listen=listen, sweep_interval=poll))
    )
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


def run_procrastinate_worker(url: str, out: str, listen: bool, poll: float) -> None:
    import asyncio

    record = _recorder(out)
    app = procrastinate_app(url, max_size=PEER_CONCURRENCY + 1)

    @app.task(name="noop")
    async def noop(t: float) -> None:
        record(t)

    async def work() -> None:
        async with app.open_async():
            await asyncio.to_thread(_ready_then_wait)
            await app.run_worker_async(
                queues=["default"],
                concurrency=PEER_CONCURRENCY,
                listen_notify=listen,
                fetch_job_polling_interval=poll,
                wait=True,
            )

    asyncio.run(work())


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

    def wait(self, n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.update() < n and time.monotonic() < deadline:
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
    def start(cls, engine: str, url: str, out: str, n: int, listen: bool, poll: float) -> Workers:
        command = [sys.executable, str(HERE), "--role", f"{engine}-worker", "--url", url, "--out", out]
        command += ["--listen", "1" if listen else "0", "--poll-interval", str(poll)]
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


def throughput(engine: str, url: str, postmaster: int | None, n_events: int, n_workers: int, poll: float) -> dict:
    reset(url)
    preload(engine, url, n_events)
    analyze(url)
    with tempfile.TemporaryDirectory() as out:
        workers = Workers.start(engine, url, out, n_workers, listen=True, poll=poll)
        try:
            before = Snapshot.take(workers.procs, postmaster)
            workers.open()
            Lines(out).wait(n_events, timeout=max(120.0, n_events / 20))
            after = Snapshot.take(workers.procs, postmaster)
        finally:
            errors = workers.stop()
        found = records(out)
    last = max((s for _, s in found), default=float("nan"))
    drain = last - before.at
    return {
        "events": len(found),
        "backlog": n_events,
        "per_second": round(len(found) / drain, 1) if found else float("nan"),
        "seconds": round(drain, 3),
        **usage(before, after, n_workers),
        "errors": errors,
    }


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
    engine: str, url: str, postmaster: int | None, rate: float, seconds: float, listen: bool, poll: float
) -> dict:
    reset(url)
    n = int(rate * seconds)
    with tempfile.TemporaryDirectory() as out:
        workers = Workers.start(engine, url, out, 1, listen=listen, poll=poll)
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


def flags(run: dict) -> list[str]:
    """What weakens a run's figure."""
    if "sent" in run:  # a latency run
        found = [] if run["kept_up"] else ["did not keep up: backlog grew"]
        if run["achieved_rate"] < 0.9 * run["rate"]:
            found.append(f"producers sent only {run['achieved_rate']:g}/s")
        return found
    found = [f"left {run['backlog'] - run['events']} events undone"] if run["events"] < run["backlog"] else []
    if not run["seconds"] >= MIN_DRAIN:
        found.append(f"drained in under {MIN_DRAIN:g}s: noisy")
    return found


def setup(poll: float) -> dict[str, object]:
    from cmb_dagster.eventqueue import WorkerSettings

    return {
        "producer_threads": PRODUCERS,
        "cmb": {
            "worker": "EventWorker, WorkerSettings defaults",
            "batch_size": WorkerSettings().batch_size,
            "handler": "sync function",
            "sweep_interval": poll,
            "listen": "on; off in latency_poll",
            "producer": "emit, autocommit, a connection per thread",
        },
        "procrastinate": {
            "version": version("procrastinate"),
            "worker": "App.run_worker_async",
            "task": "async def",
            "concurrency": PEER_CONCURRENCY,
            "pool_max_size": PEER_CONCURRENCY + 1,
            "fetch_job_polling_interval": poll,
            "listen_notify": "on; off in latency_poll",
            "delete_jobs": "never (default)",
            "producer": "defer, a pool of one connection per thread",
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--listen", default="1", help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help="server to run on (default: the cmb database's)")
    parser.add_argument("--poll-interval", type=float, default=2.0, help="cmb sweep = procrastinate polling (s)")
    parser.add_argument("--events", type=int, default=250_000, help="cmb's backlog per throughput run")
    parser.add_argument("--peer-events", type=int, default=6_000, help="procrastinate's backlog per throughput run")
    parser.add_argument("--rate", type=float, default=500.0, help="events/s of the latency runs")
    parser.add_argument("--low-rate", type=float, default=50.0, help="a rate both engines can sustain")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each latency run at --rate")
    parser.add_argument("--low-seconds", type=float, default=20.0, help="length of the latency run at --low-rate")
    args = parser.parse_args()
    if args.role == "cmb-worker":
        return run_cmb_worker(args.url, args.out, args.listen == "1", args.poll_interval)
    if args.role == "procrastinate-worker":
        return run_procrastinate_worker(args.url, args.out, args.listen == "1", args.poll_interval)

    from cmb_dagster.database import Database

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the workers and drop the database on the way out
    server = args.url or Database.from_settings().url
    info = server_info(server)
    postmaster = find_postmaster(server)
    name = f"cmb_bench_eventqueue_{secrets.token_hex(4)}"
    poll = args.poll_interval
    backlog = {"cmb": args.events, "procrastinate": args.peer_events}
    results: dict[str, dict[str, dict]] = {"cmb": {}, "procrastinate": {}}
    began = time.monotonic()
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = with_db(server, name)
        prepare(url)
        for engine in ("cmb", "procrastinate"):
            for workers in (1, 4):
                results[engine][f"throughput_{workers}"] = throughput(
                    engine, url, postmaster, backlog[engine], workers, poll
                )
            results[engine]["latency_notify"] = latency(engine, url, postmaster, args.rate, args.seconds, True, poll)
            results[engine]["latency_notify_low"] = latency(
                engine, url, postmaster, args.low_rate, args.low_seconds, True, poll
            )
            results[engine]["latency_poll"] = latency(engine, url, postmaster, args.rate, args.seconds, False, poll)
            for run in results[engine].values():
                run["flags"] = flags(run)
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    took = time.monotonic() - began

    print(
        f"server: Postgres {info['server_version']}, autovacuum={info['autovacuum']}, fsync={info['fsync']}, "
        f"synchronous_commit={info['synchronous_commit']}; {os.cpu_count()} cores; server CPU "
        f"{'measured from /proc' if postmaster else 'not measured (the server is not on this machine)'}"
    )
    print(
        f"cmb: EventWorker defaults, sweep {poll:g}s; procrastinate {version('procrastinate')}: async task, "
        f"concurrency {PEER_CONCURRENCY}, pool max_size {PEER_CONCURRENCY + 1}, polling {poll:g}s; "
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
    report = {
        "benchmark": "eventqueue",
        "server": {**info, "cpu_measured": postmaster is not None},
        "machine": {"cores": os.cpu_count()},
        "setup": setup(poll),
        "sizes": {
            **{f"backlog_{e}": n for e, n in backlog.items()},
            "rate": args.rate,
            "low_rate": args.low_rate,
            "seconds": args.seconds,
            "low_seconds": args.low_seconds,
        },
        "results": results,
        "ratios": ratios,
        "seconds": round(took, 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
