"""Flow-control benchmark: what keys, turns and limits cost the event queue.

One worker process drains a backlog of no-op events (``--events``, enough to take seconds) in each variant, with this
code and, given ``--baseline`` (a checkout of an earlier version), with that code too (``baseline/<variant>``):
- ``no-limits``: no key, no limits;
- ``keyed``: a key per event (100 keys taking turns), no limits;
- ``rate-limited``: 100 keys, each with a rate limit far above what is reached (every start takes a token);
- ``concurrency``: 100 keys, each with a concurrency limit far above what is reached (every start takes a slot).
Each variant runs ``--rounds`` times, alternating, each in its own database (ANALYZE after loading), dropped at
the end. Reports the median events/s, the worker's and the server's CPU seconds per 1,000 events, and the cost
per event of each variant against ``no-limits`` of the same code (µs). Prints a summary, then one JSON line last.

    .venv/bin/python benchmarks/bench_flow.py [--url postgresql://...] [--events 100000] [--baseline ../old]
"""

from __future__ import annotations

import argparse
import json
import os
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
KEYS = 100
CLK_TCK = os.sysconf("SC_CLK_TCK")
VARIANTS = {
    "no-limits": {},
    "keyed": {"key": "value.k"},
    "rate-limited": {"key": "value.k", "rate_limit": "1000000/s"},
    "concurrency": {"key": "value.k", "concurrency": 10_000},
}


def registry(config: dict):  # type: ignore[no-untyped-def]
    from cmb_dagster.eventqueue import HandlerRegistry

    handlers = HandlerRegistry()
    handlers.add("noop", lambda event: None, **config)
    return handlers


def load(url: str, events: int, config: dict) -> None:
    """In the variant's code: register the handler and emit the backlog."""
    from cmb_dagster.database import Database
    from cmb_dagster.eventqueue import emit_many, register

    db = Database(url)
    register(db, registry(config))
    for start in range(0, events, 10_000):
        emit_many(
            [{"namespace": "ns", "handler": "noop", "value": {"k": i % KEYS}} for i in range(start, start + 10_000)],
            db=db,
        )
    db.close()


def work(url: str, config: dict) -> None:
    """In the variant's code: drain the queue with one worker, then print the seconds it ran."""
    from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, WorkerSettings

    worker = EventWorker(url, EventQueueOptions(handlers=registry(config), worker=WorkerSettings(listen=False)))
    started = time.monotonic()
    while worker.run_once():
        pass
    print(json.dumps({"seconds": time.monotonic() - started}))
    worker.close()


def with_db(url: str, name: str) -> str:
    return urlsplit(url)._replace(path=f"/{name}").geturl()


def server_cpu(conn: psycopg.Connection) -> float:
    """CPU seconds the server's processes have used so far (the server runs on this machine): the postmaster's
    own and that of its children, live and ended."""
    postmaster = Path(f"/proc/{conn.info.backend_pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if proc.name == postmaster:
            total += sum(int(f) for f in fields[11:15]) / CLK_TCK  # utime, stime and those of ended children
        elif fields[1] == postmaster:
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def run_variant(url: str, name: str, config: dict, events: int, code: Path | None) -> dict[str, float]:
    database = f"cmb_bench_flow_{os.getpid()}_{name.replace('-', '_').replace('/', '_')}"
    env = {**os.environ, "PYTHONPATH": str(code)} if code else dict(os.environ)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        try:
            bench_url = with_db(url, database)
            role = [sys.executable, str(HERE), "--url", bench_url, "--config", json.dumps(config)]
            subprocess.run([*role, "--role", "load", "--events", str(events)], env=env, check=True)
            with psycopg.connect(bench_url, autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE")
            before = server_cpu(admin)
            started = time.monotonic()
            with tempfile.TemporaryFile() as out:
                worker = subprocess.Popen([*role, "--role", "work"], env=env, stdout=out)
                _, status, usage = os.wait4(worker.pid, 0)
                assert status == 0, f"{name}: the worker failed"
                out.seek(0)
                seconds = json.loads(out.read().decode().strip().splitlines()[-1])["seconds"]
            wall = time.monotonic() - started
            server = server_cpu(admin) - before
            with psycopg.connect(bench_url) as conn:
                left = conn.execute("SELECT count(*) FROM cmb.eventqueue_events").fetchone()[0]
            assert left == 0, f"{name}: {left} events left"
        finally:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    return {
        "events_per_second": events / seconds,
        "worker_cpu_per_1000": (usage.ru_utime + usage.ru_stime) / events * 1000,
        "server_cpu_per_1000": server / events * 1000,
        "wall_seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="driver")
    parser.add_argument("--url", default=None)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout of the version to compare with")
    args = parser.parse_args()
    if args.role == "load":
        return load(args.url, args.events, json.loads(args.config))
    if args.role == "work":
        return work(args.url, json.loads(args.config))
    url = args.url or os.environ.get("CMB_DATABASE_URL") or "postgresql://postgres@127.0.0.1:5432/postgres"
    variants = [(name, config, None) for name, config in VARIANTS.items()]
    if args.baseline:
        variants += [(f"baseline/{name}", config, args.baseline.resolve()) for name, config in VARIANTS.items()]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in variants}
    for _ in range(args.rounds):
        for name, config, code in variants:
            rounds[name].append(run_variant(url, name, config, args.events, code))
    with psycopg.connect(url) as conn:
        server = {k: conn.execute(f"SHOW {k}").fetchone()[0] for k in ("server_version", "autovacuum", "fsync")}
    result: dict[str, object] = {"events": args.events, "rounds": args.rounds, "server": server}
    print(f"{args.events} no-op events, one worker, median of {args.rounds} rounds; server {server}")
    for name, runs in rounds.items():
        figures = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        figures["all_events_per_second"] = [round(r["events_per_second"]) for r in runs]  # type: ignore[assignment]
        result[name] = figures
        print(
            f"  {name:22} {figures['events_per_second']:9,.0f} events/s  {figures['all_events_per_second']}  "
            f"worker CPU {figures['worker_cpu_per_1000']:.3f} s/1000  "
            f"server CPU {figures['server_cpu_per_1000']:.3f} s/1000"
        )
    for name in [n for n in rounds if not n.endswith("no-limits")]:
        code = name.rpartition("/")[0]
        plain = result[f"{code}/no-limits" if code else "no-limits"]["events_per_second"]  # type: ignore[index]
        cost = (1 / result[name]["events_per_second"] - 1 / plain) * 1e6  # type: ignore[index]
        result[name]["us_per_event_vs_no_limits"] = cost  # type: ignore[index]
        print(f"  {name}: {cost:+.1f} µs per event against no-limits")
    print(f"  load average {os.getloadavg()}")
    result["load_average"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
