"""The isolation rule in the callbacks engine: one bad, big or slow event affects only itself."""

import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import psycopg
import pytest
from running import Running
from sessions_helpers import CommitWatchingDatabase
from waiting import wait_until

from cmb_dagster.callbacks import (
    CallbackClient,
    CallbackSettings,
    CallbackTimeout,
    CallbackWorker,
    InvalidCallbackInput,
    RetryPolicy,
    sql,
)
from cmb_dagster.callbacks.client import CREATE_CHUNK
from cmb_dagster.database import Database
from cmb_dagster.errors import InvalidInput
from cmb_dagster.inputs import DEFAULT_MAX_PAYLOAD_BYTES, MAX_PAYLOAD_ENV
from cmb_dagster.models import Backoff

TUNING = {
    "poll_interval": 0.2,
    "lease_ttl": 3,
    "timeout": 1,
    "backoff": Backoff(first=0.01),
    "lookahead": 1,
    "allowed_hosts": ["127.0.0.1"],
}
LATER = timedelta(hours=1)
ONCE = RetryPolicy.constant(3600, fast_retries=0)  # one call, then a main retry an hour later


def count(db: Database, table: str) -> int:
    with db.connection() as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


# -- the shared input checks --------------------------------------------------------------------------


def test_the_context_limit_is_the_shared_payload_limit(db, monkeypatch):
    monkeypatch.delenv(MAX_PAYLOAD_ENV, raising=False)
    assert CallbackSettings().max_context_bytes == DEFAULT_MAX_PAYLOAD_BYTES
    with CallbackClient(db, CallbackSettings(**TUNING)) as client:
        assert client.create("a", "g", "100k", datetime.now(UTC) + LATER, "http://127.0.0.1:9/cb", {"x": "y" * 100_000})
    monkeypatch.setenv(MAX_PAYLOAD_ENV, "2048")
    assert CallbackSettings().max_context_bytes == 2048
    assert CallbackSettings(max_context_bytes=10_000).max_context_bytes == 10_000  # an explicit value wins
    monkeypatch.setenv(MAX_PAYLOAD_ENV, str(64 * 2**20))
    assert CallbackSettings().max_context_bytes == 16 * 2**20  # the context's own bound stays
    monkeypatch.setenv(MAX_PAYLOAD_ENV, "2048")
    with (
        CallbackClient(db, CallbackSettings(**TUNING)) as client,
        pytest.raises(
            InvalidCallbackInput, match=rf"^context: 3008 bytes as JSON, at most 2048 allowed \({MAX_PAYLOAD_ENV}\)"
        ),
    ):
        client.create("a", "g", "3k", datetime.now(UTC) + LATER, "http://127.0.0.1:9/cb", {"x": "y" * 3000})


BAD_CONTEXTS = {
    "nul": {"x": "a\u0000b"},
    "lone surrogate": {"x": "\ud800"},
    "nan": {"x": float("nan")},
    "over the limit": {"x": "y" * 3000},
}


def _create(client, context):
    client.create("a", "g", "k", datetime.now(UTC) + LATER, "http://127.0.0.1:9/cb", context)


def _create_many(client, context):
    events = [
        {
            "owner_client_id": "a",
            "group_key": "g",
            "event_key": f"k{i}",
            "run_at": datetime.now(UTC) + LATER,
            "cb_url": "http://127.0.0.1:9/cb",
            "context": context if i == 1 else {"i": i},
        }
        for i in range(3)
    ]
    client.create_many(events)


def _create_schedule(client, context):
    client.create_schedule("a", "g", "s", "*/5 * * * *", "http://127.0.0.1:9/cb", context=context)


def _update(client, context):
    client.update("a", "g", "stored", context=context)


@pytest.mark.parametrize("bad", BAD_CONTEXTS.values(), ids=BAD_CONTEXTS.keys())
@pytest.mark.parametrize("path", [_create, _create_many, _create_schedule, _update])
def test_every_create_path_refuses_a_bad_context_naming_it_and_writes_nothing(db, monkeypatch, path, bad):
    monkeypatch.setenv(MAX_PAYLOAD_ENV, "2048")
    with CallbackClient(db, CallbackSettings(**TUNING)) as client:
        client.create("a", "g", "stored", datetime.now(UTC) + LATER, "http://127.0.0.1:9/cb", {"v": 1})
        with pytest.raises(InvalidCallbackInput, match="^context: ") as raised:
            path(client, bad)
        assert isinstance(raised.value, InvalidInput)
        assert [e.event_key for e in client.list()] == ["stored"] and client.get("a", "g", "stored").context == {"v": 1}
    assert count(db, "callback_schedules") == count(db, "callback_change_log") == 0


