"""Zombie workers: a worker process stopped (SIGSTOP) mid-batch past its lease TTL, taken over, then resumed
(SIGCONT), calls no user code for the partitions it lost, its late commit is refused by the fence, and it goes
on working (it takes its partitions back once they are free).

Each engine's victim is stopped where only the fence stands between it and a wrong effect: callbacks with calls
on the wire; pub/sub while its batch waits for its watermark (a transaction of the test holds it), between its
lease check and its handler; stages, the event queue and the reactive scheduler at the end of a call of user code
(the call stops its own process: tests/acceptance/multihost_handlers.py), with results of the batch not committed
yet, while the other worker's runs of the same items wait at the test's gate (so the victim's late commit or
delete comes first). User code records each call with its process and time.

A slower job: runs with ``CMB_MULTIHOST=1`` (``make test-multihost``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import psycopg
import pytest
from multihost import CLI, HANDLERS_DIR, CtlProducer, Gate, WorkerProcess, held_by, launched_last, read_calls, take_over
from processes import stop
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings
from cmb_dagster.database import Database

pytestmark = pytest.mark.skipif(
    os.environ.get("CMB_MULTIHOST") != "1", reason="multi-host job: set CMB_MULTIHOST=1 (make test-multihost)"
)

TTL = 3
# a worker's log line saying a lease is no longer its own (LeaseLost, logged by the worker loop)
LOST = re.compile(r"(?:is|are) no longer held by|has expired by its own clock")
# a worker's log line saying the server ended its transaction (a connection closed under a stopped process)
ENDED = re.compile(r"server closed the connection|terminating connection")


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.close()


def start(
    workers: list[WorkerProcess], tmp_path: Path, args: list[str], env: dict[str, str], program: list[str] = CLI
) -> WorkerProcess:
    worker = WorkerProcess(args, env, tmp_path / f"worker{len(workers)}.log", program)
    workers.append(worker)
    return worker


def worker_env(database_url: str, tmp_path: Path) -> dict[str, str]:
    """A worker's environment: the test's database, the calls file and the gate of multihost_handlers.py."""
    return {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "CMB_TEST_CALLS": str(tmp_path / "calls.jsonl"),
        "CMB_TEST_GATE": str(tmp_path / "gate"),
        "PYTHONPATH": os.pathsep.join([str(HANDLERS_DIR), os.environ.get("PYTHONPATH", "")]),
    }


def calls_by(tmp_path: Path, worker: WorkerProcess, since: float = 0.0) -> list[tuple[float, list]]:
    """(time, items) of the calls of user code ``worker`` made from ``since`` on."""
    return [(at, items) for pid, at, items in read_calls(tmp_path / "calls.jsonl") if pid == worker.pid and at >= since]


def noticed_loss(worker: WorkerProcess, logged: int) -> bool:
    """Whether ``worker`` logged, after the first ``logged`` characters of its log, that a lease is no longer its."""
    return bool(LOST.search(worker.log[logged:]))


# -- callbacks ---------------------------------------------------------------------------------------------------


class Receiver:
    """An HTTP receiver on 127.0.0.1 that answers each call after ``delay`` seconds and records which process
    sent it (the peer's port among the victim's connections), when it arrived and the event's key."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.victim: int | None = None
        self.calls: list[tuple[float, bool, str]] = []  # (arrived, from the victim, event key)
        self.in_flight_from_victim = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                arrived = time.time()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                from_victim = receiver.sent_by_victim(self.client_address[1])
                with receiver._lock:
                    receiver.calls.append((arrived, from_victim, body["event_key"]))
                    receiver.in_flight_from_victim += from_victim
                try:
                    time.sleep(receiver.delay)
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                finally:
                    with receiver._lock:
                        receiver.in_flight_from_victim -= from_victim

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256  # every worker's connections at once

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sent_by_victim(self, port: int) -> bool:
        if self.victim is None:
            return False
        try:
            return any(c.laddr and c.laddr.port == port for c in psutil.Process(self.victim).net_connections("tcp"))
        except psutil.Error:
            return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def callback_status(db: Database) -> Counter:
    with db.connection() as conn:
        return Counter(dict(conn.execute("SELECT status, count(*) FROM callback_events GROUP BY status").fetchall()))


