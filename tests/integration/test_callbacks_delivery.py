import itertools
import random
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import (
    CallbackClient,
    CallbackSettings,
    CallbackWorker,
    EndpointPolicy,
    InvalidCallbackInput,
    RetryPolicy,
)
from cmb_dagster.callbacks import worker as worker_module
from cmb_dagster.database import Database
from cmb_dagster.models import Backoff

FAST = CallbackSettings(
    poll_interval=0.2, lease_ttl=3, timeout=1, backoff=Backoff(first=0.01), lookahead=1, allowed_hosts=["127.0.0.1"]
)


@pytest.fixture
def client(db):
    with CallbackClient(db, FAST) as c:
        yield c


@pytest.fixture
def workers(db):
    started: list[Running] = []

    def start(settings=FAST, **kwargs) -> Running:
        started.append(Running(CallbackWorker(db, settings, **kwargs)))
        return started[-1]

    yield start
    for running in started:
        running.stop()


def statuses(client) -> dict[str, int]:
    found: dict[str, int] = defaultdict(int)
    for event in client.list(limit=100_000):
        found[event.status.value] += 1
    return dict(found)


def keys_received(sink) -> set[str]:
    return {c.body["event_key"] for c in sink.received}


def test_events_are_called_at_their_time_never_before(client, sink, workers):
    now = datetime.now(UTC)
    run_ats = {f"k{i}": now + timedelta(seconds=random.uniform(-5, 2.5)) for i in range(40)}
    for key, at in run_ats.items():
        client.create("shop", "orders", key, at, f"{sink.url}/cb", {"key": key})
    workers(FAST.model_copy(update={"poll_interval": 60, "lease_ttl": 120, "lookahead": 5}))
    # the first poll takes them all: each is called at its time, not at the next poll a minute later
    wait_until(lambda: statuses(client) == {"notified": 40}, timeout=30)
    assert keys_received(sink) == set(run_ats)
    for call in sink.received:
        assert call.started >= run_ats[call.body["event_key"]].timestamp(), call
        assert call.body["context"] == {"key": call.body["event_key"]} and call.body["attempt"] == 1
    assert all(e.attempts == 1 and e.finished_at is not None for e in client.list())


def test_events_created_behind_the_cursor_but_still_ahead_wait_for_their_time(client, sink, workers):
    client.set_bucket_count(1)  # one bucket: one cursor
    workers(FAST.model_copy(update={"lookahead": 5}))
    now = datetime.now(UTC)
    client.create_many(  # one poll takes both, the marker ahead of its time
        {
            "owner_client_id": "a",
            "group_key": "g",
            "event_key": key,
            "run_at": now + timedelta(seconds=s),
            "cb_url": f"{sink.url}/cb",
        }
        for key, s in (("first", 0.05), ("marker", 4))
    )
    wait_until(lambda: "first" in keys_received(sink), what="the first called: the cursor is past the marker")
    now = datetime.now(UTC)
    rows = [
        {
            "owner_client_id": "a",
            "group_key": "g",
            "event_key": f"k{i}",
            "run_at": now + timedelta(seconds=0.2 + i / 500),
            "cb_url": f"{sink.url}/cb",
        }
        for i in range(300)
    ]
    client.create_many(rows)  # behind the cursor yet not due: query 2 finds them ahead of their time
    wait_until(lambda: statuses(client) == {"notified": 302})
    run_ats = {r["event_key"]: r["run_at"].timestamp() for r in rows}
    early = [c for c in sink.received if c.body["event_key"] in run_ats and c.started < run_ats[c.body["event_key"]]]
    assert early == []


def test_reject_header_rejects_and_errors_retry_then_fail(client, sink, workers):
    client.set_endpoint_policy("a", EndpointPolicy(breaker=False))  # each event retries and fails on its own
    now = datetime.now(UTC)
    client.create("a", "g", "rejected", now, f"{sink.url}/reject")
    client.create("a", "g", "retried", now, f"{sink.url}/fail", retry=RetryPolicy.constant(0.3, fast_retries=2))
    client.create(
        "a",
        "g",
        "expires",
        now,
        f"{sink.url}/fail",
        retry=RetryPolicy.constant(0.2, fast_retries=0, stop_after_delay=1.5),
    )
    workers()
    wait_until(lambda: client.get("a", "g", "rejected").status == "rejected")
    wait_until(lambda: client.get("a", "g", "retried").main_retries >= 2)
    retried = client.get("a", "g", "retried")
    assert retried.status == "pending" and retried.originally_run_at == now and retried.run_at > now
    assert retried.attempts >= 6 and retried.last_error == "HTTP 500 Internal Server Error"
    wait_until(lambda: client.get("a", "g", "expires").status == "failed")
    expired = client.get("a", "g", "expires")
    assert expired.finished_at >= now + timedelta(seconds=1.5)
    assert [c.body["attempt"] for c in sink.received if c.body["event_key"] == "retried"][:4] == [1, 2, 3, 4]


