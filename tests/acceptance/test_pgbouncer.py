"""cmb behind PgBouncer in transaction pooling mode (pgbouncer 1.18: no prepared statements across transactions).

The pooler lends a server connection for one transaction at a time and shares few of them (2 here) among all its
clients. cmb is given two URLs: CMB_DATABASE_URL through the pooler, for work, and CMB_DIRECT_DATABASE_URL to the
server itself, for what lives in a session (LISTEN, lease renewals, migrations). These tests run real worker
processes of every engine that way and show what breaks when a session thing goes through the pooler: statements
prepared on one server connection and executed on another, session settings left on a connection other clients
get next, LISTENs that hear nothing. Skipped where the ``pgbouncer`` binary is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pgbouncer_handlers
import psycopg
import pytest
from pgbouncer import PgBouncer, unavailable_reason
from processes import stop
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings
from cmb_dagster.callbacks.sink import CallbackSink
from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database, OwnConnection
from cmb_dagster.errors import PooledDatabaseUrl
from cmb_dagster.eventqueue import emit_many, register
from cmb_dagster.notifications import Listener
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, publish
from cmb_dagster.stages import StageStore
from cmb_dagster.workers import Leases, list_leases

SKIP = unavailable_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

CMB = str(Path(sys.executable).with_name("cmb-dagster"))
WAKE = pgbouncer_handlers.IDLE / 4
"""How long a test waits for an idle worker to take new work: only a notification wakes it that soon."""


@dataclass(frozen=True)
class Urls:
    pooled: str
    direct: str

    def database(self) -> Database:
        return Database(self.pooled, direct_url=self.direct)


@pytest.fixture(scope="module")
def bouncer(server_url: str) -> Iterator[PgBouncer]:
    with PgBouncer(server_url, pool_size=2) as running:
        yield running


def _dbname(url: str) -> str:
    return conninfo_to_dict(url)["dbname"]


@pytest.fixture
def urls(database_url: str, bouncer: PgBouncer) -> Urls:
    """The test database through the pooler and directly; its sessions find cmb tables (see docs/operations.md)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET search_path = cmb, public").format(sql.Identifier(_dbname(database_url)))
        )
    return Urls(bouncer.url(_dbname(database_url)), database_url)


@pytest.fixture
def db(urls: Urls) -> Iterator[Database]:
    database = urls.database()
    yield database
    database.close()


# -- the rules, in one process ----------------------------------------------------------------------------------------


def test_a_pooler_url_given_as_the_server_is_refused_naming_the_direct_url_setting(urls: Urls) -> None:
    database = Database(urls.pooled)  # no direct URL: taken for the server itself
    with pytest.raises(PooledDatabaseUrl, match="CMB_DIRECT_DATABASE_URL") as refused:
        database.ensure_ready()
    assert "127.0.0.1" in str(refused.value)


def test_a_pooled_url_whose_sessions_miss_the_cmb_schema_is_refused(database_url: str, bouncer: PgBouncer) -> None:
    database = Database(bouncer.url(_dbname(database_url)), direct_url=database_url)
    with pytest.raises(PooledDatabaseUrl, match="search_path = cmb, public"):
        database.ensure_ready()


def test_statements_repeated_by_concurrent_clients_run_through_the_pooler(db: Database) -> None:
    errors: list[BaseException] = []

    def client() -> None:
        own = OwnConnection(db)
        try:
            for n in range(40):
                with db.connection() as conn:
                    conn.execute("SELECT count(*) FROM leases WHERE kind = %s", (f"k{n % 3}",)).fetchone()
                own.get().execute("SELECT count(*) FROM flow_slots WHERE holder = %s", (str(n),)).fetchone()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=client) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


def test_own_connections_leave_no_session_setting_on_the_poolers_server_connections(db: Database) -> None:
    own = OwnConnection(db, settings={"idle_in_transaction_session_timeout": "4321ms"})
    own.get().execute("SELECT 1")
    # both server connections of the pool, each held by a transaction: one of them ran the settings of `own`, if any
    with db.connection() as a, db.connection() as b:
        seen = {conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] for conn in (a, b)}
    own.close()
    assert "4321ms" not in seen


