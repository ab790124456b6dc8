"""Scaling benchmark: each engine's throughput with 1, 2 and 4 worker processes on this machine, and what limits it.

    .venv/bin/python benchmarks/bench_scaling.py [--engines callbacks,pubsub,stages,eventqueue] [--workers 1,2,4]
        [--items full|small|N|engine=N,...] [--database-url postgresql://...]

For each engine and each worker count N, in a database of its own (named with this process's pid, dropped at
the end): load a backlog that takes one worker several seconds to drain, VACUUM ANALYZE (what autovacuum would
leave; the test server runs without it), start N real ``cmb-dagster <engine> worker`` processes and measure the
drain. The workers start behind a gate: the driver holds an ACCESS EXCLUSIVE lock on the tables the workers
write first, so each one blocks in its first statement once it holds its leases; the lock is released when all
N hold theirs, and the drain is timed from then to the last item done (polled every 0.2 s).

Measured over the drain: items/s; the workers' CPU (psutil, per process); Postgres's CPU (the whole cluster's
processes, live and ended, so the server must run on this machine; and this database's backends alone); the
load average; the most connections the workers held at once; and pg_stat_activity, sampled every 0.1 s for
this database's client backends: how many were busy on average (not ``idle``, i.e. not waiting for their
worker), and the busy ones' states as shares: ``CPU`` (active, no wait event), ``<wait_event_type>:<event>``
(active and waiting: ``Lock:*`` row and transaction locks, ``LWLock:*``, ``IO:WALSync`` commits...) or
``idle in transaction`` (a worker's own time inside a transaction), with the statements the active ones ran.
The ``limit`` column reads these figures: the machine's CPU when workers and server together use 85% of the
cores or the 1-minute load average reaches the core count, a worker's CPU when one runs at 85% of a core, locks
when they are 20% of the busy samples, the workers' side when Postgres is in a statement for fewer than half the
workers on average, else Postgres's top state.

Engines and how their workers are set up (each as its docs recommend, the same settings for every N):
- ``callbacks``: events due at once, POSTed to a receiver on 127.0.0.1 in a process of its own that answers
  200 at once (``bench_callbacks.SinkProcess``). 8 buckets; worker i of N serves the buckets with
  ``id % N == i`` (``callbacks worker --buckets``), as Dagster worker job i of N does. Worker defaults
  (poll_interval 1 s, 128 calls in flight) with ``--no-materialize`` and ``--per-host-concurrency 0``: every
  call goes to the one local host, whose default limit of 64 calls in flight across all workers would
  otherwise be the figure measured.
- ``pubsub``: rows inserted into a captured table (``bench_pubsub``'s tables, 10,000 rows a transaction), one
  consumer per branch (``pubsub consume --branch i --batch-size 1000``, the handler ``bench_pubsub:handler``
  writing a result row per event in the consumer's transaction). A branch is read by one consumer at a time,
  so with N workers the capture spreads the rows over N branches (``branch = id % N``).
- ``stages``: entities put through the API (the change path), then through ``bench_stages``' 3-stage
  pipeline (8 shards, batch_size 500, idle_sleep 0.5 s); worker i of N serves shards ``id % N == i``
  (``stages worker --index i --workers N``). An item is an entity through all three stages.
- ``eventqueue``: no-op events emitted ready (``bench_flow``'s load, 10,000 a statement; at 100,000 events queued
  and more, one such emit ran for minutes on this machine, hence 100,000), ``events worker`` with its defaults
  (batch_size 100, LISTEN on, sweep 2 s). The queue has no partitions: workers share it by
  ``FOR UPDATE SKIP LOCKED`` claims, each holding a liveness lease.
- The reactive scheduler is left out: it is no backlog drained by workers. One process per scheduler name
  holds its lease and ticks (a second of the same name stands by), and a tick's work is bounded by its tasks'
  CTL reads; it scales by splitting tasks over scheduler names (code locations), not by adding workers.

Figures in benchmarks/README.md. Run it alone on the machine. Prints a summary table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_flow import registry, server_cpu, with_db  # noqa: E402
from bench_stages import CLI, pipeline, server_url  # noqa: E402

from cmb_dagster.database import Database  # noqa: E402

EVENT_HANDLERS = registry({})  # the event queue workers' handlers (``events worker --handlers``): "noop"
BUCKETS = 8
FULL_ITEMS = {
    "callbacks": 60_000,
    "pubsub": 300_000,
    "stages": 20_000,
    "eventqueue": 100_000,
}  # emit_many stalls past ~100k queued
SMALL_SHARE = 20  # --items small: a twentieth, for a smoke run
READY_TIMEOUT = 90.0
DRAIN_TIMEOUT = 600.0
POLL = 0.2
SERVER_SETTINGS = ("server_version", "autovacuum", "fsync", "synchronous_commit", "shared_buffers", "max_connections")
SAMPLE = 0.1


# -- the engines ---------------------------------------------------------------------------------------


@dataclass
class Engine:
    """How to load a backlog, start a worker and count what is left, for one engine."""

    name: str
    lease_kind: str  # the workers hold leases of this kind once they are up
    gate: tuple[str, ...]  # the tables locked until every worker is up (their first write blocks on them)
    partitions: Callable[[int], str]  # what N workers share, as a line for the table
    load: Callable[[Database, int, int], Any]  # (db, items, workers) -> the receiver the workers call, if any
    command: Callable[[Any, int, int], list[str]]  # (receiver, index, workers) -> the CLI's arguments
    pending: str  # SQL: whether items are left (polled every POLL seconds: cheap)
    check: str  # SQL: one row, which must equal check_expected(items) after the drain
    check_expected: Callable[[int], tuple]


def load_callbacks(db: Database, items: int, workers: int) -> Any:
    from bench_callbacks import LOCAL, SinkProcess

    from cmb_dagster.callbacks import CallbackClient

    sink = SinkProcess().__enter__()
    now, url = datetime.now(UTC), f"{sink.url}/cb"
    with CallbackClient(db, LOCAL, buffered=False) as client:
        client.set_bucket_count(BUCKETS)
        for start in range(0, items, 1000):
            client.create_many(
                [
                    {
                        "owner_client_id": "bench",
                        "group_key": "scaling",
                        "event_key": str(i),
                        "run_at": now,
                        "cb_url": url,
                    }
                    for i in range(start, min(items, start + 1000))
                ]
            )
    return sink


def callbacks_command(sink: Any, index: int, workers: int) -> list[str]:
    buckets = ",".join(str(b) for b in range(BUCKETS) if b % workers == index)
    local = ["--allow-host", "127.0.0.1", "--per-host-concurrency", "0"]
    return ["callbacks", "worker", "--no-materialize", *local, "--buckets", buckets]


def pubsub_command(_: Any, index: int, workers: int) -> list[str]:
    consumer = ["--handler", "bench_pubsub:handler", "--batch-size", "1000"]
    return ["pubsub", "consume", "scaling", "--branch", str(index), *consumer]


def stages_command(_: Any, index: int, workers: int) -> list[str]:
    return ["stages", "worker", "--stages", "bench_stages:pipeline", "--index", str(index), "--workers", str(workers)]


def eventqueue_command(_: Any, index: int, workers: int) -> list[str]:
    return ["events", "worker", "--handlers", "bench_scaling:EVENT_HANDLERS"]


def load_pubsub(db: Database, items: int, workers: int) -> Any:
    from bench_pubsub import INSERT_ORDERS, SETUP

    from cmb_dagster.pubsub import install_capture

    with db.connection() as conn:
        conn.execute(SETUP)
        install_capture(conn, "public.orders", branch=f"id % {workers}", ops=["insert"])
    for start in range(0, items, 10_000):
        with db.connection() as conn:
            conn.execute(INSERT_ORDERS, {"n": min(10_000, items - start)})
    return None


def load_stages(db: Database, items: int, workers: int) -> Any:
    from cmb_dagster.stages import StageStore

    store = StageStore(db, pipeline.stages)
    for start in range(0, items, 1000):
        store.put_many({f"e{i}": {"a": i} for i in range(start, min(items, start + 1000))})
    return None


def load_eventqueue(db: Database, items: int, workers: int) -> Any:
    from bench_flow import load

    load(db.url, items, {})
    return None


ENGINES = {
    e.name: e
    for e in [
        Engine(
            "callbacks",
            "callbacks.bucket",
            ("callback_events",),
            lambda n: f"{BUCKETS} buckets, {BUCKETS // n} per worker",
            load_callbacks,
            callbacks_command,
            "SELECT EXISTS (SELECT FROM callback_events WHERE status = 'pending')",
            "SELECT count(*) FILTER (WHERE status = 'notified'), count(*) FILTER (WHERE attempts > 1)"
            " FROM callback_events",
            lambda items: (items, 0),
        ),
        Engine(
            "pubsub",
            "pubsub.consumer",
            ("public.results",),
            lambda n: f"{n} branch{'es' if n > 1 else ''}, one consumer each",
            load_pubsub,
            pubsub_command,
            "SELECT (SELECT count(*) FROM public.results) < (SELECT max(id) FROM public.orders)",
            "SELECT count(*), count(DISTINCT event_id) FROM public.results",
            lambda items: (items, items),
        ),
        Engine(
            "stages",
            "stages.shard",
            ("stage_queue", "stage_changes"),
            lambda n: f"{pipeline.shard_count} shards, {pipeline.shard_count // n} per worker",
            load_stages,
            stages_command,
            "SELECT EXISTS (SELECT FROM stage_entities WHERE NOT payload ? 'd')",
            "SELECT count(*) FILTER (WHERE (payload->>'d')::int = (payload->>'a')::int + 3) FROM stage_entities",
            lambda items: (items,),
        ),
        Engine(
            "eventqueue",
            "eventqueue.worker",
            ("eventqueue_events",),
            lambda n: "no partitions (SKIP LOCKED claims)",
            load_eventqueue,
            eventqueue_command,
            "SELECT EXISTS (SELECT FROM eventqueue_events)",
            "SELECT count(*) FROM eventqueue_dead",
            lambda items: (0,),
        ),
    ]
}


# -- measuring -------------------------------------------------------------------------------------------


def cpu(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


class ActivitySampler(threading.Thread):
    """Samples this database's client backends in pg_stat_activity (but ``skip``'s and the LISTEN-only
    connections) until stopped; keeps each backend's CPU when first seen."""

    def __init__(self, db: Database, skip: set[int]) -> None:
        super().__init__(daemon=True)
        self.conn = db.connect(autocommit=True)
        self.skip = skip | {self.conn.info.backend_pid}
        self.states: Counter[str] = Counter()
        self.queries: Counter[str] = Counter()
        self.first_cpu: dict[int, float] = {}
        self.rounds = self.idle = self.connections = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE):
            rows = self.conn.execute(
                "SELECT pid, state, wait_event_type, wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 70),"
                " state = 'idle' AND query ILIKE 'LISTEN%%'"
                " FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'"
            ).fetchall()
            self.rounds += 1
            self.connections = max(self.connections, sum(1 for row in rows if row[0] not in self.skip))
            for pid, state, wait_type, wait, query, listener in rows:
                if pid in self.skip or listener:
                    continue
                self.first_cpu.setdefault(pid, cpu(pid))
                if state == "active":
                    self.states["CPU" if wait_type is None else f"{wait_type}:{wait}"] += 1
                    self.queries[query] += 1
                elif state == "idle":
                    self.idle += 1
                else:
                    self.states[state or "?"] += 1

    def finish(self) -> dict[str, Any]:
        """``waits``: the top states of the backends that were not idle, as shares of those samples;
        ``queries``: the statements of the active ones; ``busy_backends``: how many were not idle, on average."""
        self.stopped.set()
        self.join()
        self.conn.close()
        busy = sum(self.states.values())
        active = sum(self.queries.values())
        return {
            "busy_backends": round(busy / max(1, self.rounds), 2),
            "idle_backends": round(self.idle / max(1, self.rounds), 2),
            "waits": {k: round(v / busy, 3) for k, v in self.states.most_common(5)},
            "queries": {k: round(v / active, 3) for k, v in self.queries.most_common(3)},
            "backends": len(self.first_cpu),
            "connections": self.connections,
            "backends_cpu_s": round(sum(max(0.0, cpu(p) - c) for p, c in self.first_cpu.items()), 2),
        }


