"""Isolation in the stage engine against real Postgres: results Postgres refuses, time limits, big payloads
over both transports, tenants sharing a database, and the state API's compare-and-set under concurrency."""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import psycopg
import pytest
from pydantic import BaseModel
from sessions_helpers import WatchedDatabase, cut_other_sessions, session_ended
from stages_helpers import drain
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.isolation import WorkerStuck
from cmb_dagster.models import Backoff
from cmb_dagster.stages import (
    Engine,
    Entity,
    MergePatch,
    Stage,
    StageOptions,
    StageResult,
    StageStore,
    StageWorker,
    entries,
)


class Patch(Stage):
    """Adds ``done`` to every entity; ``bad`` entities get a value the test database's own rule refuses."""

    name = "patch"

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        return StageResult(update=MergePatch({"done": "refused" if entity.payload.get("bad") else True}))


def test_a_result_postgres_refuses_is_split_off_and_the_others_commit(db):
    with db.connection() as conn:  # a rule of the deployment's own, which only Postgres knows
        conn.execute("""ALTER TABLE stage_entities
                        ADD CONSTRAINT nothing_refused CHECK (payload->>'done' IS DISTINCT FROM 'refused')""")
    store = StageStore(db, [Patch()])
    store.put_many({f"e{i}": {"i": i} for i in range(50)} | {"bad": {"bad": True}})
    drain(StageWorker(db, [Patch(max_attempts=1)]))
    assert all(store.get(f"e{i}").payload.get("done") is True for i in range(50))
    assert store.get("bad").payload == {"bad": True}
    [bad] = entries(db, stage="patch")
    assert bad.entity_id == "bad" and bad.parked_at is not None and bad.attempts == 1
    assert bad.last_error.startswith("its result cannot be stored: CheckViolation: "), bad.last_error


class Held(Stage):
    name = "held"
    release = threading.Event()
    entered = threading.Event()

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        Held.entered.set()
        Held.release.wait(30)
        return StageResult(update=MergePatch({"done": True}))


def test_a_process_past_its_timeout_holds_its_entity_until_it_returns_then_fails(db):
    """A thread cannot be stopped: past its timeout the call keeps its entry claimed and its entity out of every
    claim until it returns; then it fails (its result dropped) and is retried after the backoff."""
    Held.release.clear()
    Held.entered.clear()
    stage = Held(timeout=0.3, backoff=Backoff(first=60))
    StageStore(db, [stage]).put("slow", {})
    engine = Engine(db, [stage])
    engine.changes_batch(range(8))
    assert engine.start_batch(range(8)).taken == 1 and Held.entered.wait(10)
    [call] = engine.executor.running
    wait_until(lambda: call.seconds > 2 * call.timeout, 10, "the call runs past its timeout")
    assert engine.collect().ended == 0 and engine.start_batch(range(8)).taken == 0  # still held
    [entry] = entries(db, stage="held")
    assert entry.attempts == 0 and entry.crashes == 1 and entry.last_error is None  # claimed, not failed
    Held.release.set()
    assert engine.executor.wait_all(10)
    report = engine.collect()
    assert report.errors == 1 and report.processed == 0
    [entry] = entries(db, stage="held")
    assert entry.attempts == 1 and entry.parked_at is None and entry.crashes == 0
    assert entry.last_error.startswith("TimedOut: ran ") and entry.last_error.endswith(
        "s, past its 0.3 s limit (result dropped)"
    ), entry.last_error
    assert StageStore(db).get("slow").payload == {}
    engine.close()


def test_calls_that_ended_while_the_connection_was_lost_commit_at_the_next_collect(db):
    """The engine's connection is cut after the call ended: the commit fails, the outcome is kept (its entity stays
    out of claims) and commits once the connection is back, instead of running the entity again."""
    StageStore(db, [Patch()]).put("p", {})
    engine = Engine(db, [Patch()])
    engine.changes_batch(range(8))
    assert engine.start_batch(range(8)).taken == 1 and engine.executor.wait_all(10)
    assert cut_other_sessions(db) >= 1  # the engine's connection among them
    with pytest.raises(psycopg.OperationalError):
        engine.collect()
    assert engine.start_batch(range(8)).taken == 0  # still held: its outcome waits for its commit
    report = engine.collect()
    assert report.ended == 1 and report.processed == 1
    assert StageStore(db).get("p").payload == {"done": True} and not entries(db, stage="patch")
    engine.close()