def test_callbacks_zombie_calls_nothing_of_the_buckets_it_lost(db, database_url, workers, tmp_path):
    receiver = Receiver(delay=0.3)
    events = 400
    kind = "callbacks.bucket"
    settings = CallbackSettings(lease_ttl=TTL, timeout=1, poll_interval=0.2, allowed_hosts=["127.0.0.1"])
    try:
        with CallbackClient(db, settings) as client:
            begin = datetime.now(UTC)
            client.create_many(
                [
                    {
                        "owner_client_id": "z",
                        "group_key": "g",
                        "event_key": f"k{i}",
                        "run_at": begin + timedelta(milliseconds=30 * i),
                        "cb_url": f"{receiver.url}/cb",
                        "retry": {"delay": 1},
                    }
                    for i in range(events)
                ]
            )
        with db.connection() as conn:
            bucket_of = dict(conn.execute("SELECT event_key, bucket_id::text FROM callback_events").fetchall())
        env = {**os.environ, "CMB_DATABASE_URL": database_url}
        args = ["callbacks", "worker", "--lease-ttl", str(TTL), "--timeout", "1", "--poll-interval", "0.2"]
        args += ["--no-materialize", "--allow-host", "127.0.0.1"]
        victim = start(workers, tmp_path, args, env)
        receiver.victim = victim.pid
        wait_until(lambda: held_by(db, kind, victim), 30, "the victim holds buckets")
        other = start(workers, tmp_path, args, env)
        wait_until(lambda: receiver.in_flight_from_victim > 0, 30, "a call of the victim in flight")
        stopped_at = victim.signal(signal.SIGSTOP)
        lost = held_by(db, kind, victim)
        assert lost, "the victim held no bucket when it was stopped"
        in_flight = {key for at, mine, key in receiver.calls if mine and at < stopped_at}
        try:
            wait_until(lambda: take_over(db, kind, lost, other), 30, "the other worker took the victim's buckets over")
        except AssertionError:
            with db.connection() as conn:
                rows = conn.execute(
                    "SELECT pid, state, wait_event_type, left(query, 60), pg_blocking_pids(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database()"
                ).fetchall()
            raise AssertionError(f"no takeover; sessions: {rows}") from None
        done_before = callback_status(db)["notified"]
        wait_until(lambda: callback_status(db)["notified"] > done_before + 10, 30, "the other worker moved on")
        resumed_at = victim.signal(signal.SIGCONT)
        wait_until(lambda: callback_status(db)["notified"] == events, 60, f"every event called ({callback_status(db)})")

        # the victim rejoins: alive, and it takes the buckets over when the other one stops
        assert victim.proc.poll() is None, victim.log
        stop([other.proc])
        wait_until(lambda: set(held_by(db, kind, victim)) >= set(lost), 30, "the victim holds buckets again")

        late = [key for at, mine, key in receiver.calls if mine and at >= resumed_at and bucket_of[key] in lost]
        assert late == [], f"the victim called {len(late)} events of buckets it had lost after it resumed"
        called = Counter(key for _, _, key in receiver.calls)
        assert set(called) == set(bucket_of)  # none lost
        again = {key for key in in_flight if bucket_of[key] in lost}
        # the calls on the wire when it stopped were completed by the receiver, and called again by the new holder
        assert all(called[key] >= 2 for key in again), {key: called[key] for key in again}
    finally:
        receiver.close()


# -- pub/sub -------------------------------------------------------------------------------------------------------


# The consumer's filter: each event read waits for a shared advisory lock, so a test holding it exclusively stops
# the consumer's read mid-batch (between its lease check and its handler).
def batch_waiting_at_gate(db: Database) -> bool:
    """Whether a consumer's batch waits for the watermark a gate holds (its lease already checked)."""
    with db.connection() as conn:
        return conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%%pubsub_watermarks%%FOR NO KEY UPDATE%%')"
        ).fetchone()[0]


