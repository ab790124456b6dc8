"""Keys, fair turns, priorities and limits of the event queue, one worker in the test process."""

import json
import time

import pytest
from plans import rows_read
from waiting import wait_until

from cmb_dagster.eventqueue import (
    EventQueueOptions,
    EventWorker,
    HandlerRegistry,
    InvalidEventQueueInput,
    WorkerSettings,
    emit,
    emit_many,
    sql,
    status,
)
from cmb_dagster.eventqueue.worker import STAGE_LIMIT

SETTINGS = WorkerSettings(
    listen=False, sweep_interval=0.1, batch_size=100, worker_concurrency=1
)  # calls in claim order
CLAIM_PARAMETERS = {
    "handlers": ["plain", "tenants", "limited"],
    "limit": 100,
    "start_now": 10,
    "idle": True,
    "full": False,
    "stage_limit": STAGE_LIMIT,
    "owner": "a worker",
    "holder": "a worker",
    "fence": 1,
    "done": [],
    "done_locked": [],
}


@pytest.fixture
def seen():
    return []


@pytest.fixture
def worker(db, seen):
    registry = HandlerRegistry()
    registry.add("tenants", seen.append, key="value.tenant")
    registry.add("plain", seen.append)
    registry.add("limited", seen.append, key="value.tenant", concurrency=1, rate_limit="1000/s")
    w = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
    w.register()
    yield w
    w.close()


def test_a_key_with_one_event_starts_within_one_batch_behind_another_keys_10000(db, worker, seen):
    emit_many(
        [{"namespace": "ns", "handler": "tenants", "value": {"tenant": "a", "n": n}} for n in range(10_000)], db=db
    )
    late = emit("ns", "tenants", {"tenant": "b"}, db=db)
    worker.run_once()
    assert late in [e.id for e in seen[: SETTINGS.batch_size]]
    assert [e.key for e in seen if e.id == late] == ["b"]
    a_order = [e.value["n"] for e in seen if e.key == "a"]
    assert a_order == sorted(a_order)  # each key's events keep their order


def test_keys_take_turns_and_each_keys_events_keep_their_order(db, worker, seen):
    emit_many([{"namespace": "ns", "handler": "tenants", "value": {"tenant": "a", "n": i}} for i in range(50)], db=db)
    emit_many([{"namespace": "ns", "handler": "tenants", "value": {"tenant": "b", "n": i}} for i in range(50)], db=db)
    worker.run_once()
    assert [e.key for e in seen[:10]] in (["a", "b"] * 5, ["b", "a"] * 5)
    assert [e.value["n"] for e in seen if e.key == "b"] == list(range(50))


def test_a_high_priority_event_behind_10000_low_ones_starts_in_the_next_batch(db, worker, seen):
    emit_many([{"namespace": "ns", "handler": "plain", "value": i} for i in range(10_000)], db=db)
    urgent = emit("ns", "plain", "urgent", priority=5, db=db)
    worker.run_once()
    assert seen[0].id == urgent and seen[0].priority == 5
    assert [e.value for e in seen[1:4]] == [0, 1, 2]


def test_a_delayed_event_takes_its_turn_when_it_comes_due(db, worker, seen):
    delayed = emit("ns", "tenants", {"tenant": "b"}, delay=3600, db=db)
    emit_many([{"namespace": "ns", "handler": "tenants", "value": {"tenant": "a"}} for _ in range(300)], db=db)
    worker.run_once()
    assert delayed not in [e.id for e in seen]
    with db.connection() as conn:  # it comes due
        conn.execute("UPDATE eventqueue_events SET delay_until = now(), visible_at = now() WHERE id = %s", [delayed])
    seen.clear()
    worker.run_once()  # its first claim finds it came due, the next one stages it at the head of the round-robin
    assert delayed in [e.id for e in seen[: 2 * SETTINGS.worker_concurrency]]