def test_twenty_writers_with_past_and_present_run_at_all_fire(db, client, sink, workers):
    workers()
    same_moment = datetime.now(UTC) + timedelta(seconds=1)

    def writer(n: int) -> None:
        with CallbackClient(db, FAST) as own:  # its own buffer: 20 concurrent batch writers
            for i in range(25):
                # equal run_at values across writers, or already due (query 2)
                at = same_moment if i % 5 == 0 else datetime.now(UTC) - timedelta(seconds=random.uniform(0, 3))
                own.create(f"w{n}", "g", f"e{i}", at, f"{sink.url}/cb")

    with ThreadPoolExecutor(20) as pool:
        list(pool.map(writer, range(20)))
    wait_until(lambda: statuses(client) == {"notified": 500}, timeout=30)
    assert (
        len(keys_received(sink) | {f"{c.body['owner_client_id']}/{c.body['event_key']}" for c in sink.received}) >= 500
    )
    assert len({(c.body["owner_client_id"], c.body["event_key"]) for c in sink.received}) == 500


def test_two_workers_never_call_one_event_at_the_same_time(client, sink, workers):
    now = datetime.now(UTC)
    client.create_many(
        [
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"k{i}",
                "run_at": now + timedelta(milliseconds=10 * i),
                "cb_url": f"{sink.url}/slow?ms=30",
            }
            for i in range(300)
        ]
    )
    pair = [workers(), workers()]
    wait_until(lambda: len(client.list(status="notified", limit=1000)) >= 100, timeout=30)
    holder = max(pair, key=lambda r: r.worker.delivered)
    other = pair[1 - pair.index(holder)]
    holder.stop()  # the other takes its buckets over
    wait_until(lambda: statuses(client) == {"notified": 300}, timeout=30)
    calls = defaultdict(list)
    for c in sink.received:
        calls[c.body["event_id"]].append((c.started, c.ended))
    assert len(calls) == 300
    for spans in calls.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans)), spans
    assert holder.report.items > 0 and other.worker.delivered > 0


def test_raised_buckets_are_served_without_restarting_workers(client, sink, workers):
    workers()
    client.set_bucket_count(12)
    now = datetime.now(UTC)
    client.create_many(
        [
            {"owner_client_id": "a", "group_key": "g", "event_key": f"k{i}", "run_at": now, "cb_url": f"{sink.url}/cb"}
            for i in range(120)
        ]
    )
    assert len({e.bucket_id for e in client.list(limit=200)}) > 4
    wait_until(lambda: statuses(client) == {"notified": 120}, timeout=20)
    assert len(sink.received) == 120


def test_lowered_buckets_while_workers_call_due_events_call_each_event_once(db, client, sink, workers):
    client.set_bucket_count(8)
    # neither a lease lapse nor a call timeout on a loaded machine (both call again); several moves per bucket
    steady = FAST.model_copy(update={"lease_ttl": 10, "timeout": 5, "move_batch": 7})
    workers(settings=steady), workers(settings=steady)
    now = datetime.now(UTC)
    client.create_many(
        [
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"k{i}",
                "run_at": now + timedelta(milliseconds=10 * i - 1000),
                "cb_url": f"{sink.url}/slow?ms=150",
            }
            for i in range(500)
        ]
    )
    wait_until(lambda: len(sink.received) >= 50, timeout=60)
    removed = [e for e in client.list(status="pending", limit=1000) if e.bucket_id >= 3]
    assert removed  # events due and in flight in the buckets about to go
    assert client.set_bucket_count(3) == [0, 1, 2]
    client.create_many(
        [
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"late{i}",
                "run_at": now,
                "cb_url": f"{sink.url}/cb",
            }
            for i in range(50)
        ]
    )
    wait_until(lambda: statuses(client) == {"notified": 550}, timeout=180)
    calls = defaultdict(int)
    for call in sink.received:
        calls[call.body["event_key"]] += 1
    assert len(calls) == 550 and set(calls.values()) == {1}
    assert {e.bucket_id for e in client.list(limit=1000)} <= {0, 1, 2, *range(3, 8)}
    assert {e.bucket_id for e in client.list(limit=1000) if e.event_key.startswith("late")} <= {0, 1, 2}
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM callback_buckets").fetchone()[0] == 3


def test_lowered_buckets_no_worker_holds_move_at_once_behind_the_receiving_cursor_and_fire_once(db, sink, workers):
    with CallbackClient(db, FAST.model_copy(update={"move_batch": 7})) as client:  # several moves per bucket
        _lowered_buckets_no_worker_holds(client, sink, workers)


