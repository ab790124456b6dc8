"""A reactive tick's evaluation: the marked tasks' triggers on the current CTL values, in batches, highest priority
first; what is not ready is saved, with the facts of its explanation."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import psycopg

from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import values_to_json
from cmb_dagster.isolation import describe_error
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.admin import current_values
from cmb_dagster.reactive.catalog import TaskCatalog
from cmb_dagster.reactive.explanations import Explanation, stored_facts
from cmb_dagster.reactive.tick import Known, Tick
from cmb_dagster.triggers import evaluate
from cmb_dagster.workers import Leases

log = logging.getLogger("cmb_dagster.reactive")


@dataclass(frozen=True, slots=True)
class Evaluation:
    name: str
    status: str  # ready, waiting, error
    explanation: Explanation
    values: dict[ParameterKey, datetime]
    last: dict[ParameterKey, datetime]
    wake_at: datetime | None = None  # waiting: when time alone can make it ready
    deadline: datetime | None = None  # ready: the passed deadline it launches for (on_deadline='run')


@dataclass(frozen=True, slots=True)
class Stored:
    """A task's stored state that its evaluation reads."""

    name: str
    last: dict | None
    backwards_note: str | None
    last_success_at: datetime | None
    deadline_since: datetime | None


class Read:
    """What a tick's evaluations read: the time, the current CTL values and when each was set, and both as stored
    (ISO 8601, once per parameter)."""

    __slots__ = ("at", "changed", "changed_text", "current", "current_text", "now")

    def __init__(
        self, now: datetime, current: Mapping[ParameterKey, datetime], changed: Mapping[ParameterKey, datetime]
    ) -> None:
        self.now, self.at = now, now.isoformat()
        self.current, self.changed = current, changed
        self.current_text = {key: value.isoformat() for key, value in current.items()}
        self.changed_text = {key: value.isoformat() for key, value in changed.items()}

    def values(
        self, keys: Sequence[ParameterKey], settles: Sequence[ParameterKey], last: Mapping[str, Mapping[str, str]]
    ) -> list[list[str | None]]:
        """The facts' values of a task reading ``keys``: ``[entity, parameter, current, last]``, and when it was set
        for a parameter of ``settles``; ``last`` as stored."""
        found: list[list[str | None]] = []
        for key in keys:
            entity, parameter = key
            row = [entity, parameter, self.current_text.get(key), last.get(entity, {}).get(parameter)]
            if key in settles:
                row.append(self.changed_text.get(key))
            found.append(row)
        return found


def evaluate_marked(
    conn: psycopg.Connection, tick: Tick, catalog: TaskCatalog, known: Known | None
) -> tuple[dict[str, Evaluation], dict[str, int]]:
    """Evaluate the marked tasks in batches, highest priority first, until none is left or the time box ends;
    return the ready ones and their failed runs in a row. The marked tasks are those the tick knows of (its own
    marks, those its last tick left) and those marked by hand; all marks are read when it knows none."""
    params = tick.params
    ready: dict[str, Evaluation] = {}
    failures: dict[str, int] = {}
    if known is None:
        tick.single.update(row[0] for row in conn.execute(sql.MARKED_TASKS, params))
        for batch, names in conn.execute(sql.MARK_BATCHES, params).fetchall():
            tick.batches.add(batch)
            tick.marked.update(names)
    else:
        tick.single |= known.marked
    marked = sorted(tick.marked | tick.single, key=catalog.rank)
    size = tick.settings.batch_size
    read = read_values(conn, catalog, marked, tick.now)  # the CTL values of every batch, in one statement
    for start in range(0, len(marked), size):
        with conn.transaction():
            rows = conn.execute(sql.TASKS_TO_EVALUATE, {**params, "names": marked[start : start + size]}).fetchall()
            evaluations = [evaluate_one(catalog, Stored(r[0], r[1], r[2], r[5], r[6]), read) for r in rows]
            Leases.check(conn, tick.lease)
            # ready tasks stay marked: the launch step launches or saves them (a crash meanwhile re-evaluates them)
            save_evaluations(conn, tick, [e for e in evaluations if e.status != "ready"])
        tick.report.evaluated += len(evaluations)
        attempts = {r[0]: r[4] for r in rows}
        for e in evaluations:
            if e.status == "ready":
                ready[e.name] = e
                failures[e.name] = attempts[e.name]
            else:
                tick.report.note(e.name, e.status, e.explanation)
        if start + size < len(marked) and time.monotonic() >= tick.deadline:
            tick.report.complete = False
            tick.left.update(marked[start + size :])
            break
    return ready, failures


