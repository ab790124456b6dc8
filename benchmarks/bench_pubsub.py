"""Pub/sub benchmark: consumer throughput and commit-to-consume lag, against raw Postgres on this machine.

    python benchmarks/bench_pubsub.py [--seconds 10] [--backlog N] [--rounds 2]

Runs on CMB_DATABASE_URL's server (default: the embedded one), in a scratch database (a random name) it drops
after. Both consumers read with the same batch size and commit once per batch, in this process:
- ours: a consumer with same-database results (a row per event) reading the events captured from ``orders``;
- raw: the same inserts written by hand into an outbox table, read by a plain loop
  (SELECT ... WHERE id > last LIMIT n; INSERT results; UPDATE cursor; COMMIT), the cheapest a
  consumer can be on this server (and the one that skips events).
Figures, at batch sizes 100 and 1000:
- drain (the consumer figure): each consumer alone on a pre-loaded backlog (VACUUM ANALYZE after loading,
  CHECKPOINT before), the runs alternating, best of ``--rounds`` each; the backlog (default 200,000 rows at
  batch 100, 400,000 at batch 1000) must take each consumer at least 5 s, and a shorter drain is flagged;
- live (producer-bound when the consumer keeps up): the same consumer while a producer process inserts
  100-row transactions at full speed; once both consumers keep up, this ratio compares the producers;
- lag: p50/p99 seconds from a producer's commit to the handler call at a steady 1,000 events/s,
  with the consumer's default settings (``ConsumerWorker.run``: lease, worker loop, hints if it has them);
- idle: CPU (user+system) of a consumer process with default settings and no events, and of its
  server backends, as a share of one core.
Each run reports the CPU seconds of the consumer (this process), of the producer process, and of the Postgres
server (its postmaster's processes named postgres, from /proc; none for a server on another machine), and the
1-minute load average at the start and the end. Prints a summary, then one JSON object as the last line. Runs the
package importable as ``cmb_dagster`` (put another checkout first on PYTHONPATH to measure it: "before").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
from proc_cpu import Meter, find_postmaster
from psycopg import sql

from cmb_dagster.database import Database
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, install_capture
from cmb_dagster.settings import Settings

ROWS_PER_TRANSACTION = 100
LOAD_ROWS_PER_STATEMENT = 10_000
BATCHES = (100, 1000)
DEFAULT_BACKLOG = {100: 200_000, 1000: 400_000}
MIN_DRAIN_S = 5.0

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


# -- CPU -----------------------------------------------------------------------------------------


def cpu_text(figures: dict[str, Any], *names: str) -> str:
    return ", ".join(
        f"{name} {figures[f'{name}_cpu_us_per_event']:.1f} µs/event ({figures[f'{name}_cores']:.2f} cores)"
        if figures.get(f"{name}_cpu_s") is not None
        else f"{name} not measured"
        for name in names
    )


# -- producer and consumers ----------------------------------------------------------------------


def produce(url: str, raw: bool, seconds: float, rate: float | None, out: multiprocessing.Queue) -> None:
    """Insert 100-row transactions (or, with ``rate``, 10-row ones at that many rows/s) for ``seconds``; put
    the rows, the commits and this process's CPU seconds."""
    per_txn = ROWS_PER_TRANSACTION if rate is None else 10
    query = INSERT_RAW if raw else INSERT_ORDERS
    commits: list[tuple[float, int]] = []
    rows = 0
    with psycopg.connect(url, autocommit=True) as conn:
        cpu = time.process_time()
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            if rate is not None and rows > elapsed * rate:
                time.sleep(max(0.0, rows / rate - elapsed))
                continue
            conn.execute(query, {"n": per_txn})
            commits.append((time.time(), per_txn))
            rows += per_txn
        cpu = time.process_time() - cpu
    out.put((rows, commits, cpu))


def start_producer(url: str, raw: bool, seconds: float, rate: float | None = None):
    queue: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(target=produce, args=(url, raw, seconds, rate, queue))
    proc.start()
    return proc, queue


