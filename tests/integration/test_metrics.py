"""The metrics endpoint: a real HTTP server on 127.0.0.1 scraped while real engines write real rows; the figures
match each engine's status, an engine that fails leaves the others, every statement it runs is index-driven
without statistics, a scrape answers in time with the database host gone or a table locked, concurrent scrapes
share one reading, no secret is served, and ``cmb-dagster metrics`` runs as a child process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from plans import rows_read
from psycopg import sql
from psycopg_pool import ConnectionPool
from runs import RunStorage
from scrapes import failed_engines, names, parse, scrape, scrapes_at_once, value
from stages_helpers import Step, drain, pipeline
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient
from cmb_dagster.callbacks import admin as callbacks_admin
from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import CONNECT_TIMEOUT_S, Database
from cmb_dagster.errors import ConfigError
from cmb_dagster.eventqueue import HandlerRegistry, emit, register
from cmb_dagster.eventqueue import admin as eventqueue_admin
from cmb_dagster.metrics import CACHE_S, ENGINES, READ_TIMEOUT_S, MetricsServer, StatusCollector, check_host, serve
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, publish
from cmb_dagster.pubsub import admin as pubsub_admin
from cmb_dagster.reactive import Deadline, ReactiveWorker, SchedulerSettings, TaskSpec
from cmb_dagster.reactive import admin as reactive_admin
from cmb_dagster.stages import StageStore, StageWorker
from cmb_dagster.stages import admin as stages_admin
from cmb_dagster.triggers import Delta
from cmb_dagster.workers import Leases

BIG_TABLES = {
    "callback_events",
    "stage_queue",
    "stage_changes",
    "stage_entities",
    "stage_states",
    "eventqueue_events",
    "eventqueue_dead",
    "pubsub_events",
    "pubsub_dead_letters",
    "reactive_launches",
}
"""Tables that grow with the work done: a statement of the metrics must never scan one whole."""


@pytest.fixture
def served(db: Database) -> Iterator[MetricsServer]:
    server = serve(db, host="127.0.0.1", port=0, bucket_sets=2)
    yield server
    server.stop()


# -- what the engines write ---------------------------------------------------------------------------------------

T0 = datetime(2024, 5, 1, tzinfo=UTC)


class Failing(Step):
    """A stage whose calls all fail: its entries stay in the queue, failing."""

    def process(self, entity, state):  # type: ignore[no-untyped-def]
        raise RuntimeError("always")


def write_through_the_engines(db: Database) -> None:
    now = datetime.now(UTC)
    with CallbackClient(db, buffered=False) as client:
        for i in range(12):
            client.create("metrics", "g", f"due-{i}", now - timedelta(minutes=i + 1), "https://example.com/cb")
        for i in range(5):
            client.create("metrics", "g", f"later-{i}", now + timedelta(hours=1), "https://example.com/cb")
        client.disable_endpoint("metrics", "https://example.com/down")
    stages = [*pipeline(), Failing("broken", "a", "z")]
    StageStore(db, stages).put_many({f"e{i}": {"a": i} for i in range(4)})
    drain(StageWorker(db, stages))
    registry = HandlerRegistry()
    registry.add("h", lambda event: None)
    register(db, registry)
    for i in range(3):
        emit("ns", "h", i, db=db)
    emit("ns", "h", "later", delay=3600, db=db)
    with db.connection() as conn:
        for n in range(5):
            publish(0, {"n": n}, conn=conn)
    ConsumerWorker(db, ConsumerSpec(consumer_id="reader", handler=lambda conn, events: None, batch_size=2)).run_once()
    CtlStore(db).set("sales", "loaded_until", T0)
    runs = RunStorage()
    tasks = [
        TaskSpec(name="mart", trigger=Delta("sales", "loaded_until", "1h")),
        TaskSpec(name="due", trigger=Delta("sales", "loaded_until", "1h"), deadline=Deadline(cron="* * * * *")),
    ]
    ReactiveWorker(
        db,
        SchedulerSettings(tick_seconds=1, idle_sleep=60),
        name="w",
        tasks=tasks,
        runs=runs.lookup,
        launch=runs.launch,
    ).run(duration=1.0)
    Leases(db, "metrics.test", "holder", ttl=60).acquire(["p1"])


def test_a_scrape_reports_what_each_engine_status_says(db, served):
    write_through_the_engines(db)
    samples = parse(scrape(served.url))

    for engine in ENGINES:
        assert value(samples, "cmb_scrape_errors", engine=engine) == 0
    by_set = callbacks_admin.status(db, bucket_sets=2, totals=False).bucket_sets
    assert sum(row.pending for row in by_set) == 17 and sum(row.overdue for row in by_set) == 12
    for row in by_set:
        key = str(row.bucket_set)
        assert value(samples, "cmb_callbacks_pending", bucket_set=key) == row.pending
        assert value(samples, "cmb_callbacks_overdue", bucket_set=key) == row.overdue
        assert value(samples, "cmb_callbacks_depth_exact", bucket_set=key) == 1
        assert (
            abs(value(samples, "cmb_callbacks_oldest_overdue_seconds", bucket_set=key) - row.oldest_overdue_seconds) < 5
        )
    assert value(samples, "cmb_callbacks_endpoints", state="disabled") == 1
    assert value(samples, "cmb_callbacks_endpoints", state="open") == 0

    stages = stages_admin.status(db)
    assert value(samples, "cmb_stages_shards") == stages.shard_count
    assert stages.stage("broken").failing == 4 and stages.stage("first").processed == 4
    for row in stages.stages:
        for figure in ("queued", "timers", "low_priority", "parked", "failing"):
            assert value(samples, f"cmb_stages_{figure}", stage=row.stage) == getattr(row, figure), figure
        for figure in ("processed", "changed", "conflicts", "errors", "capped"):
            assert value(samples, f"cmb_stages_{figure}_total", stage=row.stage) == getattr(row, figure), figure

    (handler,) = eventqueue_admin.status(db).handlers
    assert (handler.queued, handler.delayed) == (3, 1)
    for figure in ("queued", "delayed", "locked", "held", "dead"):
        assert value(samples, f"cmb_eventqueue_{figure}", handler="h", kind="python") == getattr(handler, figure)

    lags = {lag.consumer_id: lag for lag in pubsub_admin.status(db).consumers}
    assert lags["reader"].events == 3
    for lag in lags.values():
        labels = {"consumer_id": lag.consumer_id, "branch": str(lag.branch_id)}
        assert value(samples, "cmb_pubsub_lag_events", **labels) == lag.events
        assert value(samples, "cmb_pubsub_parked", **labels) == lag.parked

    reactive = reactive_admin.status(db)
    for state, count in reactive.counts.items():
        assert value(samples, "cmb_reactive_tasks", scheduler="w", state=state) == count
    assert 0 <= value(samples, "cmb_reactive_tick_age_seconds", scheduler="w") < 60
    [scheduler] = reactive.schedulers
    [due] = [t for t in reactive.tasks if t.name == "due"]
    slack = value(samples, "cmb_reactive_deadline_slack_seconds", scheduler="w", task="due")
    assert abs(slack - due.deadline_state(datetime.now(UTC)).slack.total_seconds()) < 30 and -120 < slack <= 60
    assert not [k for k in samples if k[0] == "cmb_reactive_deadline_slack_seconds" and ("task", "mart") in k[1]]
    assert value(samples, "cmb_reactive_tick_duration_seconds", scheduler="w") == scheduler.tick_seconds

    lease = value(samples, "cmb_worker_lease_expires_in_seconds", kind="metrics.test", partition="p1", owner="holder")
    assert 0 < lease <= 60
    released = [
        v
        for (name, labels), v in samples.items()
        if name.startswith("cmb_worker_lease") and ("kind", "reactive.scheduler") in labels
    ]
    assert released == []  # the reactive scheduler released its lease after its tick: nobody holds it, no series


def test_an_empty_database_exports_zeros_and_no_error(db, served):
    samples = parse(scrape(served.url))
    for engine in ENGINES:
        assert value(samples, "cmb_scrape_errors", engine=engine) == 0
    assert value(samples, "cmb_callbacks_pending", bucket_set="0") == 0
    assert value(samples, "cmb_callbacks_pending", bucket_set="1") == 0
    assert value(samples, "cmb_stages_shards") == 8
    assert not {n for n in names(samples) if n.startswith(("cmb_pubsub", "cmb_eventqueue", "cmb_worker"))}


def test_an_engine_that_fails_leaves_the_others_and_counts_a_scrape_error(db, served):
    with db.connection() as conn:
        conn.execute("ALTER TABLE stage_queue RENAME TO stage_queue_away")
    samples = parse(scrape(served.url))
    assert value(samples, "cmb_scrape_errors", engine="stages") == 1
    assert not {n for n in names(samples) if n.startswith("cmb_stages")}
    assert {value(samples, "cmb_scrape_errors", engine=e) for e in ENGINES if e != "stages"} == {0}
    assert value(samples, "cmb_callbacks_pending", bucket_set="0") == 0


def test_callback_depths_are_exact_up_to_the_bound_and_estimated_above(db):
    bound = callbacks_admin.EXACT_UP_TO
    with db.connection() as conn:  # one bucket deep (random run_at over two hours around now), one shallow
        conn.execute(
            """
            INSERT INTO callback_events (event_id, bucket_id, owner_client_id, group_key, event_key, run_at,
                                         originally_run_at, cb_url, retry)
            SELECT nextval('callback_event_ids'), CASE WHEN i <= 10 THEN 1 ELSE 0 END, 'o', 'g', i::text,
                   now() + make_interval(secs => (random() - 0.5) * 7200), now(), 'http://x', '{}'
            FROM generate_series(1, %s) AS i
            """,
            (20 * bound + 10,),
        )
        overdue = conn.execute("SELECT count(*) FROM callback_events WHERE bucket_id = 0 AND run_at < now()")
        true_overdue = overdue.fetchone()[0]
    deep, shallow = callbacks_admin.depths(db, bucket_sets=2)
    assert (shallow.pending, shallow.exact) == (10, True)
    assert not deep.exact and abs(deep.pending - 20 * bound) < 0.2 * 20 * bound
    assert abs(deep.overdue - true_overdue) < 0.2 * true_overdue
    (both,) = callbacks_admin.depths(db, bucket_sets=1)
    assert not both.exact and both.oldest_overdue_seconds > 3000  # the oldest age is always read, never estimated


# -- every statement of a scrape reads indexes, without statistics ----------------------------------------------


def load_big_tables(db: Database) -> None:
    """Tens of thousands of rows in each big table, by bulk inserts into the engines' tables (no ANALYZE, and none by
    autovacuum on a server that runs it: the embedded one)."""
    with db.connection() as conn:
        for table in sorted(BIG_TABLES):
            conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(sql.Identifier(table)))
        conn.execute(
            """
            INSERT INTO callback_events (event_id, bucket_id, owner_client_id, group_key, event_key, status, run_at,
                                         originally_run_at, cb_url, retry, finished_at)
            SELECT nextval('callback_event_ids'), i % 4, 'o', 'g', i::text,
                   CASE WHEN i % 3 = 0 THEN 'notified' ELSE 'pending' END,
                   now() + make_interval(secs => i % 3600 - 1800), now(), 'http://x', '{}',
                   CASE WHEN i % 3 = 0 THEN now() END
            FROM generate_series(1, 60000) AS i
            """
        )
        conn.execute(
            """
            INSERT INTO stage_queue (entity_id, stage, shard_id, lane, due_at, attempts, parked_at)
            SELECT 'e' || i, s, stage_hash('e' || i) % 8, (i % 5 = 0)::int,
                   now() + make_interval(secs => i % 600 - 300), (i % 7 = 0)::int, CASE WHEN i % 11 = 0 THEN now() END
            FROM generate_series(1, 20000) AS i, unnest(ARRAY['first', 'second']) AS s
            """
        )
        conn.execute(
            "INSERT INTO stage_changes (entity_id, shard_id) SELECT 'e' || i, i % 8 FROM generate_series(1, 20000) i"
        )
        conn.execute(
            """
            INSERT INTO eventqueue_handlers (name, lock_expiry_seconds, max_retries, retry_delay_seconds,
                                             max_retry_delay_seconds)
            VALUES ('h1', 60, 3, 1, 60), ('h2', 60, 3, 1, 60)
            """
        )
        conn.execute(
            """
            INSERT INTO eventqueue_events (namespace, module, handler, modifier, value, delay_until, visible_at,
                                           locked_at)
            SELECT 'ns', 'm', CASE WHEN i % 2 = 0 THEN 'h1' ELSE 'h2' END, 'x', '1',
                   now() + make_interval(secs => i % 100 - 50),
                   CASE WHEN i % 13 = 0 THEN 'infinity' ELSE now() + make_interval(secs => i % 100 - 50) END,
                   CASE WHEN i % 17 = 0 THEN now() END
            FROM generate_series(1, 40000) AS i
            """
        )
        conn.execute(
            """
            INSERT INTO eventqueue_dead (id, namespace, module, handler, modifier, value, retries, enqueued_at, error,
                                         traceback)
            SELECT i, 'ns', 'm', CASE WHEN i % 2 = 0 THEN 'h1' ELSE 'h2' END, 'x', '1', 3, now(), 'e', 't'
            FROM generate_series(1, 20000) AS i
            """
        )
    ConsumerWorker(db, ConsumerSpec(consumer_id="reader", handler=lambda conn, events: None)).run_once()
    with db.connection() as conn:
        conn.execute(
            "INSERT INTO pubsub_events (branch_id, topic, op, payload) "
            "SELECT 0, 'default', 'publish', '{}' FROM generate_series(1, 40000)"
        )
        conn.execute(
            """
            INSERT INTO pubsub_dead_letters (consumer_id, branch_id, event_id, txid, topic, op, payload, created_at,
                                             error, attempts, first_failed_at, last_failed_at)
            SELECT 'reader', 0, id, txid, topic, op, payload, created_at, 'e', 1, now(), now()
            FROM pubsub_events WHERE id % 4 = 0
            """
        )


class Recorded:
    """Every statement the connections of a pool run, with its parameters."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, object]] = []
        recorder = self

        class Cursor(psycopg.Cursor):
            def execute(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def]
                recorder.statements.append((query, params))
                return super().execute(query, params, **kwargs)

        self.cursor = Cursor


