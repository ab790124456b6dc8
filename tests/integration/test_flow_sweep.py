"""Flow-control rows bounded by the keys in use: the sweep removes idle keys, and a removed key comes back with its
limits exactly, whoever takes it meanwhile."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import UTC, datetime

import psycopg
import pytest
from intervals import most_at_once
from plans import rows_read
from receiver import Receiver
from running import Running
from waiting import wait_until

from cmb_dagster import flow
from cmb_dagster.callbacks import CallbackClient, CallbackSettings, CallbackWorker
from cmb_dagster.database import Database
from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings, emit_many
from cmb_dagster.eventqueue import sql as eventqueue_sql
from cmb_dagster.eventqueue.worker import STAGE_LIMIT
from cmb_dagster.flow import FlowLimits, RateLimit
from cmb_dagster.flow import sql as flow_sql

SETTINGS = WorkerSettings(listen=False, sweep_interval=0.1, batch_size=100)
SLOW = RateLimit(rate=1, per=3600, burst=1)  # a bucket taken from is not full again during a test


HOLDER = "worker-1"


def take(conn: psycopg.Connection, scope: str, key: str, count: int, *, ttl: float) -> flow.Grant:
    """What one worker is granted of ``count`` starts of (scope, key)."""
    return flow.take(conn, {(scope, key): count}, holder=HOLDER, ttl=ttl)[(scope, key)]


def _register(db: Database, **limits: FlowLimits) -> None:
    with db.connect(autocommit=True) as conn:
        flow.register(conn, limits)


def _rows(conn: psycopg.Connection) -> tuple[int, int]:
    return conn.execute("SELECT (SELECT count(*) FROM flow_buckets), (SELECT count(*) FROM flow_slots)").fetchone()


def _keys(conn: psycopg.Connection) -> set[tuple[str, str]]:
    rows = conn.execute("SELECT scope, key FROM flow_buckets UNION SELECT scope, key FROM flow_slots").fetchall()
    return {tuple(row) for row in rows}


def _sweep_all(conn: psycopg.Connection) -> tuple[int, int]:
    """One walk over every key: (keys removed, batches)."""
    removed, batches, start = 0, 0, ("", "")
    while True:
        swept = flow.sweep(conn, start=start)
        removed, batches = removed + swept.removed, batches + 1
        if swept.next is None:
            return removed, batches
        start = swept.next


def _waiting_for_a_lock(db: Database) -> bool:
    """Whether a session of the test's database waits for a lock (asked on a connection of its own: a transaction
    reads pg_stat_activity once)."""
    with db.connect(autocommit=True) as conn:
        query = "SELECT FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        return conn.execute(query).fetchone() is not None


def _limited_worker(db: Database, seen: list) -> EventWorker:
    registry = HandlerRegistry()
    registry.add("limited", seen.append, key="value.tenant", concurrency=2, rate_limit="1000/s")
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
    worker.register()
    return worker


def _read(conn: psycopg.Connection, query: str, params: dict) -> dict:
    with conn.transaction(force_rollback=True):
        (plan,) = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query, params).fetchone()[0]
    return plan["Plan"]


def test_after_100000_keys_taken_once_the_sweep_leaves_the_rows_of_the_keys_in_use_through_indexes(db):
    seen: list = []
    worker = _limited_worker(db, seen)
    emit_many([{"namespace": "ns", "handler": "limited", "value": {"tenant": f"t{i}"}} for i in range(2_000)], db=db)
    wait_until(lambda: worker.run_once() == 0 and len(seen) == 2_000, timeout=60, what="the events handled")
    worker.close()
    _register(
        db,
        **{"bulk/rate": FlowLimits(rate_limit="1000/s"), "bulk/slots": FlowLimits(rate_limit="1000/s", concurrency=64)},
        slow=FlowLimits(rate_limit=SLOW),
    )
    with db.connect(autocommit=True) as conn:
        for first in range(0, 97_000, 10_000):
            flow.ensure(conn, [("bulk/rate", f"k{i}") for i in range(first, min(first + 10_000, 97_000))])
        flow.ensure(conn, [("bulk/slots", f"k{i}") for i in range(3_000)])
        for key in ("k1", "k2", "k3"):  # in use: a slot held, a bucket not full again
            assert take(conn, "bulk/slots", key, 1, ttl=600).count == 1
            assert take(conn, "slow", key, 1, ttl=600).count == 1
        assert _rows(conn) == (102_003, 3_000 * 64 + 2_000 * 2)
        conn.execute("SET jit = off")
        # without planner statistics (the tables were never analyzed), each statement reads its keys' rows alone
        walk = {"scope": "bulk/slots", "key": "", "limit": 100}
        rows = conn.execute(flow_sql.SWEEP_LOCK, walk).fetchall()  # autocommit: the locks end with it
        idle = [row for row in rows if row[0] == "idle"]
        assert len(idle) == 99  # k1 held (k2 and k3 come after k1999)
        delete = {name: [row[i] for row in idle] for i, name in enumerate(("scopes", "keys", "buckets", "slots"), 1)}
        take_one = {"scopes": ["bulk/slots"], "keys": ["k5"], "want": [3], "slots": [3], "holder": HOLDER, "ttl": 60}
        take_many = {"scopes": ["bulk/slots"] * 3, "keys": ["k5", "k6", "k7"], "want": [2] * 3, "slots": [2] * 3}
        emit_many([{"namespace": "ns", "handler": "limited", "value": {"tenant": f"t{i}"}} for i in range(300)], db=db)
        claim = {
            "handlers": ["limited"],
            "limit": 100,
            "start_now": 100,
            "idle": True,
            "full": False,
            "stage_limit": STAGE_LIMIT,
            "done": [],
            "done_locked": [],
            "owner": "a worker",
            "fence": 1,
            "holder": "a worker",
        }
        for query, params, most in [
            (flow_sql.SWEEP_LOCK, walk, 101 * (3 * 64 + 4)),
            (flow_sql.SWEEP_DELETE, delete, 99 * (2 * 64 + 4)),
            (flow_sql.TAKE, take_one, 4 * 64),
            (flow_sql.ENSURE, {"scopes": ["bulk/slots"], "keys": ["k5"]}, 4 * 64),
            (flow_sql.TAKE, {**take_many, "holder": HOLDER, "ttl": 60}, 3 * 4 * 64),
            (eventqueue_sql.CLAIM_DUE[True], claim, 2_000 + 1_000),  # keys at a limit: of the handler's 2,000
        ]:
            plan = _read(conn, query, params)
            read = rows_read(plan, "flow_buckets") + rows_read(plan, "flow_slots")
            assert read <= most, json.dumps(plan, indent=1)
        conn.execute("DELETE FROM eventqueue_events")
        removed, batches = _sweep_all(conn)
        assert (removed, batches) == (102_003 - 6, 205)  # 102,003 keys walked 500 at a time
        assert _rows(conn) == (6, 3 * 64)
        assert _keys(conn) == {(scope, key) for scope in ("bulk/slots", "slow") for key in ("k1", "k2", "k3")}


def test_the_sweep_never_removes_a_key_with_a_slot_held_or_a_bucket_not_full_again(db):
    _register(db, slots=FlowLimits(concurrency=2, rate_limit="1000/s"), slow=FlowLimits(rate_limit=SLOW))
    with db.connect(autocommit=True) as conn:
        assert take(conn, "slots", "held", 1, ttl=600).slots == [0]
        assert take(conn, "slots", "released", 1, ttl=600).slots == [0]
        flow.release(conn, [("slots", "released", 0)], holder=HOLDER)
        assert take(conn, "slots", "expired", 1, ttl=0.01).slots == [0]  # its holder died
        assert take(conn, "slow", "taken", 1, ttl=600).count == 1
        flow.ensure(conn, [("slow", "full")])
        expired = "SELECT now() > expires_at FROM flow_slots WHERE key = 'expired' AND slot = 0"
        wait_until(lambda: conn.execute(expired).fetchone()[0], what="the slot's expiry")
        assert _sweep_all(conn)[0] == 3
        assert _keys(conn) == {("slots", "held"), ("slow", "taken")}
        assert take(conn, "slots", "held", 2, ttl=600).slots == [1]
        assert take(conn, "slow", "taken", 1, ttl=600).count == 0
        assert take(conn, "slots", "expired", 3, ttl=600).slots == [0, 1]


def _together(db: Database, actions: list) -> list:
    """What each of ``actions`` (a function of a connection) returned, run at once in threads of their own, each on
    its own connection."""
    barrier = threading.Barrier(len(actions))
    results: list = [None] * len(actions)

    def run(i: int) -> None:
        with db.connect(autocommit=True) as conn:
            barrier.wait()
            results[i] = actions[i](conn)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(actions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_a_key_removed_while_idle_keeps_its_limits_exactly_with_concurrent_takers(db):
    _register(db, slots=FlowLimits(concurrency=3), rated=FlowLimits(rate_limit=RateLimit(rate=1, per=3600, burst=5)))
    with db.connect(autocommit=True) as conn:
        flow.ensure(conn, [("slots", "k"), ("rated", "k")])
        for round_ in range(3):
            assert flow.sweep(conn).removed == (2 if round_ == 0 else 1), round_  # removed while idle
            assert _keys(conn) == ({("rated", "k")} if round_ else set())
            grants = _together(db, [lambda c, r=round_: take(c, "slots", "k", 1, ttl=600)] * 8)
            assert sorted(s for g in grants for s in g.slots) == [0, 1, 2]  # each slot once, all of them
            flow.release(conn, [("slots", "k", slot) for slot in range(3)], holder=HOLDER)
            tokens = _together(db, [lambda c: take(c, "rated", "k", 2, ttl=600).count] * 8)
            assert sum(tokens) == (5 if round_ == 0 else 0)  # the bucket taken empty is never removed, nor refilled
        assert _rows(conn) == (1, 3)


def test_takers_racing_a_sweep_of_their_idle_key_never_share_a_slot(db):
    _register(db, slots=FlowLimits(concurrency=2))
    with db.connect(autocommit=True) as conn:
        flow.ensure(conn, [("slots", "k")])
        for round_ in range(20):
            swept, *grants = _together(
                db,
                [flow.sweep]
                + [
                    lambda c, holder=f"{round_}-{i}": flow.take(c, {("slots", "k"): 1}, holder=holder, ttl=600)[
                        ("slots", "k")
                    ]
                    for i in range(4)
                ],
            )
            slots = sorted(s for g in grants for s in g.slots)
            assert len(slots) == len(set(slots)) and set(slots) <= {0, 1}, (round_, swept, grants)
            for i, grant in enumerate(grants):
                for slot in grant.slots:
                    flow.release(conn, [("slots", "k", slot)], holder=f"{round_}-{i}")
            rows = conn.execute("SELECT count(*), coalesce(max(slot) + 1, 0) FROM flow_slots").fetchone()
            assert rows[0] == rows[1], round_  # 0..n-1, or none
        assert sorted(take(conn, "slots", "k", 3, ttl=600).slots) == [0, 1]


@pytest.mark.parametrize(
    "limits",
    [FlowLimits(concurrency=2), FlowLimits(rate_limit=RateLimit(rate=1, per=3600, burst=2))],
    ids=["slots", "tokens"],
)
@pytest.mark.parametrize("engine", ["flow", "eventqueue", "callbacks"])
def test_a_take_meeting_a_sweep_of_its_key_waits_for_it_and_takes_the_key_made_again(db, engine, limits):
    """A take that finds its idle key's rows locked by a sweep (its free slots, or its bucket) waits for the sweep and
    takes the key made again: it is not turned away as if the key were at its limit."""
    if engine == "flow":
        _register(db, s=limits)
        scope = "s"

        def take_one() -> int:
            with db.connect(autocommit=True) as conn:
                return take(conn, "s", "k", 1, ttl=60).count

    elif engine == "eventqueue":
        seen: list = []
        registry = HandlerRegistry()
        registry.add(
            "limited", seen.append, key="value.tenant", **limits.model_dump(exclude_none=True, exclude={"version"})
        )
        worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
        worker.register()
        emit_many([{"namespace": "ns", "handler": "limited", "value": {"tenant": "k"}}], db=db)
        scope = "eventqueue/limited"

        def take_one() -> int:
            worker.run_once()
            return len(seen)

    else:
        settings = CallbackSettings(per_host=limits)
        _register(db, **settings.flow_scopes())
        scope = "callbacks/host"

        async def gate_take() -> int:  # the callbacks' take: on an async connection
            async with await psycopg.AsyncConnection.connect(db.url, **db.connect_kwargs, autocommit=True) as conn:
                taken = await flow.take_async(conn, {(scope, "k"): 1}, holder=HOLDER, ttl=60)
            return taken[(scope, "k")].count

        def take_one() -> int:
            return asyncio.run(gate_take())

    granted: list[int] = []
    with db.connect(autocommit=True) as sweeping:
        flow.ensure(sweeping, [(scope, "k")])
        with sweeping.transaction():
            (locked,) = sweeping.execute(flow_sql.SWEEP_LOCK, {"scope": "", "key": "", "limit": 10}).fetchall()
            taker = threading.Thread(target=lambda: granted.append(take_one()))
            taker.start()
            wait_until(lambda: granted or _waiting_for_a_lock(db), what="the taker done or waiting")
            params = {"scopes": [scope], "keys": ["k"], "buckets": [locked[3]], "slots": [locked[4]]}
            assert sweeping.execute(flow_sql.SWEEP_DELETE, params).fetchone()[0] == 1
        taker.join()
    assert granted == [1]


def test_a_key_made_again_while_a_sweep_deletes_it_comes_back_whole(db):
    """ENSURE, adding slot rows after the key's top one, waits for a sweep that locked them: the key is then
    made again from slot 0 (otherwise the sweep would delete slots 0-63 under the new 64-127)."""
    _register(db, slots=FlowLimits(concurrency=128))
    sweeping, making = db.connect(autocommit=True), db.connect(autocommit=True)
    try:
        with sweeping.transaction():
            flow.ensure(sweeping, [("slots", "k")])
        made, swept = threading.Event(), threading.Event()

        def make() -> None:
            with making.transaction():
                flow.ensure(making, [("slots", "k")])  # a take found all 64 slots taken: 64 more
                made.set()
                swept.wait(10)

        with sweeping.transaction():
            locked = sweeping.execute(flow_sql.SWEEP_LOCK, {"scope": "", "key": "", "limit": 10}).fetchall()
            assert locked == [("idle", "slots", "k", False, 64)]
            thread = threading.Thread(target=make)
            thread.start()
            wait_until(lambda: made.is_set() or _waiting_for_a_lock(db), what="the maker done or waiting")
            params = {"scopes": ["slots"], "keys": ["k"], "buckets": [False], "slots": [64]}
            sweeping.execute(flow_sql.SWEEP_DELETE, params)
        swept.set()
        thread.join()
        slots = sweeping.execute("SELECT count(*), min(slot), max(slot) FROM flow_slots").fetchone()
        assert slots == (64, 0, 63)
    finally:
        sweeping.close()
        making.close()


def test_a_worker_loop_removes_idle_keys_and_keeps_those_in_use(db, monkeypatch):
    monkeypatch.setattr(flow, "SWEEP_INTERVAL", 0.0)
    monkeypatch.setattr(flow, "SWEEP_PAUSE", 0.0)
    seen: list = []
    worker = _limited_worker(db, seen)
    emit_many([{"namespace": "ns", "handler": "limited", "value": {"tenant": f"t{i}"}} for i in range(1_200)], db=db)
    _register(db, slow=FlowLimits(rate_limit=SLOW))
    with db.connect(autocommit=True) as conn:
        assert take(conn, "slow", "in use", 1, ttl=600).count == 1
        with Running(worker):
            wait_until(lambda: len(seen) == 1_200 and _keys(conn) == {("slow", "in use")}, timeout=60, what="a sweep")


def test_calls_to_a_host_whose_key_was_removed_keep_to_its_limit(db, monkeypatch):
    monkeypatch.setattr(flow, "SWEEP_INTERVAL", 0.0)
    monkeypatch.setattr(flow, "SWEEP_PAUSE", 0.0)
    calls: list[tuple[float, float]] = []

    def answer(request: object) -> tuple[int, bytes]:
        started = time.monotonic()
        time.sleep(0.1)
        calls.append((started, time.monotonic()))
        return 200, b"ok"

    settings = CallbackSettings(
        poll_interval=0.1, allowed_hosts=["127.0.0.0/8"], per_host=FlowLimits(concurrency=2), lookahead=1
    )
    with (
        Receiver(answer) as receiver,
        CallbackClient(db, settings) as client,
        db.connect(autocommit=True) as conn,
        Running(CallbackWorker(db, settings)),
    ):
        for batch in range(3):
            at = datetime.now(UTC)
            client.create_many(
                [
                    {
                        "owner_client_id": "o",
                        "group_key": "g",
                        "event_key": f"{batch}-{i}",
                        "run_at": at,
                        "cb_url": f"{receiver.url}/cb",
                    }
                    for i in range(6)
                ]
            )
            wait_until(lambda b=batch: len(calls) == 6 * (b + 1), timeout=30, what="the calls")
            wait_until(lambda: not _keys(conn), timeout=30, what="the host's key removed once idle")
    assert most_at_once(calls) <= 2


def test_an_async_take_makes_a_removed_key_in_one_go(db):
    """The async take (the callbacks' gate's, several keys in one statement) makes a key's rows when it finds them
    missing, and takes again, in the same transaction: a key removed while idle is taken as a full one is."""
    settings = CallbackSettings(per_host=FlowLimits(concurrency=2, rate_limit="100/s"))
    _register(db, **settings.flow_scopes())

    async def take_async() -> dict:
        async with await psycopg.AsyncConnection.connect(db.url, **db.connect_kwargs, autocommit=True) as conn:
            return await flow.take_async(conn, {("callbacks/host", "h"): 3}, holder=HOLDER, ttl=60)

    with db.connect(autocommit=True) as conn:
        for _ in range(2):
            assert asyncio.run(take_async()) == {("callbacks/host", "h"): flow.Grant(2, [0, 1], None)}
            conn.execute("UPDATE flow_slots SET holder = NULL, expires_at = '-infinity'")
            conn.execute("UPDATE flow_buckets SET refilled_at = now() - interval '1 hour'")  # full
            assert flow.sweep(conn).removed == 1


@pytest.mark.parametrize("limit", [1, 2])
def test_a_walk_in_small_batches_visits_every_key_once(db, limit):
    _register(db, a=FlowLimits(concurrency=1), b=FlowLimits(rate_limit="10/s"), c=FlowLimits(rate_limit=SLOW))
    with db.connect(autocommit=True) as conn:
        flow.ensure(conn, [("a", "1"), ("a", "2"), ("b", "1"), ("b", "3"), ("c", "1")])
        assert take(conn, "c", "1", 1, ttl=60).count == 1
        start, removed, batches = ("", ""), 0, 0
        while start is not None:
            swept = flow.sweep(conn, start=start, limit=limit)
            removed, batches, start = removed + swept.removed, batches + 1, swept.next
        assert (removed, batches) == (4, -(-5 // limit))
        assert _keys(conn) == {("c", "1")}


def test_a_sweep_leaves_a_key_whose_rows_were_added_to_after_it_locked_them(db):
    _register(db, slots=FlowLimits(concurrency=128))
    with db.connect(autocommit=True) as sweeping, db.connect(autocommit=True) as other:
        flow.ensure(sweeping, [("slots", "k")])
        with sweeping.transaction():
            (locked,) = sweeping.execute(flow_sql.SWEEP_LOCK, {"scope": "", "key": "", "limit": 10}).fetchall()
            other.execute("INSERT INTO flow_slots (scope, key, slot) VALUES ('slots', 'k', 64)")
            params = {"scopes": ["slots"], "keys": ["k"], "buckets": [locked[3]], "slots": [locked[4]]}
            assert sweeping.execute(flow_sql.SWEEP_DELETE, params).fetchone()[0] == 0
        assert sweeping.execute("SELECT count(*), min(slot), max(slot) FROM flow_slots").fetchone() == (65, 0, 64)


def test_making_a_keys_rows_never_waits_for_a_taker_holding_its_top_slot(db):
    _register(db, slots=FlowLimits(concurrency=128))
    with db.connect(autocommit=True) as taking, db.connect(autocommit=True) as making:
        assert take(taking, "slots", "k", 63, ttl=600).count == 63
        making.execute("SET lock_timeout = '2s'")
        with taking.transaction():
            assert take(taking, "slots", "k", 1, ttl=600).slots == [63]  # its top slot, not committed yet
            flow.ensure(making, [("slots", "k")])
        assert making.execute("SELECT count(*) FROM flow_slots").fetchone()[0] == 128
