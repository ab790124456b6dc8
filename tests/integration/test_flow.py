"""The shared flow control on real Postgres: token buckets and concurrency slots per key, across connections."""

from __future__ import annotations

import threading

import psycopg
import pytest
from waiting import wait_until

from cmb_dagster import flow
from cmb_dagster.database import Database
from cmb_dagster.errors import InvalidInput
from cmb_dagster.flow import FlowLimits, RateLimit

HOLDER = "worker-1"


def take(conn: psycopg.Connection, scope: str, key: str, count: int, *, ttl: float) -> flow.Grant:
    """What one worker is granted of ``count`` starts of (scope, key)."""
    return flow.take(conn, {(scope, key): count}, holder=HOLDER, ttl=ttl)[(scope, key)]


def _register(db: Database, **limits: FlowLimits) -> None:
    with db.connect(autocommit=True) as conn:
        flow.register(conn, limits)


def test_a_concurrency_limit_grants_free_slots_only(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=2))
    with db.connect(autocommit=True) as conn:
        first = take(conn, "s", "a", 3, ttl=60)
        assert (first.count, first.slots) == (2, [0, 1])
        assert take(conn, "s", "a", 1, ttl=60).count == 0
        assert take(conn, "s", "b", 1, ttl=60).count == 1  # another key has slots of its own
        flow.release(conn, [("s", "a", 0)], holder=HOLDER)
        assert take(conn, "s", "a", 2, ttl=60).slots == [0]
        flow.release(conn, [("s", "a", 0)], holder="another worker")  # not its slot: nothing is freed
        assert take(conn, "s", "a", 1, ttl=60).count == 0


def test_a_slot_whose_holder_stopped_renewing_frees_itself_after_its_ttl(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=1))
    with db.connect(autocommit=True) as conn:
        assert take(conn, "s", "a", 1, ttl=0.2).count == 1
        assert flow.renew(conn, [("s", "a", 0)], holder=HOLDER, ttl=600) == {("s", "a", 0)}
        taken_long_ago = "SELECT now() - taken_at > interval '1 second' FROM flow_slots WHERE key = 'a' AND slot = 0"
        wait_until(lambda: conn.execute(taken_long_ago).fetchone()[0], what="the first time to live long past")
        assert take(conn, "s", "a", 1, ttl=60).count == 0  # renewed: still held
        assert flow.renew(conn, [("s", "a", 0)], holder=HOLDER, ttl=0.2) == {("s", "a", 0)}  # its last renewal
        wait_until(lambda: take(conn, "s", "a", 1, ttl=60).count == 1, timeout=60, what="the slot freed by its ttl")
        assert flow.renew(conn, [("s", "a", 0)], holder="worker that stopped", ttl=60) == set()  # no longer its


def test_a_rate_limit_grants_the_burst_then_one_token_per_period(db: Database) -> None:
    _register(db, s=FlowLimits(rate_limit=RateLimit(rate=1, per=2, burst=3)))
    with db.connect(autocommit=True) as conn:
        assert take(conn, "s", "a", 4, ttl=60).count == 3
        empty = take(conn, "s", "a", 1, ttl=60)
        assert empty.count == 0 and 0 < empty.retry_after <= 2  # when the next token comes
        granted = wait_until(lambda: take(conn, "s", "a", 2, ttl=60).count, timeout=60, what="the next token")
        assert granted == 1  # one token a period, not the burst again


def test_slots_are_never_granted_twice_across_connections(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=3))
    granted: list[int] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        with db.connect(autocommit=True) as conn:
            for _ in range(20):
                with conn.transaction():
                    grant = flow.take(conn, {("s", "k"): 1}, holder=name, ttl=60)[("s", "k")]
                with lock:
                    granted.extend(grant.slots)

    threads = [threading.Thread(target=worker, args=(str(n),)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(granted) == [0, 1, 2]


def test_register_forgets_the_limits_of_a_scope_given_without_limits(db: Database) -> None:
    _register(db, s=FlowLimits(concurrency=1))
    with db.connect(autocommit=True) as conn:
        flow.register(conn, {"s": None})
        assert flow.scopes(conn, "") == []
        assert take(conn, "s", "a", 5, ttl=60).count == 5


def test_an_older_definition_cannot_overwrite_a_newer_one(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    _register(db, s=FlowLimits(concurrency=1, version=1))
    _register(db, s=FlowLimits(concurrency=2, version=2))  # the newer deployment
    _register(db, s=FlowLimits(concurrency=1, version=1))  # a worker of the older one, restarted
    _register(db, s=None)  # one older still: no limits, version 0
    with db.connect(autocommit=True) as conn:
        (stored,) = flow.scopes(conn, "s")
        assert (stored.concurrency, stored.version) == (2, 2)
        assert take(conn, "s", "a", 3, ttl=60).count == 2
    assert "version 2 is registered, newer than this worker's 1" in caplog.text
    _register(db, s=FlowLimits(concurrency=3, version=2))  # the same version: the last definition applies
    with db.connect(autocommit=True) as conn:
        assert [s.concurrency for s in flow.scopes(conn, "s")] == [3]


def test_usage_reports_tokens_and_slots_in_use(db: Database) -> None:
    _register(db, s=FlowLimits(rate_limit="10/s", concurrency=2))
    with db.connect(autocommit=True) as conn:
        take(conn, "s", "a", 1, ttl=60)
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

        assert take(conn, "s", "a", 1, ttl=60).count == 1
        assert rows() == 64
        assert take(conn, "s", "a", 100, ttl=60).count == 100
        assert rows() == 128
        assert take(conn, "s", "a", 200, ttl=60).count == 99
        assert rows() == 200