def whole_scans(plan: dict, parent: str = "") -> list[str]:
    """Big tables the plan reads whole: a Seq Scan, a bitmap of a whole index, an index scan without a condition
    (unless a Limit stops it)."""
    kind, table = plan["Node Type"], plan.get("Relation Name")
    found = []
    if kind == "Seq Scan" and table in BIG_TABLES:
        found.append(f"Seq Scan on {table}")
    elif kind == "Bitmap Index Scan" and "Index Cond" not in plan:
        found.append(f"whole {plan['Index Name']}")
    elif kind in ("Index Scan", "Index Only Scan") and table in BIG_TABLES and "Index Cond" not in plan:
        found += [f"whole {plan['Index Name']}"] if parent != "Limit" else []
    for child in plan.get("Plans", ()):
        found += whole_scans(child, kind)
    return found


@pytest.mark.parametrize("statistics", [False, True], ids=["without-statistics", "analyzed"])
def test_every_statement_of_a_scrape_reads_big_tables_through_indexes(db, statistics):
    load_big_tables(db)
    with psycopg.connect(db.url, autocommit=True, **db.connect_kwargs) as conn:
        if statistics:
            conn.execute("VACUUM ANALYZE")  # as autovacuum leaves a deployment
        else:
            stats = conn.execute(
                "SELECT count(*) FROM pg_stats WHERE schemaname = %s AND tablename = ANY(%s)",
                (db.schema, sorted(BIG_TABLES)),
            ).fetchone()[0]
            assert stats == 0  # a fresh database: the planner has no statistics
    recorded = Recorded()
    with ConnectionPool(
        db.url,
        kwargs=db.connect_kwargs,
        min_size=1,
        max_size=2,
        configure=lambda c: setattr(c, "cursor_factory", recorded.cursor),
    ) as pool:
        source = Database.of(pool, schema=db.schema)
        families = list(StatusCollector(source, bucket_sets=2).collect())
    assert {s.labels["engine"]: s.value for f in families if f.name == "cmb_scrape_errors" for s in f.samples} == {
        engine: 0 for engine in ENGINES
    }
    pending = next(s.value for f in families if f.name == "cmb_callbacks_pending" for s in f.samples)
    assert pending > 10_000  # the estimate's statements ran too
    statements = [(q, p) for q, p in recorded.statements if "set_config('search_path'" not in q]
    assert len(statements) >= len(ENGINES)
    with psycopg.connect(db.url, **db.connect_kwargs) as conn:
        conn.execute(f"SET search_path = {db.schema}")
        scans = {}
        for query, params in statements:
            (plan,) = conn.execute("EXPLAIN (FORMAT JSON) " + query, params).fetchone()[0]
            if whole_scans(plan["Plan"]):
                scans[query.strip().splitlines()[0]] = whole_scans(plan["Plan"])
        assert not scans, scans
        # the callbacks depths read a bounded number of events, whatever the depth (40,000 pending here)
        ((query, params),) = [(q, p) for q, p in statements if "counted AS MATERIALIZED" in q]
        conn.execute("SET jit = off")
        (plan,) = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query, params).fetchone()[0]
        assert rows_read(plan["Plan"], "callback_events") < 12_000, json.dumps(plan, indent=1)


