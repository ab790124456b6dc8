"""A dead endpoint, as webhook services treat one: its circuit breaker opens, its due events wait while one probe per
interval goes out, and they are delivered once it answers again; past its owner's limit it is disabled with one
notification, and one command sends its events again. Worker processes, local receivers, real Postgres."""

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from callback_settings import CLI, WORKER
from processes import stop
from receiver import Receiver, Request
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, EndpointPolicy, RetryPolicy
from cmb_dagster.database import Database
from cmb_dagster.models import Backoff

CONCURRENCY = 8  # calls in flight to the host, across the workers
SETTINGS = CallbackSettings(allowed_hosts=["127.0.0.1"])
PROBE_EVERY = 1.0  # seconds between probes: the outage below is a few dozen of them, as ten minutes would be at 20 s
EVENTS = 1000


class Endpoint:
    """A receiver whose /dead path answers 503 while ``down``, and that counts the calls in flight at once."""

    def __init__(self) -> None:
        self.down = True
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        self.receiver = Receiver(self.answer)

    def answer(self, request: Request) -> tuple[int, bytes]:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(0.005)  # an endpoint that takes a little time, so calls overlap
            if request.path.startswith("/dead") and self.down:
                return 503, b"down for maintenance"
            return 200, b"ok"
        finally:
            with self._lock:
                self.in_flight -= 1