def test_pubsub_zombie_delivers_nothing_of_the_consumer_it_lost(db, database_url, workers, tmp_path):
    from cmb_dagster.pubsub import publish

    kind, partition = "pubsub.consumer", "results@0"

    def publish_range(numbers: range) -> None:
        with db.connection() as conn:
            for n in numbers:
                publish(0, {"n": n}, topic="work", conn=conn)

    def results() -> Counter:
        with db.connection() as conn:
            return Counter(dict(conn.execute("SELECT item, count(*) FROM public.results GROUP BY item").fetchall()))

    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (item int NOT NULL, pid int NOT NULL)")
    publish_range(range(100))
    env = worker_env(database_url, tmp_path)
    args = ["pubsub", "consume", "results", "--handler", "multihost_handlers:pubsub_record", "--batch-size", "10",
            "--lease-ttl", str(TTL), "--handler-timeout", "1"]  # fmt: skip
    victim = start(workers, tmp_path, args, env)
    wait_until(lambda: len(results()) == 100, 60, "the victim delivered the first events")
    other = start(workers, tmp_path, args, env)
    with psycopg.connect(database_url) as gate:
        gate.execute("SELECT 1 FROM cmb.pubsub_watermarks WHERE consumer_id = 'results' FOR UPDATE")
        publish_range(range(100, 300))
        wait_until(lambda: batch_waiting_at_gate(db), 30, "the victim's batch waits at the gate")
        stopped_at = victim.signal(signal.SIGSTOP)
        lost = held_by(db, kind, victim)
        assert set(lost) == {partition}, lost
        gate.rollback()  # the batch locks the watermark; its transaction stays open
    # the stopped consumer's transaction (its lease checked, its watermark locked) is ended by the server
    wait_until(lambda: take_over(db, kind, lost, other), 30, "the other worker took the consumer over")
    print(f"pubsub: taken over {time.time() - stopped_at:.1f}s after the stop")
    done_before = len(results())
    wait_until(lambda: len(results()) > done_before + 20, 30, "the other worker moved on")
    logged = len(victim.log)
    resumed_at = victim.signal(signal.SIGCONT)
    wait_until(lambda: noticed_loss(victim, logged) or ENDED.search(victim.log[logged:])
               or calls_by(tmp_path, victim, resumed_at), 30,
               "the resumed victim noticed the loss (or the end of its transaction) or called its handler")  # fmt: skip
    wait_until(lambda: len(results()) == 300, 60, "every event delivered")

    late = calls_by(tmp_path, victim, resumed_at)
    assert late == [], f"the victim called its handler {len(late)} times for the consumer it had lost"
    assert victim.proc.poll() is None, victim.log
    stop([other.proc])  # the victim rejoins: it takes the consumer back and delivers what comes next
    wait_until(lambda: held_by(db, kind, victim), 30, "the victim holds the consumer again")
    publish_range(range(300, 320))
    wait_until(lambda: len(results()) == 320, 30, "the events published after the other stopped delivered")
    found = results()
    assert set(found) == set(range(320)), f"lost: {sorted(set(range(320)) - set(found))[:20]}"
    assert max(found.values()) == 1, f"applied twice: {[i for i, n in found.items() if n > 1][:20]}"


# -- stages --------------------------------------------------------------------------------------------------------