# -- a database away, slow or scraped by many at once --------------------------------------------------------------


def test_concurrent_scrapes_share_one_reading_and_all_get_in(db, served):
    write_through_the_engines(db)
    began = time.monotonic()
    answers = scrapes_at_once(served.url, 200)  # more than a listening socket's default queue takes
    elapsed = time.monotonic() - began
    for samples in answers:
        assert failed_engines(samples) == set()
        assert value(samples, "cmb_eventqueue_queued", handler="h", kind="python") == 3
    readings = {  # each reading times its reads anew: the same durations are the same reading
        tuple(sorted((labels, v) for (name, labels), v in samples.items() if name == "cmb_scrape_duration_seconds"))
        for samples in answers
    }
    assert len(readings) <= 1 + elapsed / CACHE_S


def test_a_scrape_answers_in_time_when_the_database_host_is_gone():
    with socket.socket() as gone:  # a host that takes the connection and never answers
        gone.bind(("127.0.0.1", 0))
        gone.listen(100)
        host, port = gone.getsockname()
        away = Database(f"postgresql://postgres@{host}:{port}/postgres")
        server = serve(away, port=0)
        # the readers give up connecting after a timeout of their own, shorter than the other connections'
        own_timeout = away.bounded(READ_TIMEOUT_S).connect_kwargs["connect_timeout"]
        assert own_timeout < CONNECT_TIMEOUT_S
        try:
            for samples in scrapes_at_once(server.url, 20):
                assert failed_engines(samples) == set(ENGINES)
                # the first engine waited for that timeout (libpq may count it in whole seconds), not failed sooner
                assert value(samples, "cmb_scrape_duration_seconds", engine="callbacks") >= own_timeout - 1
        finally:
            server.stop()
            away.close()