# -- one bad schedule ----------------------------------------------------------------------------------


def test_a_schedule_that_cannot_be_materialized_is_skipped_and_the_others_go_on(db, caplog):
    with CallbackClient(db, CallbackSettings(**TUNING)) as client:
        for key in ("bad", "good"):
            client.create_schedule("a", "g", key, "* * * * *", "http://127.0.0.1:9/cb", horizon=600)
        with db.connection() as conn:  # as stored by an older version that accepted it
            conn.execute("""UPDATE callback_schedules SET retry = retry || '{"stop_after_delay": 1e20}'
                            WHERE schedule_key = 'bad'""")
        assert client.materialize_schedules() >= 10
        assert {e.event_key.partition("@")[0] for e in client.list(limit=1000)} == {"good"}
        assert "schedule a/g/bad skipped: ValidationError: " in caplog.text
        assert isinstance(client.get_schedule("a", "g", "bad").retry, dict)  # still readable: list, delete work
        assert [s.schedule_key for s in client.list_schedules()] == ["bad", "good"]


# -- error text from the outside world is sanitised before it is stored --------------------------------


class Endpoint:
    """An HTTP server on 127.0.0.1: ``/poison`` answers ``500 bad<NUL>reason``, every other path 200."""

    def __init__(self):
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                path = urlsplit(self.path).path
                calls.append(path)
                if path == "/poison":
                    self.send_response(500, "bad\x00reason")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    served = Endpoint()
    yield served
    served.close()


@pytest.fixture
def work(db):
    """Start a CallbackWorker on a thread; stopped by the teardown."""
    started = []
    yield lambda **kwargs: started.append(Running(CallbackWorker(db, CallbackSettings(**TUNING), **kwargs)))
    for running in started:
        running.stop()


def test_a_status_line_with_a_nul_is_stored_sanitised_and_the_rest_of_the_batch_is_delivered(db, endpoint, work):
    with CallbackClient(db, CallbackSettings(**TUNING)) as client:
        client.set_bucket_count(1)  # every event in one bucket: their outcomes are written together
        now = datetime.now(UTC)
        client.create_many(
            [
                {
                    "owner_client_id": "a",
                    "group_key": "g",
                    "event_key": key,
                    "run_at": now,
                    "cb_url": f"{endpoint.url}/{'poison' if key == 'poison' else 'ok'}",
                    "retry": ONCE,
                }
                for key in ["ok0", "ok1", "poison", "ok2", "ok3"]
            ]
        )
        work()
        wait_until(
            lambda: client.get("a", "g", "poison").main_retries == 1 and not client.list(status="pending")[1:],
            what="the poison event retried, the others finished",
        )
        poison = client.get("a", "g", "poison")
        assert (poison.status, poison.attempts, poison.last_error) == ("pending", 1, "HTTP 500 bad\\0reason")
        others = [e for e in client.list() if e.event_key != "poison"]
        assert [(e.status, e.attempts, e.last_error) for e in others] == [("notified", 1, None)] * 4
    assert sorted(endpoint.calls) == ["/ok"] * 4 + ["/poison"]


class BrokenMessage(Exception):
    def __str__(self):
        raise RuntimeError("no message")


class Launcher:
    """A Dagster launcher that raises ``error`` for every run."""

    def __init__(self, error):
        self.error = error

    def launch(self, job_name, *, run_key, run_config, tags):
        raise self.error