def test_a_stopped_worker_commits_its_calls_in_flight_before_it_lets_its_shards_go(db):
    """stop() while a call runs: the worker claims nothing more, keeps its leases renewed while the call runs past a
    lease TTL, commits the call once it returned, then stops (the next holder does not run the entity again)."""
    Held.release.clear()
    Held.entered.clear()
    stage = Held()
    store = StageStore(db, [stage])
    store.put("in-flight", {})
    worker = StageWorker(db, StageOptions(stages=[stage], lease_ttl=1.0, idle_sleep=0.05))
    running = threading.Thread(target=worker.run)
    running.start()
    try:
        assert Held.entered.wait(10)
        worker.stop()
        store.put("later", {})  # changed after the stop: left to the next holder
        with db.connection() as conn:
            until = conn.execute(
                "SELECT max(expires_at) FROM leases WHERE kind = 'stages.shard' AND partition LIKE 'shard:%'"
            ).fetchone()[0]
            wait_until(lambda: conn.execute("SELECT clock_timestamp() > %s", (until,)).fetchone()[0], 5, "a TTL")
            held = conn.execute(
                "SELECT bool_and(expires_at > clock_timestamp()) FROM leases WHERE partition LIKE 'shard:%'"
            ).fetchone()[0]
        assert held and running.is_alive()  # still the shards' holder, renewing, while its call runs
    finally:
        Held.release.set()
        running.join(10)
    assert not running.is_alive()
    assert store.get("in-flight").payload == {"done": True} and "done" not in store.get("later").payload
    assert entries(db, stage="held") == []  # committed, not released (no crash left); "later" was not even asked


def test_a_worker_whose_every_slot_is_stuck_past_its_timeout_stops(db):
    """Threads cannot be stopped: once every slot holds a call past twice its timeout, collecting raises WorkerStuck
    (the worker stops and its process is restarted)."""
    Held.release.clear()
    stage = Held(timeout=0.1)
    StageStore(db, [stage]).put_many({"x": {}, "y": {}})
    engine = Engine(db, [stage], concurrency=2)
    engine.changes_batch(range(8))
    assert engine.start_batch(range(8)).taken == 2
    wait_until(lambda: all(call.seconds > 2 * call.timeout for call in engine.executor.running), 10, "both stuck")
    try:
        with pytest.raises(WorkerStuck, match="2 calls of user code are still running past their time limit"):
            engine.collect()
    finally:
        Held.release.set()
        engine.executor.wait_all(10)
        engine.close()


def test_two_tenants_in_one_database_never_wait_on_each_other(database_url):
    """A stage with max_parallelism=1 in schema ta holds its slot while it runs; the same stage in tb runs."""
    Held.release.clear()
    Held.entered.clear()
    ta, tb = Database(database_url, schema="ta"), Database(database_url, schema="tb")
    engines = {}
    for tenant in (ta, tb):
        stage = Held(max_parallelism=1)
        StageStore(tenant, [stage]).put("x", {})
        engines[tenant.schema] = engine = Engine(tenant, [stage])
        engine.changes_batch(range(8))
    running = threading.Thread(target=engines["ta"].process_batch, args=(range(8),))
    running.start()
    assert Held.entered.wait(10)
    Held.release.set()  # tb's call returns at once...
    report = engines["tb"].process_batch(range(8))
    assert report.blocked_until is None and report.processed == 1  # ...and it did not wait for ta's slot
    running.join(10)
    for engine in engines.values():
        engine.close()
    ta.close()
    tb.close()


def _transport_url(database_url: str, transport: str) -> str:
    with psycopg.connect(database_url) as conn:
        sockets = conn.execute("SHOW unix_socket_directories").fetchone()[0]
        addresses = conn.execute("SHOW listen_addresses").fetchone()[0]
        port = conn.execute("SHOW port").fetchone()[0]
    parts = urlsplit(database_url)
    if transport == "socket":
        directory = sockets.split(",")[0].strip()
        if not directory:
            pytest.skip("the server listens on no unix socket")
        return f"postgresql://{parts.username or 'postgres'}@/{parts.path.lstrip('/')}?host={directory}&port={port}"
    if not addresses.strip():
        pytest.skip("the server listens on no TCP address")
    return f"postgresql://{parts.username or 'postgres'}@127.0.0.1:{port}/{parts.path.lstrip('/')}"