def _lowered_buckets_no_worker_holds(client: CallbackClient, sink, workers) -> None:
    client.set_bucket_count(6)
    past = datetime.now(UTC) - timedelta(minutes=1)
    client.create_many(
        [
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"k{i}",
                "run_at": past + timedelta(milliseconds=i),
                "cb_url": f"{sink.url}/cb",
            }
            for i in range(120)
        ]
    )
    before = {e.event_key: e for e in client.list(limit=200)}
    served = [e for e in before.values() if e.bucket_id < 2]
    running = workers(buckets=[0, 1])  # its cursors pass the run_at and ids of the events of buckets 2-5
    wait_until(lambda: len(sink.received) == len(served))
    running.stop()
    assert client.set_bucket_count(2) == [0, 1]
    moved = {e.event_key: e for e in client.list(status="pending", limit=200)}
    assert len(moved) == 120 - len(served) and {e.bucket_id for e in moved.values()} <= {0, 1}
    assert all(e.event_id > before[k].event_id for k, e in moved.items())
    workers(buckets=[0, 1])
    wait_until(lambda: statuses(client) == {"notified": 120})
    assert sorted(c.body["event_key"] for c in sink.received) == sorted(before)


def test_bucket_count_is_bounded(client):
    for count in (0, -1, 4097, 100_000_000):
        with pytest.raises(InvalidCallbackInput, match="count"):
            client.set_bucket_count(count)
    assert client.bucket_ids() == [0, 1, 2, 3]


def test_an_event_moved_behind_the_cursor_still_fires(client, sink, workers):
    client.create("a", "g", "moved", datetime.now(UTC) + timedelta(hours=1), f"{sink.url}/cb")
    client.create("a", "g", "marker", datetime.now(UTC), f"{sink.url}/cb")
    workers()
    wait_until(lambda: "marker" in keys_received(sink))
    client.update("a", "g", "moved", run_at=datetime.now(UTC) - timedelta(minutes=5))
    wait_until(lambda: client.get("a", "g", "moved").status == "notified")
    assert [c.body["event_key"] for c in sink.received].count("moved") == 1


def test_a_lapsed_lease_is_taken_back_and_nothing_is_lost(db, client, sink, workers):
    running = workers()
    now = datetime.now(UTC)
    client.create_many(
        [
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"k{i}",
                "run_at": now + timedelta(milliseconds=10 * i),
                "cb_url": f"{sink.url}/slow?ms=20",
            }
            for i in range(300)
        ]
    )

    def lowest_fence() -> int:
        with db.connection() as conn:
            return conn.execute(
                "SELECT coalesce(min(fence), 0) FROM leases WHERE kind = 'callbacks.bucket'"
            ).fetchone()[0]

    wait_until(lambda: running.worker.delivered > 0)
    for round_ in range(3):  # the worker stalls past its lease (as after a long GC pause) and takes it back
        with db.connection() as conn:
            conn.execute("UPDATE leases SET expires_at = now() - interval '1 second' WHERE kind = 'callbacks.bucket'")
        wait_until(lambda round_=round_: lowest_fence() >= round_ + 2)
    wait_until(lambda: statuses(client) == {"notified": 300}, timeout=30)
    running.stop()  # its run ends by writing what its calls left
    with db.connection() as conn:
        saved = conn.execute("SELECT min(max_run_at) FROM callback_buckets").fetchone()[0]
    assert saved >= now  # the saved watermark kept moving after the takebacks
    assert len({c.body["event_key"] for c in sink.received}) == 300


def test_failed_calls_are_logged_with_their_keys_at_a_bounded_rate(db, caplog):
    settings = CallbackSettings(allowed_hosts=["127.0.0.1"], poll_interval=0.05)
    with CallbackClient(db, settings) as client:
        for n in range(worker_module.FAILURES_LOGGED_PER_WINDOW + 5):
            client.create(
                "shop",
                "orders",
                f"o-{n}",
                datetime.now(UTC),
                "http://127.0.0.1:9/closed",
                retry=RetryPolicy.constant(3600, fast_retries=0, stop_after_delay=7200),
            )
        with caplog.at_level("WARNING", logger="cmb_dagster.callbacks"), Running(CallbackWorker(db, settings)):
            wait_until(lambda: all(e.attempts for e in client.list()), timeout=30, what="every event tried once")
    lines = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    assert len(lines) == worker_module.FAILURES_LOGGED_PER_WINDOW
    assert "callback shop/orders/o-" in lines[0] and "retries in" in lines[0]