def workers(database_url: str, count: int) -> list[subprocess.Popen]:
    env = {**os.environ, "CMB_DATABASE_URL": database_url, "CMB_CALLBACK_ALLOWED_HOSTS": "127.0.0.1"}
    return [
        subprocess.Popen(
            [*WORKER, "--per-host-concurrency", str(CONCURRENCY)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]


@contextmanager
def running(db: Database, database_url: str, count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` worker processes, serving every bucket before this returns; stopped (those in the list at the end)
    when the block ends."""
    procs = workers(database_url, count)
    try:
        wait_until(lambda: serving(db), timeout=60, what="the workers hold the buckets")
        yield procs
    finally:
        stop(procs)


def serving(db: Database) -> bool:
    """Whether every bucket is held by a worker."""
    with db.connection() as conn:
        return conn.execute(
            "SELECT count(*) = (SELECT count(*) FROM callback_buckets) FROM leases "
            "WHERE kind = 'callbacks.bucket' AND expires_at > now()"
        ).fetchone()[0]


def statuses(db: Database, group: str) -> dict[str, int]:
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT status, count(*) FROM callback_events WHERE group_key = %s GROUP BY status", (group,)
        ).fetchall()
    return dict(rows)


def test_a_dead_endpoint_costs_one_probe_per_interval_and_its_events_go_out_once_it_answers(db, database_url):
    endpoint = Endpoint()
    # a short stop_after_delay: without the breaker, these events would fail for good long before the outage ends
    retry = RetryPolicy.constant(0.5, fast_retries=2, stop_after_delay=5)
    policy = EndpointPolicy(
        failure_threshold=5, failure_rate=None, probe_interval=Backoff(first=PROBE_EVERY, factor=1, max=PROBE_EVERY)
    )
    with endpoint.receiver as receiver, CallbackClient(db, SETTINGS) as client, running(db, database_url, 2):
        client.set_endpoint_policy("shop", policy)
        start = datetime.now(UTC)
        dead = f"{receiver.url}/dead"
        client.create_many(
            [
                {
                    "owner_client_id": "shop",
                    "group_key": "dead",
                    "event_key": f"d{i}",
                    "run_at": start + timedelta(milliseconds=i),
                    "cb_url": dead,
                    "retry": retry,
                }
                for i in range(EVENTS)
            ]
        )
        # the same host and owner, another endpoint: one call every 100 ms through the outage and after it
        client.create_many(
            [
                {
                    "owner_client_id": "shop",
                    "group_key": "alive",
                    "event_key": f"a{i}",
                    "run_at": start + timedelta(seconds=1 + i / 10),
                    "cb_url": f"{receiver.url}/alive",
                }
                for i in range(400)
            ]
        )
        [opened] = wait_until(lambda: client.endpoints("shop", state="open"), timeout=30, what="the breaker opens")
        assert opened.endpoint == dead
        opened_at = opened.opened_at.timestamp()
        outage = 20 * PROBE_EVERY
        wait_until(lambda: time.time() >= opened_at + outage, timeout=outage + 5, interval=0.2)
        assert statuses(db, "dead").get("failed", 0) == 0
        # at most one request per probe interval after it opened (the calls already on the wire excepted)
        after = [r for r in receiver.received("/dead") if r.at > opened_at + 1.0]
        assert len(after) <= (time.time() - opened_at) / PROBE_EVERY + 1, len(after)
        assert statuses(db, "dead").get("held", 0) >= EVENTS - 200
        endpoint.down = False
        back_at = time.time()
        wait_until(lambda: statuses(db, "dead") == {"notified": EVENTS}, timeout=60, what="all delivered")
        wait_until(lambda: statuses(db, "alive") == {"notified": 400}, timeout=60)
        recovered = [r for r in receiver.received("/dead") if r.at >= back_at]
        keys = [json.loads(r.body)["event_key"] for r in recovered]
        order = [int(k[1:]) for k in keys]
        first, last = order[: len(order) // 5], order[-len(order) // 5 :]
        assert sum(first) / len(first) < sum(last) / len(last)  # oldest first
        assert endpoint.most_in_flight <= CONCURRENCY  # within the host's limit throughout
        # the other endpoint of the host kept its normal lateness through the outage (once the dead one is back, its
        # held events share the host's limit with it: per_endpoint limits keep them apart)
        late = [
            r.at - datetime.fromisoformat(json.loads(r.body)["run_at"]).timestamp()
            for r in receiver.received("/alive")
            if opened_at + 1.0 < r.at < back_at
        ]
        assert len(late) > 100 and max(late) < 1.0, sorted(late)[-5:]
        assert {e.endpoint for e in client.endpoints("shop", state="closed")} == {dead, f"{receiver.url}/alive"}


def test_an_endpoint_open_too_long_is_disabled_with_one_notification_and_one_command_sends_its_events(db, database_url):
    endpoint = Endpoint()
    policy = EndpointPolicy(
        failure_threshold=3,
        failure_rate=None,
        probe_interval=Backoff(first=0.5, factor=2, max=2),
        disable_after=3,
    )
    with endpoint.receiver as receiver, CallbackClient(db, SETTINGS) as client:
        client.set_endpoint_policy("shop", policy)
        client.set_failure_hook("shop", f"{receiver.url}/hook")
        dead = f"{receiver.url}/dead"
        start = datetime.now(UTC)
        client.create_many(
            [
                {"owner_client_id": "shop", "group_key": "dead", "event_key": f"d{i}", "run_at": start, "cb_url": dead}
                for i in range(100)
            ]
        )
        with running(db, database_url, 2) as procs:
            wait_until(lambda: client.endpoints("shop", state="open"), timeout=30, what="the breaker opens")
            # kill -9 the workers at random points until it is disabled, a new one started for each killed
            rng = random.Random(49)
            deadline = time.monotonic() + 60
            while not client.endpoints("shop", state="disabled"):
                assert time.monotonic() < deadline, "not disabled within a minute"
                time.sleep(rng.uniform(0.05, 0.6))
                victim = procs.pop(rng.randrange(len(procs)))
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                procs += workers(database_url, 1)
            wait_until(lambda: receiver.received("/hook"), timeout=30, what="the notification")
            time.sleep(2 * PROBE_EVERY)  # long enough for a second one to show
            assert statuses(db, "dead") == {"disabled": 100}
        hooks = receiver.received("/hook")
        assert len({h.headers["webhook-id"] for h in hooks}) == 1
        notice = json.loads(hooks[0].body)
        assert notice["type"] == "endpoint.disabled" and notice["endpoint"] == dead
        assert 0 < notice["events"] <= 100  # those held then; the others are kept as disabled when they come due
        assert statuses(db, "cmb.failure") == {"notified": 1}
        endpoint.down = False
        env = {**os.environ, "CMB_DATABASE_URL": database_url}
        enabled = subprocess.run(
            [*CLI, "callbacks", "endpoint", "enable", "--owner", "shop", dead],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert enabled.returncode == 0, enabled.stderr
        assert "100 events will be sent again" in enabled.stdout
        with running(db, database_url, 1):
            wait_until(lambda: statuses(db, "dead") == {"notified": 100}, timeout=60, what="all sent again")
        assert len({h.headers["webhook-id"] for h in receiver.received("/hook")}) == 1
