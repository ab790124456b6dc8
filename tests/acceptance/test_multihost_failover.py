"""Failover: a primary and a streaming standby (pg_basebackup, synchronous replication), worker processes of
every engine connected with a libpq multi-host URL (``target_session_attrs=read-write``). The standby is
promoted and the old primary stopped mid-work: every worker process resumes on the new primary by itself,
nothing committed is lost, same-database results are applied exactly once (callbacks and event queue
handlers: at least once, a repeat only for a call in flight at the failover).

A lease taken on the old primary and never replicated (asynchronous replication) cannot let two workers act:
the fence check (owner and fence) refuses the worker whose lease was lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from clusters import Cluster, cluster_directory, multihost_url, unavailable
from processes import stop
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.workers import LeaseLost, Leases

HERE = Path(__file__).parent
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
DBNAME = "cmb_failover"

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("CMB_MULTIHOST") != "1", reason="multi-host failover: a slower job, set CMB_MULTIHOST=1"
    ),
    pytest.mark.skipif(unavailable() is not None, reason=f"cannot run Postgres clusters here: {unavailable()}"),
]


@dataclass
class Pair:
    """A primary and its streaming standby, the multi-host URL naming both, and a Database on it."""

    primary: Cluster
    standby: Cluster
    url: str
    db: Database
    logs: Path

    def fail_over(self) -> None:
        """Promote the standby, then stop the old primary as a crash would."""
        self.standby.promote()
        self.primary.stop("immediate")

    def replicated(self) -> bool:
        """Whether the standby has replayed everything the primary wrote so far."""
        [(lag,)] = self.primary.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), coalesce(max(replay_lsn), '0/0')) FROM pg_stat_replication"
        )
        return lag is not None and lag <= 0

    def worker(self, *command: str, **env: str) -> subprocess.Popen:
        """A worker process on the multi-host URL, its output in a log of its own."""
        log = self.logs / f"worker-{len(list(self.logs.glob('worker-*')))}.log"
        environment = {
            **os.environ,
            "CMB_DATABASE_URL": self.url,
            "CMB_DEBUG": "1",  # a worker that dies leaves its traceback in its log
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            **env,
        }
        with log.open("w") as out:
            process = subprocess.Popen(list(command), env=environment, stdout=out, stderr=subprocess.STDOUT)
        process.log = log  # type: ignore[attr-defined]
        return process


def _pair(root: Path, logs: Path, *, synchronous: bool) -> Pair:
    primary = Cluster(root, "primary").initdb().start()
    primary.execute(f"CREATE DATABASE {DBNAME}")
    Database(primary.url(DBNAME)).upgrade()
    standby = Cluster(root, "standby").standby_of(primary).start()
    wait_until(
        lambda: primary.execute("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")[0][0],
        30,
        "the standby streaming",
    )
    if synchronous:  # a commit returns once the standby has it: nothing acknowledged is lost in a failover
        primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        primary.execute("SELECT pg_reload_conf()")
        wait_until(
            lambda: primary.execute("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")[0][0],
            30,
            "the standby synchronous",
        )
    url = multihost_url([primary, standby], DBNAME)
    return Pair(primary, standby, url, Database(url), logs)


@pytest.fixture
def pair(tmp_path) -> Iterator[Pair]:
    with cluster_directory() as root:
        made = _pair(root, tmp_path, synchronous=True)
        try:
            yield made
        finally:
            made.db.close()


@pytest.fixture
def async_pair(tmp_path) -> Iterator[Pair]:
    with cluster_directory() as root:
        made = _pair(root, tmp_path, synchronous=False)
        try:
            yield made
        finally:
            made.db.close()


def count(db: Database, query: str) -> int:
    with db.connection() as conn:
        return conn.execute(query).fetchone()[0]


def retrying(action: Callable[[], object], what: str) -> object:
    """``action()``, again after each database error (the failover), for 60 s at most."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return action()
        except psycopg.Error:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still failing 60 s after the failover") from None
            time.sleep(0.1)


