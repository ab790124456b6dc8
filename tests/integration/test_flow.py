"""The shared flow control on real Postgres: token buckets and concurrency slots per key, across connections."""

from __future__ import annotations

import threading
import time

import pytest

from cmb_dagster import flow
from cmb_dagster.database import Database
from cmb_dagster.errors import InvalidInput
from cmb_dagster.flow import FlowLimits, RateLimit


def _register(db: Database, **limits: FlowLimits) -> None:
    with db.connect(autocommit=True) as conn:
        flow.register(conn, limits)


def test_a_concurrency_limit_grants_free_slots_only(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=2))
    with db.connect(autocommit=True) as conn:
        first = flow.take(conn, "s", "a", ["1", "2", "3"], ttl=60)
        assert (first.count, first.slots) == (2, [0, 1])
        assert flow.take(conn, "s", "a", ["4"], ttl=60).count == 0
        assert flow.take(conn, "s", "b", ["5"], ttl=60).count == 1  # another key has slots of its own
        flow.release(conn, "s", "a", {"1": 0})
        assert flow.take(conn, "s", "a", ["4", "6"], ttl=60).slots == [0]
        flow.release(conn, "s", "a", {"2": 0})  # not its slot: nothing is freed
        assert flow.take(conn, "s", "a", ["7"], ttl=60).count == 0


def test_a_slot_whose_holder_stopped_renewing_frees_itself_after_its_ttl(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=1))
    with db.connect(autocommit=True) as conn:
        assert flow.take(conn, "s", "a", ["1"], ttl=0.5).count == 1
        assert flow.take(conn, "s", "a", ["2"], ttl=0.5).count == 0
        flow.renew(conn, "s", "a", {"1": 0}, ttl=1.5)
        time.sleep(0.7)
        assert flow.take(conn, "s", "a", ["2"], ttl=0.5).count == 0  # renewed: still held
        deadline = time.monotonic() + 10
        while flow.take(conn, "s", "a", ["2"], ttl=60).count == 0:
            assert time.monotonic() < deadline, "the slot never freed itself"
            time.sleep(0.05)


def test_a_rate_limit_grants_the_burst_then_one_token_per_period(db: Database) -> None:
    _register(db, s=FlowLimits(rate_limit=RateLimit(rate=2, per=1, burst=3)))
    with db.connect(autocommit=True) as conn:
        assert flow.take(conn, "s", "a", ["1", "2", "3", "4"], ttl=60).count == 3
        empty = flow.take(conn, "s", "a", ["4"], ttl=60)
        assert empty.count == 0 and 0 < empty.retry_after <= 0.5
        time.sleep(empty.retry_after + 0.05)
        assert flow.take(conn, "s", "a", ["4", "5"], ttl=60).count == 1


def test_slots_are_never_granted_twice_across_connections(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=3))
    granted: list[int] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        with db.connect(autocommit=True) as conn:
            for i in range(20):
                with conn.transaction():
                    grant = flow.take(conn, "s", "k", [f"{name}-{i}"], ttl=60)
                with lock:
                    granted.extend(grant.slots)

    threads = [threading.Thread(target=worker, args=(str(n),)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(granted) == [0, 1, 2]


def test_register_forgets_a_scope_given_without_limits(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=1))
    with db.connect(autocommit=True) as conn:
        flow.register(conn, {"s": None})
        assert conn.execute("SELECT count(*) FROM flow_limits").fetchone()[0] == 0


def test_usage_reports_tokens_and_slots_in_use(db: Database) -> None:
    _register(db, s=FlowLimits(rate_limit="10/s", concurrency=2))
    with db.connect(autocommit=True) as conn:
        flow.take(conn, "s", "a", ["1"], ttl=60)
        (use,) = flow.usage(conn, ["s"])
    assert (use.key, use.concurrency, use.in_flight, use.burst) == ("a", 2, 1, 10.0)
    assert 8.9 < use.tokens <= 10


@pytest.mark.parametrize(
    ("given", "field"),
    [({"rate_limit": "ten a second"}, "rate_limit"), ({"concurrency": 0}, "concurrency"), ({"rate": 1}, "rate")],
)
def test_bad_limits_name_the_field(given: dict, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        FlowLimits(**given)


def test_slot_rows_are_made_as_they_are_needed_up_to_the_limit(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=200))
    with db.connect(autocommit=True) as conn:

        def rows() -> int:
            return conn.execute("SELECT count(*) FROM flow_slots").fetchone()[0]

        assert flow.take(conn, "s", "a", ["0"], ttl=60).count == 1
        assert rows() == 64
        assert flow.take(conn, "s", "a", [str(i) for i in range(1, 101)], ttl=60).count == 100
        assert rows() == 128
        assert flow.take(conn, "s", "a", [str(i) for i in range(101, 301)], ttl=60).count == 99
        assert rows() == 200
