"""ReactiveWorker: a reactive scheduler's ticks on the shared worker loop, outside a Dagster sensor; its status."""

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner
from running import Running
from runs import RunStorage
from waiting import wait_until

from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.reactive import ReactiveWorker, SchedulerSettings, TaskSpec, status, task_states
from cmb_dagster.reactive.cli import reactive as reactive_cli
from cmb_dagster.reactive.engine import LEASE_KIND
from cmb_dagster.reactive.models import Launch
from cmb_dagster.triggers import Delta
from cmb_dagster.workers import LeaseLost

T0 = datetime(2024, 5, 1, tzinfo=UTC)
KEY = ("sales", "loaded_until")
SPECS = [TaskSpec(name="mart", trigger=Delta(*KEY, "1h")), TaskSpec(name="other", trigger=Delta("prices", "p", "1h"))]


def worker(db: Database, runs: RunStorage, **kwargs) -> ReactiveWorker:
    settings = SchedulerSettings(tick_seconds=1, idle_sleep=60)  # only a CTL change wakes it within a test
    return ReactiveWorker(db, settings, name="w", tasks=SPECS, runs=runs.lookup, launch=runs.launch, **kwargs)


def holder(db: Database) -> str | None:
    with db.connection() as conn:
        row = conn.execute(
            "SELECT owner FROM leases WHERE kind = %s AND partition = 'w' AND expires_at > now()", (LEASE_KIND,)
        ).fetchone()
    return row[0] if row else None


def mart(db: Database):
    return next(s for s in status(db, "w").tasks if s.name == "mart")


def test_a_ctl_change_wakes_the_worker_which_launches_and_then_records_the_success(db):
    runs = RunStorage()
    with Running(worker(db, runs, owner="one")) as running:
        wait_until(lambda: running.worker.listening and holder(db) == "one")
        CtlStore(db).set(*KEY, T0)
        wait_until(lambda: [launch.task for launch in runs.requested] == ["mart"])
        wait_until(lambda: mart(db).last_values == {"sales": {"loaded_until": T0.isoformat()}})
        assert mart(db).status == "waiting"
    assert running.report.held == {"w"} and running.report.items >= 2 and running.report.errors == 0
    assert holder(db) is None  # released on the way out


def test_a_second_worker_of_the_same_scheduler_stands_by_until_the_first_stops(db):
    first_runs, second_runs = RunStorage(), RunStorage()
    first = Running(worker(db, first_runs, owner="first"))
    wait_until(lambda: holder(db) == "first")
    with Running(worker(db, second_runs, owner="second")):
        CtlStore(db).set(*KEY, T0)
        wait_until(lambda: len(first_runs.requested) == 1)
        first.stop()
        wait_until(lambda: holder(db) == "second", timeout=15)
        CtlStore(db).set("prices", "p", T0)
        wait_until(lambda: [launch.task for launch in second_runs.requested] == ["other"])
    assert [launch.task for launch in first_runs.requested] == ["mart"]


def test_a_run_for_a_while_reports_its_ticks_and_a_failing_launch_is_retried_by_the_loop(db):
    calls = []

    def failing(launches: Sequence[Launch]) -> None:
        calls.append(launches)
        raise RuntimeError("the run launcher is down")

    CtlStore(db).set(*KEY, T0)
    runs = RunStorage()
    report = ReactiveWorker(
        db, SchedulerSettings(idle_sleep=0.05), name="w", tasks=SPECS, runs=runs.lookup, launch=failing
    ).run(duration=1.5)
    assert report.errors == len(calls) >= 1 and report.steps >= 1
    assert [launch.task for launch in calls[0]] == ["mart"]


def test_status_counts_the_tasks_and_the_cli_prints_its_rows(db):
    CtlStore(db).set(*KEY, T0)
    runs = RunStorage()
    worker(db, runs).run(duration=1.0)
    current = status(db, "w")
    assert [task.name for task in current.tasks] == ["mart", "other"]
    assert current.counts == {"waiting": 2}
    shown = CliRunner().invoke(
        reactive_cli, ["status", "w", "--json"], env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema}
    )
    assert json.loads(shown.output) == [task.model_dump(mode="json") for task in current.tasks]
    with pytest.warns(DeprecationWarning, match=r"status\(database, scheduler, name\).tasks"):
        assert task_states(db, "w") == current.tasks


def test_a_tick_launches_nothing_once_its_lease_lapsed_by_the_process_clock(db):
    """The tick shares its loop's lease: a process stopped past the lease (its clock says it lapsed) during a tick
    records the launch it decided on but does not request the run (the scheduler's next holder requests it again
    after launch_grace)."""
    runs = RunStorage()
    reactive = worker(db, runs, owner="one")
    [loop] = reactive.loops()
    assert reactive.engine.leases is loop.leases  # the tick's renewals while user code runs are the loop's
    lease = loop.leases.acquire(["w"])["w"]
    CtlStore(db).set(*KEY, T0)
    lease.term.valid_until = time.monotonic() + 1  # as after a stop: by this process's clock, about to lapse
    with pytest.raises(LeaseLost):
        loop.step(lease)  # the tick, as the loop runs it
    assert runs.requested == []
    with db.connection() as conn:
        assert conn.execute("SELECT task FROM reactive_launches").fetchall() == [("mart",)]
    reactive.finish()