@contextmanager
def locked(db: Database, tables: list[str]) -> Iterator[None]:
    """The tables locked against any read (as a migration locks what it alters) while the block runs."""
    with psycopg.connect(db.url, **db.connect_kwargs) as conn:
        names = sql.SQL(", ").join(sql.Identifier(db.schema, table) for table in tables)
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(names))
        yield
        conn.rollback()


def test_a_locked_table_fails_its_engine_alone_after_the_statement_timeout(db, served, caplog):
    with locked(db, ["reactive_tasks"]):
        (samples,) = scrapes_at_once(served.url, 1)
    assert failed_engines(samples) == {"reactive"}
    assert value(samples, "cmb_scrape_duration_seconds", engine="reactive") >= READ_TIMEOUT_S * 0.9
    assert "canceling statement due to statement timeout" in caplog.text


# -- secrets, bounds, the command ---------------------------------------------------------------------------------

SECRET = "pw-that-must-not-show"


def with_password(url: str) -> str:
    """``url`` with a password the server (trust authentication) ignores."""
    if url.startswith("postgresql://") and "@" in url:
        user, rest = url.split("://", 1)[1].split("@", 1)
        return f"postgresql://{user.split(':')[0]}:{SECRET}@{rest}"
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}password={SECRET}"


def test_no_secret_is_served_nor_logged(db, caplog):
    secret_db = Database(with_password(db.url), schema=db.schema)
    server = serve(secret_db, port=0)
    try:
        with db.connection() as conn:
            conn.execute("ALTER TABLE leases RENAME TO leases_away")  # a failing engine logs why
        text = scrape(server.url)
    finally:
        server.stop()
        secret_db.close()
    assert value(parse(text), "cmb_scrape_errors", engine="workers") == 1
    assert "leases" in caplog.text and SECRET not in caplog.text and SECRET not in text


