"""Stage scheduler benchmark: entities/s through 3 stages (1 and 2 workers, and with 10% concurrent
external updates), side by side with the same pipeline as a 3-step DBOS workflow per entity; timer lateness.

    .venv/bin/python benchmarks/bench_stages.py [--count 5000] [--timers 100000 --timer-window 60]

Runs on CMB_DATABASE_URL (or the embedded server) in databases of its own, dropped at the end. cmb workers
are `cmb-dagster stages worker` processes; DBOS (pip install dbos, the `bench` extra) runs in a process of
its own with a queue, each step one transaction on the same server. Each pipeline run is timed from the
first write of its entities to the last entity through the third stage (for DBOS: first insert to the
last workflow done). Timer lateness: timers written straight into the queue (the change path's offer,
without the fan-out of their entities), then the time process() starts minus the due time, with one
worker. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402

from cmb_dagster.database import Database  # noqa: E402
from cmb_dagster.settings import Settings  # noqa: E402
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult, StageStore  # noqa: E402

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


class Seen(BaseModel):
    runs: int = 0


class Step(Stage):
    """Sets ``target`` = ``source`` + 1 once: each of the three stages changes the entity once."""

    state_model = Seen

    def __init__(self, name: str, source: str, target: str) -> None:
        super().__init__()
        self.name = name  # type: ignore[misc]
        self.source, self.target = source, target

    def should_process(self, entity: Entity, state: Seen) -> bool:
        return self.source in entity.payload and self.target not in entity.payload

    def process(self, entity: Entity, state: Seen) -> StageResult:
        if self.source not in entity.payload or self.target in entity.payload:
            return StageResult()
        return StageResult(
            update=MergePatch({self.target: entity.payload[self.source] + 1}), new_state=Seen(runs=state.runs + 1)
        )


class Due(Stage):
    """A timer at payload["due"]; when it fires, records how late it ran (ms)."""

    name = "due"

    def should_process(self, entity: Entity, state: BaseModel):  # type: ignore[no-untyped-def]
        return datetime.fromtimestamp(entity.payload["due"], UTC) if "late_ms" not in entity.payload else False

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        late = time.time() - entity.payload["due"]
        if late < 0:
            return StageResult(timer=datetime.fromtimestamp(entity.payload["due"], UTC))
        return StageResult(update=MergePatch({"late_ms": round(late * 1000, 2)}))


pipeline = StageOptions(
    stages=[Step("first", "a", "b"), Step("second", "b", "c"), Step("third", "c", "d")],
    shard_count=8,
    batch_size=500,
    idle_sleep=0.5,
)
timers = StageOptions(stages=[Due()], shard_count=4, batch_size=1000, idle_sleep=0.5, publish=False)


# -- helpers -------------------------------------------------------------------------------------


def server_url() -> str:
    from cmb_dagster.embedded import embedded_url

    settings = Settings.from_env()
    return settings.database_url or embedded_url(settings.home)


def with_db(url: str, name: str) -> str:
    return urlsplit(url)._replace(path=f"/{name}").geturl()


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def create_db(server: str, name: str) -> str:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return with_db(server, name)


def drop_db(server: str, name: str) -> None:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def server_settings(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return {
            k: conn.execute(f"SHOW {k}").fetchone()[0]
            for k in ("server_version", "autovacuum", "fsync", "synchronous_commit", "shared_buffers")
        }


STARTED: list[subprocess.Popen] = []


def start_workers(url: str, options: str, n: int) -> list[subprocess.Popen]:
    env = {**os.environ, "CMB_DATABASE_URL": url, "PYTHONPATH": f"{ROOT / 'benchmarks'}{os.pathsep}{ROOT}"}
    procs = []
    for i in range(n):  # stderr to a file: a full pipe would stall a worker that logs
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the worker process writes it until it ends
        proc = subprocess.Popen(
            [*CLI, "stages", "worker", "--stages", f"bench_stages:{options}", "--index", str(i), "--workers", str(n)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
        proc.log = log  # type: ignore[attr-defined]
        procs.append(proc)
    STARTED.extend(procs)
    return procs


def stop_workers(procs: list[subprocess.Popen]) -> float:
    """Stop the workers; return their CPU seconds (user + system)."""
    for p in procs:
        p.terminate()
    cpu = 0.0
    for p in procs:
        p.wait(timeout=30)
        p.log.seek(0)  # type: ignore[attr-defined]
        err = p.log.read()  # type: ignore[attr-defined]
        if "Traceback" in err:
            print(f"a worker logged errors:\n{err[-2000:]}", file=sys.stderr)
        if p.returncode not in (0, -15):
            print(err[-2000:], file=sys.stderr)
            raise SystemExit(f"a worker failed with exit code {p.returncode}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    return cpu


def count_done(url: str, key: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute(f"SELECT count(*) FROM cmb.stage_entities WHERE payload ? '{key}'").fetchone()[0]


def wait_count(url: str, key: str, n: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while count_done(url, key) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {count_done(url, key)} of {n} entities done after {timeout}s")
        time.sleep(0.05)
    return time.monotonic()


# -- cmb -----------------------------------------------------------------------------------------


def bench_cmb(server: str, count: int, workers: int, external_share: float = 0.0) -> dict[str, float]:
    name = f"cmb_bench_stages_{uuid.uuid4().hex[:6]}"
    url = create_db(server, name)
    try:
        db = Database(url)
        db.ensure_ready()
        store = StageStore(db, pipeline.stages)
        store.put("warmup", {"a": 0})  # workers start, install the capture, hold their leases
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        procs = start_workers(url, "pipeline", workers)
        wait_count(url, "d", 1, 30)
        external: list[int] = []
        stop = threading.Event()

        def write_externally() -> None:  # plain SQL on another field of a random 10%, while stages run
            rng = random.Random(1)
            targets = rng.sample(range(count), int(count * external_share))
            with psycopg.connect(url, autocommit=True) as conn:
                for i in targets:
                    if stop.is_set():
                        break
                    conn.execute(
                        "UPDATE cmb.stage_entities SET payload = payload || '{\"x\": 1}' WHERE entity_id = %s",
                        (f"e{i}",),
                    )
                    external.append(i)
                    time.sleep(0.0005)

        started = time.monotonic()
        for chunk in range(0, count, 1000):
            store.put_many({f"e{i}": {"a": i} for i in range(chunk, min(count, chunk + 1000))})
            if chunk == 0 and external_share:
                thread = threading.Thread(target=write_externally, daemon=True)
                thread.start()
        ended = wait_count(url, "d", count + 1, 600)
        stop.set()
        stop_workers(procs)
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        with psycopg.connect(url) as conn:
            processed, conflicts = conn.execute(
                "SELECT sum(processed), sum(conflicts) FROM cmb.stage_counters"
            ).fetchone()
            wrong = conn.execute(
                "SELECT count(*) FROM cmb.stage_entities WHERE (payload->>'d')::int <> (payload->>'a')::int + 3"
            ).fetchone()[0]
        if wrong:
            raise SystemExit(f"{wrong} entities have a wrong result")
        seconds = ended - started
        db.close()
        return {
            "entities": count,
            "workers": workers,
            "seconds": round(seconds, 3),
            "entities_per_s": round(count / seconds, 1),
            "external_updates": len(external),
            "conflict_retries": int(conflicts or 0),
            "conflict_rate": round(float(conflicts or 0) / max(1, int(processed or 1)), 4),
            "worker_cpu_s": round(
                (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime), 2
            ),
        }
    finally:
        drop_db(server, name)


# -- DBOS ----------------------------------------------------------------------------------------

DBOS_APP = r"""
import os, sys, time, json
import psycopg
from psycopg_pool import ConnectionPool
from dbos import DBOS, DBOSConfig, Queue

