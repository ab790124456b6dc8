"""The calls run on the executor of user code: ``concurrency`` at once and never more, a call past its timeout
cancelled and retried by its policy (never two calls of one event at once), launches in threads that hold their
event until they end, and a worker whose every call slot hangs stops."""

import json
import select
import socket
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from callback_settings import FAST
from intervals import most_at_once
from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackWorker, RetryPolicy
from cmb_dagster.isolation import WorkerStuck

SETTINGS = FAST.model_copy(update={"per_host": None})  # the executor's slots are the only bound here
SLOW = 0.3  # seconds a call to /slow takes
STALL_LIMIT = 20.0  # seconds a call to /stall waits for the client to give up before it answers


class Target:
    """An HTTP server on 127.0.0.1 recording each call as (event key, path, start, end, cut) in ``calls``:
    ``/slow`` answers after ``SLOW`` seconds; ``/stall`` answers only after ``STALL_LIMIT`` seconds, and ends
    earlier, ``cut``, when the client closes the connection."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, float, bool]] = []
        self.lock = threading.Lock()
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                started = time.monotonic()
                key = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["event_key"]
                cut = False
                if self.path == "/slow":
                    time.sleep(SLOW)
                elif self.path == "/stall":
                    cut = _closed_by_client(self.connection, STALL_LIMIT)
                with target.lock:
                    target.calls.append((key, self.path, started, time.monotonic(), cut))
                if cut:
                    self.close_connection = True
                    return
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, key: str) -> list[tuple[str, str, float, float, bool]]:
        with self.lock:
            return [call for call in self.calls if call[0] == key]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _closed_by_client(conn: socket.socket, limit: float) -> bool:
    """Wait up to ``limit`` seconds for the client to close ``conn``; whether it did."""
    deadline = time.monotonic() + limit
    while (remaining := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([conn], [], [], remaining)
        if readable:
            try:
                return conn.recv(1, socket.MSG_PEEK) == b""
            except OSError:  # reset: the client aborted the connection
                return True
    return False


@pytest.fixture
def target():
    served = Target()
    yield served
    served.close()


@pytest.fixture
def work(db):
    """Start a CallbackWorker on a thread; stopped by the teardown."""
    started = []
    yield lambda settings=SETTINGS, **kwargs: started.append(Running(CallbackWorker(db, settings, **kwargs)))
    for running in started:
        running.stop()


def create(client: CallbackClient, keys: list[str], url: str, **kwargs) -> None:
    at = datetime.now(UTC)
    event = {"owner_client_id": "a", "group_key": "g", "run_at": at, "cb_url": url, **kwargs}
    client.create_many([{**event, "event_key": k} for k in keys])


def test_n_slow_targets_are_called_n_at_once_at_concurrency_n_and_never_more(db, target, work):
    settings = SETTINGS.model_copy(update={"worker_concurrency": 4})
    keys = [f"k{i}" for i in range(16)]
    with CallbackClient(db, settings) as client:
        create(client, keys, f"{target.url}/slow")
        work(settings)
        wait_until(lambda: len(client.list(status="notified", limit=100)) == 16, timeout=30, what="all notified")
    assert sorted(call[0] for call in target.calls) == sorted(keys)  # each called once
    assert most_at_once((start, end) for _, _, start, end, _ in target.calls) == 4


def test_a_call_past_its_timeout_is_cancelled_and_retried_by_its_policy_never_two_at_once(db, target, work):
    policy = RetryPolicy.constant(3600, fast_retries=2)  # three calls, then a main retry an hour later
    with CallbackClient(db, SETTINGS) as client:
        create(client, ["stalls"], f"{target.url}/stall", retry=policy)
        create(client, ["quick"], f"{target.url}/ok")
        work()
        event = wait_until(
            lambda: (e := client.get("a", "g", "stalls")).main_retries and e, timeout=30, what="the main retry"
        )
        assert (event.status, event.attempts, event.last_error) == ("pending", 3, "timed out")
        assert client.get("a", "g", "quick").status == "notified"
    calls = target.of("stalls")
    assert len(calls) == 3 and all(cut for *_, cut in calls)  # each cut by the client at its deadline
    assert most_at_once((start, end) for _, _, start, end, _ in calls) == 1


class Launcher:
    """A Dagster launcher recording each launch as (event key, start, end); the first launch of an event whose
    key starts with ``hang`` blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.launches: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()

    def launch(self, job_name, *, run_key, run_config, tags):
        key = tags["cmb/callback"].rpartition("/")[2]
        started = time.monotonic()
        with self.lock:
            first = all(k != key for k, _, _ in self.launches)
        if key.startswith("hang") and first:
            self.release.wait(60)
        with self.lock:
            self.launches.append((key, started, time.monotonic()))
        return "run"

    def of(self, key: str) -> list[tuple[float, float]]:
        with self.lock:
            return [(start, end) for k, start, end in self.launches if k == key]


def test_a_launch_that_hangs_holds_its_event_until_it_ends_while_http_calls_and_launches_go_on(db, target, work):
    launcher = Launcher()
    policy = RetryPolicy.constant(3600, fast_retries=1)
    with CallbackClient(db, SETTINGS) as client:
        create(client, ["hang"], "dagster://nightly", retry=policy)
        work(launcher=launcher)
        try:
            wait_until(lambda: client.get("a", "g", "hang").attempts == 1, what="the hanging launch started")
            create(client, [f"web{i}" for i in range(8)], f"{target.url}/slow")
            create(client, ["other"], "dagster://nightly")
            wait_until(
                lambda: len(client.list(status="notified", limit=100)) == 9,
                timeout=30,
                what="the HTTP calls and the other launch done while a launch hangs",
            )
            time.sleep(2 * SETTINGS.timeout)  # a window past the launch's deadline, for what must not happen
            held = client.get("a", "g", "hang")  # still running: no outcome, no retry
            assert (held.status, held.attempts, held.main_retries, launcher.of("hang")) == ("pending", 1, 0, [])
        finally:
            launcher.release.set()
        wait_until(lambda: client.get("a", "g", "hang").status == "notified", what="the fast retry launched")
    first, second = launcher.of("hang")
    assert second[0] >= first[1]  # the retry started once the launch past its deadline had ended
    assert client.get("a", "g", "hang").attempts == 2


def test_a_worker_whose_every_call_slot_hangs_stops_with_worker_stuck(db):
    launcher = Launcher()
    settings = SETTINGS.model_copy(update={"worker_concurrency": 2})
    worker, raised = CallbackWorker(db, settings, launcher=launcher), []

    def run():
        try:
            worker.run()
        except WorkerStuck as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    try:
        with CallbackClient(db, settings) as client:
            create(client, ["hang0", "hang1"], "dagster://nightly")
            thread.start()
            wait_until(lambda: raised, timeout=30, what="WorkerStuck")
    finally:
        launcher.release.set()
        worker.stop()
        thread.join(30)
    assert "2 calls of user code are still running past their time limit" in str(raised[0])
