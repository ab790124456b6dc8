"""A reactive tick's launch: ready tasks by priority while fewer than ``max_concurrent_runs`` reactive runs are queued
or running, each evaluated again first if an earlier tick left it ready, shaped by its user code and recorded with
its run_key. A hold keeps ready tasks below a waiting task that a run in flight feeds from launching."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg

from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.catalog import TaskCatalog
from cmb_dagster.reactive.evaluation import Evaluation, Stored, as_explanation, evaluate_stored, save_evaluations
from cmb_dagster.reactive.explanations import Explanation
from cmb_dagster.reactive.models import ABOVE_HIGHEST_PRIORITY, LOWEST_PRIORITY, Launch
from cmb_dagster.reactive.tick import Tick
from cmb_dagster.reactive.user_code import Shaped, UserCall, UserCode, Wait
from cmb_dagster.workers import Leases


@dataclass(frozen=True)
class Hold:
    """Ready tasks below ``priority`` wait: ``producer``'s run feeds ``task``, a waiting task of that priority."""

    task: str
    priority: int
    producer: str


def values_hash(values: Mapping[ParameterKey, datetime], partition_key: str | None = None) -> str:
    """A short stable digest of CTL values and the partition (part of a run_key)."""
    return _encoded_values(values, partition_key)[1]


def _encoded_values(values: Mapping[ParameterKey, datetime], partition_key: str | None = None) -> tuple[str, str]:
    """``values`` in UTC as stored JSON text, and :func:`values_hash` of them (one encoding for both)."""
    nested: dict[str, dict[str, str]] = {}  # as values_to_json, the keys sorted by json.dumps
    for (entity, parameter), value in values.items():
        nested.setdefault(entity, {})[parameter] = value.astimezone(UTC).isoformat()
    text = json.dumps(nested, sort_keys=True)
    hashed = text if partition_key is None else text + "\n" + partition_key
    return text, hashlib.sha256(hashed.encode()).hexdigest()[:12]


def find_hold(
    conn: psycopg.Connection,
    tick: Tick,
    catalog: TaskCatalog,
    in_flight: Mapping[str, tuple[ParameterKey, ...]],
    busy: Mapping[str, str],
    ready: Mapping[str, Evaluation],
) -> Hold | None:
    """The highest-priority waiting task fed by a run in flight, if any (it holds the tasks below it): a reactive
    task ``in_flight`` that produces a parameter it reads, or a run materializing an entity upstream of it (``busy``
    maps those entities to a description of their run); ``ready`` tasks, found ready in this tick and not saved yet,
    do not wait."""
    producers: dict[str, str] = {}  # waiting task -> what feeds it: a reactive task in flight, or another run
    for producer in sorted(in_flight):
        for key in in_flight[producer]:
            for name in catalog.index.get(key, ()):
                producers.setdefault(name, producer)
    for entity in sorted(busy):
        for name in catalog.downstream.get(entity, ()):
            producers.setdefault(name, f"{busy[entity]} (materializes {entity})")
    producers = {name: producer for name, producer in producers.items() if name not in ready}
    if not producers:
        return None
    with conn.transaction():
        row = conn.execute(sql.TOP_WAITING_TASK, {"scheduler": tick.scheduler, "names": list(producers)}).fetchone()
    return None if row is None else Hold(task=row[0], priority=row[1], producer=producers[row[0]])