def test_stages_zombie_commits_nothing_of_the_shards_it_lost(db, database_url, workers, tmp_path):
    import multihost_handlers

    from cmb_dagster.stages import StageStore

    kind, options = "stages.shard", multihost_handlers.stages_small_batches
    store = StageStore(db, options.stages)
    gate = Gate(tmp_path / "gate")
    entities = 300
    store.put_many({f"e{i}": {"n": i} for i in range(entities)})

    def states() -> list[tuple[str, int, int | None, int | None, float | None]]:
        """(entity, version, runs, pid, committed at) of every entity ('mark' stage state; None before it ran)."""
        with db.connection() as conn:
            return conn.execute(
                "SELECT e.entity_id, e.version, (s.state->>'runs')::int, (s.state->>'pid')::int,"
                " extract(epoch FROM s.updated_at)::float8"
                " FROM stage_entities e LEFT JOIN stage_states s ON s.entity_id = e.entity_id AND s.stage = 'mark'"
            ).fetchall()

    def shards(worker: WorkerProcess) -> dict[str, int]:
        return {p: fence for p, fence in held_by(db, kind, worker).items() if p.startswith("shard:")}

    def committed_by(worker: WorkerProcess, since: float) -> list[str]:
        return [e for e, _, _, pid, at in states() if pid == worker.pid and at is not None and at >= since]

    env = worker_env(database_url, tmp_path)
    args = ["stages", "worker", "--stages", "multihost_handlers:stages_small_batches"]
    victim = start(workers, tmp_path, args, env)
    wait_until(lambda: len(shards(victim)) == options.shard_count, 30, "the victim holds every shard")
    wait_until(lambda: len(calls_by(tmp_path, victim)) >= 40, 30, "the victim runs the stage")
    other = start(workers, tmp_path, args, env)
    gate.stop_after_call(victim.pid)  # the victim stops itself at the end of a call: its batch is not committed
    wait_until(lambda: victim.stopped, 30, "the victim stopped inside the stage")
    stopped_at = time.time()
    lost = shards(victim)
    assert len(lost) == options.shard_count, lost
    with db.connection() as conn:  # its batch: claimed (each claim counted as a crash until the commit)
        in_flight = {e for (e,) in conn.execute("SELECT entity_id FROM stage_queue WHERE crashes > 0")}
    assert in_flight, "the victim had no batch in flight"
    for entity in in_flight:  # the other worker's runs of them wait: the victim's late commit comes first
        gate.hold(other.pid, entity)
    wait_until(lambda: take_over(db, kind, lost, other), 30, "the other worker took the victim's shards over")
    wait_until(lambda: {i[0] for _, i in calls_by(tmp_path, other)} >= in_flight, 30, "the other runs them again")
    done_before = len(calls_by(tmp_path, other))
    wait_until(lambda: len(calls_by(tmp_path, other)) > done_before + 20, 30, "the other worker moved on")
    logged = len(victim.log)
    resumed_at = victim.signal(signal.SIGCONT)  # its call ends: the batch commits late
    wait_until(lambda: noticed_loss(victim, logged) or committed_by(victim, resumed_at), 30,
               "the resumed victim noticed the loss or committed")  # fmt: skip
    for entity in in_flight:
        gate.open(other.pid, entity)
    wait_until(lambda: all(runs == 1 for _, _, runs, _, _ in states()), 60, "every entity through the stage")

    assert committed_by(victim, stopped_at) == [], "the victim's late commit was not refused"
    late = calls_by(tmp_path, victim, resumed_at)
    assert late == [], f"the victim ran the stage {len(late)} times on shards it had lost"
    found = states()
    assert all(version == 2 for _, version, _, _, _ in found), "an entity changed more than once (put, then the stage)"
    assert all(pid == other.pid for e, _, _, pid, _ in found if e in in_flight), "in flight at the stop: rerun"
    assert victim.proc.poll() is None, victim.log
    stop([other.proc])  # the victim rejoins: it takes every shard back and runs what comes next
    wait_until(lambda: len(shards(victim)) == options.shard_count, 30, "the victim holds the shards again")
    store.put_many({f"e{i}": {"n": i} for i in range(entities, entities + 20)})
    wait_until(lambda: len(committed_by(victim, resumed_at)) == 20, 30, "the victim runs the new entities")
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM stage_queue").fetchone()[0] == 0


# -- event queue ---------------------------------------------------------------------------------------------------

# Every claim (or renewal) of an event and every delete, with the worker that made it (its PGAPPNAME).
EVENT_HISTORY = """
CREATE TABLE public.claim_history (
    id bigint, visible_at timestamptz, worker text, at timestamptz DEFAULT clock_timestamp()
);
CREATE TABLE public.delete_history (id bigint, worker text, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION public.record_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO public.delete_history (id, worker) VALUES (OLD.id, current_setting('application_name'));
    ELSE
        INSERT INTO public.claim_history (id, visible_at, worker)
        VALUES (NEW.id, NEW.visible_at, current_setting('application_name'));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER claim_history AFTER UPDATE ON cmb.eventqueue_events FOR EACH ROW WHEN (NEW.locked_at IS NOT NULL)
EXECUTE FUNCTION public.record_claim();
CREATE TRIGGER delete_history AFTER DELETE ON cmb.eventqueue_events FOR EACH ROW EXECUTE FUNCTION public.record_claim();
"""


