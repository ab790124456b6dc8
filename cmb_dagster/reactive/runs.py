"""A reactive tick's following of runs: the runs in flight looked up in bulk (a success makes the values a run was
launched on the task's last-seen values and marks it; a failure backs it off), lost launches requested again,
backoffs ended, tasks whose wake time came marked; and the successful runs launched by hand recorded."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import psycopg

from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import values_as_of, values_from_json, values_to_json
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.catalog import TaskCatalog
from cmb_dagster.reactive.evaluation import Evaluation, as_explanation
from cmb_dagster.reactive.launch import values_hash
from cmb_dagster.reactive.models import Launch, ManualLookup, RunInfo, RunLookup, RunState, SeenRun, sorted_keys
from cmb_dagster.reactive.tick import Known, Tick
from cmb_dagster.reactive.user_code import UserCall, UserCode
from cmb_dagster.workers import Leases

MANUAL_OVERLAP = timedelta(minutes=5)  # hand-launched runs are read again this far back (recorded once each)

_Finished = tuple[str, str, str, bool, datetime | None]  # task, run_key, run_id, success, backoff until


def follow_runs(
    conn: psycopg.Connection,
    tick: Tick,
    catalog: TaskCatalog,
    user_code: UserCode,
    runs: RunLookup,
    known: Known | None,
) -> dict[str, tuple[ParameterKey, ...]]:
    """Handle finished runs (none are read when no run is known to be in flight); re-request lost launches; end
    backoffs and wake tasks whose time came. Return the tasks in flight and what they produce."""
    params = tick.params
    launched: list[tuple[Any, ...]] = []
    finished: list[_Finished] = []
    lost: list[Launch] = []
    if known is None or known.in_flight:
        with conn.transaction():
            launched = conn.execute(sql.LAUNCHED_TASKS, params).fetchall()
            found = runs(tick.scheduler, [row[1] for row in launched]) if launched else {}
            _finish(conn, tick, catalog, launched, found, finished, lost)
    tick.marked.update(name for name, _, _, success, _ in finished if success)  # in a batch
    for statement in (sql.END_BACKOFFS, sql.WAKE_TASKS):  # the tasks each marks (and those marked by hand)
        tick.single.update(row[0] for row in conn.execute(statement, params))
    tick.marked |= tick.single
    _relaunch(tick, user_code, lost)
    done = {f[0] for f in finished}
    return {row[0]: sorted_keys(row[7]) for row in launched if row[0] not in done}


def _finish(
    conn: psycopg.Connection,
    tick: Tick,
    catalog: TaskCatalog,
    launched: Sequence[tuple[Any, ...]],
    found: Mapping[str, RunInfo],
    finished: list[_Finished],
    lost: list[Launch],
) -> None:
    """Inside the transaction that read the ``launched`` tasks: note the runs ``found`` for them, record those
    that finished (appended to ``finished``) and collect the launches whose run never appeared (``lost``)."""
    now, report = tick.now, tick.report
    seen: list[tuple[str, str]] = []
    for name, run_key, run_id, launched_at, attempts, ready_values, text, _, partition, facts in launched:
        run = found.get(run_key)
        if run is None:
            if launched_at <= now - tick.settings.launch_grace:
                attempt = int(run_key.rsplit(":", 1)[1])
                lost.append(
                    Launch(
                        name,
                        run_key,
                        attempt,
                        values_from_json(ready_values),
                        catalog.explained(name, text, facts),
                        relaunch=True,
                        partition_key=partition,
                    )
                )
            else:
                report.note(name, "in progress", f"run {run_key} requested at {launched_at}, not yet created")
        elif run.state is RunState.ACTIVE:
            if run.run_id != run_id:
                seen.append((name, run.run_id))
            report.note(name, "in progress", f"run {run.run_id} ({run_key}) is queued or running")
        if run is not None and run.run_id != run_id:
            why = catalog.explained(name, text, facts)
            report.seen_runs.append(SeenRun(name, run.run_id, run_key, values_from_json(ready_values), why))
        if run is None or run.state is RunState.ACTIVE:
            continue
        if run.state is RunState.SUCCESS:
            finished.append((name, run_key, run.run_id, True, None))
            report.note(name, "succeeded", f"run {run.run_id} succeeded: its CTL values are now last-seen")
        else:
            backoff = tick.backoff(attempts)
            finished.append((name, run_key, run.run_id, False, now + backoff))
            report.note(
                name,
                "failed",
                f"run {run.run_id} failed (failure {attempts + 1} in a row); trigger stays armed, "
                f"retry after {backoff} at {now + backoff}",
            )
    if seen or finished:
        Leases.check(conn, tick.lease)
    if seen:
        names, run_ids = [s[0] for s in seen], [s[1] for s in seen]
        conn.execute(sql.NOTE_RUN_IDS, {**tick.params, "names": names, "run_ids": run_ids})
    if finished:
        rows = [
            {"name": n, "run_key": k, "run_id": i, "success": ok, "backoff_until": b.isoformat() if b else None}
            for n, k, i, ok, b in finished
        ]
        batch = conn.execute(sql.FINISH_RUNS, {**tick.params, "rows": json.dumps(rows)}).fetchone()
        if batch is not None:
            tick.batches.add(batch[0])


def _relaunch(tick: Tick, user_code: UserCode, lost: Sequence[Launch]) -> None:
    """Request again the runs that never appeared, with the run config and tags their user code gives now."""
    shapes = user_code.shape(
        tick, [UserCall(Evaluation(x.task, "ready", as_explanation(x.why), x.values, {}), False) for x in lost]
    )
    report = tick.report
    for launch, shape in zip(lost, shapes, strict=True):
        if shape is None:
            report.note(
                launch.task,
                "in progress",
                f"no run with run_key {launch.run_key} appeared; "
                "requested again by a later tick (this one's time for user code is spent)",
            )
        elif isinstance(shape, str):
            report.note(launch.task, "error", f"run {launch.run_key} cannot be requested again: {shape}")
        else:
            report.launches.append(replace(launch, run_config=shape.run_config, tags=shape.tags))
            report.note(launch.task, "relaunched", f"no run with run_key {launch.run_key} appeared; requested again")


def record_manual_runs(conn: psycopg.Connection, tick: Tick, catalog: TaskCatalog, manual: ManualLookup) -> None:
    """Successful hand-launched runs tagged with a task: their values become its last-seen values, once each."""
    params = tick.params
    with conn.transaction():
        row = conn.execute(sql.MANUAL_AFTER, params).fetchone()
        after = row[0] if row else None
        found = [run for run in manual(after - MANUAL_OVERLAP if after else None) if run.task in catalog.tasks]
        if not found:
            return
        rows = []
        for run in sorted(found, key=lambda r: r.finished_at):
            keys = catalog.reads[run.task]
            values = run.values if run.values is not None else values_as_of(conn, keys, run.started_at)
            values = {k: v for k, v in values.items() if k in keys}
            rows.append(
                {
                    "name": run.task,
                    "run_key": f"manual:{run.run_id}",
                    "run_id": run.run_id,
                    "values": values_to_json(values),
                    "hash": values_hash(values),
                    "finished_at": run.finished_at.isoformat(),
                }
            )
        Leases.check(conn, tick.lease)
        recorded = conn.execute(sql.RECORD_MANUAL_RUNS, {**params, "rows": json.dumps(rows)}).fetchall()
        conn.execute(sql.SAVE_MANUAL_AFTER, {**params, "after": max(r.finished_at for r in found)})
    tick.single.update(task for task, _, _ in recorded)
    tick.marked |= tick.single
    for task, run_id, values in recorded:
        tick.report.manual += 1
        tick.report.note(
            task,
            "recorded",
            f"hand-launched run {run_id} succeeded: its values {json.dumps(values)} are now last-seen",
        )
