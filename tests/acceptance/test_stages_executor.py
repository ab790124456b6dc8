"""Stage workers (real processes) on the shared executor: ``concurrency`` calls at once, an entity held until its
call has really ended, ``sys.exit()`` in a stage, a stage that holds the GIL under ``isolation="process"``, and an
``async def`` stage cancelled at its timeout. Each call records its interval (server clock)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from intervals import most_at_once
from processes import stop
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.stages import StageStore, entries, status

HERE = Path(__file__).parent
WORKER = [sys.executable, "-c", "from cmb_dagster.cli import run; run()", "stages", "worker", "--stages"]

Interval = tuple[str, str, int, datetime, datetime | None, str | None]  # stage, entity, pid, start, end, how


@pytest.fixture
def start_worker(database_url: str) -> Iterator:
    """Starts `cmb-dagster stages worker` on the options named, after loading ``payloads``; stops it at the end."""
    started: list[subprocess.Popen[bytes]] = []
    sys.path.insert(0, str(HERE))
    import stages_executor_stages

    def start(options: str, db: Database, payloads: dict[str, dict]) -> subprocess.Popen[bytes]:
        with db.connect(autocommit=True) as conn:
            conn.execute(stages_executor_stages.CALLS)
        StageStore(db, getattr(stages_executor_stages, options).stages).put_many(payloads)
        env = {
            **os.environ,
            "CMB_DATABASE_URL": database_url,
            "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        command = [*WORKER, f"stages_executor_stages:{options}"]
        started.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return started[-1]

    yield start
    stop(started)


def calls(db: Database, entity: str | None = None) -> list[Interval]:
    with db.connection() as conn:
        return conn.execute(
            "SELECT stage, entity_id, pid, started_at, ended_at, how FROM public.stage_calls"
            " WHERE %(entity)s::text IS NULL OR entity_id = %(entity)s ORDER BY started_at",
            {"entity": entity},
        ).fetchall()


def done(db: Database, field: str) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM stage_entities WHERE payload ? %s", (field,)).fetchone()[0]


def test_a_worker_runs_concurrency_calls_at_once(db, start_worker):
    start_worker("concurrent", db, {f"s{i}": {"do": "sleep", "seconds": 0.2} for i in range(12)})
    wait_until(lambda: done(db, "slow") == 12, 30, "12 slow calls")
    intervals = [(c[3], c[4]) for c in calls(db)]
    assert len(intervals) == 12 and most_at_once(intervals) == 4  # concurrency=4: four at once, never more


def test_an_entity_stays_held_until_its_timed_out_call_has_ended(db, start_worker):
    """a_slow's first call on e sleeps 2 s, past its 0.5 s timeout; it is retried at once after it failed, and
    b_fast is due on e too: no call on e starts before the previous one ended, however the timeout passed."""
    start_worker("held", db, {"e": {"do": "sleep", "seconds": 2.0, "first_only": True}})
    wait_until(lambda: done(db, "a_slow") == 1 and done(db, "b_fast") == 1, 30, "both stages done on e")
    on_e = calls(db, "e")
    assert [c[0] for c in on_e] == ["a_slow", "b_fast", "a_slow"], on_e
    assert most_at_once((c[3], c[4]) for c in on_e) == 1  # one call on e at a time
    first = on_e[0]
    assert first[4] - first[3] >= timedelta(seconds=1.5)  # the thread ran its 2 s, the others waited for it
    assert on_e[1][3] >= first[4]
    assert StageStore(db).get("e").payload["a_slow"] == 2  # the first call's result was dropped
    a_slow = status(db).stage("a_slow")
    assert a_slow.errors == 1 and a_slow.processed == 1  # the first call failed (timed out), the second committed


def test_sys_exit_in_process_fails_its_entry_and_the_worker_goes_on(db, start_worker):
    worker = start_worker("exits", db, {"bad": {"do": "exit"}} | {f"k{i}": {} for i in range(20)})
    wait_until(lambda: [e.entity_id for e in entries(db, stage="exits") if e.parked_at] == ["bad"], 30, "bad parked")
    [entry] = entries(db, stage="exits", entity_id="bad")
    assert entry.last_error == "UserCodeExit: user code raised SystemExit: 3", entry.last_error
    StageStore(db).put_many({f"later{i}": {} for i in range(5)})  # the worker goes on with what comes next
    wait_until(lambda: done(db, "exits") == 25, 30, "every other entity done")
    assert worker.poll() is None


def test_process_isolation_kills_a_call_that_holds_the_gil_and_the_lease_never_lapses(db, start_worker):
    start_worker("spins", db, {"spin": {"do": "spin"}} | {f"k{i}": {} for i in range(10)})
    leases: list[tuple[str, int, bool]] = []

    def parked() -> bool:
        with db.connection() as conn:
            leases.extend(
                conn.execute(
                    "SELECT partition, fence, expires_at > now() FROM leases WHERE kind = 'stages.shard'"
                ).fetchall()
            )
        return [e.entity_id for e in entries(db, stage="spins") if e.parked_at] == ["spin"]

    wait_until(parked, 30, "the spinning entry killed at its timeout and parked", interval=0.1)
    [entry] = entries(db, stage="spins", entity_id="spin")
    assert entry.last_error == "TimedOut: killed at its 1 s limit", entry.last_error
    wait_until(lambda: done(db, "spins") == 10, 30, "every other entity done")
    [spun] = [c for c in calls(db) if c[1] == "spin"]
    assert spun[4] is None  # killed inside the loop: it never recorded an end
    assert leases and all(fresh for _, _, fresh in leases)  # renewed all along, also while the child spun
    assert len({(partition, fence) for partition, fence, _ in leases}) == len({p for p, _, _ in leases})


def test_an_async_process_is_cancelled_at_its_timeout(db, start_worker):
    start_worker("naps", db, {"long": {"seconds": 60.0}} | {f"k{i}": {"seconds": 0.05} for i in range(10)})
    wait_until(lambda: any(e.parked_at for e in entries(db, stage="napping", entity_id="long")), 30, "parked")
    [entry] = entries(db, stage="napping", entity_id="long")
    assert entry.last_error == "TimedOut: cancelled at its 2 s limit", entry.last_error
    wait_until(lambda: done(db, "napping") == 10, 30, "every other entity done")
    [long] = calls(db, "long")
    assert long[5] == "cancelled" and long[4] - long[3] < timedelta(seconds=30)  # not left to sleep its minute