def test_eventqueue_zombie_runs_and_deletes_nothing_it_lost(db, database_url, workers, tmp_path):
    import multihost_handlers

    from cmb_dagster.eventqueue import emit_many, register

    register(db, multihost_handlers.eventqueue)
    with db.connection() as conn:
        conn.execute(EVENT_HISTORY)
    gate = Gate(tmp_path / "gate")

    def emit(values: range) -> list[int]:
        return emit_many([{"namespace": "ns", "handler": "record", "value": i} for i in values], db=db)

    def history() -> tuple[list[tuple[int, str, float, float]], list[tuple[int, str, float]]]:
        """(event, worker, at, until) of every claim or renewal, (event, worker, at) of every delete."""
        with db.connection() as conn:
            claims = conn.execute(
                "SELECT id, worker, extract(epoch FROM at)::float8, extract(epoch FROM visible_at)::float8"
                " FROM public.claim_history ORDER BY at"
            ).fetchall()
            deletes = conn.execute(
                "SELECT id, worker, extract(epoch FROM at)::float8 FROM public.delete_history ORDER BY at"
            ).fetchall()
        return claims, deletes

    def claimed_last_by(worker: str) -> set[int]:
        """The events still queued whose last claim is ``worker``'s."""
        with db.connection() as conn:
            return {
                i
                for (i, w) in conn.execute(
                    "SELECT DISTINCT ON (c.id) c.id, c.worker FROM public.claim_history c"
                    " JOIN eventqueue_events e ON e.id = c.id ORDER BY c.id, c.at DESC"
                )
                if w == worker
            }

    def queued() -> int:
        with db.connection() as conn:
            return conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0]

    ids = emit(range(100))
    args = ["events", "worker", "--handlers", "multihost_handlers:eventqueue", "--batch-size", "5",
            "--sweep-interval", "0.5"]  # fmt: skip
    env = worker_env(database_url, tmp_path)
    victim = start(workers, tmp_path, args, {**env, "PGAPPNAME": "victim"})
    wait_until(lambda: len(calls_by(tmp_path, victim)) >= 30, 30, "the victim runs handlers")
    other = start(workers, tmp_path, args, {**env, "PGAPPNAME": "other"})
    gate.stop_after_call(victim.pid)  # the victim stops itself at the end of a handler: its batch is in flight
    wait_until(lambda: victim.stopped, 30, "the victim stopped inside a handler")
    stopped_at = time.time()
    in_flight = claimed_last_by("victim")
    assert in_flight, "the victim had no claimed event in flight"
    for event in in_flight:  # the other worker's runs of them wait: the victim's late delete comes first
        gate.hold(other.pid, event)
    ids += emit(range(100, 160))  # work for the other meanwhile (it runs the lapsed claims after it)
    wait_until(lambda: not (claimed_last_by("victim") & in_flight), 30, "the other worker claimed them (lapsed)")
    wait_until(lambda: {i[0] for _, i in calls_by(tmp_path, other, stopped_at)} >= in_flight, 30, "the other runs them")
    wait_until(lambda: len({i[0] for _, i in calls_by(tmp_path, other, stopped_at)} - in_flight) >= 20, 30,
               "the other worker moved on")  # fmt: skip
    ids += emit(range(160, 200))  # new work, for the victim to claim once it is through its stale batch
    resumed_at = victim.signal(signal.SIGCONT)
    # new events run: the victim is through its stale calls (their outcomes are written before its next claims)
    wait_until(lambda: len({i[0] for _, i in calls_by(tmp_path, victim, resumed_at)} - in_flight) >= 10, 30,
               "the resumed victim runs new events")  # fmt: skip
    for event in in_flight:
        gate.open(other.pid, event)
    wait_until(lambda: queued() == 0, 60, "every event run and deleted")

    claims, deletes = history()
    late = [
        (event, round(at - resumed_at, 2))
        for at, (event,) in calls_by(tmp_path, victim, resumed_at)
        if not any(i == event and w == "victim" and start <= at <= until for i, w, start, until in claims)
    ]
    assert late == [], f"the victim ran handlers of events whose claim it had lost (event, s after resuming): {late}"

    def last_claimer(event: int, at: float) -> str | None:
        return next((w for i, w, start, _ in reversed(claims) if i == event and start <= at), None)

    refused = [(event, w) for event, w, at in deletes if w == "victim" and last_claimer(event, at) != "victim"]
    assert refused == [], f"the victim deleted events another worker had claimed since: {refused}"
    runs = Counter(items[0] for _, _, items in read_calls(tmp_path / "calls.jsonl"))
    assert set(runs) == set(ids), f"never run: {sorted(set(ids) - set(runs))[:20]}"
    assert victim.proc.poll() is None, victim.log
    stop([other.proc])  # the victim rejoins: alone, it runs what comes next
    more = emit(range(200, 220))
    wait_until(lambda: queued() == 0, 30, "the events emitted after the other stopped run")
    assert {i[0] for _, i in calls_by(tmp_path, victim, resumed_at)} >= set(more)


