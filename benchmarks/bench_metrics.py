"""Metrics benchmark: how fast the endpoint of ``cmb-dagster metrics`` answers with 1M pending callbacks.

    .venv/bin/python benchmarks/bench_metrics.py [--pending 1000000] [--finished 0] [--scrapes 50] [--buckets 4]
        [--bucket-sets 1]

Loads the pending callbacks with bulk INSERTs into the engine's tables (run_at one to two hours before or after
now: half overdue, for the whole run), serves the metrics on 127.0.0.1 and scrapes them over HTTP, ``--scrapes``
times in each of three states of the database: as loaded (no statistics, no visibility map), after ANALYZE, after VACUUM
ANALYZE (what autovacuum leaves). Prints p50 / p99 per state, the callbacks figures against the true counts,
and what the old ``status()`` totals (one scan of every event) take for comparison; the last line is JSON.
Runs on CMB_DATABASE_URL (or the embedded server) in a database of its own, dropped at the end. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_callbacks import bench_database  # noqa: E402

from cmb_dagster.callbacks import admin  # noqa: E402
from cmb_dagster.database import Database  # noqa: E402
from cmb_dagster.metrics import serve  # noqa: E402

CHUNK = 100_000


def load(db: Database, pending: int, finished: int) -> float:
    """Insert ``pending`` pending callbacks and about ``finished`` notified ones among them (ids interleaved) in
    chunks; return the seconds it took."""
    started = time.perf_counter()
    total = pending + finished
    with db.connection() as conn:
        buckets = conn.execute("SELECT count(*) FROM callback_buckets").fetchone()[0]
    for first in range(1, total + 1, CHUNK):
        with db.connection() as conn:
            conn.execute(
                """
                INSERT INTO callback_events (event_id, bucket_id, owner_client_id, group_key, event_key, status,
                                             run_at, originally_run_at, cb_url, retry, finished_at)
                SELECT nextval('callback_event_ids'), i %% %(buckets)s, 'bench', 'g', i::text, s.status,
                       now() + make_interval(secs => sign(random() - 0.5) * (3600 + random() * 3600)), now(),
                       'https://example.com/cb', '{"stop_after_delay": 3600}',
                       CASE WHEN s.status = 'notified' THEN now() END
                FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
                     LATERAL (SELECT CASE WHEN random() * %(total)s < %(finished)s + 0 * i THEN 'notified'
                                          ELSE 'pending' END AS status) AS s
                """,
                {
                    "buckets": buckets,
                    "first": first,
                    "last": min(first + CHUNK - 1, total),
                    "total": total,
                    "finished": finished,
                },
            )
    return time.perf_counter() - started


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def scrape(url: str) -> tuple[float, str]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body = response.read().decode()
    return time.perf_counter() - started, body


def callbacks_figures(body: str) -> dict[str, float]:
    """Pending and overdue summed over the bucket sets, whether all were exact, the callbacks read's seconds."""
    found: dict[str, float] = {"pending": 0, "overdue": 0, "exact": 1}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name in ("cmb_callbacks_pending", "cmb_callbacks_overdue"):
                found[s.name.removeprefix("cmb_callbacks_")] += s.value
            elif s.name == "cmb_callbacks_depth_exact":
                found["exact"] = min(found["exact"], s.value)
            elif s.name == "cmb_scrape_duration_seconds" and s.labels["engine"] == "callbacks":
                found["callbacks_read_ms"] = s.value * 1000
            elif s.name == "cmb_scrape_errors" and s.value:
                raise RuntimeError(f"the scrape failed on {s.labels['engine']}")
    return found


def measure(db: Database, url: str, scrapes: int, truth: tuple[int, int]) -> dict[str, float]:
    first, _ = scrape(url)
    times, bodies = [], []
    for _ in range(scrapes):
        seconds, body = scrape(url)
        times.append(seconds)
        bodies.append(body)
    figures = [callbacks_figures(body) for body in bodies]
    started = time.perf_counter()
    admin.status(db, totals=True)  # the old totals: one scan of every event
    totals_ms = (time.perf_counter() - started) * 1000
    pending, overdue = truth
    return {
        "first_ms": first * 1000,
        "p50_ms": percentile(times, 50) * 1000,
        "p99_ms": percentile(times, 99) * 1000,
        "max_ms": max(times) * 1000,
        "callbacks_read_p50_ms": percentile([f["callbacks_read_ms"] for f in figures], 50),
        "exact": min(f["exact"] for f in figures),
        "pending_error_max": max(abs(f["pending"] - pending) / pending for f in figures),
        "overdue_error_max": max(abs(f["overdue"] - overdue) / max(overdue, 1) for f in figures),
        "old_totals_ms": totals_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--bucket-sets", type=int, default=1)
    parser.add_argument("--buckets", type=int, default=4, help="the callbacks engine's bucket count")
    parser.add_argument("--finished", type=int, default=0, help="notified events among the pending ones (about)")
    args = parser.parse_args()
    with bench_database() as db:
        admin.set_bucket_count(db, args.buckets)
        loaded_s = load(db, args.pending, args.finished)
        with db.connection() as conn:
            server_version = conn.execute("SHOW server_version").fetchone()[0]
            autovacuum = conn.execute("SHOW autovacuum").fetchone()[0]
            truth = conn.execute(  # about --pending when --finished is given
                "SELECT count(*), count(*) FILTER (WHERE run_at < now()) FROM callback_events WHERE status = 'pending'"
            ).fetchone()
        endpoint = serve(db, host="127.0.0.1", port=0, bucket_sets=args.bucket_sets)
        results: dict[str, dict[str, float]] = {}
        try:
            for state, statement in (("as loaded", None), ("analyzed", "ANALYZE"), ("vacuumed", "VACUUM ANALYZE")):
                if statement:
                    with psycopg.connect(db.url, autocommit=True, **db.connect_kwargs) as conn:
                        conn.execute(f"{statement} {db.schema}.callback_events")
                results[state] = measure(db, endpoint.url, args.scrapes, truth)
        finally:
            endpoint.stop()
    transport = "unix socket" if "host=/" in db.url or urlsplit(db.url).hostname in (None, "") else "tcp"
    print(
        f"{truth[0]:,} pending callbacks ({args.finished:,} notified among them) loaded in {loaded_s:.1f} s; "
        f"PostgreSQL {server_version} over {transport}, "
        f"autovacuum {autovacuum}; {args.buckets} buckets; {args.scrapes} scrapes over HTTP per state, "
        f"{args.bucket_sets} bucket set(s)"
    )
    for state, r in results.items():
        print(
            f"{state:>10}: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms (first {r['first_ms']:.1f} ms, "
            f"callbacks read p50 {r['callbacks_read_p50_ms']:.1f} ms); estimate off by at most "
            f"{r['pending_error_max']:.1%} (pending) / {r['overdue_error_max']:.1%} (overdue); "
            f"the old status() totals: {r['old_totals_ms']:.0f} ms"
        )
    print(
        json.dumps(
            {
                "bench": "metrics",
                "pending": args.pending,
                "buckets": args.buckets,
                "finished": args.finished,
                "bucket_sets": args.bucket_sets,
                "scrapes": args.scrapes,
                "server": server_version,
                "transport": transport,
                "machine": platform.machine(),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