def test_a_listener_hears_notifications_sent_through_the_pooler(db: Database) -> None:
    heard: list[str | None] = []
    with Listener(db, ["cmb.bouncer"], lambda channel, payload: heard.append(payload), heartbeat=0.5) as listener:
        wait_until(listener.connected.is_set, 10, "the listener connected")
        for n in range(5):  # transactions on the pooler's server connections, the listener's among them if it used one
            with db.connection() as conn:
                conn.execute("SELECT pg_notify('cmb.bouncer', %s)", (str(n),))
        wait_until(lambda: {"0", "1", "2", "3", "4"} <= set(heard), 10, "every notification heard")


def test_leases_are_renewed_while_work_holds_every_server_connection_of_the_pooler(db: Database) -> None:
    leases = Leases(db, "test.kind", owner="a", ttl=3.0)
    assert leases.acquire(["p"]).keys() == {"p"}
    renewed = threading.Event()
    with db.connection() as a, db.connection() as b:  # both server connections of the pooler, in transactions
        for conn in (a, b):
            conn.execute("SELECT 1")
        renewal = threading.Thread(target=lambda: leases.acquire(["p"]) and renewed.set(), daemon=True)
        renewal.start()
        wait_until(renewed.is_set, leases.ttl / 3, "the lease renewed while the pooler is busy")


def test_a_pubsub_handler_past_its_timeout_has_its_transaction_ended_through_the_pooler(db: Database) -> None:
    release, calls = threading.Event(), []

    def hang_once(conn: psycopg.Connection, events: list) -> None:
        calls.append(len(events))
        if len(calls) == 1:
            release.wait(60)

    with db.connection() as conn:
        publish(0, {"n": 0}, topic="work", conn=conn)
    spec = ConsumerSpec(consumer_id="slow", handler=hang_once, handler_timeout=1, lease_ttl=3.0)

    def idle_in_transaction() -> int:
        with psycopg.connect(db.direct_url, autocommit=True) as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in%'"
            return conn.execute(query).fetchone()[0]

    with Running(ConsumerWorker(db, spec)):
        try:
            wait_until(lambda: calls and idle_in_transaction() == 0, 20, "the hung call's transaction ended")
            assert calls == [1], "the batch is not delivered again while its call runs"
        finally:
            release.set()
    # the worker stopped as stuck (its call ran past twice its limit), or went on once the call ended: either way,
    # a worker delivers the batch again
    with Running(ConsumerWorker(db, spec)):
        wait_until(lambda: len(calls) >= 2, 20, "the batch delivered again after the hung call ended")


# -- worker processes of each engine ------------------------------------------------------------------------------