app_url, sys_url, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
pool = ConnectionPool(app_url, min_size=4, max_size=16, open=True)
DBOS(config=DBOSConfig(name="bench_stages", system_database_url=sys_url, log_level="WARNING"))

def change(entity_id, source, target):
    with pool.connection() as conn:
        conn.execute("UPDATE entities SET payload = payload || jsonb_build_object(%s::text, (payload->>%s)::int + 1),"
                     " version = version + 1 WHERE entity_id = %s", (target, source, entity_id))

@DBOS.step()
def first(entity_id): change(entity_id, "a", "b")

@DBOS.step()
def second(entity_id): change(entity_id, "b", "c")

@DBOS.step()
def third(entity_id): change(entity_id, "c", "d")

@DBOS.workflow()
def pipeline(entity_id):
    first(entity_id); second(entity_id); third(entity_id)

if __name__ == "__main__":
    DBOS.launch()
    queue = DBOS.register_queue("pipeline", worker_concurrency=int(os.environ.get("DBOS_CONCURRENCY", "16")),
                                polling_interval_sec=0.1)
    with pool.connection() as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS entities"
            " (entity_id text PRIMARY KEY, version bigint NOT NULL DEFAULT 1, payload jsonb NOT NULL)"
        )
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    for chunk in range(0, count, 1000):
        ids = [f"e{i}" for i in range(chunk, min(count, chunk + 1000))]
        with pool.connection() as conn:
            conn.execute("INSERT INTO entities (entity_id, payload) SELECT id, jsonb_build_object('a', n) "
                         "FROM unnest(%s::text[], %s::int[]) AS u(id, n)", (ids, list(range(chunk, chunk + len(ids)))))
        handles = [queue.enqueue(pipeline, i) for i in ids]
    handles[-1].get_result()
    with pool.connection() as conn:
        while conn.execute("SELECT count(*) FROM entities WHERE payload ? 'd'").fetchone()[0] < count:
            time.sleep(0.05)
    seconds = time.monotonic() - started
    print(json.dumps({"seconds": seconds}), flush=True)
    DBOS.destroy()
