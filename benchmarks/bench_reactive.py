"""One reactive scheduler tick: time and database round trips, against the number of changes and of tasks.

Each scenario gets its own schema: N tasks over P CTL parameters (each task reads two:
``All(ChunkDelta(a, 'hour'), Delay(b, '30d'))``), brought to a steady state (every task launched once,
its run succeeded, its values committed). Then C parameters move one hour forward and one tick is
measured: reading the changes, evaluating the affected tasks, launching those that fire. Runs are
looked up through a stand-in that reports every run as succeeded (the Dagster run-storage query is
one bulk query and not part of this figure). Round trips are counted at psycopg's wait().

Run: ``.venv/bin/python benchmarks/bench_reactive.py [--quick] [--large]`` on CMB_DATABASE_URL (or the embedded
server), alone on the machine; ``--tasks N [--changes C ...]`` measures that one scenario only (5 tasks per
parameter; e.g. ``--tasks 100000 --changes 1000``: the idle tick and 1,000 changes at 100,000 tasks). JSON
object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cmb_dagster.ctl.store import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.embedded import embedded_url
from cmb_dagster.reactive.engine import TaskScheduler
from cmb_dagster.reactive.models import RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.settings import Settings
from cmb_dagster.triggers import All, ChunkDelta, Delay

BASE = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(days=1)
ROUND_TRIPS = 0
_wait = psycopg.Connection.wait


def _counting_wait(self, gen, *args, **kwargs):  # type: ignore[no-untyped-def]
    global ROUND_TRIPS
    ROUND_TRIPS += 1
    return _wait(self, gen, *args, **kwargs)


psycopg.Connection.wait = _counting_wait  # type: ignore[method-assign]


def all_succeeded(scheduler: str, run_keys):  # type: ignore[no-untyped-def]
    return {key: RunInfo(f"run-{key}", RunState.SUCCESS) for key in run_keys}


def key(i: int) -> tuple[str, str]:
    return (f"entity{i:05d}", "loaded_until")


def measured_tick(engine: TaskScheduler) -> dict[str, float]:
    global ROUND_TRIPS
    ROUND_TRIPS = 0
    started = time.perf_counter()
    report = engine.tick(all_succeeded)
    seconds = time.perf_counter() - started
    assert report.complete, report.summary()
    return {
        "seconds": round(seconds, 4),
        "round_trips": ROUND_TRIPS,
        "changes": report.changes,
        "evaluated": report.evaluated,
        "launched": len(report.launches),
    }


def settle(engine: TaskScheduler) -> dict[str, float]:
    """Tick until a tick completes within its time box; the figures of all those ticks together."""
    started, ticks = time.perf_counter(), 0
    while True:
        ticks += 1
        report = engine.tick(all_succeeded)
        if report.complete:
            return {"seconds": round(time.perf_counter() - started, 4), "ticks": ticks}


def scenario(url: str, tasks: int, parameters: int, *changes: int) -> list[dict[str, object]]:
    """One steady state of ``tasks``; then each change count in turn (one round each, on the same state)."""
    db = Database(url, schema=f"bench_{uuid.uuid4().hex[:8]}", max_pool_size=4)
    try:
        store = CtlStore(db, actor="bench")
        store.set_many({key(i): BASE for i in range(parameters)})
        specs = [
            TaskSpec(
                name=f"task{i:06d}",
                trigger=All(ChunkDelta(*key(i % parameters), "hour"), Delay(*key((i * 7 + 3) % parameters), "30d")),
                priority=i % 10,
            )
            for i in range(tasks)
        ]
        # the cap never binds: a task has at most one run in flight
        engine = TaskScheduler(db, "bench", specs, SchedulerSettings(max_concurrent_runs=tasks, tick_seconds=50))
        setup_started = time.perf_counter()
        first = settle(engine)  # new definitions: every task evaluated and launched (several time boxes at 100,000)
        settle(engine)  # every run succeeded: values committed, tasks evaluated again
        idle = measured_tick(engine)
        setup = time.perf_counter() - setup_started
        rounds = []
        for hour, count in enumerate(changes, start=1):
            store.set_many({key(i * (parameters // count)): BASE + timedelta(hours=hour) for i in range(count)})
            tick = measured_tick(engine)
            follow_up = measured_tick(engine)  # those runs succeeded
            rounds.append(
                {
                    "tasks": tasks,
                    "parameters": parameters,
                    "changes": count,
                    "tick": tick,
                    "follow_up_tick": follow_up,
                    "idle_tick": idle,
                    "first_tick": first,
                    "setup_seconds": round(setup, 2),
                }
            )
        return rounds
    finally:
        with db.connect(autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(db.schema)))
        db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller curves")
    parser.add_argument("--large", action="store_true", help="also 100,000 tasks (100 and 1,000 changes)")
    parser.add_argument("--tasks", type=int, help="only this number of tasks (5 per parameter)")
    parser.add_argument("--changes", type=int, nargs="+", default=[100], help="with --tasks: changes, in turn")
    arguments = parser.parse_args()
    if arguments.tasks and min(arguments.changes) < 1:
        parser.error("--changes: at least 1 (each scenario measures its idle tick too)")
    quick = arguments.quick
    settings = Settings.from_env()
    server = settings.database_url or embedded_url(settings.home)
    name = f"cmb_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = urlsplit(server)._replace(path=f"/{name}").geturl()
    try:
        if arguments.tasks:
            only = scenario(url, arguments.tasks, max(arguments.tasks // 5, 1), *arguments.changes)
            headline, by_changes, by_tasks, large = only[0], only[1:], [], []
        else:
            [headline] = scenario(url, 10_000, 2_000, 100)
            by_changes = [scenario(url, 10_000, 2_000, c)[0] for c in ((10, 1000) if quick else (10, 300, 1000))]
            # same number of tasks per parameter (5 x 2 reads), so 100 changes touch ~1,000 tasks each time
            sizes = (1_000, 20_000) if quick else (1_000, 3_000, 30_000)
            by_tasks = [scenario(url, n, n // 5, 100)[0] for n in sizes]
            large = scenario(url, 100_000, 20_000, 100, 1_000) if arguments.large else []
        with psycopg.connect(url) as conn:
            settings = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("server_version", "autovacuum", "fsync", "synchronous_commit")
            }
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def row(r: dict) -> str:
        t = r["tick"]
        return (
            f"{r['tasks']:>7,} tasks {r['parameters']:>6,} params {r['changes']:>5,} changed: "
            f"tick {t['seconds'] * 1000:7.1f} ms, {t['round_trips']:3d} round trips, "
            f"{t['evaluated']:6,} evaluated, {t['launched']:6,} launched; "
            f"follow-up {r['follow_up_tick']['seconds'] * 1000:6.1f} ms; "
            f"idle {r['idle_tick']['seconds'] * 1000:5.1f} ms, {r['idle_tick']['round_trips']} round trips"
        )

    if arguments.tasks:
        print(f"{arguments.tasks:,} tasks (setup: first tick {headline['first_tick']['seconds']:.1f} s):")
        for r in [headline, *by_changes]:
            print("  " + row(r))
    else:
        print("headline (target < 1 s):")
        print("  " + row(headline))
        print(f"  first tick (all {headline['tasks']:,} tasks new): {headline['first_tick']['seconds']:.2f} s")
        print("vs number of changes (10,000 tasks):")
        for r in sorted([headline, *by_changes], key=lambda r: r["changes"]):
            print("  " + row(r))
        print("vs number of tasks (100 changes, 5 tasks per parameter):")
        for r in sorted([headline, *by_tasks], key=lambda r: r["tasks"]):
            print("  " + row(r))
    if large:
        print(f"100,000 tasks (setup: first tick {large[0]['first_tick']['seconds']:.1f} s):")
        for r in large:
            print("  " + row(r))
    print(
        f"server: PostgreSQL {settings['server_version']}, autovacuum={settings['autovacuum']}, "
        f"fsync={settings['fsync']}, synchronous_commit={settings['synchronous_commit']}; "
        f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        json.dumps(
            {
                "headline": headline,
                "by_changes": [
                    {"changes": r["changes"], **r["tick"]}
                    for r in sorted([headline, *by_changes], key=lambda r: r["changes"])
                ],
                "by_tasks": [
                    {"tasks": r["tasks"], **r["tick"]} for r in sorted([headline, *by_tasks], key=lambda r: r["tasks"])
                ],
                "large": [{"tasks": r["tasks"], "changes": r["changes"], **r["tick"]} for r in large],
                "server": settings,
            }
        )
    )


if __name__ == "__main__":
    main()