class Workers:
    """Worker processes with the pooled and the direct URL; their logs and user-code calls under ``tmp_path``."""

    def __init__(self, urls: Urls, tmp_path: Path) -> None:
        self.urls = urls
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, program: str = CMB) -> None:
        environment = {
            **os.environ,
            "CMB_DATABASE_URL": self.urls.pooled,
            "CMB_DIRECT_DATABASE_URL": self.urls.direct,
            "CMB_TEST_CALLS": str(self.tmp_path / "calls.jsonl"),
            "PYTHONPATH": str(Path(__file__).parent),
        }
        with (self.tmp_path / "workers.log").open("ab") as out:
            self.procs.append(subprocess.Popen([program, *args], env=environment, stdout=out, stderr=subprocess.STDOUT))

    def script(self, function: str) -> None:
        self.start("-c", f"import pgbouncer_handlers as h; h.{function}()", program=sys.executable)

    def called(self) -> list:
        """Every item user code was called with so far."""
        path = self.tmp_path / "calls.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [item for line in lines for item in json.loads(line)[2]]

    def log(self) -> str:
        path = self.tmp_path / "workers.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        """wait_until, failing with the end of the workers' log."""

        def done() -> bool:
            if any(proc.poll() is not None for proc in self.procs):
                raise AssertionError(f"a worker exited before {what}; the workers' log:\n{self.log()[-3000:]}")
            return bool(predicate())

        try:
            wait_until(done, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the workers' log ends with:\n{self.log()[-3000:]}") from None

    def check_log(self) -> None:
        """Nothing failed in the workers: no error, no retried database call (a lost prepared statement...)."""
        bad = [line for line in self.log().splitlines() if " ERROR " in line or "WARNING cmb_dagster" in line]
        assert not bad, "\n".join(bad[:10])


@pytest.fixture
def workers(urls: Urls, tmp_path: Path) -> Iterator[Workers]:
    running = Workers(urls, tmp_path)
    try:
        yield running
    finally:
        stop(running.procs)


def _holds(db: Database, kind: str) -> bool:
    return any(lease.kind == kind and lease.expires_in > 0 for lease in list_leases(db))


def test_callbacks_worker_through_the_pooler(db: Database, workers: Workers) -> None:
    settings = CallbackSettings(allowed_hosts=["127.0.0.1"])
    with CallbackSink() as sink, CallbackClient(db, settings) as client:

        def give(keys: range) -> None:
            now = datetime.now(UTC)
            client.create_many(
                {"owner_client_id": "a", "group_key": "g", "event_key": f"k{i}", "run_at": now, "cb_url": sink.url}
                for i in keys
            )

        give(range(200))
        poll = 2 * WAKE  # a call's timeout plus the poll interval stay under 2/3 of the lease TTL
        workers.start("callbacks", "worker", "--poll-interval", str(poll), "--timeout", "5",
                      "--lease-ttl", str(3 * poll),
                      "--allow-host", "127.0.0.1")  # fmt: skip
        workers.wait(lambda: sink.count >= 200, 60, "the first 200 callbacks delivered")
        give(range(200, 201))  # to an idle worker: its NOTIFY wakes it
        workers.wait(lambda: sink.count >= 201, WAKE, "a callback given to the idle worker delivered")
    workers.check_log()


def test_pubsub_consumer_through_the_pooler(db: Database, workers: Workers) -> None:
    with db.connection() as conn:
        for n in range(300):
            publish(0, {"n": n}, topic="work", conn=conn)
    workers.script("pubsub_worker")
    workers.wait(lambda: len(workers.called()) >= 300, 60, "the first 300 events delivered")
    with db.connection() as conn:
        publish(0, {"n": 300}, topic="work", conn=conn)
    workers.wait(lambda: 300 in workers.called(), WAKE, "an event published to the idle consumer delivered")
    assert sorted(workers.called()) == list(range(301))
    workers.check_log()


def test_eventqueue_worker_through_the_pooler(db: Database, workers: Workers) -> None:
    register(db, pgbouncer_handlers.eventqueue)
    emit_many([{"namespace": "ns", "handler": "record", "value": i} for i in range(300)], db=db)
    workers.start("events", "worker", "--handlers", "pgbouncer_handlers:eventqueue",
                  "--sweep-interval", str(pgbouncer_handlers.IDLE))  # fmt: skip
    workers.wait(lambda: len(workers.called()) >= 300, 60, "the first 300 events handled")
    emit_many([{"namespace": "ns", "handler": "record", "value": 300}], db=db)
    workers.wait(lambda: 300 in workers.called(), WAKE, "an event emitted to the idle worker handled")
    workers.check_log()


def test_stages_worker_through_the_pooler(db: Database, workers: Workers) -> None:
    store = StageStore(db, pgbouncer_handlers.stages.stages)
    store.put_many({f"e{i}": {"n": i} for i in range(300)})
    workers.start("stages", "worker", "--stages", "pgbouncer_handlers:stages")
    workers.wait(lambda: len(set(workers.called())) >= 300, 60, "the first 300 entities processed")
    store.put_many({"late": {"n": 300}})
    workers.wait(lambda: "late" in workers.called(), WAKE, "an entity written for the idle worker processed")
    workers.check_log()


def test_reactive_scheduler_through_the_pooler(db: Database, workers: Workers) -> None:
    store = CtlStore(db, actor="producer")
    base = datetime(2024, 5, 1, tzinfo=UTC)
    workers.script("reactive_worker")
    wait_until(lambda: _holds(db, "reactive.scheduler"), 30, "the scheduler holds its lease")
    for step in range(1, 6):
        for i in range(pgbouncer_handlers.REACTIVE_TASKS):
            store.set(f"e{i}", "p", base + timedelta(seconds=step))
        workers.wait(lambda: len(workers.called()) >= pgbouncer_handlers.REACTIVE_TASKS, 30, "launches")
    expected = {f"t{i}" for i in range(pgbouncer_handlers.REACTIVE_TASKS)}
    workers.wait(lambda: expected <= set(workers.called()), 30, "every task launched")
    workers.check_log()