def limit(run: dict[str, Any], cores: int) -> str:
    """What the figures say limits the drain (see the module's docstring)."""
    used = run["worker_cores"] + run["server_cores"] + run.get("sink_cores", 0.0)
    waits = run["activity"]["waits"]
    locks = sum(v for k, v in waits.items() if k.startswith("Lock:"))
    if used >= 0.85 * cores or run["load_average"][0] >= cores:
        side = "Postgres" if run["server_cores"] > run["worker_cores"] else "workers"
        return f"machine CPU ({used:.1f}/{cores} cores, most in {side}; load {run['load_average'][0]:.1f})"
    if run["worker_max_core"] >= 0.85:
        return f"worker CPU (a worker at {run['worker_max_core']:.2f} core)"
    if locks >= 0.2:
        return f"locks ({locks:.0%} of the busy backends' samples)"
    busy = run["activity"]["busy_backends"]
    working = busy * (1 - waits.get("idle in transaction", 0.0))  # in a statement, not waiting for its client
    if working < 0.5 * run["workers"]:
        return f"the workers' side (Postgres in a statement for {working:.2f} of {run['workers']} workers on average)"
    top = next((k for k in waits if k != "idle in transaction"), "?")
    return f"Postgres: {top} ({waits.get(top, 0):.0%} of the busy backends' samples)"