# -- reactive scheduler --------------------------------------------------------------------------------------------


def test_reactive_zombie_launches_nothing_after_losing_the_scheduler(db, database_url, workers, tmp_path):
    import multihost_handlers

    kind, ttl = "reactive.scheduler", 1 + 10  # the scheduler's lease: tick_seconds + 10
    gate = Gate(tmp_path / "gate")
    env = worker_env(database_url, tmp_path)
    lookups = tmp_path / "lookups.jsonl"
    script = f"import multihost_handlers as m; m.reactive_worker({database_url!r}, lookups={str(lookups)!r})"
    producer = CtlProducer(db, multihost_handlers.REACTIVE_TASKS)
    try:
        victim = start(workers, tmp_path, ["-c", script], env, program=[sys.executable])
        wait_until(lambda: len(calls_by(tmp_path, victim)) >= 3, 30, "the victim launches runs")
        other = start(workers, tmp_path, ["-c", script], env, program=[sys.executable])
        # the victim stops itself at the end of its next lookup of runs, inside a tick (before the tick's lease
        # checks, its launches and their recording)
        gate.stop_after_call(victim.pid)
        wait_until(lambda: victim.stopped, 30, "the victim stopped inside a tick")
        stopped_at = time.time()
        lost = held_by(db, kind, victim)
        assert lost, "the victim did not hold the scheduler when it stopped"
        wait_until(lambda: take_over(db, kind, lost, other), 2 * ttl, "the other worker took the scheduler over")
        assert time.time() - stopped_at > ttl * 2 / 3, "taken over before the victim's lease could have lapsed"
        wait_until(lambda: len(calls_by(tmp_path, other)) >= 3, 30, "the other worker launches runs")
        logged = len(victim.log)
        resumed_at = victim.signal(signal.SIGCONT)
        wait_until(lambda: noticed_loss(victim, logged) or calls_by(tmp_path, victim, resumed_at), 30,
                   "the resumed victim noticed the loss or launched")  # fmt: skip
        late = calls_by(tmp_path, victim, resumed_at)
        assert late == [], f"the victim launched {len(late)} times after losing the scheduler"
        looked_up = [at for pid, at, _ in read_calls(lookups) if pid == victim.pid and at >= resumed_at]
        assert looked_up == [], "the victim looked runs up after losing the scheduler"
        assert victim.proc.poll() is None, victim.log
        stop([other.proc])  # the victim rejoins: it takes the scheduler back and launches again
        wait_until(lambda: held_by(db, kind, victim), 30, "the victim holds the scheduler again")
        wait_until(lambda: calls_by(tmp_path, victim, resumed_at), 30, "the victim launches again")
    finally:
        final = producer.stop()
    wait_until(lambda: launched_last(read_calls(tmp_path / "calls.jsonl")) == final, 60,
               "every last CTL change launched (nothing lost)")  # fmt: skip
    with db.connection() as conn:
        rows = conn.execute("SELECT task, values_hash FROM reactive_launches").fetchall()
    assert len(set(rows)) == len(rows), "a set of values launched twice"
    calls = read_calls(tmp_path / "calls.jsonl")
    run_keys = Counter(run_key for _, _, launches in calls for _, run_key, _ in launches)
    assert max(run_keys.values()) == 1, [k for k, n in run_keys.items() if n > 1][:10]