def test_a_key_at_concurrency_1_never_starts_an_event_ahead_of_one_another_claim_holds(db, worker, seen):
    first, second = emit_many(
        [{"namespace": "ns", "handler": "limited", "value": {"tenant": "a", "n": n}} for n in (0, 1)], db=db
    )
    with db.connection() as conn:  # another worker's claim holds the key's first event right now
        conn.execute("SELECT 1 FROM eventqueue_events WHERE id = %s FOR UPDATE", (first,))
        worker.run_once()
        assert seen == []  # its second event waits for the first
    worker.run_once()
    assert [e.id for e in seen] == [first, second]


def test_status_shows_each_handlers_key_and_limits_and_each_limited_keys_use(db, worker, seen):
    emit_many([{"namespace": "ns", "handler": "limited", "value": {"tenant": t}} for t in "ab"], db=db)
    worker.run_once()
    now = status(db)
    limited = next(h for h in now.handlers if h.handler == "limited")
    assert (limited.key, limited.concurrency, limited.rate_per_second) == ("value.tenant", 1, 1000.0)
    assert {(k.key, k.in_flight) for k in now.keys} == {("a", 0), ("b", 0)}
    assert all(k.tokens is not None and 0 <= k.tokens <= 1000 for k in now.keys)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"key": "value..x"}, "key"),
        ({"key": "namespace.x"}, "key"),
        ({"key": "tenant"}, "key"),
        ({"rate_limit": "fast"}, "rate_limit"),
        ({"concurrency": 0}, "concurrency"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(config, field):
    with pytest.raises(InvalidEventQueueInput, match=field):
        HandlerRegistry().add("h", print, **config)


@pytest.mark.parametrize("priority", [1001, -1001, 1.5, True, "1"])
def test_a_bad_priority_is_refused_and_nothing_is_written(db, worker, priority):
    with pytest.raises(InvalidEventQueueInput, match="priority"):
        emit("ns", "plain", 1, priority=priority, db=db)
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0] == 0


@pytest.mark.parametrize("statistics", [False, True], ids=["without-statistics", "analyzed"])
def test_the_claim_reads_a_batch_through_indexes_over_a_100000_event_backlog(db, worker, statistics):
    emit_many([{"namespace": "ns", "handler": "plain", "value": i} for i in range(50_000)], db=db)
    tenants = [{"namespace": "ns", "handler": "tenants", "value": {"tenant": str(i % 100)}} for i in range(50_000)]
    emit_many(tenants, db=db)
    emit("ns", "plain", 1, delay=3600, db=db)
    with db.connect(autocommit=True) as conn:
        if statistics:
            conn.execute("VACUUM ANALYZE eventqueue_events")
        conn.execute("SET jit = off")
        for query in (sql.CLAIM_DUE[True], sql.CLAIM_DUE[False], *sql.STAGE.values(), sql.NEXT_VISIBLE):
            with conn.transaction(force_rollback=True):
                (plan,) = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query, CLAIM_PARAMETERS).fetchone()[0]
            assert rows_read(plan["Plan"], "eventqueue_events") < 1_000, json.dumps(plan, indent=1)
    # an emit reads its keys' last turns through the index, once per key (not per event), in a statement planned
    # for its values each time, as a prepared one would not be (psycopg prepares a statement run five times)
    read = "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables WHERE relname = %s"
    with db.connect() as conn:
        for _ in range(6):
            with conn.transaction(force_rollback=True):
                before = conn.execute(read, ["eventqueue_events"]).fetchone()[0]
                emit_many([{"namespace": "ns", "handler": "plain", "value": i} for i in range(1000)], conn=conn)
                emit_many(tenants[:1000], conn=conn)
                assert conn.execute(read, ["eventqueue_events"]).fetchone()[0] - before < 1_000


# -- debounce -------------------------------------------------------------------------------------------------


@pytest.fixture
def batches():
    return []


def debouncing(db, batches, **config) -> EventWorker:
    registry = HandlerRegistry()
    registry.add("digest", batches.append, key="value.user", **config)
    w = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
    w.register()
    return w


