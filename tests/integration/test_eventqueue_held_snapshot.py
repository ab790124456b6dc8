"""While another session holds a snapshot, no entry of an event claimed since can be removed from the indexes. An
emit and a claim read from their priority's turn floors up, and a worker about to sleep reads only the waiting events
no worker holds, so what they touch does not grow with the events handled meanwhile; an event whose transaction
commits long after its emit (below the floors by then) is still handled."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
from running import Running
from waiting import wait_until

from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings, emit, sql
from cmb_dagster.eventqueue.queue import DEFAULT_MODIFIER, DEFAULT_MODULE, MAX_BATCH_BYTES
from cmb_dagster.eventqueue.worker import FULL_CLAIM_EVERY

SETTINGS = WorkerSettings(sweep_interval=0.1)


class Handled:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: set[int] = set()

    def __call__(self, event) -> None:
        with self.lock:
            self.ids.add(event.id)

    def all_of(self, ids) -> bool:
        with self.lock:
            return set(ids) <= self.ids


@pytest.fixture
def handled():
    return Handled()


@pytest.fixture
def worker(db, handled):
    registry = HandlerRegistry()
    registry.add("plain", handled)
    w = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
    w.register()
    yield w
    w.close()


@contextmanager
def held_snapshot(db):
    """Another session in REPEATABLE READ that has read once: no row that dies meanwhile can be removed."""
    with db.connect(autocommit=True) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        yield


def produce(db, handled, n: int, every: float = 0.0) -> list[int]:
    """``n`` events, one transaction each (``every`` seconds apart), all handled."""
    ids = []
    for _ in range(n):
        ids.append(emit("ns", "plain", 1, db=db))
        time.sleep(every)
    wait_until(lambda: handled.all_of(ids), timeout=60, what=f"{n} events handled")
    return ids


def buffers(plan: dict) -> int:
    """Shared buffers the executed plan's nodes on eventqueue_events (its heap and indexes) touched."""
    ours = plan.get("Relation Name") == "eventqueue_events"
    own = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"] if ours else 0
    return own + sum(buffers(child) for child in plan.get("Plans", ()))


def explained(db, query: str, params: dict) -> int:
    with db.connection() as conn, conn.transaction(force_rollback=True):
        [[[plan]]] = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params).fetchall()
    return buffers(plan["Plan"])


def emit_claim_and_sleep_buffers(db) -> tuple[int, int, int]:
    """Buffers of eventqueue_events one emit of one event, one (empty) claim and one look for the next waiting event
    (before a worker sleeps) touch, planned with the statistics of a vacuum the snapshot held back (the table taken
    for nearly empty)."""
    with db.connect(autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE eventqueue_events")
    emitted = {
        "namespaces": ["ns"], "modules": [DEFAULT_MODULE], "handlers": ["plain"], "modifiers": [DEFAULT_MODIFIER],
        "values": ["1"], "delays": [0.0], "priorities": [0], "payload": "plain", "max_batch_bytes": MAX_BATCH_BYTES,
    }  # fmt: skip
    claim = {
        "handlers": ["plain"], "limit": 100, "start_now": 10, "idle": True, "full": False, "owner": "probe",
        "holder": "probe", "fence": 1, "done": [], "done_locked": [],
    }  # fmt: skip
    sleep = {"handlers": ["plain"]}
    return (
        explained(db, sql.EMIT, emitted),
        explained(db, sql.CLAIM_DUE[False], claim),
        explained(db, sql.NEXT_VISIBLE, sleep),
    )


def test_an_emit_a_claim_and_a_sleep_touch_as_much_after_3000_events_handled_under_a_held_snapshot_as_after_100(
    db, worker, handled
):
    with held_snapshot(db), Running(worker):
        produce(db, handled, 100)
        moved_past(db, handled)
        few = emit_claim_and_sleep_buffers(db)
        produce(db, handled, 3000)
        moved_past(db, handled)
        many = emit_claim_and_sleep_buffers(db)
    # the entries of the last two seconds' events at most (their dead versions kept), not one per event handled
    assert all(m <= f + 60 for f, m in zip(few, many, strict=True)), (few, many)


def moved_past(db, handled) -> None:
    """A few events at a time until the claims' floor of priority 0 is past every event handled before."""
    with db.connection() as conn:
        last = conn.execute("SELECT max(id) FROM eventqueue_events").fetchone()[0] or 0
        last = max(last, conn.execute("SELECT last_value FROM eventqueue_events_id_seq").fetchone()[0])
    wait_until(lambda: floor_past(db, handled, last), timeout=60, what="the floor past the events handled")


def test_an_event_committed_long_after_its_emit_is_handled_once_the_floors_have_moved_past_its_turn(
    db, worker, handled
):
    with Running(worker), db.connect(autocommit=True) as late:
        with late.transaction():
            late_id = emit("ns", "plain", "late", conn=late)
            turn = late.execute("SELECT turn FROM eventqueue_events WHERE id = %s", [late_id]).fetchone()[0]
            produce(db, handled, 200)
            wait_until(lambda: floor_past(db, handled, turn), timeout=30, what="the floor past the late event's turn")
        committed = time.monotonic()
        wait_until(lambda: handled.all_of([late_id]), timeout=FULL_CLAIM_EVERY + 30, what="the late event handled")
        assert time.monotonic() - committed < FULL_CLAIM_EVERY + 5


def floor_past(db, handled, turn: int) -> bool:
    """After a few more events handled: whether claims of priority 0 read from above ``turn``."""
    produce(db, handled, 5, every=0.05)
    with db.connection() as conn:
        row = conn.execute("SELECT floor FROM eventqueue_turn_floors WHERE priority = 0").fetchone()
    return row is not None and row[0] > turn