def evaluate_stored(
    conn: psycopg.Connection, catalog: TaskCatalog, rows: Sequence[Stored], now: datetime
) -> list[Evaluation]:
    """The evaluations of the tasks stored as ``rows``, on the CTL values as they are now."""
    read = read_values(conn, catalog, [row.name for row in rows], now)
    return [evaluate_one(catalog, row, read) for row in rows]


def read_values(conn: psycopg.Connection, catalog: TaskCatalog, names: Sequence[str], now: datetime) -> Read:
    """The current values of the CTL parameters the tasks ``names`` read."""
    keys = sorted({key for name in names for key in catalog.reads.get(name, ())})
    current, changed = current_values(conn, keys)
    return Read(now, current, changed)


def evaluate_one(catalog: TaskCatalog, row: Stored, read: Read) -> Evaluation:
    name, now, last = row.name, read.now, _last_values(row.last)
    spec = catalog.tasks.get(name)
    if spec is None:
        why = "not defined in this process's code (another version synced it)"
        return Evaluation(name, "error", Explanation(why), {}, last)
    try:
        result = evaluate(
            spec.trigger, now=now, current=read.current, last=last, timezone=spec.timezone, changed=read.changed
        )
    except Exception as exc:  # noqa: BLE001 - one bad task must not break the tick
        error = describe_error(exc)
        log.warning("reactive task %s: evaluating %r raised %s", name, spec.trigger, error)
        return Evaluation(name, "error", Explanation(f"evaluating the trigger raised {error}"), {}, last)
    facts = stored_facts(
        catalog.trigger_hashes[name],
        read.at,
        read.values(catalog.reads[name], catalog.settles[name], row.last or {}),
        row.backwards_note,
    )
    explanation = Explanation("", facts, spec.trigger, spec.timezone)
    if result.fired and any(last.get(key) != value for key, value in result.used.items()):
        return Evaluation(name, "ready", explanation, dict(result.used), last)
    wake_at = result.wake_at
    if spec.deadline is not None and spec.on_deadline == "run" and row.deadline_since is not None:
        state = spec.deadline.state(now, spec.timezone, row.last_success_at, row.deadline_since)
        if state.late:
            why = (
                f"deadline {spec.deadline.describe(spec.timezone)} passed at {state.due_at} without a successful "
                f"run since {state.since}: launched anyway (on_deadline='run'), though its trigger waits\n"
            )
            late = explanation.prefixed(why)
            return Evaluation(name, "ready", late, dict(result.used), last, None, state.due_at)
        wake_at = state.due_at if wake_at is None else min(wake_at, state.due_at)  # met or not: the next follows it
    return Evaluation(name, "waiting", explanation, {}, last, wake_at)


def save_evaluations(conn: psycopg.Connection, tick: Tick, evaluations: Sequence[Evaluation]) -> None:
    """Store the evaluations of tasks not launched (their marks of their own go)."""
    if not evaluations:
        return
    rows = [
        {
            "name": e.name,
            "status": e.status,
            "ready_values": values_to_json(e.values) if e.values else None,
            "explanation": e.explanation.text,
            "facts": e.explanation.facts,
            "wake_at": e.wake_at.isoformat() if e.wake_at else None,
            "unmark": e.name in tick.single,
        }
        for e in evaluations
    ]
    conn.execute(sql.SAVE_EVALUATIONS, {**tick.params, "rows": json.dumps(rows)})


def as_explanation(why: str | Explanation) -> Explanation:
    """A launch's ``why`` as an explanation."""
    return why if isinstance(why, Explanation) else Explanation(why)


@lru_cache(maxsize=1 << 16)
def _moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _last_values(stored: Mapping[str, Mapping[str, str]] | None) -> dict[ParameterKey, datetime]:
    """:func:`values_from_json`, each value parsed once (many tasks saw the same values)."""
    return {(e, p): _moment(v) for e, parameters in (stored or {}).items() for p, v in parameters.items()}