# -- one run -----------------------------------------------------------------------------------------------


def start_worker(url: str, argv: list[str], log: Any) -> subprocess.Popen:
    env = {**os.environ, "CMB_DATABASE_URL": url, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])}
    return subprocess.Popen([*CLI, *argv], env=env, stdout=log, stderr=log)


def stop_worker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(conn: psycopg.Connection, kind: str, workers: list[subprocess.Popen], logs: list[Any]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        owners = conn.execute(
            "SELECT count(DISTINCT owner) FROM leases WHERE kind = %s AND expires_at > now()", (kind,)
        ).fetchone()[0]
        if owners >= len(workers):
            return
        dead = [i for i, p in enumerate(workers) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs[(dead or [0])[0]].seek(0)
            tail = logs[(dead or [0])[0]].read().decode(errors="replace")[-3000:]
            raise SystemExit(f"{kind}: {owners} of {len(workers)} workers up ({len(dead)} exited); a log:\n{tail}")
        time.sleep(0.1)


def run_one(server: str, engine: Engine, workers: int, items: int) -> dict[str, Any]:
    name = f"cmb_bench_scaling_{os.getpid()}_{engine.name}_{workers}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = with_db(server, name)
    db = Database(url)
    context, procs, logs = None, [], []
    try:
        db.ensure_ready()
        loaded = time.monotonic()
        context = engine.load(db, items, workers)
        load_seconds = time.monotonic() - loaded
        with db.connect(autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        db.close()  # the load's pool: the connections counted from here on are the workers'
        monitor = db.connect(autocommit=True)
        gate = db.connect()
        gate.execute(f"LOCK TABLE {', '.join(engine.gate)} IN ACCESS EXCLUSIVE MODE")
        for index in range(workers):
            logs.append(tempfile.TemporaryFile())  # noqa: SIM115 - the worker writes it until it ends
            procs.append(start_worker(url, engine.command(context, index, workers), logs[-1]))
        wait_ready(monitor, engine.lease_kind, procs, logs)
        sampler = ActivitySampler(db, {monitor.info.backend_pid, gate.info.backend_pid})
        cpu_before = {p.pid: cpu(p.pid) for p in procs}
        sink_pid = context._process.pid if context is not None else None  # the SinkProcess's child
        sink_before = cpu(sink_pid) if sink_pid else 0.0
        own = [monitor.info.backend_pid, sampler.conn.info.backend_pid]  # the benchmark's backends, not counted
        server_before = server_cpu(monitor) - sum(cpu(p) for p in own)
        started = time.monotonic()
        gate.commit()
        sampler.start()
        while monitor.execute(engine.pending).fetchone()[0]:
            if time.monotonic() - started > DRAIN_TIMEOUT:
                raise SystemExit(f"{engine.name}, {workers} workers: items left after {DRAIN_TIMEOUT}s")
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"{engine.name}: a worker exited during the drain")
            time.sleep(POLL)
        seconds = time.monotonic() - started
        worker_cpu = {p.pid: cpu(p.pid) - cpu_before[p.pid] for p in procs}
        server_used = server_cpu(monitor) - sum(cpu(p) for p in own) - server_before
        sink = cpu(sink_pid) - sink_before if sink_pid else 0.0
        activity = sampler.finish()
        load_average = os.getloadavg()
        for proc in procs:
            stop_worker(proc)
        checked = tuple(monitor.execute(engine.check).fetchone())
        monitor.close()
        gate.close()
        errors = 0
        for log in logs:
            log.seek(0)
            text = log.read().decode(errors="replace")
            errors += text.count("Traceback") + text.count(" ERROR ")
        run: dict[str, Any] = {
            "engine": engine.name,
            "workers": workers,
            "partitions": engine.partitions(workers),
            "items": items,
            "load_seconds": round(load_seconds, 1),
            "seconds": round(seconds, 2),
            "items_per_s": round(items / seconds),
            "worker_cpu_s": round(sum(worker_cpu.values()), 2),
            "worker_cores": round(sum(worker_cpu.values()) / seconds, 2),
            "worker_max_core": round(max(worker_cpu.values()) / seconds, 2),
            "server_cpu_s": round(server_used, 2),
            "server_cores": round(server_used / seconds, 2),
            "db_backends_cores": round(activity["backends_cpu_s"] / seconds, 2),
            "connections_per_worker": round(activity["connections"] / workers, 1),
            "load_average": [round(x, 2) for x in load_average],
            "activity": activity,
            "check": {"found": list(checked), "expected": list(engine.check_expected(items))},
            "errors_logged": errors,
        }
        if sink_pid:
            run["sink_cores"] = round(sink / seconds, 2)
        run["limit"] = limit(run, os.cpu_count() or 1)
        return run
    finally:
        for proc in procs:
            stop_worker(proc)
        if context is not None:
            context.__exit__(None, None, None)
        db.close()
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# -- main --------------------------------------------------------------------------------------------------


def item_counts(value: str, engines: list[str]) -> dict[str, int]:
    if value == "full":
        return {e: FULL_ITEMS[e] for e in engines}
    if value == "small":
        return {e: FULL_ITEMS[e] // SMALL_SHARE for e in engines}
    if value.isdigit():
        return dict.fromkeys(engines, int(value))
    counts = {e: FULL_ITEMS[e] for e in engines}
    for part in value.split(","):
        engine, _, count = part.partition("=")
        if engine not in counts or not count.isdigit():
            raise SystemExit(f"--items: {part!r} is not ENGINE=COUNT with one of {', '.join(engines)}")
        counts[engine] = int(count)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES), help="Comma-separated, of: " + ", ".join(ENGINES))
    parser.add_argument("--workers", default="1,2,4", help="Worker counts to run, comma-separated.")
    parser.add_argument(
        "--items",
        default="full",
        help=f"full ({', '.join(f'{k} {v:,}' for k, v in FULL_ITEMS.items())}), small (a {SMALL_SHARE}th), "
        "a count for every engine, or ENGINE=COUNT,...",
    )
    parser.add_argument("--database-url", default=None, help="The server (default: CMB_DATABASE_URL, else embedded).")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown {', '.join(unknown)} (of {', '.join(ENGINES)})")
    counts = item_counts(args.items, engines)
    worker_counts = [int(n) for n in args.workers.split(",")]
    server = args.database_url or server_url()
    with psycopg.connect(server) as conn:
        info = {k: conn.execute(f"SHOW {k}").fetchone()[0] for k in SERVER_SETTINGS}
    cores = os.cpu_count()
    print(
        f"scaling benchmark on {Database(server).display_url}: {cores} CPUs, "
        + ", ".join(f"{k} {v}" for k, v in info.items())
        + f"; load average at start {os.getloadavg()}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    for name in engines:
        for n in worker_counts:
            run = run_one(server, ENGINES[name], n, counts[name])
            runs.append(run)
            print(
                f"  {name} x{n}: {run['items']:,} items loaded in {run['load_seconds']}s, "
                f"drained in {run['seconds']}s: {run['items_per_s']:,}/s; {run['limit']}",
                flush=True,
            )
    base = {r["engine"]: r["items_per_s"] for r in runs if r["workers"] == worker_counts[0]}
    print()
    header = (
        f"{'engine':10} {'workers':>7} {'items':>8} {'items/s':>8} {'speedup':>7} {'worker cores':>12} "
        f"{'max/worker':>10} {'PG cores':>8} {'busy':>5} {'load 1m':>7}  busy backends' states / limit"
    )
    print(header)
    for r in runs:
        r["speedup"] = round(r["items_per_s"] / base[r["engine"]], 2) if r["engine"] in base else None
        waits = ", ".join(f"{k} {v:.0%}" for k, v in list(r["activity"]["waits"].items())[:3])
        print(
            f"{r['engine']:10} {r['workers']:>7} {r['items']:>8,} {r['items_per_s']:>8,} {r['speedup'] or '':>7} "
            f"{r['worker_cores']:>12.2f} {r['worker_max_core']:>10.2f} {r['server_cores']:>8.2f} "
            f"{r['activity']['busy_backends']:>5.2f} "
            f"{r['load_average'][0]:>7.2f}  {waits} / {r['limit']}"
        )
    for r in runs:
        wrong = r["check"]["found"] != r["check"]["expected"]
        if wrong or r["errors_logged"]:
            print(f"  ! {r['engine']} x{r['workers']}: check {r['check']}, {r['errors_logged']} errors logged")
    print(json.dumps({"benchmark": "scaling", "cpus": cores, "server": info, "items": counts, "runs": runs}))


if __name__ == "__main__":
    main()