def fail_over_mid_work(pair: Pair, procs: list[subprocess.Popen], progressed: Callable[[], bool]) -> None:
    """Wait for work under way, fail over, and check every worker process is still the one that started."""
    wait_until(lambda: alive(procs) or progressed(), 60, "work under way before the failover", interval=0.05)
    pair.fail_over()
    assert not pair.standby.in_recovery()
    alive(procs)


def alive(procs: list[subprocess.Popen]) -> None:
    dead = [p for p in procs if p.poll() is not None]
    assert not dead, "\n".join(p.log.read_text()[-3000:] for p in dead)  # type: ignore[attr-defined]


def finish(procs: list[subprocess.Popen]) -> None:
    """The workers ran through the failover: alive until now, then stopped cleanly."""
    alive(procs)
    stop(procs)
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(p.log.read_text()[-3000:] for p in procs)


# -- event queue ---------------------------------------------------------------------------------------------


def handler_runs(out: Path) -> dict[int, list[float]]:
    found: dict[int, list[float]] = {}
    for path in out.glob("*.log"):
        for line in path.read_text().splitlines():
            event_id, at = line.split()
            found.setdefault(int(event_id), []).append(float(at))
    return found


def test_event_queue_workers_resume_on_the_new_primary(pair, tmp_path):
    sys.path.insert(0, str(HERE))
    import eventqueue_handlers

    from cmb_dagster.eventqueue import emit_many, register

    out = tmp_path / "runs"
    out.mkdir()
    register(pair.db, eventqueue_handlers.registry)
    ids = emit_many([{"namespace": "ns", "handler": "record", "value": i} for i in range(3000)], db=pair.db)
    batch = 20
    command = [*CLI, "events", "worker", "--handlers", "eventqueue_handlers:registry", "--sweep-interval", "0.5"]
    env = {"EQ_OUT": str(out), "EQ_SLEEP": "0.001", "EQ_LOCK_EXPIRY": "3"}
    procs = [pair.worker(*command, "--batch-size", str(batch), **env) for _ in range(2)]
    try:
        fail_over_mid_work(pair, procs, lambda: 300 <= len(handler_runs(out)) <= 2000)
        failed_over_at = time.time()
        wait_until(
            lambda: retrying(lambda: count(pair.db, "SELECT count(*) FROM eventqueue_events"), "events left") == 0,
            90,
            "every event done on the new primary",
            interval=0.2,
        )
        finish(procs)
    finally:
        stop(procs)
    seen = handler_runs(out)
    assert sorted(seen) == ids  # none lost
    repeated = {i: at for i, at in seen.items() if len(at) > 1}
    # at least once: only events in flight at the failover ran again, a batch per worker at most
    assert len(repeated) <= len(procs) * batch, len(repeated)
    assert all(min(at) <= failed_over_at for at in repeated.values())


# -- stages --------------------------------------------------------------------------------------------------


def test_stage_workers_resume_on_the_new_primary_and_apply_each_result_once(pair):
    sys.path.insert(0, str(HERE))
    import stages_crash_stages

    from cmb_dagster.stages import StageStore

    entities = 400
    StageStore(pair.db, stages_crash_stages.options.stages).put_many({f"k{i}": {"a": i} for i in range(entities)})
    command = [*CLI, "stages", "worker", "--stages", "stages_crash_stages:options"]
    procs = [pair.worker(*command) for _ in range(2)]
    finished = "SELECT count(*) FROM stage_entities WHERE payload ? 'expired_late_ms'"
    started = "SELECT count(*) FROM stage_entities WHERE payload ? 'c'"
    try:
        fail_over_mid_work(pair, procs, lambda: 40 <= count(pair.db, started) < entities)
        wait_until(
            lambda: retrying(lambda: count(pair.db, finished), "stages") == entities,
            90,
            "every entity through every stage on the new primary",
            interval=0.2,
        )
        finish(procs)
    finally:
        stop(procs)
    with pair.db.connection() as conn:
        payloads = dict(conn.execute("SELECT entity_id, payload FROM stage_entities").fetchall())
        versions = Counter(v for (v,) in conn.execute("SELECT version FROM stage_entities"))
        runs = Counter(s["runs"] for (s,) in conn.execute("SELECT state FROM stage_states WHERE state IS NOT NULL"))
        left = conn.execute("SELECT count(*) FROM stage_queue").fetchone()[0]
    assert all((p["b"], p["c"], p["d"]) == (p["a"] + 1, p["a"] + 2, p["a"] + 3) for p in payloads.values())
    assert all("early" not in p for p in payloads.values())  # the timers never fired early
    assert versions == {6: entities}  # put, three stages, the timer set, the timer fired: nothing twice
    assert runs == {1: 4 * entities}  # every stage's state saved with its change, once
    assert left == 0


