"""Event queue benchmark: cmb_dagster.eventqueue vs procrastinate, same Postgres, same no-op task.

Measures (each engine with its own worker processes, set up as its docs recommend):
- throughput with 1 and 4 worker processes over a pre-loaded backlog (handler starts per second);
- latency from emit to handler start (p50/p99) at a steady 500 events/s with one worker, with
  LISTEN/NOTIFY on, and with notifications off (polling only, the same 1 s interval for both).

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/bench_eventqueue.py [--url postgresql://...] [--events 5000] [--seconds 4]

Prints a summary, then one JSON line last. benchmarks/README.md keeps the figures of dated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve()
DB_NAME = "cmb_bench_eventqueue"
POLL_INTERVAL = 1.0  # polling / sweep interval of both engines when notifications are off
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- worker processes ---------------------------------------------------------------------------------


def _recorder(out: str):  # type: ignore[no-untyped-def]
    fd = os.open(os.path.join(out, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(emitted_at: float) -> None:
        os.write(fd, f"{emitted_at:.6f} {time.time():.6f}\n".encode())

    return record


def run_cmb_worker(url: str, out: str, listen: bool, sweep: float) -> None:
    from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings

    record = _recorder(out)
    registry = HandlerRegistry()
    registry.add("noop", lambda event: record(event.value["t"]))
    worker = EventWorker(
        url, EventQueueOptions(handlers=registry, worker=WorkerSettings(listen=listen, sweep_interval=sweep))
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop())
    worker.run()


def procrastinate_app(url: str):  # type: ignore[no-untyped-def]
    import logging

    import procrastinate

    logging.getLogger("procrastinate.app").setLevel(logging.ERROR)  # "App is instantiated in the main module"

    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))


def run_procrastinate_worker(url: str, out: str, listen: bool, sweep: float) -> None:
    record = _recorder(out)
    app = procrastinate_app(url)

    @app.task(name="noop")
    def noop(t: float) -> None:
        record(t)

    kwargs = {"listen_notify": listen}
    if not listen:
        kwargs["fetch_job_polling_interval"] = sweep
    app.run_worker(queues=["default"], concurrency=1, wait=True, **kwargs)


# -- driver ---------------------------------------------------------------------------------------------


def with_db(url: str, name: str) -> str:
    return urlsplit(url)._replace(path=f"/{name}").geturl()


def server_info(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return {
            k: conn.execute(f"SHOW {k}").fetchone()[0]
            for k in ("server_version", "autovacuum", "fsync", "synchronous_commit", "max_connections")
        }


def fresh_database(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB_NAME)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DB_NAME)))
    bench_url = with_db(url, DB_NAME)
    from cmb_dagster.database import Database
    from cmb_dagster.eventqueue import HandlerRegistry, register

    db = Database(bench_url)
    db.upgrade()
    registry = HandlerRegistry()
    registry.add("noop", print)
    register(db, registry)
    db.close()
    app = procrastinate_app(bench_url)
    with app.open():
        app.schema_manager.apply_schema()
    return bench_url


def reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE cmb.eventqueue_events")
        conn.execute("TRUNCATE procrastinate_jobs CASCADE")
        conn.execute("VACUUM cmb.eventqueue_events")
        conn.execute("VACUUM procrastinate_jobs")


def start_workers(engine: str, url: str, out: str, n: int, listen: bool) -> list[subprocess.Popen[bytes]]:
    command = [
        sys.executable,
        str(HERE),
        "--role",
        f"{engine}-worker",
        "--url",
        url,
        "--out",
        out,
        "--listen",
        "1" if listen else "0",
        "--sweep",
        str(POLL_INTERVAL if not listen else 2.0),
    ]
    return [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(n)]


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def stop_workers(procs: list[subprocess.Popen[bytes]]) -> tuple[float, int]:
    """Stop the workers; return their CPU seconds and how many error lines they logged."""
    cpu = sum(cpu_seconds(p.pid) for p in procs)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    errors = 0
    for p in procs:
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        errors += sum(
            1
            for line in err.decode(errors="replace").splitlines()
            if "Traceback" in line or " ERROR " in line or ("error" in line.lower() and "0 errors" not in line)
        )
    return cpu, errors


def records(out: str) -> list[tuple[float, float]]:
    found = []
    for path in Path(out).glob("*.log"):
        for line in path.read_text().splitlines():
            emitted, started = line.split()
            found.append((float(emitted), float(started)))
    return found


def wait_for(out: str, n: int, timeout: float) -> list[tuple[float, float]]:
    deadline = time.monotonic() + timeout
    while True:
        found = records(out)
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def preload(engine: str, url: str, n: int) -> None:
    if engine == "cmb":
        from cmb_dagster.database import Database
        from cmb_dagster.eventqueue import emit_many

        db = Database(url)
        for start in range(0, n, 1000):
            emit_many([{"namespace": "bench", "handler": "noop", "value": {"t": 0.0}}] * min(1000, n - start), db=db)
        db.close()
    else:
        app = procrastinate_app(url)

        @app.task(name="noop")
        def noop(t: float) -> None: ...

        with app.open():
            for start in range(0, n, 1000):
                noop.batch_defer(*[{"t": 0.0}] * min(1000, n - start))


def throughput(engine: str, url: str, n_events: int, n_workers: int) -> dict[str, float]:
    reset(url)
    preload(engine, url, n_events)
    with tempfile.TemporaryDirectory() as out:
        procs = start_workers(engine, url, out, n_workers, listen=True)
        found = wait_for(out, n_events, timeout=120)
        cpu, errors = stop_workers(procs)
    starts = sorted(s for _, s in found)
    span = starts[-1] - starts[0] if len(starts) > 1 else float("nan")
    return {
        "events": len(found),
        "per_second": round((len(starts) - 1) / span, 1) if span else float("nan"),
        "seconds": round(span, 3),
        "worker_cpu_seconds": round(cpu, 2),
        "worker_cpu_share": round(cpu / span / n_workers, 2) if span else float("nan"),
        "errors": errors,
    }


PRODUCERS = 4  # threads, each with its own connection: one commit (fsync) per event caps a single producer


def produce(engine: str, url: str, rate: float, n: int) -> float:
    """Send ``n`` events at ``rate`` per second in total, one transaction each; return the rate achieved."""
    import threading

    began = time.monotonic() + 0.5

    def producer(index: int) -> None:
        if engine == "cmb":
            from cmb_dagster.eventqueue import emit

            conn = psycopg.connect(url, autocommit=True, options="-c search_path=cmb,public")

            def send() -> None:
                emit("bench", "noop", {"t": time.time()}, conn=conn)

            close = conn.close
        else:
            app = procrastinate_app(url)

            @app.task(name="noop")
            def noop(t: float) -> None: ...

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


def latency(engine: str, url: str, rate: float, seconds: float, listen: bool) -> dict[str, float]:
    reset(url)
    n = int(rate * seconds)
    with tempfile.TemporaryDirectory() as out:
        procs = start_workers(engine, url, out, 1, listen=listen)
        time.sleep(1.5)  # the worker is up and idle
        achieved = produce(engine, url, rate, n)
        found = wait_for(out, n, timeout=20)  # an engine that cannot keep up is reported as such
        cpu, errors = stop_workers(procs)
    lat = sorted((s - e) * 1000 for e, s in found)
    q = statistics.quantiles(lat, n=100) if len(lat) > 2 else [float("nan")] * 99
    return {
        "events": len(found),
        "sent": n,
        "achieved_rate": round(achieved, 1),
        "p50_ms": round(q[49], 2),
        "p99_ms": round(q[98], 2),
        "max_ms": round(lat[-1], 2) if lat else float("nan"),
        "worker_cpu_seconds": round(cpu, 2),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="driver")
    parser.add_argument("--url", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--listen", default="1")
    parser.add_argument("--sweep", type=float, default=2.0)
    parser.add_argument("--events", type=int, default=2000, help="backlog per throughput run")
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--low-rate", type=float, default=50.0, help="a rate both engines can sustain")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each latency run")
    args = parser.parse_args()
    if args.role == "cmb-worker":
        return run_cmb_worker(args.url, args.out, args.listen == "1", args.sweep)
    if args.role == "procrastinate-worker":
        return run_procrastinate_worker(args.url, args.out, args.listen == "1", args.sweep)

    from cmb_dagster.database import Database

    server = args.url or Database.from_settings().url
    info = server_info(server)
    url = fresh_database(server)
    results: dict[str, dict[str, dict[str, float]]] = {"cmb": {}, "procrastinate": {}}
    for engine in ("cmb", "procrastinate"):
        for workers in (1, 4):
            results[engine][f"throughput_{workers}"] = throughput(engine, url, args.events, workers)
        results[engine]["latency_notify"] = latency(engine, url, args.rate, args.seconds, listen=True)
        results[engine]["latency_notify_low"] = latency(engine, url, args.low_rate, args.seconds, listen=True)
        results[engine]["latency_poll"] = latency(engine, url, args.rate, args.seconds, listen=False)

    print(
        f"server: Postgres {info['server_version']}, autovacuum={info['autovacuum']}, fsync={info['fsync']}, "
        f"synchronous_commit={info['synchronous_commit']}; machine shared with other jobs (2 cores)"
    )
    print(
        f"procrastinate: its own worker (concurrency=1, listen_notify, polling {POLL_INTERVAL}s when off), "
        "same no-op task, same database"
    )
    ratios = {}
    for key, label, field, better in [
        ("throughput_1", "throughput, 1 worker (events/s)", "per_second", "higher"),
        ("throughput_4", "throughput, 4 workers (events/s)", "per_second", "higher"),
        ("latency_notify", f"emit->start p50 at {args.rate:.0f}/s, notify (ms)", "p50_ms", "lower"),
        ("latency_notify", f"emit->start p99 at {args.rate:.0f}/s, notify (ms)", "p99_ms", "lower"),
        ("latency_notify_low", f"emit->start p50 at {args.low_rate:.0f}/s, notify (ms)", "p50_ms", "lower"),
        ("latency_notify_low", f"emit->start p99 at {args.low_rate:.0f}/s, notify (ms)", "p99_ms", "lower"),
        ("latency_poll", f"emit->start p50 at {args.rate:.0f}/s, polling {POLL_INTERVAL}s (ms)", "p50_ms", "lower"),
        ("latency_poll", f"emit->start p99 at {args.rate:.0f}/s, polling {POLL_INTERVAL}s (ms)", "p99_ms", "lower"),
    ]:
        ours, theirs = results["cmb"][key][field], results["procrastinate"][key][field]
        ratio = (ours / theirs if better == "higher" else theirs / ours) if ours and theirs else float("nan")
        ratios[f"{key}.{field}"] = round(ratio, 2)
        behind = [e for e in results if results[e][key].get("sent", 0) > results[e][key]["events"]]
        note = f"  ({', '.join(behind)} did not keep up: backlog grew)" if behind else ""
        print(f"  {label:58} cmb {ours:>9}   procrastinate {theirs:>9}   cmb advantage x{ratio:.2f}{note}")
    for engine in results:
        for key, value in results[engine].items():
            print(f"  {engine:13} {key:15} {value}")
    print(json.dumps({"benchmark": "eventqueue", "server": info, "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
