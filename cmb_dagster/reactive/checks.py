"""Health checks of reactive tasks, from their stored state and CTL: the scheduler's tick age and each task's
deadline (no Dagster here)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from cmb_dagster.database import DatabaseSource
from cmb_dagster.health import Verdict
from cmb_dagster.reactive.admin import waits_on
from cmb_dagster.reactive.models import ReactiveChecks, SchedulerState, TaskState
from cmb_dagster.triggers.durations import human_duration

TICK_CHECK = "tick_age"
"""The reactive tasks asset's check of the scheduler sensor's last tick (a :class:`ReactiveChecks` field)."""

AssetPath = tuple[str, ...]


def deadline_check(task: str) -> str:
    """The name of a task's deadline check (a Dagster check name: letters, digits, underscores)."""
    return "deadline_" + re.sub(r"[^A-Za-z0-9_]", "_", task)


def tick_verdicts(
    asset: AssetPath,
    schedulers: Sequence[SchedulerState],
    now: datetime,
    interval_seconds: float,
    checks: ReactiveChecks,
) -> list[Verdict]:
    """How many sensor intervals passed since the latest tick of ``schedulers`` (none yet: it passes)."""
    ticked = [s for s in schedulers if s.ticked_at is not None]
    if not ticked:
        return checks.judge(asset, {TICK_CHECK: (0.0, "the reactive scheduler has not ticked yet")})
    latest = max(ticked, key=lambda s: s.ticked_at)  # type: ignore[arg-type, return-value]
    age = max((now - latest.ticked_at).total_seconds(), 0.0)  # type: ignore[operator]
    took = f", took {latest.tick_seconds:.2f} s" if latest.tick_seconds is not None else ""
    ago = human_duration(timedelta(seconds=round(age)))
    what = (
        f"scheduler {latest.name} last ticked {ago} ago ({latest.ticked_at}{took}): "
        f"{age / interval_seconds:.1f} intervals of {interval_seconds:g} s"
    )
    return checks.judge(asset, {TICK_CHECK: (age / interval_seconds, what)})


def deadline_verdicts(
    database: DatabaseSource, tasks: Sequence[TaskState], assets: Mapping[str, Sequence[AssetPath]], now: datetime
) -> list[Verdict]:
    """The deadline check of each task with a deadline, on each asset ``assets`` gives it: failed (error) while
    its deadline passed without a successful run, naming what its trigger waits on."""
    verdicts = []
    for task in tasks:
        state = task.deadline_state(now)
        if state is None:
            continue
        deadline = task.deadline_text()
        if state.late:
            waiting = waits_on(database, task, now)
            blocked = "; ".join(waiting) if waiting else "its trigger fires, on values its last successful run saw"
            launched = f"; run {task.run_id or task.run_key} in flight" if task.status == "launched" else ""
            text = (
                f"reactive task {task.name}: deadline ({deadline}) passed at {state.due_at} without a successful run "
                f"since {state.since}, late by {state.lateness}{launched}; {blocked}"
            )
            severity, value = "error", -state.slack.total_seconds()
        else:
            text = f"reactive task {task.name}: deadline ({deadline}): {state.text()}"
            severity, value = "ok", 0.0
        verdicts += [
            Verdict(tuple(path), deadline_check(task.name), severity, text, value)  # type: ignore[arg-type]
            for path in assets.get(task.name, ())
        ]
    return verdicts