def launch_ready(
    conn: psycopg.Connection,
    tick: Tick,
    catalog: TaskCatalog,
    user_code: UserCode,
    in_flight: int,
    hold: Hold | None,
    fresh: Mapping[str, Evaluation],
    failures: Mapping[str, int],
    stored: bool,
) -> tuple[int, bool]:
    """Launch ready tasks by priority under the cap and above a hold: those evaluated in this tick (``fresh``, not
    saved yet, with their ``failures`` in a row) and those left ready by earlier ticks (evaluated again first;
    ``stored``: there may be some); the rest are saved as ready. Their user code runs between transactions. Return
    the runs now in flight and whether tasks may be left stored as ready."""
    cap = tick.settings.max_concurrent_runs
    params = tick.params
    report = tick.report
    floor = hold.priority if hold else LOWEST_PRIORITY
    launchable = {"min_priority": floor, "max_priority": ABOVE_HIGHEST_PRIORITY}
    pending = sorted(
        (e for e in fresh.values() if catalog.tasks[e.name].priority >= floor), key=lambda e: catalog.rank(e.name)
    )
    unsaved = [e for e in fresh.values() if catalog.tasks[e.name].priority < floor]
    cut = False  # the tick's time for user code ran out
    while in_flight < cap and (stored or pending):
        with conn.transaction() if stored else nullcontext():
            limit = cap - in_flight
            rows = []
            if stored:
                rows = conn.execute(sql.READY_TASKS, {**params, **launchable, "limit": limit}).fetchall()
            rows = [r for r in rows if r[0] not in fresh]  # ready before and evaluated again in this tick
            if not rows and not pending:
                break
            candidates = [(r[4], r[0]) for r in rows] + [(catalog.tasks[e.name].priority, e.name) for e in pending]
            names = {name for _, name in sorted(candidates, key=lambda c: (-c[0], c[1]))[:limit]}
            stale = [Stored(r[0], r[1], r[2], r[5], r[6]) for r in rows if r[0] in names]
            attempts_so_far = {**failures, **{r[0]: r[3] for r in rows}}
            evaluations = evaluate_stored(conn, catalog, stale, tick.now) if stale else []
            ready = [e for e in pending if e.name in names] + [e for e in evaluations if e.status == "ready"]
            pending = [e for e in pending if e.name not in names]
            ready.sort(key=lambda e: catalog.rank(e.name))
            gone = [e for e in evaluations if e.status != "ready"]
            if gone:
                Leases.check(conn, tick.lease)
                save_evaluations(conn, tick, gone)
        for e in gone:
            report.note(e.name, e.status, e.explanation.prefixed("no longer fires now that a slot is free: "))
        shapes = user_code.shape(tick, [UserCall(e, True) for e in ready])
        launches = _launch(conn, tick, list(zip(ready, shapes, strict=True)), attempts_so_far)
        report.launches.extend(launches)
        for launch in launches:
            report.note(launch.task, "launched", as_explanation(launch.why).prefixed(f"run_key {launch.run_key}: "))
        in_flight += len(launches)
        later = [e for e, shape in zip(ready, shapes, strict=True) if shape is None]
        if later:
            unsaved.extend(later)
            report.complete, cut = False, True
            for e in later:
                report.note(e.name, "ready", "waits for the next tick: this tick's time for user code is spent")
            break
    left = bool(pending or unsaved) or (stored and (in_flight >= cap or hold is not None or cut))
    if pending or unsaved:
        with conn.transaction():
            Leases.check(conn, tick.lease)
            save_evaluations(conn, tick, [*pending, *unsaved])
    if hold:
        held = {"min_priority": LOWEST_PRIORITY, "max_priority": hold.priority}
        why = f"waiting for {hold.producer} which feeds higher-priority {hold.task} (priority {hold.priority})"
        _note_not_launched(conn, tick, held, "held", why)
    if in_flight >= cap:
        why = f"ready, waits for a slot: {in_flight}/{cap} reactive runs queued or running"
        _note_not_launched(conn, tick, launchable, "capped", why)
    return in_flight, left