def test_the_gate_starts_nothing_when_its_bucket_is_no_longer_held(db, client, sink, caplog):
    """The bucket is taken over after the poll read the events: the gate, waiting on the lease the takeover
    locks, then finds it gone and starts no call (the worker's own renewal is a minute away)."""
    client.set_bucket_count(1)
    waiting_on_a_lock = """SELECT pid FROM pg_stat_activity
                           WHERE datname = current_database() AND wait_event_type = 'Lock'"""
    with Running(CallbackWorker(db, FAST.model_copy(update={"lease_ttl": 180}))) as running:
        owner = running.worker.owner
        with db.connection() as conn:
            wait_until(
                lambda: (
                    conn.execute("SELECT owner FROM leases WHERE kind = %s", (worker_module.LEASE_KIND,)).fetchall()
                    == [(owner,)]
                ),
                what="the worker holds the bucket",
            )
        with db.connection() as taker:  # its lock is held until the block commits
            taker.execute(
                "UPDATE leases SET fence = fence + 1, owner = 'other' WHERE kind = %s", (worker_module.LEASE_KIND,)
            )
            for n in range(5):
                client.create("a", "g", f"k{n}", datetime.now(UTC), f"{sink.url}/cb")
            with db.connection() as conn:
                wait_until(lambda: conn.execute(waiting_on_a_lock).fetchall(), timeout=60, what="the gate waits")
        wait_until(
            lambda: sink.received or "gate failed (LeaseLost)" in caplog.text, timeout=60, what="the gate answered"
        )
    assert sink.received == [] and all(e.attempts == 0 and e.status == "pending" for e in client.list())


def test_a_worker_goes_on_after_its_connections_were_cut(db, client, sink, workers):
    running = workers()
    client.create("a", "g", "before", datetime.now(UTC), f"{sink.url}/cb")
    wait_until(lambda: "before" in keys_received(sink))
    with db.connection() as conn:  # every other session of this database: the worker's too
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    for n in range(5):
        client.create("a", "g", f"after-{n}", datetime.now(UTC), f"{sink.url}/cb")
    wait_until(lambda: {f"after-{n}" for n in range(5)} <= keys_received(sink), timeout=30)
    assert running.threads[0].is_alive()


class DispatcherBug(BaseException):
    """A failure no handler of the dispatcher catches (it catches Exception)."""


class GateFailingDatabase(Database):
    """A database whose first async connection (the one the callback gate opens) raises DispatcherBug."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.failures = 0

    async def connect_async(self, *, autocommit: bool = False) -> psycopg.AsyncConnection:
        if not self.failures:
            self.failures += 1
            raise DispatcherBug("a bug in the dispatcher")
        return await super().connect_async(autocommit=autocommit)


def test_a_worker_whose_dispatcher_fails_stops_and_another_calls_its_events(database_url, client, sink, workers):
    failing = GateFailingDatabase(database_url)
    broken, raised = CallbackWorker(failing, FAST), []

    def run():
        try:
            broken.run()
        except RuntimeError as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        client.create("a", "g", "k", datetime.now(UTC), f"{sink.url}/cb")
        wait_until(lambda: not thread.is_alive(), timeout=30)  # it stops rather than hold its buckets, calling nothing
    finally:
        failing.close()
    assert failing.failures == 1 and raised and isinstance(raised[0].__cause__, DispatcherBug)
    assert "k" not in keys_received(sink)
    workers()
    wait_until(lambda: "k" in keys_received(sink), timeout=30)


# -- the worker contract: run for a time, drain on stop, progress, a stop asked while it starts -----------------------


def test_a_run_for_a_duration_ends_by_draining_the_calls_in_flight(db, client, sink):
    now = datetime.now(UTC)
    client.create_many(
        [
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"k{i}",
                "run_at": now,
                "cb_url": f"{sink.url}/slow?ms=800",
            }
            for i in range(20)
        ]
    )
    progress = []
    worker = CallbackWorker(db, FAST)
    report = worker.run(1.0, on_progress=progress.append)
    assert report.seconds >= 1.0 and report.items == 20 and report.owner == worker.owner
    assert progress and not worker.listening
    assert statuses(client) == {"notified": 20}  # every call started was let end and its outcome written


def test_a_stop_asked_while_the_worker_starts_ends_its_run_at_once(db):
    worker = CallbackWorker(db, FAST)
    worker.stop()
    reports = []
    threading.Thread(target=lambda: reports.append(worker.run(3600)), daemon=True).start()
    wait_until(lambda: reports, 60, "the run ended, long before its hour")
    assert reports[0].items == 0


def test_a_worker_built_without_settings_is_deprecated(db):
    with pytest.deprecated_call(match="CallbackSettings"):
        worker = CallbackWorker(db)
    assert worker.settings.lease_ttl == CallbackSettings().lease_ttl