@pytest.mark.parametrize("transport", ["socket", "tcp"])
def test_a_batch_with_large_payloads_commits_within_seconds(database_url, transport, monkeypatch):
    """A 10 MB entity and 60 entities of 100 KB in one batch: the commit is never sent inside a pipeline."""
    monkeypatch.setenv("CMB_MAX_PAYLOAD_BYTES", str(32 * 1024 * 1024))
    db = Database(_transport_url(database_url, transport))
    store = StageStore(db, [Patch()])
    store.put("big", {"blob": "x" * (10 * 1024 * 1024)})
    store.put_many({f"p{i}": {"blob": "y" * 100_000} for i in range(60)})
    worker = StageWorker(db, [Patch()])
    finished = threading.Event()
    threading.Thread(target=lambda: (drain(worker), finished.set()), daemon=True).start()
    assert finished.wait(60), "the batch did not finish (a commit blocked inside a pipeline?)"
    assert store.get("big").payload["done"] is True
    assert all(store.get(f"p{i}").payload["done"] is True for i in range(60))
    worker.engine.close()
    db.close()


def test_the_engine_session_limit_on_idling_in_a_transaction_takes_effect(db, database_url):
    watched = WatchedDatabase(database_url)
    engine = Engine(watched, [Patch()], idle_timeout=0.5)
    engine.changes_batch(range(8))  # its connection opened, with its session settings
    [conn] = watched.connections
    conn.execute("BEGIN")  # idle inside a transaction for longer than the limit: the server ends the session
    wait_until(lambda: session_ended(db, conn.info.backend_pid), 30, "the idle session ended by the server")
    with pytest.raises((psycopg.OperationalError, psycopg.errors.IdleInTransactionSessionTimeout)):
        conn.execute("SELECT 1")
    engine.close()
    watched.close()


class Counter(BaseModel):
    n: int = 0


class Counted(Stage):
    name = "counted"
    state_model = Counter

    def process(self, entity: Entity, state: Counter) -> StageResult:  # pragma: no cover - never runs here
        return StageResult()


def test_concurrent_update_state_calls_lose_no_update(db):
    """Property: threads increment a state by compare-and-set; every success is one increment."""
    store = StageStore(db, [Counted()])
    store.put("c", {})
    successes = []

    def increment() -> None:
        mine = 0
        for _ in range(40):
            state, version = store.read_state("c", "counted")
            if store.update_state("c", "counted", Counter(n=state.n + 1), version):
                mine += 1
        successes.append(mine)

    threads = [threading.Thread(target=increment) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    state, version = store.read_state("c", "counted")
    assert sum(successes) > 0
    assert state.n == sum(successes) == version, (state.n, sum(successes), version)


def test_update_state_refuses_a_version_that_moved_while_it_waited(db):
    """A CAS blocked behind another writer's lock compares the version that writer left, not the one it saw."""
    store = StageStore(db, [Counted()])
    store.put("c", {})
    assert store.update_state("c", "counted", Counter(n=1), 0)
    results: list[bool] = []
    with db.connection() as blocker:
        blocker.execute("SELECT 1 FROM stage_entities WHERE entity_id = 'c' FOR NO KEY UPDATE")
        waiting = threading.Thread(target=lambda: results.append(store.update_state("c", "counted", Counter(n=99), 1)))
        waiting.start()
        wait_until(lambda: _waits_for_a_lock(db), 10, "the CAS waits for the entity lock")
        blocker.execute("UPDATE stage_states SET state = '{\"n\": 2}', version = 2 WHERE entity_id = 'c'")
    waiting.join(10)
    assert results == [False]
    assert store.read_state("c", "counted") == (Counter(n=2), 2)


def _waits_for_a_lock(db: Database) -> bool:
    with db.connection() as conn:
        return bool(
            conn.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ).fetchone()
        )


@pytest.mark.parametrize(
    ("field", "entity_id", "payload"),
    [
        ("entity_id", "a\x00b", {}),
        ("entity_id", "\udc80", {}),
        ("entity_id", "x" * 257, {}),
        ("payload of 'e'", "e", {"text": "a\x00b"}),
        ("payload of 'e'", "e", {"text": "\ud800"}),
        ("payload of 'e'", "e", {"blob": "x" * (5 * 1024 * 1024)}),
        ("payload of 'e'", "e", {"n": float("nan")}),
    ],
)
def test_put_refuses_what_postgres_cannot_store_naming_the_field(db, field, entity_id, payload):
    from cmb_dagster.stages import InvalidStageInput

    store = StageStore(db, [Patch()])
    with pytest.raises(InvalidStageInput, match=f"^{field}: "):
        store.put(entity_id, payload)
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM stage_entities").fetchone() == (0,)
