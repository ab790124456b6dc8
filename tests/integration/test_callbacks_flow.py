"""Limits per destination across workers, per-owner overrides, slots of a killed worker, priorities."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner
from intervals import most_at_once
from processes import stop
from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, CallbackWorker, InvalidCallbackInput
from cmb_dagster.callbacks.admin import status
from cmb_dagster.callbacks.cli import callbacks as callbacks_cli
from cmb_dagster.flow import FlowLimits, RateLimit
from cmb_dagster.models import Backoff

SETTINGS = CallbackSettings(
    poll_interval=0.2,
    lease_ttl=6,
    timeout=3,  # no call times out: the receiver's figures are those of calls the workers waited for
    backoff=Backoff(first=0.01),
    lookahead=1,
    allowed_hosts=["127.0.0.0/8"],
    per_host=FlowLimits(concurrency=3),
)

WORKER = """
import sys
from cmb_dagster.callbacks import CallbackSettings, CallbackWorker
url, settings, buckets = sys.argv[1:4]
chosen = [int(b) for b in buckets.split(",")] if buckets else None
CallbackWorker(url, CallbackSettings.model_validate_json(settings), buckets=chosen).run()
"""


class Receiver:
    """An HTTP server on ``host`` that records each call's key, path and start and end (``time.time()``); a call to
    ``/slow`` answers after ``slow`` seconds, one to ``/hang`` when the receiver stops."""

    def __init__(self, host: str, slow: float = 0.3) -> None:
        self.calls: list[tuple[str, str, float, float]] = []
        self.arrived: list[tuple[str, str, float]] = []
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                started = time.time()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.arrived.append((self.path, body["event_key"], started))
                if self.path == "/slow":
                    time.sleep(slow)
                elif self.path == "/hang":
                    receiver.released.wait(30)
                receiver.calls.append((self.path, body["event_key"], started, time.time()))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def most_at_once(self, keys: set[str] | None = None) -> int:
        """The most calls (of ``keys``) that were in progress at one moment."""
        return most_at_once((start, end) for _, key, start, end in self.calls if keys is None or key in keys)

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(host: str, slow: float = 0.3) -> Receiver:
        made.append(Receiver(host, slow))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


@pytest.fixture
def processes(database_url):
    started: list[subprocess.Popen] = []

    def start(settings: CallbackSettings, buckets: str = "") -> subprocess.Popen:
        command = [sys.executable, "-c", WORKER, database_url, settings.model_dump_json(), buckets]
        started.append(subprocess.Popen(command))
        return started[-1]

    yield start
    stop(started)


def create(client: CallbackClient, url: str, keys: list[str], owner: str = "shop", group: str = "g", **kwargs) -> None:
    at = datetime.now(UTC)
    client.create_many(
        [
            {"owner_client_id": owner, "group_key": group, "event_key": k, "run_at": at, "cb_url": url, **kwargs}
            for k in keys
        ]
    )


def bucket_keys(db, owner: str, group: str, buckets: int) -> dict[int, list[str]]:
    """Event keys k0, k1... of ``owner``/``group`` by the bucket they land in."""
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT k, (hashtextextended(%s || chr(1) || %s || chr(1) || k, 0) & 9223372036854775807) %% %s"
            " FROM unnest(ARRAY(SELECT 'k' || i FROM generate_series(0, 39) AS i)) AS k",
            (owner, group, buckets),
        ).fetchall()
    found: dict[int, list[str]] = {b: [] for b in range(buckets)}
    for key, bucket in rows:
        found[bucket].append(key)
    return found


def notified(client: CallbackClient) -> int:
    return len(client.list(status="notified", limit=10_000))


def test_two_workers_never_call_one_host_more_than_its_limit_at_once_while_other_hosts_go_on(
    db, database_url, receivers, processes
):
    slow, fast = receivers("127.0.0.1"), receivers("127.0.0.2")
    with CallbackClient(db, SETTINGS) as client:
        create(client, f"{slow.url}/slow", [f"s{i}" for i in range(24)])  # 24 x 0.3 s, 3 at a time: 2.4 s at least
        create(client, f"{fast.url}/cb", [f"f{i}" for i in range(20)])
        processes(SETTINGS)
        processes(SETTINGS)
        wait_until(lambda: len(fast.calls) == 20, timeout=30, what="the fast host's calls")
        slow_done = len(slow.calls)
        wait_until(lambda: notified(client) == 44, timeout=60, what="every call")
    assert slow_done < 24  # the other host's calls did not wait for the slow host's
    assert slow.most_at_once() <= 3


def test_per_owner_and_per_group_limits_replace_the_host_limit(db, receivers):
    slow = receivers("127.0.0.1", slow=1.0)
    settings = SETTINGS.model_copy(
        update={"per_owner": {"vip": FlowLimits(concurrency=6), "vip/one": FlowLimits(concurrency=1)}}
    )
    with CallbackClient(db, settings) as client:
        create(client, f"{slow.url}/slow", [f"v{i}" for i in range(12)], owner="vip")
        create(client, f"{slow.url}/slow", [f"o{i}" for i in range(4)], owner="vip", group="one")
        create(client, f"{slow.url}/slow", [f"s{i}" for i in range(9)])
        with Running(CallbackWorker(db, settings)):
            wait_until(lambda: notified(client) == 25, timeout=60, what="every call")
            uses = {(u.scope, u.key): u.concurrency for u in status(db).limits}
    assert 3 < slow.most_at_once({f"v{i}" for i in range(12)}) <= 6  # past the host's limit, within the owner's
    assert slow.most_at_once({f"o{i}" for i in range(4)}) == 1
    assert slow.most_at_once({f"s{i}" for i in range(9)}) <= 3
    assert uses == {
        ("callbacks/host", "127.0.0.1"): 3,
        ("callbacks/owner/vip", ""): 6,
        ("callbacks/owner/vip/one", ""): 1,
    }


def test_the_slots_of_a_killed_worker_return_after_their_ttl_not_before(db, database_url, receivers, processes):
    host, other = receivers("127.0.0.1"), receivers("127.0.0.2")
    settings = SETTINGS.model_copy(update={"per_host": FlowLimits(concurrency=2), "lease_ttl": 6, "timeout": 1.5})
    with CallbackClient(db, settings) as client:
        client.set_bucket_count(2)
        keys = bucket_keys(db, "shop", "g", 2)
        create(client, f"{host.url}/hang", keys[0][:2])  # bucket 0: two calls that hold both slots of the host
        holder = processes(settings, "0")
        wait_until(lambda: len(host.arrived) == 2, timeout=30, what="the holder's calls")
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        with db.connection() as conn:
            expiries = [
                row[0].timestamp()
                for row in conn.execute(
                    "SELECT expires_at FROM flow_slots WHERE scope = 'callbacks/host' AND key = '127.0.0.1'"
                )
            ]
        assert len(expiries) == 2 and min(expiries) > time.time()
        create(client, f"{host.url}/cb", keys[1][:3])  # bucket 1: to the same host, then to another
        create(client, f"{other.url}/cb", keys[1][3:6])
        processes(settings, "1")
        wait_until(lambda: len([c for c in host.calls if c[0] == "/cb"]) == 3, timeout=30, what="calls after the ttl")
    others = [start for _, _, start, _ in other.calls]
    after = [start for path, _, start, _ in host.calls if path == "/cb"]
    assert len(others) == 3 and min(others) < min(expiries)  # the second worker was calling meanwhile
    assert min(after) >= min(expiries) - 0.01  # not one call to the host before a slot expired


def test_a_high_priority_callback_due_with_many_low_ones_is_called_in_the_first_batch(db, receivers):
    receiver = receivers("127.0.0.1", slow=0.05)
    settings = SETTINGS.model_copy(update={"worker_concurrency": 4, "poll_batch_size": 50, "per_host": None})
    with CallbackClient(db, settings) as client:
        client.set_bucket_count(1)  # the first poll reads them all (each bucket is polled in turn)
        past = datetime.now(UTC) - timedelta(seconds=10)
        client.create_many(
            [
                {
                    "owner_client_id": "shop",
                    "group_key": "g",
                    "event_key": f"low{i}",
                    "run_at": past,
                    "cb_url": f"{receiver.url}/slow",
                }
                for i in range(300)
            ]
        )
        create(client, f"{receiver.url}/slow", ["high"], priority=10)
        assert client.get("shop", "g", "high").priority == 10
        with Running(CallbackWorker(db, settings)):
            wait_until(lambda: len(receiver.arrived) >= 8, timeout=30, what="the first calls")
    first = [key for _, key, _ in sorted(receiver.arrived, key=lambda a: a[2])[:4]]
    assert "high" in first


@pytest.mark.parametrize("priority", [1001, -1001, "high", 1.5])
def test_a_priority_out_of_bounds_is_refused_naming_the_field(db, priority):
    with CallbackClient(db, SETTINGS) as client, pytest.raises(InvalidCallbackInput, match="priority"):
        client.create("shop", "g", "k", datetime.now(UTC), "http://127.0.0.1:9/x", priority=priority)


def test_a_high_priority_callback_created_while_low_ones_wait_goes_before_them(db, receivers):
    receiver = receivers("127.0.0.1", slow=0.3)
    settings = SETTINGS.model_copy(update={"worker_concurrency": 1, "per_host": None})
    with CallbackClient(db, settings) as client:
        create(client, f"{receiver.url}/slow", [f"low{i}" for i in range(20)])
        with Running(CallbackWorker(db, settings)):
            wait_until(lambda: receiver.arrived, timeout=30, what="the first call")
            create(client, f"{receiver.url}/slow", ["high"], priority=5)
            wait_until(lambda: any(key == "high" for _, key, _ in receiver.arrived), timeout=30, what="the call")
            order = [key for _, key, _ in receiver.arrived]
    assert order.index("high") <= 5  # not behind the 20 low ones polled before it (the next poll reads it)


def test_the_cli_creates_with_a_priority_and_shows_the_limits_in_use(db, receivers):
    receiver = receivers("127.0.0.1", slow=0.3)
    env = {"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema, "CMB_CALLBACK_ALLOWED_HOSTS": "127.0.0.0/8"}
    create = ["create", "shop", "g", "k", "--in", "0", "--url", f"{receiver.url}/slow", "--priority", "7"]
    created = CliRunner().invoke(callbacks_cli, create, env=env)
    assert created.exit_code == 0, created.output
    refused = CliRunner().invoke(callbacks_cli, [*create[:3], "k2", *create[4:-1], "1001"], env=env)
    assert refused.exit_code == 2 and "Invalid value for '--priority'" in refused.output  # refused while parsing
    with CallbackClient(db, SETTINGS) as client:
        assert client.get("shop", "g", "k").priority == 7
        with Running(CallbackWorker(db, SETTINGS)):
            wait_until(lambda: receiver.arrived, timeout=30, what="the call")
            shown = CliRunner().invoke(callbacks_cli, ["status"], env=env)
    assert "callbacks/host 127.0.0.1: 1/3 in flight" in shown.output


def test_a_rate_limit_of_an_owner_spaces_its_calls(db, receivers):
    receiver = receivers("127.0.0.1", slow=0)
    metered = FlowLimits(rate_limit=RateLimit(rate=4, burst=1), concurrency=2)
    settings = SETTINGS.model_copy(update={"per_owner": {"metered": metered}})
    with CallbackClient(db, settings) as client:
        create(client, f"{receiver.url}/slow", [f"m{i}" for i in range(12)], owner="metered")
        with Running(CallbackWorker(db, settings)):
            wait_until(lambda: notified(client) == 12, timeout=30, what="every call")
    starts = sorted(start for _, _, start in receiver.arrived)
    assert starts[-1] - starts[0] >= 2.5  # 1 at once, then 4 a second: 11 more take 2.75 s at least
    assert max(sum(1 for t in starts if s <= t < s + 1) for s in starts) <= 6  # 1 + 4, and one of arrival jitter


def test_a_rate_limit_of_an_endpoint_spaces_its_calls_while_the_hosts_other_endpoints_go_on(db, receivers):
    receiver = receivers("127.0.0.1", slow=0)
    metered = f"{receiver.url}/slow?tenant=1"  # the endpoint is the URL without its query
    limits = {"per_endpoint": {f"{receiver.url}/slow": FlowLimits(rate_limit=RateLimit(rate=4, burst=1))}}
    settings = CallbackSettings(**{**SETTINGS.model_dump(), **limits})
    assert settings.flow_key("shop", "g", "127.0.0.1", f"{receiver.url}/slow") == (
        f"callbacks/endpoint/{receiver.url}/slow",
        "",
    )
    with CallbackClient(db, settings) as client:
        create(client, metered, [f"m{i}" for i in range(12)])
        create(client, f"{receiver.url}/other", [f"o{i}" for i in range(12)], group="other")
        with Running(CallbackWorker(db, settings)):
            wait_until(lambda: notified(client) == 24, timeout=30, what="every call")
    metered_starts = sorted(start for path, _, start in receiver.arrived if path.startswith("/slow"))
    other_starts = sorted(start for path, _, start in receiver.arrived if path == "/other")
    assert metered_starts[-1] - metered_starts[0] >= 2.5  # 1 at once, then 4 a second
    assert other_starts[-1] < metered_starts[-1] - 1.0  # the other endpoint of the host did not wait for it


def test_per_endpoint_entries_must_be_urls(db):
    with pytest.raises(InvalidCallbackInput, match=r"per_endpoint"):
        CallbackSettings(per_endpoint={"not a url": FlowLimits(concurrency=1)})