def _launch(
    conn: psycopg.Connection,
    tick: Tick,
    candidates: Sequence[tuple[Evaluation, Shaped | Wait | str | None]],
    attempts_so_far: Mapping[str, int],
) -> list[Launch]:
    """In one transaction, record the launches of the shaped ``candidates``; one whose user code failed backs
    off with the error (those not shaped are left as they are)."""
    params, now = tick.params, tick.now
    shaped = [shape for _, shape in candidates if isinstance(shape, Shaped)]
    waits = [shape for _, shape in candidates if isinstance(shape, Wait)]
    refused = []
    for candidate, shape in candidates:
        if isinstance(shape, str):
            backoff = tick.backoff(attempts_so_far.get(candidate.name, 0))
            why = f"error: {shape}; not launched, retry after {backoff} at {now + backoff}"
            explanation = candidate.explanation.prefixed(why + "\n")
            refused.append(
                {
                    "name": candidate.name,
                    "explanation": explanation.text,
                    "facts": explanation.facts,
                    "backoff_until": (now + backoff).isoformat(),
                    "unmark": candidate.name in tick.single,
                }
            )
            tick.report.note(candidate.name, "error", why)
    if not shaped and not refused and not waits:
        return []
    with conn.transaction():
        Leases.check(conn, tick.lease)
        if refused:
            conn.execute(sql.LAUNCH_REFUSED, {**params, "rows": json.dumps(refused)})
        if waits:
            rows = [
                {"name": w.evaluation.name, "explanation": w.explanation.text, "facts": w.explanation.facts}
                for w in waits
            ]
            shown = dict(conn.execute(sql.WAIT_FOR_PARTITION, {**params, "rows": json.dumps(rows)}).fetchall())
            tick.left.update(shown)  # still marked: evaluated again next tick
            for w in waits:
                if shown.get(w.evaluation.name):  # its state changed: shown now (unchanged: hourly)
                    tick.report.note(w.evaluation.name, "waiting", w.explanation)
        return _record_launches(conn, tick, shaped, attempts_so_far) if shaped else []


def _record_launches(
    conn: psycopg.Connection, tick: Tick, shaped: Sequence[Shaped], attempts_so_far: Mapping[str, int]
) -> list[Launch]:
    """Record the launches of ``shaped`` (run_key: task, values and partition, attempt); return those recorded."""
    params = tick.params
    encoded = {s.evaluation.name: _encoded_values(s.evaluation.values, s.partition_key) for s in shaped}
    hashes = {name: digest for name, (_, digest) in encoded.items()}
    previous = {
        (task, digest): count
        for task, digest, count in conn.execute(
            sql.PREVIOUS_ATTEMPTS,
            {**params, "rows": json.dumps([{"task": t, "values_hash": h} for t, h in hashes.items()])},
        ).fetchall()
    }
    planned = []
    reasons: dict[str, Explanation] = {}
    for s in shaped:
        e = s.evaluation
        attempt = previous.get((e.name, hashes[e.name]), 0) + 1
        reason = e.explanation
        if attempts_so_far.get(e.name):
            reason = reason.prefixed(f"retry after {attempts_so_far[e.name]} failed run(s); ")
        reasons[e.name] = reason
        planned.append(
            Launch(
                e.name,
                f"{e.name}:{hashes[e.name]}:{attempt}",
                attempt,
                e.values,
                reason,
                partition_key=s.partition_key,
                run_config=s.run_config,
                tags=s.tags,
                deadline=e.deadline,
            )
        )
    columns = {
        "names": [p.task for p in planned],
        "run_keys": [p.run_key for p in planned],
        "values": [encoded[p.task][0] for p in planned],
        "hashes": [hashes[p.task] for p in planned],
        "attempts": [p.attempt for p in planned],
        "reasons": [reasons[p.task].text for p in planned],
        "facts": json.dumps([reasons[p.task].facts for p in planned]),
        "partition_keys": [p.partition_key for p in planned],
        "unmarks": [p.task in tick.single for p in planned],
    }
    launched = {row[0] for row in conn.execute(sql.MARK_LAUNCHED, {**params, **columns}).fetchall()}
    return [p for p in planned if p.task in launched]


def _note_not_launched(conn: psycopg.Connection, tick: Tick, bounds: Mapping[str, int], action: str, why: str) -> None:
    """Report the first ready tasks within the priority ``bounds``, and how many more there are."""
    params = {**tick.params, **bounds}
    with conn.transaction():
        shown = conn.execute(sql.READY_TASKS, {**params, "limit": 20}).fetchall()
        waiting = conn.execute(sql.COUNT_READY, params).fetchone()[0] if len(shown) == 20 else len(shown)
    for row in shown:
        tick.report.note(row[0], action, why)
    if waiting > len(shown):
        tick.report.note("...", action, f"{waiting - len(shown)} more ready task(s): {why}")