@pytest.mark.parametrize(
    ("error", "stored"),
    [
        (RuntimeError("boom\x00here"), "Dagster launch failed: RuntimeError: boom\\0here"),
        (RuntimeError("lone \ud800"), "Dagster launch failed: RuntimeError: lone \ufffd"),
        (BrokenMessage(), "Dagster launch failed: BrokenMessage: (its message could not be read)"),
        (LookupError("no\x00job"), "no run of Dagster job 'nightly': LookupError: no\\0job"),
    ],
)
def test_a_launch_error_is_stored_sanitised(db, work, error, stored):
    with CallbackClient(db, CallbackSettings(**TUNING)) as client:
        client.create("a", "g", "k", datetime.now(UTC), "dagster://nightly", retry=ONCE)
        work(launcher=Launcher(error))
        event = wait_until(lambda: (e := client.get("a", "g", "k")).attempts and e.last_error and e, what="an outcome")
        assert event.last_error == stored


# -- two tenants share no lock ---------------------------------------------------------------------------


def test_two_tenants_in_one_database_never_wait_on_each_others_event_id_lock(database_url):
    ta, tb = Database(database_url, schema="ta"), Database(database_url, schema="tb")
    settings = CallbackSettings(**TUNING, create_timeout=5)  # b within 5 s even on a loaded machine
    try:
        with ta.connection() as holder, CallbackClient(ta, settings) as a, CallbackClient(tb, settings) as b:
            holder.execute(sql.LOCK_EVENT_IDS_EXCLUSIVE)  # as a change of ta's bucket count holds it
            assert b.create("b", "g", "k", datetime.now(UTC) + LATER, "http://127.0.0.1:9/cb")
            with pytest.raises(CallbackTimeout):
                a.create("a", "g", "k", datetime.now(UTC) + LATER, "http://127.0.0.1:9/cb")
    finally:
        ta.close()
        tb.close()


# -- no commit inside a pipeline ----------------------------------------------------------------------


def test_create_many_the_gate_and_the_outcome_writes_commit_outside_their_pipelines(database_url, endpoint):
    db = CommitWatchingDatabase(database_url)
    try:
        with CallbackClient(db, CallbackSettings(**TUNING)) as client:
            now = datetime.now(UTC)
            client.create_many(  # more than one chunk: inserted in a pipeline
                [
                    {
                        "owner_client_id": "a",
                        "group_key": "g",
                        "event_key": f"k{i:03}",
                        "run_at": now if i < 5 else now + LATER,
                        "cb_url": f"{endpoint.url}/ok",
                    }
                    for i in range(CREATE_CHUNK + 1)
                ]
            )
            assert db.commits_in_pipeline and not any(db.commits_in_pipeline)
            created = len(db.commits_in_pipeline)
            with Running(CallbackWorker(db, CallbackSettings(**TUNING))):
                wait_until(lambda: len(client.list(status="notified")) == 5, what="the due events notified")
    finally:
        db.close()
    # at least one gate and one outcome write besides
    assert len(db.commits_in_pipeline) >= created + 2 and not any(db.commits_in_pipeline)


def _socket_url(database_url: str) -> str:
    with psycopg.connect(database_url) as conn:
        directories = conn.execute("SHOW unix_socket_directories").fetchone()[0]
        port = conn.execute("SHOW port").fetchone()[0]
    directory = directories.split(",")[0].strip()
    if not directory:
        pytest.skip("the server listens on no unix socket")
    return f"postgresql://postgres@/{urlsplit(database_url).path.lstrip('/')}?host={directory}&port={port}"


def test_a_create_many_of_10_mb_of_contexts_commits_within_a_minute_over_the_unix_socket(database_url):
    """The commit is never sent inside a pipeline, where it can wait forever on large data (psycopg #685)."""
    db = Database(_socket_url(database_url))
    at = datetime.now(UTC) + LATER
    events = [
        {
            "owner_client_id": "a",
            "group_key": "g",
            "event_key": f"k{i}",
            "run_at": at,
            "cb_url": "http://127.0.0.1:9/cb",
            "context": {"blob": f"{i:04}" + "x" * 25_000},
        }
        for i in range(400)
    ]
    ids = []
    try:
        with CallbackClient(db, CallbackSettings(**TUNING)) as client:
            creating = threading.Thread(target=lambda: ids.extend(client.create_many(events)), daemon=True)
            creating.start()
            creating.join(60)
            assert not creating.is_alive(), "create_many hung (a commit blocked inside a pipeline?)"
            assert len(ids) == 400 and client.get("a", "g", "k399").context == events[399]["context"]
    finally:
        db.close()