# -- pub/sub -------------------------------------------------------------------------------------------------


class Producer(threading.Thread):
    """Inserts orders 1..n one transaction each through the multi-host URL; after an error (the failover) it
    reconnects and inserts the order again unless it is there: every order ends up committed once."""

    def __init__(self, url: str, n: int) -> None:
        super().__init__(daemon=True)
        self.url, self.n = url, n
        self.done = 0
        self.errors = 0

    def run(self) -> None:
        conn = None
        order = 1
        while order <= self.n:
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                conn.execute(
                    "INSERT INTO public.orders VALUES (%s, 1) ON CONFLICT (id) DO NOTHING", (order,)
                )  # the capture trigger publishes only a row inserted
                order += 1
                self.done = order - 1
                time.sleep(0.002)  # a steady stream, still flowing at the failover
            except psycopg.Error:
                self.errors += 1
                time.sleep(0.05)
        if conn is not None:
            conn.close()


def test_pubsub_consumers_resume_on_the_new_primary_and_apply_each_event_once(pair):
    from cmb_dagster.pubsub import install_capture

    with pair.db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint NOT NULL)")  # no unique key: repeats show
        conn.execute("CREATE TABLE public.orders (id bigint PRIMARY KEY, amount int NOT NULL)")
        install_capture(conn, "public.orders")
    n = 3000
    producer = Producer(pair.url, n)
    command = [
        *CLI,
        "pubsub",
        "consume",
        "mirror",
        "--handler",
        "pubsub_handlers:record",
        "--batch-size",
        "100",
        "--lease-ttl",
        "2",
    ]
    procs = [pair.worker(*command) for _ in range(2)]  # identical consumers: one works, the other stands by
    producer.start()
    try:
        # failed over once both consumers run their loop: a consumer still registering exits on a lost connection
        started = lambda: all("started" in p.log.read_text() for p in procs)  # noqa: E731
        fail_over_mid_work(
            pair, procs, lambda: started() and count(pair.db, "SELECT count(*) FROM public.results") >= 300
        )
        produced_at_failover = producer.done
        producer.join(120)
        assert producer.done == n
        wait_until(
            lambda: retrying(lambda: count(pair.db, "SELECT count(*) FROM public.results"), "results") >= n,
            90,
            "every event delivered on the new primary",
            interval=0.2,
        )
        finish(procs)
    finally:
        stop(procs)
    with pair.db.connection() as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT event_id) FROM public.results").fetchone() == (n, n)
        assert conn.execute(
            "SELECT count(DISTINCT o.id) FROM public.orders o"
            " JOIN cmb.pubsub_events e ON (e.key->>'id')::bigint = o.id"
            " JOIN public.results r ON r.event_id = e.id"
        ).fetchone() == (n,)  # each order's event applied once, none lost
    assert produced_at_failover < n  # orders were still being written across the failover


# -- callbacks -----------------------------------------------------------------------------------------------


