"""Pub/sub benchmark: consumer throughput and commit-to-consume lag, against raw Postgres on this machine.

    python benchmarks/bench_pubsub.py [--seconds 10]

Runs on CMB_DATABASE_URL's server (default: the embedded one), in a scratch database it drops after.
- throughput: one consumer with same-database results (a row per event) while a producer process
  inserts 100-row transactions into a captured table at full speed, batch sizes 100 and 1000; and
  the same consumer draining a 100k backlog alone;
- raw: the same inserts written by hand into an outbox table, read by a plain loop
  (SELECT ... WHERE id > last LIMIT n; INSERT results; UPDATE cursor; COMMIT), the cheapest a
  consumer can be on this server (and the one that skips events);
- lag: p50/p99 seconds from a producer's commit to the handler call at a steady 1,000 events/s,
  with the consumer's default settings (``ConsumerWorker.run``: lease, worker loop, hints if it has them);
- idle: CPU (user+system) of a consumer process with default settings and no events, and of its
  server backends, as a share of one core.
Prints a summary, then one JSON object as the last line. Runs the package importable as
``cmb_dagster`` (put another checkout first on PYTHONPATH to measure it: "before").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import threading
import time
import uuid
from urllib.parse import urlsplit

import psutil
import psycopg
from psycopg import sql

from cmb_dagster.database import Database
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, install_capture
from cmb_dagster.settings import Settings

ROWS_PER_TRANSACTION = 100
BACKLOG = 100_000

SETUP = """
CREATE TABLE public.orders (id bigserial PRIMARY KEY, customer int NOT NULL, amount int NOT NULL, note text NOT NULL);
CREATE TABLE public.results (event_id bigint NOT NULL, amount int NOT NULL);
CREATE TABLE public.raw_orders (
    id bigserial PRIMARY KEY, customer int NOT NULL, amount int NOT NULL, note text NOT NULL
);
CREATE TABLE public.raw_events (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
CREATE TABLE public.raw_cursor (name text PRIMARY KEY, last_id bigint NOT NULL);
INSERT INTO public.raw_cursor VALUES ('bench', 0);
"""

INSERT_ORDERS = """
INSERT INTO public.orders (customer, amount, note)
SELECT g %% 97, g %% 1000, 'order ' || g FROM generate_series(1, %(n)s) g
"""

INSERT_RAW = """
WITH o AS (
    INSERT INTO public.raw_orders (customer, amount, note)
    SELECT g %% 97, g %% 1000, 'order ' || g FROM generate_series(1, %(n)s) g RETURNING *
)
INSERT INTO public.raw_events (payload) SELECT to_jsonb(o) FROM o
"""

RAW_READ = "SELECT id, payload FROM public.raw_events WHERE id > %s ORDER BY id LIMIT %s"
RAW_RESULTS = "INSERT INTO public.results SELECT unnest(%s::bigint[]), unnest(%s::int[])"
RAW_ADVANCE = "UPDATE public.raw_cursor SET last_id = %s WHERE name = 'bench'"


def handler(conn: psycopg.Connection, events: list) -> None:
    conn.execute(RAW_RESULTS, ([e.id for e in events], [e.payload["amount"] for e in events]))


def produce(url: str, raw: bool, seconds: float, rate: float | None, out: multiprocessing.Queue) -> None:
    """Insert 100-row transactions (or, with ``rate``, 10-row ones at that many rows/s) for ``seconds``."""
    per_txn = ROWS_PER_TRANSACTION if rate is None else 10
    query = INSERT_RAW if raw else INSERT_ORDERS
    commits: list[tuple[float, int]] = []
    rows = 0
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            if rate is not None and rows > elapsed * rate:
                time.sleep(max(0.0, rows / rate - elapsed))
                continue
            conn.execute(query, {"n": per_txn})
            commits.append((time.time(), per_txn))
            rows += per_txn
    out.put((rows, commits))


def start_producer(url: str, raw: bool, seconds: float, rate: float | None = None):
    queue: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(target=produce, args=(url, raw, seconds, rate, queue))
    proc.start()
    return proc, queue


def results_count(db: Database) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM public.results").fetchone()[0]


def reset(db: Database) -> None:
    with db.connection() as conn:
        conn.execute(
            "TRUNCATE public.results, public.orders, public.raw_orders, public.raw_events, cmb.pubsub_events"
            " RESTART IDENTITY"
        )
        conn.execute("DELETE FROM cmb.pubsub_watermarks")
        conn.execute("UPDATE public.raw_cursor SET last_id = 0")
    with db.connect(autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def raw_consumer_loop(db: Database, batch: int, until: float, total: int | None = None) -> int:
    consumed = 0
    with db.connect() as conn:
        while time.monotonic() < until and (total is None or consumed < total):
            last = conn.execute("SELECT last_id FROM public.raw_cursor WHERE name = 'bench' FOR UPDATE").fetchone()[0]
            rows = conn.execute(RAW_READ, (last, batch)).fetchall()
            if rows:
                conn.execute(RAW_RESULTS, ([r[0] for r in rows], [r[1]["amount"] for r in rows]))
                conn.execute(RAW_ADVANCE, (rows[-1][0],))
            conn.commit()
            consumed += len(rows)
            if not rows:
                time.sleep(0.001)
    return consumed


def our_consumer_loop(db: Database, batch: int, until: float, name: str, total: int | None = None) -> int:
    consumer = ConsumerWorker(db, ConsumerSpec(consumer_id=name, handler=handler, batch_size=batch))
    consumed = 0
    while time.monotonic() < until and (total is None or consumed < total):
        n = consumer.run_once()
        consumed += n
        if not n:
            time.sleep(0.001)
    return consumed


def with_producer(db: Database, raw: bool, batch: int, seconds: float) -> dict[str, float]:
    reset(db)
    proc, queue = start_producer(db.url, raw, seconds)
    started = time.monotonic()
    until = started + seconds
    consumed = raw_consumer_loop(db, batch, until) if raw else our_consumer_loop(db, batch, until, f"tp{batch}")
    elapsed = time.monotonic() - started
    produced, _ = queue.get(timeout=60)
    proc.join(30)
    return {"consumed_per_s": round(consumed / elapsed), "produced_per_s": round(produced / seconds)}


def drain(db: Database, raw: bool, batch: int) -> float:
    reset(db)
    with db.connection() as conn:
        for _ in range(BACKLOG // 10_000):
            conn.execute(INSERT_RAW if raw else INSERT_ORDERS, {"n": 10_000})
    started = time.monotonic()
    until = started + 300
    if raw:
        consumed = raw_consumer_loop(db, batch, until, BACKLOG)
    else:
        consumed = our_consumer_loop(db, batch, until, f"drain{batch}", BACKLOG)
    return round(consumed / (time.monotonic() - started))


def lag(db: Database, seconds: float, rate: float, idle_sleep: float | None = None) -> dict[str, float]:
    reset(db)
    received: dict[int, float] = {}

    def timing_handler(conn: psycopg.Connection, events: list) -> None:
        handler(conn, events)
        now = time.time()
        for e in events:
            received[e.key["id"]] = now

    kwargs = {} if idle_sleep is None else {"idle_sleep": idle_sleep}
    consumer = ConsumerWorker(db, ConsumerSpec(consumer_id=f"lag{idle_sleep}", handler=timing_handler, **kwargs))
    proc, queue = start_producer(db.url, False, seconds, rate)
    runner = threading.Thread(target=consumer.run)
    runner.start()
    produced, commits = queue.get(timeout=seconds + 60)
    proc.join(30)
    deadline = time.monotonic() + 30
    while len(received) < produced and time.monotonic() < deadline:
        time.sleep(0.05)
    consumer.stop()
    runner.join(60)
    lags = []
    order_id = 0
    for committed_at, n in commits:
        for _ in range(n):
            order_id += 1
            if order_id in received:
                lags.append(received[order_id] - committed_at)
    lags.sort()
    return {
        "events_per_s": round(produced / seconds),
        "delivered": len(lags),
        "produced": produced,
        "p50_s": round(lags[len(lags) // 2], 4),
        "p99_s": round(lags[int(len(lags) * 0.99)], 4),
        "max_s": round(lags[-1], 4),
    }


def idle_consumer(url: str, seconds: float) -> None:
    ConsumerWorker(Database(url), ConsumerSpec(consumer_id="idle", handler=handler)).run(seconds)


def idle_cpu(db: Database, seconds: float) -> dict[str, float]:
    """CPU share of one core used by an idle consumer (default settings) and by its server backends."""
    reset(db)
    proc = multiprocessing.Process(target=idle_consumer, args=(db.url, seconds + 3))
    proc.start()
    with db.connect(autocommit=True) as conn:

        def backends() -> list[int]:
            return [
                r[0]
                for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND backend_type = 'client backend'"
                )
            ]

        deadline = time.monotonic() + 10
        while len(backends()) < 2 and time.monotonic() < deadline:  # pool + listener connected
            time.sleep(0.1)
        time.sleep(1.0)
        pids = backends()

        def cpu() -> tuple[float, float]:
            client = psutil.Process(proc.pid).cpu_times()
            server = 0.0
            for pid in pids:
                try:
                    t = psutil.Process(pid).cpu_times()
                    server += t.user + t.system
                except psutil.Error:
                    pass
            return client.user + client.system, server

        c0, s0, t0 = *cpu(), time.monotonic()
        time.sleep(seconds)
        c1, s1, t1 = *cpu(), time.monotonic()
    proc.join(30)
    wall = t1 - t0
    return {
        "client_core_share": round((c1 - c0) / wall, 4),
        "server_core_share": round((s1 - s0) / wall, 4),
        "backends": len(pids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="Length of each timed run.")
    args = parser.parse_args()

    server = Database.from_settings(Settings.from_env()).url
    name = f"cmb_bench_pubsub_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        version = conn.execute("SHOW server_version").fetchone()[0]
    url = urlsplit(server)._replace(path=f"/{name}").geturl()
    db = Database(url)
    try:
        with db.connection() as conn:
            conn.execute(SETUP)
            install_capture(conn, "public.orders", ops=["insert"])
        figures: dict[str, object] = {"server_version": version, "seconds": args.seconds}
        for batch in (100, 1000):
            ours = with_producer(db, False, batch, args.seconds)
            raw = with_producer(db, True, batch, args.seconds)
            # drains alternate, best of two each: the machine is shared, load comes and goes
            drains = {False: [], True: []}
            for _ in range(2):
                for raw_loop in (False, True):
                    drains[raw_loop].append(drain(db, raw_loop, batch))
            figures[f"batch_{batch}"] = {
                "ours": ours,
                "raw": raw,
                "ratio": round(ours["consumed_per_s"] / raw["consumed_per_s"], 2),
                "drain_ours_per_s": max(drains[False]),
                "drain_raw_per_s": max(drains[True]),
            }
            figures[f"batch_{batch}"]["drain_ratio"] = round(
                figures[f"batch_{batch}"]["drain_ours_per_s"] / figures[f"batch_{batch}"]["drain_raw_per_s"], 2
            )
        figures["lag_at_1000_per_s"] = lag(db, max(args.seconds, 10.0), 1000.0)  # default settings
        figures["idle_cpu"] = idle_cpu(db, max(args.seconds, 10.0))
        with db.connection() as conn:
            figures["settings"] = dict(
                conn.execute(
                    "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', 'fsync', 'synchronous_commit')"
                ).fetchall()
            )
    finally:
        db.close()
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    print(
        f"pub/sub benchmark on Postgres {version} ({figures['settings']}), {args.seconds:.0f}s runs, "
        f"producer in its own process"
    )
    for batch in (100, 1000):
        f = figures[f"batch_{batch}"]
        print(
            f"  batch {batch:>4}: consumed {f['ours']['consumed_per_s']:>7,}/s while the producer wrote "
            f"{f['ours']['produced_per_s']:,}/s; raw loop {f['raw']['consumed_per_s']:,}/s "
            f"(producer {f['raw']['produced_per_s']:,}/s): ratio {f['ratio']}"
        )
        print(
            f"              100k backlog drained at {f['drain_ours_per_s']:,}/s vs raw {f['drain_raw_per_s']:,}/s: "
            f"ratio {f['drain_ratio']}"
        )
    f = figures["lag_at_1000_per_s"]
    print(
        f"  lag at {f['events_per_s']:,} events/s, default settings: p50 {f['p50_s'] * 1000:.1f} ms, "
        f"p99 {f['p99_s'] * 1000:.1f} ms, max {f['max_s'] * 1000:.0f} ms "
        f"({f['delivered']:,}/{f['produced']:,} delivered)"
    )
    f = figures["idle_cpu"]
    print(
        f"  idle consumer: {f['client_core_share'] * 100:.2f}% of a core in the consumer process, "
        f"{f['server_core_share'] * 100:.2f}% in its {f['backends']} server backends"
    )
    sys.stdout.flush()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