def test_events_of_one_key_within_the_window_make_one_call_with_all_of_them_in_order(db, batches):
    worker = debouncing(db, batches, debounce=0.5)
    ids = []
    for n in range(100):
        ids += emit_many([{"namespace": "ns", "handler": "digest", "value": {"user": "u", "n": n}}], db=db)
    other = emit("ns", "digest", {"user": "v"}, db=db)
    assert worker.run_once() == 0  # the window is open
    wait_until(lambda: worker.run_once() and batches, timeout=10, what="the batches called")
    worker.run_once()
    assert sorted(len(b) for b in batches) == [1, 100]
    (batch,) = [b for b in batches if len(b) == 100]
    assert [e.id for e in batch] == ids and [e.value["n"] for e in batch] == list(range(100))
    assert [e.id for b in batches if len(b) == 1 for e in b] == [other]
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0] == 0


def test_with_max_wait_a_batch_is_called_while_events_keep_coming(db, batches):
    worker = debouncing(db, batches, debounce=600, max_wait=1.0)  # the window alone closes only after 10 minutes
    first = [emit("ns", "digest", {"user": "u"}, db=db) for _ in range(3)]

    def called() -> bool:
        emit("ns", "digest", {"user": "u"}, db=db)  # events keep coming
        worker.run_once()
        return bool(batches)

    wait_until(called, 60, "a call while events kept coming", interval=0.1)
    assert [e.id for e in batches[0][:3]] == first


def test_a_batch_is_as_large_as_max_batch_at_most(db, batches):
    worker = debouncing(db, batches, debounce=0.2, max_batch=30)
    emit_many([{"namespace": "ns", "handler": "digest", "value": {"user": "u", "n": n}} for n in range(70)], db=db)
    wait_until(lambda: worker.run_once() is not None and sum(map(len, batches)) == 70, timeout=10, what="all called")
    assert sorted(len(b) for b in batches) == [10, 30, 30]


def test_debounce_settings_are_checked():
    with pytest.raises(InvalidEventQueueInput, match="max_wait"):
        HandlerRegistry().add("h", print, max_wait=5)
    with pytest.raises(InvalidEventQueueInput, match="debounce"):
        HandlerRegistry().add("h", print, debounce=-1)


def test_the_handlers_asset_shows_its_limits_and_their_use(db, worker, seen):
    from cmb_dagster.eventqueue.dagster_defs import handler_observation

    emit_many([{"namespace": "ns", "handler": "limited", "value": {"tenant": t}} for t in "ab"], db=db)
    worker.run_once()
    with db.connection() as conn:  # an event of key a in flight
        conn.execute("UPDATE flow_slots SET holder = '1', expires_at = now() + interval '1 minute' WHERE key = 'a'")
    now = status(db)
    limited = next(h for h in now.handlers if h.handler == "limited")
    metadata = handler_observation(limited, keys=now.keys).metadata
    assert metadata["key"].value == "value.tenant"
    assert metadata["limits"].value == "1000/s (burst 1000), 1 in flight"
    assert (metadata["in_flight"].value, metadata["keys_at_limit"].value) == (1, 1)
    plain = next(h for h in now.handlers if h.handler == "plain")
    assert "limits" not in handler_observation(plain).metadata


def test_a_claim_meeting_keys_without_flow_rows_starts_no_more_calls_than_its_free_slots(db):
    """A claim that finds limited keys whose flow rows do not exist yet makes them and claims again: the two claims
    together start at most the worker's free slots, the others wait their turn."""
    started = []
    registry = HandlerRegistry()
    registry.add("slow", lambda event: started.append(event.key) or time.sleep(0.2), key="value.k", concurrency=50)
    settings = WorkerSettings(listen=False, sweep_interval=0.1, batch_size=100, worker_concurrency=4)
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=settings))
    worker.register()
    try:
        emit("ns", "slow", {"k": "known"}, db=db)
        worker.run_once()  # the key "known" has its flow rows now
        emit_many([{"namespace": "ns", "handler": "slow", "value": {"k": k}} for k in ["known", "new"] * 4], db=db)
        worker.run_once()
        assert sorted(started[1:]) == ["known"] * 4 + ["new"] * 4
    finally:
        worker.close()