def test_callback_workers_resume_on_the_new_primary(pair):
    from cmb_dagster.callbacks import CallbackClient, CallbackSettings
    from cmb_dagster.callbacks.sink import CallbackSink

    n = 600
    command = [*CLI, "callbacks", "worker", "--lease-ttl", "3", "--timeout", "1", "--poll-interval", "0.2"]
    with CallbackSink() as sink:
        settings = CallbackSettings(allowed_hosts=["127.0.0.1"])
        with CallbackClient(pair.db, settings) as client:
            start = datetime.now(UTC)
            client.create_many(
                [
                    {
                        "owner_client_id": "a",
                        "group_key": "g",
                        "event_key": f"k{i}",
                        "run_at": start + timedelta(milliseconds=5 * i),
                        "cb_url": f"{sink.url}/slow?ms=50",
                    }
                    for i in range(n)
                ]
            )
        procs = [pair.worker(*command, "--no-materialize", CMB_CALLBACK_ALLOWED_HOSTS="127.0.0.1") for _ in range(2)]
        notified = "SELECT count(*) FROM callback_events WHERE status = 'notified'"
        try:
            fail_over_mid_work(pair, procs, lambda: 100 <= count(pair.db, notified) < n - 100)
            failed_over_at = time.time()
            wait_until(
                lambda: retrying(lambda: count(pair.db, notified), "callbacks") == n,
                90,
                "every callback notified on the new primary",
                interval=0.2,
            )
            finish(procs)
        finally:
            stop(procs)
        calls = Counter(c.body["event_key"] for c in sink.received)
        first_call: dict[str, float] = {}
        for c in sink.received:
            first_call.setdefault(c.body["event_key"], c.started)
    assert set(calls) == {f"k{i}" for i in range(n)}  # none lost
    repeated = [key for key, times in calls.items() if times > 1]
    # at least once; a second call only for a call in flight at the failover (its outcome not committed)
    assert all(first_call[key] <= failed_over_at for key in repeated)
    assert len(repeated) <= len(procs) * CallbackSettings().worker_concurrency


# -- reactive scheduler ------------------------------------------------------------------------------------

TASKS = 20
BASE = datetime(2024, 5, 1, tzinfo=UTC)
# A scheduler process: a ReactiveWorker woken by every CTL change, with a stand-in run storage in which every
# launched run has already succeeded (as in test_reactive_crash.py).
SCHEDULER = f"""
import os
from cmb_dagster.database import Database
from cmb_dagster.reactive import ReactiveWorker, RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.triggers import Delta
from cmb_dagster.workers import stop_workers_on_signals

specs = [TaskSpec(name=f"t{{i}}", trigger=Delta(f"e{{i}}", "p", "1s")) for i in range({TASKS})]
succeeded = lambda scheduler, keys: {{k: RunInfo("run-" + k, RunState.SUCCESS) for k in keys}}
worker = ReactiveWorker(Database(os.environ["CMB_DATABASE_URL"]), SchedulerSettings(tick_seconds=1, idle_sleep=0.1),
                        name="failover", tasks=specs, runs=succeeded, launch=lambda launches: None)
with stop_workers_on_signals():
    worker.run()
"""


def test_reactive_scheduler_resumes_on_the_new_primary_and_launches_no_values_twice(pair):
    from cmb_dagster.ctl import CtlStore
    from cmb_dagster.reactive import status

    store = CtlStore(pair.db, actor="producer")
    moments = {f"e{i}": BASE for i in range(TASKS)}
    stopping = threading.Event()

    def produce() -> None:
        step = 0
        while not stopping.is_set():
            entity = f"e{step % TASKS}"
            moment = moments[entity] + timedelta(seconds=1 + step % 3)
            retrying(lambda e=entity, m=moment: store.set(e, "p", m), "a CTL change")  # again: the same value
            moments[entity] = moment
            step += 1
            time.sleep(0.005)

    procs = [pair.worker(sys.executable, "-c", SCHEDULER)]  # one scheduler per name (a second stands by for minutes)
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    launches = "SELECT count(*) FROM reactive_launches"
    try:
        fail_over_mid_work(pair, procs, lambda: count(pair.db, launches) >= 40)
        before = retrying(lambda: count(pair.db, launches), "launches")
        wait_until(lambda: count(pair.db, launches) > before + 40, 60, "launches on the new primary", interval=0.1)
        stopping.set()
        producer.join(60)

        def settled() -> bool:
            states = {s.name: s for s in status(pair.db, "failover").tasks}
            return len(states) == TASKS and all(
                s.status == "waiting"
                and not s.dirty
                and s.last_values.get(f"e{s.name[1:]}", {}).get("p") == moments[f"e{s.name[1:]}"].isoformat()
                for s in states.values()
            )

        wait_until(settled, 60, "every last change launched and done", interval=0.1)
        finish(procs)
    finally:
        stopping.set()
        stop(procs)
    with pair.db.connection() as conn:
        rows = conn.execute("SELECT task, values_hash, attempt, outcome FROM reactive_launches").fetchall()
    assert all(outcome == "success" for *_, outcome in rows)
    assert all(attempt == 1 for _, _, attempt, _ in rows)  # no set of values launched twice
    assert len({(task, digest) for task, digest, _, _ in rows}) == len(rows)