@pytest.mark.parametrize("host", ["", "not a host", "-x", "a" * 300, "1.2.3.4.5", 5, None])
def test_a_bad_host_is_refused(host):
    with pytest.raises(ConfigError, match="host"):
        check_host(host)


@pytest.mark.parametrize("port", [-1, 65536, True, "80"])
def test_a_bad_port_is_refused(db, port):
    with pytest.raises(ConfigError, match="port"):
        serve(db, port=port)


@pytest.mark.parametrize("sets", [0, 4097, 1.5])
def test_a_bad_bucket_set_count_is_refused(db, sets):
    with pytest.raises(ConfigError, match="bucket_sets"):
        serve(db, port=0, bucket_sets=sets)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(db: Database) -> dict[str, str]:
    return {**os.environ, "CMB_DATABASE_URL": with_password(db.url), "CMB_SCHEMA": db.schema}


def cli(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("cmb-dagster")), *args]


@pytest.mark.parametrize("args", [["--port", "0"], ["--port", "65536"], ["--host", "bad host"], ["--bucket-sets", "0"]])
def test_the_command_refuses_bad_bounds(db, args):
    env = cli_env(db)
    done = subprocess.run(cli("metrics", *args), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_the_command_serves_until_terminated(db, tmp_path):
    write_through_the_engines(db)
    port, env = free_port(), cli_env(db)
    log = (tmp_path / "metrics.log").open("w+")
    proc = subprocess.Popen(cli("metrics", "--port", str(port)), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def answered() -> str | None:
            assert proc.poll() is None, Path(log.name).read_text()
            try:
                return scrape(url)
            except (urllib.error.URLError, ConnectionError):
                return None

        samples = parse(wait_until(answered, 60, "the endpoint answers"))
        assert value(samples, "cmb_callbacks_pending", bucket_set="0") == 17
        assert value(samples, "cmb_eventqueue_queued", handler="h", kind="python") == 3
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = Path(log.name).read_text()
    assert f"127.0.0.1:{port}/metrics" in output and SECRET not in output