def vacuum_analyze(db: Database) -> None:
    """VACUUM ANALYZE the database, then CHECKPOINT: what was loaded is counted and flushed before the clock."""
    with db.connect(autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")


def reset(db: Database) -> None:
    with db.connection() as conn:
        conn.execute(
            "TRUNCATE public.results, public.orders, public.raw_orders, public.raw_events, cmb.pubsub_events"
            " RESTART IDENTITY"
        )
        conn.execute("DELETE FROM cmb.pubsub_watermarks")
        conn.execute("UPDATE public.raw_cursor SET last_id = 0")
    vacuum_analyze(db)


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


# -- figures -------------------------------------------------------------------------------------


def with_producer(db: Database, raw: bool, batch: int, seconds: float, postmaster: int | None) -> dict[str, Any]:
    """Consumed per second while a producer process inserts at full speed (producer-bound once it keeps up)."""
    reset(db)
    proc, queue = start_producer(db.url, raw, seconds)
    with Meter(postmaster, consumer=os.getpid()) as meter:
        until = time.monotonic() + seconds
        consumed = raw_consumer_loop(db, batch, until) if raw else our_consumer_loop(db, batch, until, f"tp{batch}")
    produced, _, producer_cpu = queue.get(timeout=60)
    proc.join(30)
    figures = {
        "consumed_per_s": round(consumed / meter.wall),
        "produced_per_s": round(produced / seconds),
        **meter.figures(consumed, unit="us", producer=producer_cpu),
    }
    figures["kept_up"] = figures["consumed_per_s"] >= 0.95 * figures["produced_per_s"]
    return figures


def drain(db: Database, raw: bool, batch: int, backlog: int, postmaster: int | None) -> dict[str, Any]:
    """A consumer alone on ``backlog`` events loaded before it starts (counted by ANALYZE, then a checkpoint)."""
    reset(db)
    with db.connection() as conn:
        for start in range(0, backlog, LOAD_ROWS_PER_STATEMENT):
            conn.execute(INSERT_RAW if raw else INSERT_ORDERS, {"n": min(LOAD_ROWS_PER_STATEMENT, backlog - start)})
    vacuum_analyze(db)
    with Meter(postmaster, consumer=os.getpid()) as meter:
        until = time.monotonic() + 600
        if raw:
            consumed = raw_consumer_loop(db, batch, until, backlog)
        else:
            consumed = our_consumer_loop(db, batch, until, f"drain{batch}", backlog)
    return {
        "events_per_s": round(consumed / meter.wall),
        "seconds": round(meter.wall, 2),
        "complete": consumed >= backlog,
        "under_5s": meter.wall < MIN_DRAIN_S,
        **meter.figures(consumed, unit="us"),
    }


def lag(db: Database, seconds: float, rate: float, postmaster: int | None) -> dict[str, Any]:
    reset(db)
    received: dict[int, float] = {}

    def timing_handler(conn: psycopg.Connection, events: list) -> None:
        handler(conn, events)
        now = time.time()
        for e in events:
            received[e.key["id"]] = now

    consumer = ConsumerWorker(db, ConsumerSpec(consumer_id="lag", handler=timing_handler))
    proc, queue = start_producer(db.url, False, seconds, rate)
    runner = threading.Thread(target=consumer.run)
    with Meter(postmaster, consumer=os.getpid()) as meter:
        runner.start()
        produced, commits, producer_cpu = queue.get(timeout=seconds + 60)
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
        **meter.figures(produced, unit="us", producer=producer_cpu),
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


def best_drains(db: Database, batch: int, backlog: int, rounds: int, postmaster: int | None) -> dict[str, Any]:
    """Drains alternating ours and raw, ``rounds`` each (the machine is shared: load comes and goes); the best
    of each side, its ratio, and whether any drain took under 5 s."""
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "raw": []}
    for _ in range(rounds):
        for side in runs:
            runs[side].append(drain(db, side == "raw", batch, backlog, postmaster))
    best = {side: max(done, key=lambda d: d["events_per_s"]) for side, done in runs.items()}
    return {
        "backlog": backlog,
        "ours": best["ours"],
        "raw": best["raw"],
        "ours_runs_per_s": [d["events_per_s"] for d in runs["ours"]],
        "raw_runs_per_s": [d["events_per_s"] for d in runs["raw"]],
        "ratio": round(best["ours"]["events_per_s"] / best["raw"]["events_per_s"], 2),
        "any_under_5s": any(d["under_5s"] for done in runs.values() for d in done),
        "complete": all(d["complete"] for done in runs.values() for d in done),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="Length of each live, lag and idle run.")
    parser.add_argument(
        "--backlog",
        type=int,
        help="Events in each drained backlog (default: 200,000 at batch 100, 400,000 at batch 1000).",
    )
    parser.add_argument("--rounds", type=int, default=2, help="Drains of each side per batch size (best is kept).")
    args = parser.parse_args()

    load_start = [round(x, 2) for x in os.getloadavg()]
    server = Database.from_settings(Settings.from_env()).url
    name = f"cmb_bench_pubsub_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        version = conn.execute("SHOW server_version").fetchone()[0]
    url = urlsplit(server)._replace(path=f"/{name}").geturl()
    db = Database(url)
    figures: dict[str, Any] = {"server_version": version, "seconds": args.seconds, "load_average_start": load_start}
    try:
        postmaster = find_postmaster(url)
        figures["postgres_cpu_measured"] = postmaster is not None
        with db.connection() as conn:
            conn.execute(SETUP)
            install_capture(conn, "public.orders", ops=["insert"])
        for batch in BATCHES:
            backlog = args.backlog or DEFAULT_BACKLOG[batch]
            drains = best_drains(db, batch, backlog, args.rounds, postmaster)
            ours = with_producer(db, False, batch, args.seconds, postmaster)
            raw = with_producer(db, True, batch, args.seconds, postmaster)
            figures[f"batch_{batch}"] = {
                "drain": drains,
                "drain_ratio": drains["ratio"],
                "live_ours": ours,
                "live_raw": raw,
                "live_ratio": round(ours["consumed_per_s"] / raw["consumed_per_s"], 2),
                "live_producer_bound": ours["kept_up"] and raw["kept_up"],
            }
        figures["lag_at_1000_per_s"] = lag(db, args.seconds, 1000.0, postmaster)  # default settings
        figures["idle_cpu"] = idle_cpu(db, args.seconds)
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
    figures["load_average_end"] = [round(x, 2) for x in os.getloadavg()]

    print(
        f"pub/sub benchmark on Postgres {version} ({figures['settings']}), {args.seconds:g}s live runs, "
        f"producer in its own process, load average {load_start[0]} at the start, "
        f"{figures['load_average_end'][0]} at the end"
    )
    if not figures["postgres_cpu_measured"]:
        print("  the server is not on this machine: its CPU is not measured")
    for batch in BATCHES:
        f = figures[f"batch_{batch}"]
        d = f["drain"]
        print(
            f"  batch {batch:>4}, drain of {d['backlog']:,} (the consumer figure): "
            f"ours {d['ours']['events_per_s']:,}/s in {d['ours']['seconds']:.1f}s "
            f"vs raw {d['raw']['events_per_s']:,}/s in {d['raw']['seconds']:.1f}s: "
            f"ratio {f['drain_ratio']}"
            + (" (A DRAIN TOOK UNDER 5 s: raise --backlog)" if d["any_under_5s"] else "")
            + ("" if d["complete"] else " (INCOMPLETE)")
        )
        print(f"              CPU ours: {cpu_text(d['ours'], 'consumer', 'postgres')}")
        print(f"              CPU raw:  {cpu_text(d['raw'], 'consumer', 'postgres')}")
        for side in ("ours", "raw"):
            live = f[f"live_{side}"]
            print(
                f"              live, {side}: consumed {live['consumed_per_s']:,}/s while the producer wrote "
                f"{live['produced_per_s']:,}/s"
                + (" (kept up: producer-bound)" if live["kept_up"] else "")
                + f"; {cpu_text(live, 'consumer', 'producer', 'postgres')}"
            )
        print(
            f"              live ratio {f['live_ratio']}"
            + (" (producer-bound: both kept up, it compares the producers)" if f["live_producer_bound"] else "")
        )
    f = figures["lag_at_1000_per_s"]
    print(
        f"  lag at {f['events_per_s']:,} events/s, default settings: p50 {f['p50_s'] * 1000:.1f} ms, "
        f"p99 {f['p99_s'] * 1000:.1f} ms, max {f['max_s'] * 1000:.0f} ms "
        f"({f['delivered']:,}/{f['produced']:,} delivered); {cpu_text(f, 'consumer', 'producer', 'postgres')}"
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