# -- a lease lost with the old primary ---------------------------------------------------------------------


def test_a_lease_taken_on_the_old_primary_and_not_replicated_cannot_let_two_workers_act(async_pair):
    """Asynchronous replication: worker A takes over B's expired lease on the primary, acts, and both commits
    are acknowledged but never reach the standby. After the failover B holds the partition again; A, whose
    lease was lost, is refused by the fence check, so only one of them acts on the new primary. (With
    synchronous replication A's takeover would be on the standby before A could act on it.)"""
    pair = async_pair
    with pair.db.connection() as conn:
        conn.execute("CREATE TABLE public.effects (owner text NOT NULL)")
    b = Leases(pair.db, "failover", owner="worker-b", ttl=1.0)
    a = Leases(pair.db, "failover", owner="worker-a", ttl=30.0)
    held_by_b = b.acquire(["p"])["p"]
    wait_until(pair.replicated, 30, "B's lease on the standby")
    pair.standby.execute("ALTER SYSTEM SET primary_conninfo = ''")  # the standby stops receiving
    pair.standby.execute("SELECT pg_reload_conf()")
    wait_until(lambda: not pair.primary.execute("SELECT count(*) FROM pg_stat_replication")[0][0], 30, "cut off")

    held_by_a = wait_until(lambda: a.acquire(["p"]).get("p"), 30, "A taking B's expired lease on the old primary")
    assert held_by_a.fence == held_by_b.fence + 1

    def act(lease) -> None:
        with pair.db.connection() as conn:
            Leases.check(conn, lease)
            conn.execute("INSERT INTO public.effects VALUES (%s)", (lease.owner,))

    act(held_by_a)  # acknowledged by the old primary only
    pair.fail_over()

    held_by_b = retrying(lambda: wait_until(lambda: b.acquire(["p"]).get("p"), 30, "B holding p again"), "B")
    assert held_by_b.fence == held_by_a.fence  # the same number on the new timeline: the owner tells them apart
    acted = []
    for lease in (held_by_a, held_by_b):
        try:
            act(lease)
            acted.append(lease.owner)
        except LeaseLost:
            pass
    assert acted == ["worker-b"]
    assert count(pair.db, "SELECT count(*) FROM public.effects") == 1  # A's first effect went with the old primary


def test_multihost_urls_are_read_masked_and_followed_in_every_form(pair):
    """The URL forms a failover needs: settings refuse several hosts that may land on the standby, secrets are
    masked, the key=value form and Dagster's storage URL (SQLAlchemy on psycopg2) follow the primary."""
    import sqlalchemy

    from cmb_dagster.errors import ConfigError
    from cmb_dagster.secrets import mask
    from cmb_dagster.settings import Settings, dagster_storage_url

    assert Settings.from_env(database_url=pair.url).database_url == pair.url
    with pytest.raises(ConfigError, match="add target_session_attrs=read-write"):
        Settings.from_env(database_url=pair.url.replace("?target_session_attrs=read-write", ""))
    secret_url = pair.url.replace("postgres@", "postgres:s3cret-pw@")
    assert "s3cret-pw" not in mask(secret_url) and f"{pair.standby.port}/{DBNAME}" in mask(secret_url)
    key_value = multihost_url([pair.primary, pair.standby], DBNAME, key_value=True)
    storage = sqlalchemy.create_engine(dagster_storage_url(pair.url), poolclass=sqlalchemy.pool.NullPool)

    def ports() -> tuple[int, int]:
        with Database(key_value).connect() as conn, storage.connect() as dagster:
            return conn.info.port, dagster.exec_driver_sql("SELECT inet_server_port()").scalar()

    assert ports() == (pair.primary.port, pair.primary.port)
    pair.fail_over()
    assert ports() == (pair.standby.port, pair.standby.port)
