"""The stage scheduler's rate limit and max parallelism on the shared flow control: across worker processes,
per key, and across a kill -9 of a worker holding a batch slot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path

import stages_flow_workers
from intervals import most_at_once, most_within
from processes import stop
from pydantic import BaseModel
from waiting import wait_until

from cmb_dagster import flow
from cmb_dagster.database import Database
from cmb_dagster.stages import Engine, Entity, MergePatch, Stage, StageResult, StageStore, shard_of, status
from cmb_dagster.stages.stage import parallel_scope

HERE = Path(__file__).parent


def _prepare(db: Database, setup: str, payloads: dict[str, dict]) -> None:
    with db.connect(autocommit=True) as conn:
        conn.execute(stages_flow_workers.RUNS)
        conn.execute("CREATE TABLE IF NOT EXISTS public.stage_release (x int)")
    StageStore(db, stages_flow_workers.SETUPS[setup]()).put_many(payloads)


@contextmanager
def _workers(database_url: str, setup: str, count: int = 2, ttl: float = 10.0) -> Iterator[list[subprocess.Popen]]:
    env = {**os.environ, "CMB_DATABASE_URL": database_url}
    script = str(HERE / "stages_flow_workers.py")
    procs = [
        subprocess.Popen([sys.executable, script, setup, str(i), str(count), str(ttl)], env=env) for i in range(count)
    ]
    try:
        yield procs
    finally:
        stop(procs)


def _runs(db: Database, stage: str) -> list[tuple[str, str | None, int, datetime, datetime | None]]:
    with db.connection() as conn:
        return conn.execute(
            "SELECT entity_id, key, pid, started_at, ended_at FROM public.stage_runs WHERE stage = %s"
            " ORDER BY started_at",
            (stage,),
        ).fetchall()


def _ended(db: Database, stage: str, count: int) -> bool:
    return sum(r[4] is not None for r in _runs(db, stage)) >= count


def test_a_rate_limit_holds_across_two_worker_processes(db, database_url):
    _prepare(db, "rate", {f"r{i}": {} for i in range(100)})
    with _workers(database_url, "rate"):
        wait_until(lambda: _ended(db, "rated", 100), 60, "100 entities processed")
    runs = _runs(db, "rated")
    assert len({r[2] for r in runs}) == 2  # both workers ran the stage
    assert most_within([r[3] for r in runs], timedelta(seconds=1)) <= 20 + 10  # rate + burst


def test_max_parallelism_is_never_exceeded_across_two_worker_processes(db, database_url):
    _prepare(db, "parallel", {f"p{i}": {} for i in range(40)})
    with _workers(database_url, "parallel"):
        wait_until(lambda: _ended(db, "one_at_a_time", 40), 60, "40 entities processed")
    runs = _runs(db, "one_at_a_time")
    assert len({r[2] for r in runs}) == 2
    assert most_at_once((r[3], r[4]) for r in runs) == 1


def test_a_busy_key_does_not_hold_up_another_keys_rate(db, database_url):
    payloads = {f"a{i:03}": {"tenant": "a"} for i in range(100)}
    _prepare(db, "keyed_rate", payloads)
    StageStore(db).put_many({f"b{i}": {"tenant": "b"} for i in range(10)})  # queued behind a's 100
    with _workers(database_url, "keyed_rate"):
        wait_until(lambda: _ended(db, "per_tenant", 110), 60, "110 entities processed")
    runs = _runs(db, "per_tenant")
    a_starts = [r[3] for r in runs if r[1] == "a"]
    b_starts = [r[3] for r in runs if r[1] == "b"]
    assert max(b_starts) < a_starts[70]  # b never waited for a's tokens (behind them it would go after a's 100th)
    assert most_within(a_starts, timedelta(seconds=1)) <= 20 + 20  # a's own bucket still holds


class Blocking(Stage):
    name = "blocking"

    def __init__(self, **kw: object) -> None:
        super().__init__(max_parallelism=1, key=lambda e: e.payload["tenant"], **kw)
        self.entered = threading.Event()
        self.release = threading.Event()

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        if entity.payload["tenant"] == "a":
            self.entered.set()
            assert self.release.wait(10)
        return StageResult(update=MergePatch({"done": True}))


def test_a_key_running_at_its_max_parallelism_does_not_hold_up_another_key(db):
    """Two engines as two workers: the first runs a1 (key a) in its shard, the second serves the other shards."""
    stage = Blocking()
    store = StageStore(db, [stage])
    store.put("a1", {"tenant": "a"})
    others = [s for s in range(8) if s != shard_of("a1", 8)]
    assert shard_of("a3", 8) in others and shard_of("b2", 8) in others
    first = Engine(db, [stage], owner="first")
    first.changes_batch(range(8))
    running = threading.Thread(target=first.process_batch, args=([shard_of("a1", 8)],))
    running.start()
    try:
        assert stage.entered.wait(10)  # first holds a's one batch slot while a1 runs
        store.put_many({"a3": {"tenant": "a"}, "b2": {"tenant": "b"}})
        second = Engine(db, [stage], owner="second")
        second.changes_batch(others)
        report = second.process_batch(others)
        assert report.processed == 1 and report.held_back == 1  # b2 ran, a3 waits for a's slot
        assert store.get("b2").payload["done"] and "done" not in store.get("a3").payload
        [limits] = [row.limits for row in status(db).stages if row.stage == "blocking"]
        assert limits.max_parallelism == 1 and {u.key: u.batches for u in limits.keys} == {"a": 1, "b": 0}
    finally:
        stage.release.set()
        running.join(10)
    wait_until(lambda: second.process_batch(others).processed, 10, "a3 runs once a's slot is free again")
    first.close()
    second.close()


def test_the_slot_of_a_killed_worker_returns_after_its_ttl_and_not_before(db, database_url):
    ttl = 2.0
    _prepare(db, "held", {f"h{i}": {} for i in range(12)})
    with _workers(database_url, "held", ttl=ttl) as procs:
        [first] = wait_until(lambda: _runs(db, "held"), 30, "a worker holds the slot")
        with db.connection() as conn:  # the holder renews its slot while its call runs past the ttl
            wait_until(
                lambda: conn.execute("SELECT clock_timestamp()").fetchone()[0] > first[3] + timedelta(seconds=2 * ttl)
            )
        assert len(_runs(db, "held")) == 1
        holder = next(p for p in procs if p.pid == first[2])
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        with db.connection() as conn:
            killed_at = conn.execute("SELECT clock_timestamp()").fetchone()[0]
            [use] = [u for u in flow.usage(conn, [parallel_scope("held")]) if u.in_flight]
            expires = conn.execute(
                "SELECT expires_at FROM flow_slots WHERE scope = %s AND holder IS NOT NULL", (parallel_scope("held"),)
            ).fetchone()[0]
            conn.execute("INSERT INTO public.stage_release VALUES (1)")  # the next calls return at once
        assert use.in_flight == 1  # the dead worker's slot is still taken...
        second = wait_until(lambda: _runs(db, "held")[1:], 30, "the other worker runs the stage")[0]
        assert second[3] >= expires  # ...until its time-to-live passed
        # renewed about every ttl / 3 while its call ran: the slot lasted well past the kill
        assert second[3] - killed_at >= timedelta(seconds=ttl / 6)
        assert second[2] != first[2]