"""


def bench_dbos(server: str, count: int) -> dict[str, float]:
    try:
        import dbos  # noqa: F401
    except ImportError:
        return {"skipped": "pip install dbos (the bench extra)"}
    app, system = f"dbos_bench_app_{uuid.uuid4().hex[:6]}", f"dbos_bench_sys_{uuid.uuid4().hex[:6]}"
    app_url = create_db(server, app)
    sys_url = create_db(server, system)
    script = ROOT / "benchmarks" / ".dbos_app.py"
    script.write_text(DBOS_APP)
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.Popen(
            [sys.executable, str(script), app_url, sys_url, str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"DBOS did not start: {line} {proc.stderr.read()[-2000:]}")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline() or "{}")
        _, err = proc.communicate(timeout=60)
        if proc.returncode != 0 or "seconds" not in result:
            raise SystemExit(f"DBOS run failed ({proc.returncode}): {err[-2000:]}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds = result["seconds"]
        return {
            "entities": count,
            "seconds": round(seconds, 3),
            "entities_per_s": round(count / seconds, 1),
            "cpu_s": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 2),
            "errors_logged": err.count("Traceback"),
        }
    finally:
        script.unlink(missing_ok=True)
        drop_db(server, app)
        drop_db(server, system)


# -- timers --------------------------------------------------------------------------------------


def bench_timers(server: str, count: int, window: float) -> dict[str, float]:
    name = f"cmb_bench_timers_{uuid.uuid4().hex[:6]}"
    url = create_db(server, name)
    try:
        db = Database(url)
        db.ensure_ready()
        store = StageStore(db, timers.stages)
        store.put("warmup", {"due": time.time()})
        procs = start_workers(url, "timers", 1)
        wait_count(url, "late_ms", 1, 30)
        # The timers go straight into the queue (as the change path's offer would put them), so that
        # the figure is the firing lateness alone, not the fan-out of 100k new entities before it.
        lead = 3.0 + count / 20000  # time to write them all before the first is due
        first_due = time.time() + lead
        with psycopg.connect(url) as conn:
            conn.execute("SELECT set_config('cmb.stages_writer', 'bench', true)")
            conn.execute(
                "INSERT INTO cmb.stage_entities (entity_id, payload) SELECT 't' || i, "
                "jsonb_build_object('due', %s::float8 + %s::float8 * i / %s) FROM generate_series(0, %s - 1) i",
                (first_due, window, count, count),
            )
            conn.execute(
                "INSERT INTO cmb.stage_queue (entity_id, stage, shard_id, lane, due_at) "
                "SELECT entity_id, 'due', cmb.stage_hash(entity_id) % (SELECT shard_count FROM cmb.stage_settings), "
                "0, to_timestamp((payload->>'due')::float8) FROM cmb.stage_entities WHERE entity_id LIKE 't%'"
            )
        with psycopg.connect(url) as conn:
            queued = conn.execute("SELECT count(*) FROM cmb.stage_queue").fetchone()[0]
        if time.time() > first_due:
            print(
                f"warning: the timers were queued {time.time() - first_due:.1f}s after the first was due",
                file=sys.stderr,
            )
        wait_count(url, "late_ms", count + 1, lead + window + 120)
        stop_workers(procs)
        with psycopg.connect(url) as conn:
            late = [
                r[0]
                for r in conn.execute(
                    "SELECT (payload->>'late_ms')::float8 FROM cmb.stage_entities WHERE entity_id <> 'warmup'"
                )
            ]
        db.close()
        return {
            "timers": count,
            "window_s": window,
            "queued_before_first_due": queued,
            "p50_ms": round(percentile(late, 50), 1),
            "p99_ms": round(percentile(late, 99), 1),
            "max_ms": round(max(late), 1),
            "early": sum(1 for x in late if x < 0),
        }
    finally:
        drop_db(server, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=5000, help="entities per pipeline run")
    parser.add_argument("--timers", type=int, default=100000, help="timers")
    parser.add_argument("--timer-window", type=float, default=60.0, help="seconds over which the timers are due")
    parser.add_argument("--skip-timers", action="store_true")
    parser.add_argument("--skip-dbos", action="store_true")
    parser.add_argument("--only-timers", action="store_true")
    args = parser.parse_args()
    server = server_url()
    settings = server_settings(server)
    print(
        f"stages benchmark on {Database(server).display_url}: Postgres {settings['server_version']}, "
        f"autovacuum={settings['autovacuum']}, fsync={settings['fsync']}, "
        f"synchronous_commit={settings['synchronous_commit']}, "
        f"{os.cpu_count()} CPUs (shared)"
    )
    results: dict[str, object] = {"benchmark": "stages", "server": settings, "cpus": os.cpu_count()}
    runs = [
        ("cmb_1_worker", lambda: bench_cmb(server, args.count, 1)),
        ("dbos", lambda: {"skipped": "--skip-dbos"} if args.skip_dbos else bench_dbos(server, args.count)),
        ("cmb_2_workers", lambda: bench_cmb(server, args.count, 2)),
        ("cmb_1_worker_10pct_external", lambda: bench_cmb(server, args.count, 1, 0.10)),
    ]
    for key, run in [] if args.only_timers else runs:
        results[key] = run()
        print(f"{key:30} {results[key]}")
    if not args.only_timers and "entities_per_s" in results["dbos"]:  # type: ignore[operator]
        ratio = results["cmb_1_worker"]["entities_per_s"] / results["dbos"]["entities_per_s"]  # type: ignore[index]
        results["ratio_cmb_1_worker_vs_dbos"] = round(ratio, 2)
        print(f"cmb (1 worker) / DBOS entities/s: {ratio:.2f}")
    if not args.skip_timers:
        results["timers"] = bench_timers(server, args.timers, args.timer_window)
        print(f"{'timers':30} {results['timers']}")
    print(json.dumps(results))


if __name__ == "__main__":
    try:
        main()
    finally:
        for proc in STARTED:  # never leave a worker behind a failed run
            if proc.poll() is None:
                proc.kill()
