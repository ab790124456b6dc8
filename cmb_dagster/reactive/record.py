"""A reactive tick's last step: the waiting tasks the tick log has not shown for long are shown again, and the tick
is recorded (when it ran and how long it took; the batches of marks it evaluated go, the tasks it leaves marked are
marked one by one)."""

from __future__ import annotations

import time
from datetime import timedelta

import psycopg

from cmb_dagster.reactive import sql
from cmb_dagster.reactive.catalog import TaskCatalog
from cmb_dagster.reactive.tick import Tick
from cmb_dagster.workers import Leases

REMIND_AFTER = timedelta(hours=1)
"""A waiting task whose state did not change is shown in the tick log again after this long."""
REMINDERS_PER_TICK = 200


def remind_waiting(conn: psycopg.Connection, tick: Tick, catalog: TaskCatalog) -> None:
    """Show again the waiting tasks whose explanation (what blocks them) the tick log has not shown for an hour
    (a task whose state changes is shown on that tick)."""
    params = {**tick.params, "since": tick.now - REMIND_AFTER, "limit": REMINDERS_PER_TICK}
    if not conn.execute(sql.REMINDERS_DUE, params).fetchone()[0]:
        return
    with conn.transaction():
        Leases.check(conn, tick.lease)
        rows = conn.execute(sql.REMIND_WAITING, params).fetchall()
    for name, text, facts, evaluated_at, _ in sorted(rows, key=lambda r: (-r[4], r[0])):
        since = f" since {evaluated_at:%Y-%m-%d %H:%M:%S %Z}" if evaluated_at else ""
        if text is None and facts is None:
            tick.report.note(name, "still waiting", f"unchanged{since}: not evaluated yet")
        else:
            explanation = catalog.explained(name, text, facts).prefixed(f"unchanged{since}: ")
            tick.report.note(name, "still waiting", explanation)


def end_tick(conn: psycopg.Connection, tick: Tick) -> None:
    """Record the tick, and how long it took; the marks it leaves are committed before it ends (the next tick reads
    them only if this one says so)."""
    done = {**tick.params, "seconds": time.monotonic() - tick.started}
    if tick.batches:
        conn.execute(sql.END_TICK, {**done, "left": sorted(tick.left), "batches": sorted(tick.batches)})
    else:  # every task left marked has a mark of its own
        conn.execute(sql.SAVE_TICK, done)
