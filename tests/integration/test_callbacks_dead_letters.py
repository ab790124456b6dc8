"""Dead letters: a callback that fails for good keeps its last answer, is listed, and is sent again by a replay,
once, whatever runs at the same time."""

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from receiver import Receiver
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
from cmb_dagster.callbacks.admin import status
from cmb_dagster.models import Backoff

FAST = CallbackSettings(
    poll_interval=0.2,
    lease_ttl=3,
    timeout=1,
    backoff=Backoff(first=0.01),
    lookahead=1,
    allowed_hosts=["127.0.0.1"],
    endpoint_policy=EndpointPolicy(breaker=False),  # every failing event a dead letter of its own
)
SHORT = RetryPolicy(stop_after_delay=0.3, fast_retries=0, delay=0.1)  # fails for good within a second
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


@pytest.fixture
def client(db):
    with CallbackClient(db, FAST) as c:
        yield c


def count(db, status: str) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM callback_events WHERE status = %s", (status,)).fetchone()[0]


class Switch:
    """A receiver's answer: 500 with a long body while down, 200 once up."""

    def __init__(self) -> None:
        self.up = False

    def __call__(self, request):
        return (200, b"ok") if self.up else (500, b"down for maintenance " + b"x" * 2000)


def test_a_dead_letter_keeps_its_last_answer_and_is_listed(db, database_url, client):
    with Receiver(Switch()) as receiver, Running(CallbackWorker(db, FAST)):
        client.create("shop", "orders", "o-1", datetime.now(UTC), f"{receiver.url}/cb", retry=SHORT)
        client.create("shop", "refunds", "r-1", datetime.now(UTC), f"{receiver.url}/cb", retry=SHORT)
        client.create("shop", "orders", "fine", datetime.now(UTC) + timedelta(hours=1), f"{receiver.url}/cb")
        wait_until(lambda: count(db, "failed") == 2)
    (dead,) = client.failed("shop", "orders")
    assert (dead.event_key, dead.status, dead.last_status_code) == ("o-1", "failed", 500)
    assert dead.last_error == "HTTP 500 Internal Server Error"
    assert dead.last_response.startswith("down for maintenance x") and len(dead.last_response.encode()) <= 512
    assert dead.attempts >= 1 and dead.replays == 0
    listed = client.failed()
    assert sorted(e.event_key for e in listed) == ["o-1", "r-1"]
    assert listed == sorted(listed, key=lambda e: (e.finished_at, e.event_id))  # oldest failure first
    assert client.failed(until=listed[0].finished_at) == []
    assert client.failed(since=listed[0].finished_at, limit=1) == listed[:1]
    assert status(db).totals.failed == 2
    assert sum(s.dead_letters for s in status(db, bucket_sets=2, totals=False).bucket_sets) == 2
    with pytest.raises(InvalidCallbackInput, match="event_key"):
        client.failed("shop", event_key="o-1")
    with pytest.raises(InvalidCallbackInput, match="limit"):
        client.replay(limit=10**6)

    env = {**os.environ, "CMB_DATABASE_URL": database_url}
    out = subprocess.run(
        [*CLI, "callbacks", "failed", "--json", "--owner", "shop", "--group", "orders"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert [json.loads(line)["event_key"] for line in out.splitlines()] == ["o-1"]
    out = subprocess.run(
        [*CLI, "callbacks", "replay", "--owner", "shop", "--group", "orders", "--key", "o-1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == "replayed 1 events"
    again = client.get("shop", "orders", "o-1")
    assert (again.status, again.attempts, again.replays, again.webhook_id) == ("pending", 0, 1, dead.webhook_id)
    assert again.event_id != dead.event_id  # a new version: no call of the old one can start or write
    assert client.replay("shop", "orders", "o-1") == 0  # pending now: nothing to replay
    assert client.get("shop", "refunds", "r-1").status == "failed"  # not selected


def test_a_replay_of_1000_failed_events_calls_each_once(db, client):
    switch = Switch()
    with Receiver(switch) as receiver, Running(CallbackWorker(db, FAST), CallbackWorker(db, FAST)):
        client.create_many(
            {
                "owner_client_id": "shop",
                "group_key": "orders",
                "event_key": f"o-{i}",
                "run_at": datetime.now(UTC),
                "cb_url": f"{receiver.url}/cb",
                "retry": SHORT,
            }
            for i in range(1000)
        )
        wait_until(lambda: count(db, "failed") == 1000, timeout=60)
        ids_before = {e.event_key: e.webhook_id for e in client.failed(limit=1000)}
        switch.up = True
        before = len(receiver.received())
        replayed = []
        barrier = threading.Barrier(2)

        def replay():
            barrier.wait()
            replayed.append(client.replay("shop", limit=1000))

        threads = [threading.Thread(target=replay) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(replayed) == 1000  # each event replayed by one of the two
        wait_until(lambda: count(db, "notified") == 1000, timeout=60)
        assert client.replay("shop", limit=1000) == 0
        after = receiver.received()[before:]
    calls = Counter(r.headers["webhook-id"] for r in after)
    assert set(calls.values()) == {1} and len(calls) == 1000  # each called once
    assert set(calls) == set(ids_before.values())  # with the id of its first round
    assert {json.loads(r.body)["attempt"] for r in after} == {1}  # a new round: attempts from 0
