"""Held-xmin probe: which hot statements and indexes of each engine get dearer while a snapshot is held (issue 48).

    .venv/bin/python benchmarks/bench_held_xmin.py [--engines eventqueue,flow,callbacks,stages,pubsub]
        [--rate 400] [--rates stages=200,...] [--seconds 60] [--vacuum-every 10] [--window SECONDS]
    .venv/bin/python benchmarks/bench_held_xmin.py --engines eventqueue,procrastinate,callbacks,pgqueuer
        --seconds 600 --window 60        # issue 48's acceptance figure

For each engine, in a database of its own (``bench_callbacks.bench_database``: on CMB_DATABASE_URL's server, or
the embedded one; dropped at the end), one producer and one worker run the engine's normal work through its public
API in two phases of the same work, ``--rate`` x ``--seconds`` items each:
- A: nothing held;
- B: another session in REPEATABLE READ that ran one SELECT holds its snapshot for the whole phase (until the
  phase's figures are read), so no row that dies during the phase can be removed; then it is released with the
  engine at work again (below).
The producer is one thread with one connection, one item per transaction at ``--rate`` a second (``--rates`` sets
an engine's own), sending at once when it is behind. Every ``--vacuum-every`` seconds the tables changed since the
last round are vacuumed and analyzed (what autovacuum would do; the test server runs without it); at the end of
each phase, once more (this one counted in the statistics: its n_dead_tup are the dead rows it could not remove).

Every figure of a phase is taken over its window: its last fifth of items, or with ``--window`` the items of its
last SECONDS at the rate (issue 48 reads the last minute of a 600 s phase), from the moment the producer starts
them to the last item handled. The figure that does not depend on the machine's speed: buffers touched (hit +
read) per item, for every heap and index the phase used (pg_statio_user_tables, pg_statio_user_indexes), with the
index entries read per item (idx_tup_read of pg_stat_user_indexes: the dead entries a scan steps over count too)
and the share of HOT updates. The counters are read when the window opens and at the end, once every item is
handled and the engine's sessions have ended (a backend flushes its statistics when it exits; while it runs, at
most once a second, so the first reading may miss up to a second of work, counted in the window). The vacuums and
this probe's own reads run in sessions with track_counts off (a superuser setting): they add nothing to those
counters. Also per phase: the items handled a second, the producer's rate and the duration of one send (p50/p99),
the latency the engine gives (below, p50/p99), n_dead_tup and the tables' sizes at the end, and EXPLAIN (ANALYZE,
BUFFERS) of each engine's hot reads as the phase left the tables (the snapshot still held in B).

The release: once B's figures are read, the engine is started again and the producer sends at the rate; then the
snapshot is released, the vacuum rounds run every ``--vacuum-every`` seconds from that moment, and each second each
table the engine changed in B is measured (heap and indexes, pg_table_size + pg_indexes_size) against its size at
A's end, for up to 120 s: ``back_within_s`` is the first second at which every one of them is within 1.5x of it or
truncated since the release (a new file). Files do not shrink on a vacuum, and a table that keeps a row per item
(procrastinate's jobs, kept by its default ``delete_jobs``; PgQueuer's log) grows with the work alone: with phases
not much longer than the watch, such a table cannot be back. Then the engine is stopped and the tables vacuumed
once more (counted): what a vacuum gets back.

Issue 48's figures, per engine: ``ratio``, B over A of the items handled a second and of the p99 latency over the
window, and ``back_within_s``; ``within_acceptance`` when both ratios are within 1.5x and the tables are back within
60 s of the release. A peer runs where it has a counterpart among our engines, in the same run.

Engines (the worker in a process of its own, started before the phase and warmed up):
- ``eventqueue``: a no-op handler without a key (``EventWorker``, concurrency 10, LISTEN on, sweep 2 s), one
  ``emit`` per item; latency from emit to handler start.
- ``flow``: the same with ``bench_flow``'s limits on 100 keys (``value.k``): a rate limit and a concurrency
  limit far above what is reached, so every start takes a token and a slot; latency as above.
- ``callbacks``: ``cmb-dagster callbacks worker`` calling ``bench_callbacks.SinkProcess``, one unbuffered
  ``CallbackClient.create`` due at once per item; latency from run_at (the create) to the call.
- ``stages``: ``bench_stages``' three-stage pipeline (``stages worker``), one ``StageStore.put`` per item; an item
  is handled once through the third stage.
- ``pubsub``: ``bench_pubsub``'s captured ``orders`` table, one row inserted per item, one ``ConsumerWorker``
  with default settings writing a result row per event; latency from the capture to the handler.

The peers, in ``--engines`` only (they need the bench extras: ``pip install -e '.[bench]'``), each in a database of
its own like ours, its tables vacuumed and counted like ours:
- ``procrastinate`` (the counterpart of ``eventqueue``): ``bench_eventqueue``'s worker, set up as its docs advise
  (its no-op ``async def`` task, concurrency 10, LISTEN/NOTIFY on, polling every 2 s as our sweep), and its
  producer's ``defer`` through a pool of one connection, one transaction per item; latency from defer to the
  task's start.
- ``pgqueuer`` (the counterpart of ``callbacks`` and ``eventqueue``): a ``QueueManager`` set up as
  ``bench_callbacks`` sets it up (asyncpg, batch 50, 200 tasks at most, dequeue timeout 1 s) with a no-op
  entrypoint; one ``enqueue`` per item on an asyncpg connection (one transaction each); latency from the enqueue
  to the entrypoint's start.

Prints a table per engine (relations whose buffers per item reach 0.05 in a phase), a line per engine with issue
48's figures, then one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve()
ENGINES = ("eventqueue", "flow", "callbacks", "stages", "pubsub")
PEERS = {"procrastinate": ("eventqueue",), "pgqueuer": ("callbacks", "eventqueue")}  # a peer: our engines it mirrors
PROBE_APP = "cmb_held_xmin_probe"  # application_name of this probe's own sessions
COUNTED = f"-c application_name={PROBE_APP} -c search_path=cmb,public"
UNCOUNTED = f"-c track_counts=off {COUNTED}"  # its reads add nothing to the statistics
WINDOW = 0.8  # without --window, the counters are read when this share of the items is sent, and at the end
CATCH_UP = 120.0  # seconds the worker has, once the producer is done, to handle the last items
SESSIONS_GONE = 30.0  # seconds the engine's sessions have to end once its processes are stopped
SETTLE = 1.0  # seconds between a worker's gate and the first item
WORKER_CONCURRENCY = 10
SWEEP = 2.0
SHOWN = 0.05  # buffers per item below which a relation is left out of the printed table (not of the JSON)
ACCEPTED = 1.5  # issue 48: B's items/s and p99 within this factor of A's; the tables back within it of A's end size
BACK_BY = 60.0  # issue 48: seconds after the release by which the tables are back
WATCH = 120.0  # seconds the tables' sizes are watched after the release, at most
Sender = tuple[Callable[[int], object], Callable[[], object]]  # send item i; close


# -- worker processes -------------------------------------------------------------------------------


def run_eventqueue_worker(url: str, out: str, config: dict[str, Any]) -> None:
    """An ``EventWorker`` with one no-op handler (``config``: its key and limits) recording emit and start times."""
    from bench_eventqueue import Work, handler, serve_until_stopped

    from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings

    record = handler(out, Work(), "sync")
    registry = HandlerRegistry()
    registry.add("noop", lambda event: record(event.value["t"]), **config)
    settings = WorkerSettings(listen=True, sweep_interval=SWEEP, worker_concurrency=WORKER_CONCURRENCY)
    worker = EventWorker(url, EventQueueOptions(handlers=registry, worker=settings))
    serve_until_stopped(worker)


def run_pubsub_consumer(url: str, out: str) -> None:
    """A ``ConsumerWorker`` with default settings: ``bench_pubsub``'s handler, recording capture and delivery times."""
    from bench_eventqueue import Work, _ready_then_wait, handler
    from bench_pubsub import handler as write_results

    from cmb_dagster.database import Database
    from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker

    record = handler(out, Work(), "sync")

    def deliver(conn: psycopg.Connection, events: list) -> None:  # type: ignore[type-arg]
        write_results(conn, events)
        for event in events:
            record(event.created_at.timestamp())

    worker = ConsumerWorker(Database(url), ConsumerSpec(consumer_id="held", handler=deliver))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop())
    worker.check()
    _ready_then_wait()
    worker.run()


async def run_pgqueuer_consumer(url: str, out: str) -> None:
    """PgQueuer's ``QueueManager`` set up as ``bench_callbacks`` sets it up, with one no-op entrypoint recording
    enqueue and start times."""
    import asyncpg
    from bench_callbacks import LOCAL, PGQUEUER_BATCH_SIZE, PGQUEUER_MAX_CONCURRENT_TASKS
    from bench_eventqueue import Work, _ready_then_wait, handler
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    record = handler(out, Work(), "async")
    manager = QueueManager(Queries(AsyncpgDriver(await asyncpg.connect(url))))

    @manager.entrypoint("noop")
    async def noop(job) -> None:  # type: ignore[no-untyped-def]
        await record(json.loads(job.payload)["t"])

    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, manager.shutdown.set)
    await asyncio.to_thread(_ready_then_wait)
    await manager.run(
        batch_size=PGQUEUER_BATCH_SIZE,
        max_concurrent_tasks=PGQUEUER_MAX_CONCURRENT_TASKS,
        dequeue_timeout=timedelta(seconds=LOCAL.poll_interval),
    )


def start_role(role: str, url: str, out: str, *args: str):  # type: ignore[no-untyped-def]
    """This script as a worker process (``role``) behind a gate, ready and released; a ``bench_eventqueue.Workers``."""
    from bench_eventqueue import Workers

    log = Path(out, "worker.err")
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(HERE), "--role", role, "--url", url, "--out", out, *args],
            bufsize=0,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    workers = Workers([proc], [log])
    try:
        workers.wait_ready()
    except BaseException:
        workers.stop()
        raise
    workers.open()
    time.sleep(SETTLE)
    return workers


def error_lines(log: str) -> list[str]:
    """The lines of a worker's log that report an error."""
    return [
        line
        for line in log.splitlines()
        if "Traceback" in line or ("error" in line.lower() and "(0 errors)" not in line)
    ]


def milliseconds_since(found: list[tuple[float, float]], since: float) -> list[float]:
    """Milliseconds from the first time to the second of each pair whose first time is ``since`` or later."""
    return [(second - first) * 1000 for first, second in found if first >= since]


# -- engines ----------------------------------------------------------------------------------------

Probe = tuple[str, str, dict[str, Any]]  # what it mirrors (statement; index), the query, its parameters


class Engine:
    """One engine's work: ``setup`` once in its database; per phase (``phase``) ``start`` its worker, ``sender`` for
    the producer's thread, ``handled`` items so far (read through the probe's uncounted session), ``latencies`` of the
    items sent since a time, ``stop``; ``probes`` of its hot reads."""

    latency: str | None = None
    phase = ""  # "A", "B" or "R" (at work again around the release), set before ``start``

    def setup(self, url: str) -> None:
        pass

    def start(self, url: str, out: str) -> None:
        raise NotImplementedError

    def sender(self, url: str) -> Sender:
        raise NotImplementedError

    def handled(self, monitor: psycopg.Connection) -> int:
        raise NotImplementedError

    def latencies(self, since: float) -> list[float]:
        return []

    def stop(self) -> list[str]:
        """Stop the worker; return the lines of its log that report errors."""
        raise NotImplementedError

    def probes(self, monitor: psycopg.Connection) -> list[Probe]:
        return []


class RoleEngine(Engine):
    """An engine whose worker is this script in a ``role`` of its own, writing a line per item handled to ``out``."""

    role = ""

    def role_args(self) -> list[str]:
        return []

    def start(self, url: str, out: str) -> None:
        from bench_eventqueue import Lines

        self.out, self.lines = out, Lines(out)
        self.workers = start_role(self.role, url, out, *self.role_args())

    def handled(self, monitor: psycopg.Connection) -> int:
        return self.lines.update()

    def latencies(self, since: float) -> list[float]:
        from bench_eventqueue import records

        return milliseconds_since(records(self.out), since)

    def stop(self) -> list[str]:
        self.workers.stop()
        return error_lines(self.workers.logs[0].read_text(errors="replace"))


# The event queue's turn floors: where an emit's reads of priority 0 start.
NEXT_TURN = "coalesce((SELECT next FROM eventqueue_turn_floors WHERE priority = 0), 0)"


class EventQueue(RoleEngine):
    latency = "emit -> handler start"

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.keyed = "key" in config

    role = "eventqueue-worker"

    def role_args(self) -> list[str]:
        return ["--config", json.dumps(self.config)]

    def sender(self, url: str) -> Sender:
        from bench_flow import KEYS

        from cmb_dagster.eventqueue import emit

        conn = psycopg.connect(url, autocommit=True, options="-c search_path=cmb,public")

        def send(i: int) -> None:
            emit("bench", "noop", {"t": time.time(), "k": i % KEYS} if self.keyed else {"t": time.time()}, conn=conn)

        return send, conn.close

    def probes(self, monitor: psycopg.Connection) -> list[Probe]:
        from cmb_dagster.eventqueue import sql as eq

        key = {"key": "0" if self.keyed else ""}
        handlers = {"handlers": ["noop"]}
        found = [
            (
                "emit: the key's last turn from the floors' next (_turns' heads; eventqueue_events_key_turn)",
                f"""SELECT x.turn + 1 FROM eventqueue_events x
                   WHERE x.handler = 'noop' AND x.flow_key = %(key)s AND x.priority = 0 AND x.turn IS NOT NULL
                     AND x.turn >= {NEXT_TURN}
                   ORDER BY x.turn DESC LIMIT 1""",
                key,
            ),
            (
                "emit: the head of the priority from the floors' next (_turns' heads; eventqueue_events_ready)",
                f"""SELECT x.turn FROM eventqueue_events x
                   WHERE (-x.priority::integer) = 0 AND x.turn >= {NEXT_TURN} AND x.turn >= 0
                   ORDER BY (-x.priority::integer), x.turn LIMIT 1""",
                {},
            ),
            (
                "claim: the ready events from the floor (CLAIM_DUE's due, unlocked; eventqueue_events_ready)",
                """SELECT e.id FROM eventqueue_events e
                   WHERE ((-e.priority::integer), e.turn)
                         >= (0, coalesce((SELECT floor FROM eventqueue_turn_floors WHERE priority = 0), 0))
                     AND (-e.priority::integer) <= 0 AND e.turn >= 0 AND e.visible_at <= now()
                     AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL
                   ORDER BY (-e.priority::integer), e.turn, e.id LIMIT 100""",
                handlers,
            ),
            (
                "claim: waiting events came due (CLAIM_DUE's came_due; eventqueue_events_waiting)",
                """SELECT EXISTS (SELECT 1 FROM eventqueue_events e WHERE e.turn IS NULL AND e.locked_by IS NULL
                                  AND e.visible_at <= now()
                                  AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL)""",
                handlers,
            ),
            ("sleep: the next waiting event (NEXT_VISIBLE; eventqueue_events_waiting)", eq.NEXT_VISIBLE, handlers),
        ]
        if self.keyed:
            from cmb_dagster.flow import sql as flow_sql

            found += [
                (
                    "claim: an event of the key ahead (claim's ranked; eventqueue_events_key_turn)",
                    """SELECT EXISTS (SELECT 1 FROM eventqueue_events x
                                      WHERE x.handler = 'noop' AND x.flow_key = %(key)s AND x.turn IS NOT NULL
                                        AND (x.priority > 0 OR (x.priority = 0 AND x.turn < 9223372036854775807)))""",
                    key,
                ),
                (
                    "claim: keys at their limit (flow at_limit; flow_buckets_empty, flow_slots_taken)",
                    flow_sql.at_limit("ARRAY['eventqueue/noop']"),
                    {},
                ),
                (
                    "claim: a key's free slots (flow take's flow_free, unlocked; flow_slots_pkey)",
                    f"""SELECT s.slot FROM flow_slots s
                        WHERE s.scope = 'eventqueue/noop' AND s.key = %(key)s AND s.slot < 10000
                          AND {flow_sql.SLOT_FREE} ORDER BY s.slot LIMIT 10""",
                    key,
                ),
                (
                    "claim: a key's bucket (flow take's flow_now, unlocked; flow_buckets_pkey)",
                    "SELECT b.tokens FROM flow_buckets b WHERE b.scope = 'eventqueue/noop' AND b.key = %(key)s",
                    key,
                ),
            ]
        return found


class Callbacks(Engine):
    latency = "run_at (create) -> call"

    def start(self, url: str, out: str) -> None:
        from bench_callbacks import LOCAL, LOG_DIR, SinkProcess, start_cmb_worker, warmed_up

        from cmb_dagster.callbacks import CallbackClient
        from cmb_dagster.database import Database

        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log = f"held-xmin-callbacks-{self.phase}.log"
        self.sink = SinkProcess().__enter__()
        self.target = f"{self.sink.url}/cb"
        try:
            self.worker = start_cmb_worker(url, self.log)
            own = Database(url, max_pool_size=1)
            try:
                with CallbackClient(own, LOCAL, buffered=False) as client:
                    client.create("bench", "warm-up", self.phase, datetime.now(UTC), self.target)
            finally:
                own.close()
            warmed_up(self.sink)
        except BaseException:
            self.stop()
            raise

    def sender(self, url: str) -> Sender:
        from bench_callbacks import LOCAL

        from cmb_dagster.callbacks import CallbackClient
        from cmb_dagster.database import Database

        own = Database(url, max_pool_size=1)
        client = CallbackClient(own, LOCAL, buffered=False).__enter__()

        def send(i: int) -> None:
            client.create("bench", "held", f"{self.phase}-{i}", datetime.now(UTC), self.target)

        def close() -> None:
            client.__exit__(None, None, None)
            own.close()

        return send, close

    def handled(self, monitor: psycopg.Connection) -> int:
        return self.sink.count()

    def latencies(self, since: float) -> list[float]:
        return milliseconds_since(
            [(datetime.fromisoformat(c.body["run_at"]).timestamp(), c.started) for c in self.sink.calls()], since
        )

    def stop(self) -> list[str]:
        from bench_callbacks import LOG_DIR, stop_process

        if getattr(self, "worker", None) is not None:
            stop_process(self.worker)
            self.worker = None
        self.sink.__exit__(None, None, None)
        log = LOG_DIR / self.log
        return error_lines(log.read_text(errors="replace")) if log.exists() else []

    def probes(self, monitor: psycopg.Connection) -> list[Probe]:
        from cmb_dagster.callbacks import sql as cb
        from cmb_dagster.flow import sql as flow_sql

        run_at, event_id, max_event_id = monitor.execute(cb.LOAD_WATERMARK, {"bucket": 0}).fetchone()
        poll = {"bucket": 0, "lookahead": 2.0, "limit": 1000}
        return [
            ("poll: the bucket's watermark (LOAD_WATERMARK; callback_buckets_pkey)", cb.LOAD_WATERMARK, {"bucket": 0}),
            (
                "poll: events planned past the cursor (POLL_AHEAD; callback_events_pending)",
                cb.POLL_AHEAD,
                {**poll, "run_at": run_at, "event_id": event_id},
            ),
            (
                "poll: events inserted past the horizon (POLL_LATE; callback_events_pending_ids)",
                cb.POLL_LATE,
                {**poll, "run_at": run_at, "max_event_id": max_event_id},
            ),
            ("poll: due urgent events (POLL_URGENT; callback_events_urgent)", cb.POLL_URGENT, {**poll, "held": []}),
            ("poll: the transactions drawing ids (EVENT_ID_DRAWERS)", cb.EVENT_ID_DRAWERS, {}),
            (
                "gate: the host's free slots (flow take's flow_free, unlocked; flow_slots_pkey)",
                f"""SELECT s.slot FROM flow_slots s
                    WHERE (s.scope, s.key) = (SELECT scope, key FROM flow_slots ORDER BY scope, key LIMIT 1)
                      AND {flow_sql.SLOT_FREE} ORDER BY s.slot LIMIT 10""",
                {},
            ),
        ]


class Stages(Engine):
    def start(self, url: str, out: str) -> None:
        from bench_stages import count_done, pipeline, start_workers, wait_count

        from cmb_dagster.database import Database
        from cmb_dagster.stages import StageStore

        done = count_done(url, "d")
        own = Database(url)
        try:
            StageStore(own, pipeline.stages).put(f"warm-up-{self.phase}", {"a": 0})
        finally:
            own.close()
        self.procs = start_workers(url, "pipeline", 1)
        try:
            wait_count(url, "d", done + 1, 60)
        except BaseException:
            self.stop()
            raise

    def sender(self, url: str) -> Sender:
        from bench_stages import pipeline

        from cmb_dagster.database import Database
        from cmb_dagster.stages import StageStore

        own = Database(url, max_pool_size=1)
        store = StageStore(own, pipeline.stages)
        return (lambda i: store.put(f"{self.phase}{i}", {"a": i})), own.close

    def handled(self, monitor: psycopg.Connection) -> int:
        return monitor.execute(
            "SELECT count(*) FROM cmb.stage_entities WHERE starts_with(entity_id, %s) AND payload ? 'd'", (self.phase,)
        ).fetchone()[0]

    def stop(self) -> list[str]:
        from bench_stages import stop_workers

        stop_workers(self.procs)
        found = []
        for proc in self.procs:
            proc.log.seek(0)
            found += error_lines(proc.log.read())
        return found

    def probes(self, monitor: psycopg.Connection) -> list[Probe]:
        from bench_stages import pipeline

        from cmb_dagster.stages import sql as st

        stages = [stage.name for stage in pipeline.stages]
        shards = list(range(pipeline.shard_count))
        return [
            (
                "claim: a shard's due entries (CLAIM's picked, unlocked; stage_queue_due)",
                """SELECT q.entity_id FROM stage_queue q
                   WHERE q.shard_id = 0 AND q.stage = 'first' AND q.lane = 0 AND q.parked_at IS NULL
                     AND q.due_at <= now()
                   ORDER BY q.due_at LIMIT 500""",
                {},
            ),
            (
                "plan: each shard's earliest entry and change (PLAN; stage_queue_due, stage_changes_shard)",
                st.PLAN,
                {"stages": stages, "shards": shards},
            ),
            (
                "change path: the shards' changes (PEEK_CHANGES; stage_changes_shard)",
                st.PEEK_CHANGES,
                {"shards": shards, "limit": pipeline.batch_size},
            ),
            (
                "count: a stage's counter row (COUNT's conflict target; stage_counters_pkey)",
                "SELECT processed FROM stage_counters WHERE stage = 'third' AND shard_id = 0",
                {},
            ),
        ]


class PubSub(RoleEngine):
    latency = "capture -> handler"

    def setup(self, url: str) -> None:
        from bench_pubsub import SETUP

        from cmb_dagster.pubsub import install_capture

        with psycopg.connect(url, options="-c search_path=cmb,public") as conn:
            conn.execute(SETUP)
            install_capture(conn, "public.orders", ops=["insert"])

    role = "pubsub-consumer"

    def sender(self, url: str) -> Sender:
        from bench_pubsub import INSERT_ORDERS

        conn = psycopg.connect(url, autocommit=True)
        return (lambda i: conn.execute(INSERT_ORDERS, {"n": 1})), conn.close

    def probes(self, monitor: psycopg.Connection) -> list[Probe]:
        from cmb_dagster.pubsub import sql as ps

        branch, snapshot = monitor.execute(
            "SELECT branch_id, snapshot::text FROM pubsub_watermarks WHERE consumer_id = 'held'"
        ).fetchone()
        key = {"consumer_id": "held", "branch_id": branch}
        read = {"branch_id": branch, "snapshot": snapshot, "target": None, "strict": False, "limit": 1001}
        return [
            (
                "batch: the consumer's watermark (LOCK_WATERMARK, unlocked; pubsub_watermarks_pkey)",
                ps.REGISTRATION,
                key,
            ),
            (
                "batch: the next events (READ_BATCH; pubsub_events_pkey)",
                ps.READ_BATCH,
                {**read, "txid": "0", "event_id": 0},
            ),
        ]


class Procrastinate(RoleEngine):
    """``bench_eventqueue``'s procrastinate worker (its no-op ``async def`` task, concurrency 10, LISTEN on, polling
    as our sweep) and producer (``defer`` through a pool of one connection)."""

    latency = "defer -> task start"

    def setup(self, url: str) -> None:
        from bench_eventqueue import procrastinate_app

        app = procrastinate_app(url)
        with app.open():
            app.schema_manager.apply_schema()

    def start(self, url: str, out: str) -> None:
        from bench_eventqueue import Lines, Work, Workers

        self.out, self.lines = out, Lines(out)
        work = Work(concurrency=WORKER_CONCURRENCY)
        self.workers = Workers.start("procrastinate", url, out, 1, listen=True, poll=SWEEP, work=work)
        self.workers.open()
        time.sleep(SETTLE)

    def sender(self, url: str) -> Sender:
        from bench_eventqueue import procrastinate_app

        app = procrastinate_app(url, min_size=1, max_size=1)

        @app.task(name="noop")
        async def noop(t: float) -> None: ...

        app.open()
        return (lambda i: noop.defer(t=time.time())), app.close


class PgQueuer(RoleEngine):
    """``run_pgqueuer_consumer``; the producer: one ``enqueue`` at a time on an asyncpg connection."""

    latency = "enqueue -> entrypoint start"
    role = "pgqueuer-consumer"

    def setup(self, url: str) -> None:
        from bench_callbacks import _pgqueuer_install

        asyncio.run(_pgqueuer_install(url))

    def sender(self, url: str) -> Sender:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        loop = asyncio.new_event_loop()  # run by the producer's thread, one enqueue at a time
        conn = loop.run_until_complete(asyncpg.connect(url))
        queries = Queries(AsyncpgDriver(conn))

        def send(i: int) -> None:
            loop.run_until_complete(queries.enqueue("noop", json.dumps({"t": time.time()}).encode()))

        def close() -> None:
            loop.run_until_complete(conn.close())
            loop.close()

        return send, close


def engine_of(name: str) -> Engine:
    from bench_flow import VARIANTS

    return {
        "eventqueue": lambda: EventQueue({}),
        "flow": lambda: EventQueue({**VARIANTS["rate-limited"], **VARIANTS["concurrency"]}),
        "callbacks": Callbacks,
        "stages": Stages,
        "pubsub": PubSub,
        "procrastinate": Procrastinate,
        "pgqueuer": PgQueuer,
    }[name]()


# -- the producer -----------------------------------------------------------------------------------


class Producer(threading.Thread):
    """Sends items 0..n-1 at ``rate`` a second (at once when behind), one ``send`` each, until ``halt``; ``sent`` so
    far, and per item the end of its send (``time.time()``) and its duration in seconds."""

    def __init__(self, sender: Sender, rate: float, n: int) -> None:
        super().__init__(name="producer", daemon=True)
        self.send, self.close = sender
        self.rate, self.n = rate, n
        self.sent = 0
        self.ends = [0.0] * n
        self.durations = [0.0] * n
        self.error: BaseException | None = None
        self.halted = threading.Event()

    def run(self) -> None:
        try:
            began = time.monotonic()
            for i in range(self.n):
                if self.halted.wait(max(0.0, began + i / self.rate - time.monotonic())):
                    break
                started = time.perf_counter()
                self.send(i)
                self.durations[i] = time.perf_counter() - started
                self.ends[i] = time.time()
                self.sent = i + 1
        except Exception as exc:
            self.error = exc  # the phase fails with it
            raise
        finally:
            self.close()

    def finish(self) -> None:
        """Wait for the last send; raise what failed the producer, if anything did."""
        self.join()
        if self.error is not None:
            raise RuntimeError(f"the producer failed: {self.error!r}") from self.error

    def halt(self) -> None:
        """Stop sending, then ``finish``."""
        self.halted.set()
        self.finish()


# -- statistics, vacuums, the held snapshot -----------------------------------------------------------

HEAP = ("blocks", "seq_scan", "seq_tup_read", "n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del")
INDEX = ("blocks", "idx_scan", "idx_tup_read", "idx_tup_fetch")
HEAP_STATS = """
SELECT s.schemaname || '.' || s.relname, io.heap_blks_hit + io.heap_blks_read, s.seq_scan, s.seq_tup_read,
       s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_del,
       coalesce(io.toast_blks_hit + io.toast_blks_read + io.tidx_blks_hit + io.tidx_blks_read, 0)
FROM pg_stat_user_tables s JOIN pg_statio_user_tables io USING (relid)
"""
INDEX_STATS = """
SELECT i.schemaname || '.' || i.relname, i.indexrelname, io.idx_blks_hit + io.idx_blks_read, i.idx_scan,
       i.idx_tup_read, i.idx_tup_fetch
FROM pg_stat_user_indexes i JOIN pg_statio_user_indexes io USING (indexrelid)
"""
SIZES = """
SELECT s.schemaname || '.' || s.relname, pg_table_size(s.relid), pg_indexes_size(s.relid), s.n_dead_tup, s.n_live_tup
FROM pg_stat_user_tables s
"""
FILES = """
SELECT s.schemaname || '.' || s.relname, pg_table_size(s.relid) + pg_indexes_size(s.relid),
       pg_relation_filenode(s.relid)
FROM pg_stat_user_tables s
"""
VACUUMED = re.compile(
    r'finished vacuuming "[^".]*\.([^"]+)".*?tuples: (\d+) removed, (\d+) remain, (\d+) are dead but not yet removable',
    re.S,
)


def counters(monitor: psycopg.Connection) -> dict[str, dict[str, int]]:
    """Every heap's, toast's and index's counters so far, keyed "<table> heap|toast|<index>"."""
    found: dict[str, dict[str, int]] = {}
    for table, *values, toast in monitor.execute(HEAP_STATS):
        found[f"{table} heap"] = dict(zip(HEAP, values, strict=True))
        found[f"{table} toast"] = {"blocks": toast}
    for table, index, *values in monitor.execute(INDEX_STATS):
        found[f"{table} {index}"] = dict(zip(INDEX, values, strict=True))
    return found


def changes(conn: psycopg.Connection) -> dict[str, int]:
    """Per table, the rows inserted, updated and deleted so far (as the engine's sessions flushed them)."""
    return dict(
        conn.execute("SELECT schemaname || '.' || relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables")
    )


def changed_since(conn: psycopg.Connection, before: dict[str, int]) -> tuple[list[str], dict[str, int]]:
    now = changes(conn)
    return sorted(t for t, n in now.items() if n != before.get(t)), now


def vacuum(conn: psycopg.Connection, tables: list[str]) -> dict[str, dict[str, int]]:
    """VACUUM (VERBOSE, ANALYZE) each table; per table the rows it removed, those left, the dead ones it kept."""
    found: dict[str, dict[str, int]] = {}

    def notice(diag: psycopg.errors.Diagnostic) -> None:
        match = VACUUMED.search(diag.message_primary or "")
        if match:
            found[match[1]] = {"removed": int(match[2]), "remain": int(match[3]), "dead_kept": int(match[4])}

    conn.add_notice_handler(notice)
    try:
        for table in tables:
            conn.execute(sql.SQL("VACUUM (VERBOSE, ANALYZE) {}").format(sql.Identifier(*table.split(".", 1))))
    finally:
        conn.remove_notice_handler(notice)
    return found


class Vacuums(threading.Thread):
    """Every ``every`` seconds, a vacuum of the tables changed since the last round, in an uncounted session;
    ``rounds``: when, and the dead rows each vacuum kept."""

    def __init__(self, url: str, every: float) -> None:
        super().__init__(name="vacuums", daemon=True)
        self.conn = psycopg.connect(url, autocommit=True, options=UNCOUNTED)
        self.every = every
        self.done = threading.Event()
        self.began = time.monotonic()
        self.seen = changes(self.conn)
        self.rounds: list[dict[str, Any]] = []

    def run(self) -> None:
        while not self.done.wait(self.every):
            tables, self.seen = changed_since(self.conn, self.seen)
            found = vacuum(self.conn, tables)
            kept = {t: f["dead_kept"] for t, f in found.items() if not t.startswith("pg_toast.")}
            self.rounds.append({"at_s": round(time.monotonic() - self.began, 1), "dead_kept": kept})

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.conn.close()


def hold_snapshot(url: str) -> psycopg.Connection:
    """A session in REPEATABLE READ that ran one SELECT and stays in its transaction: its snapshot holds the xmin."""
    conn = psycopg.connect(url, options=UNCOUNTED)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.execute("SELECT 1")
    return conn


def sessions(monitor: psycopg.Connection) -> set[int]:
    """The client sessions on this database other than the probe's own."""
    rows = monitor.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend' "
        "AND application_name IS DISTINCT FROM %s",
        (PROBE_APP,),
    )
    return {pid for (pid,) in rows}


def wait_sessions_gone(monitor: psycopg.Connection, before: set[int]) -> list[int]:
    """Wait until the sessions opened since ``before`` have ended (their statistics flushed); return those left."""
    deadline = time.monotonic() + SESSIONS_GONE
    while (left := sessions(monitor) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(left)


def explain(monitor: psycopg.Connection, probes: list[Probe]) -> dict[str, dict[str, Any]]:
    """EXPLAIN (ANALYZE, BUFFERS) of each probe: buffers touched, milliseconds, the indexes its plan read."""

    def indexes(node: dict[str, Any]) -> set[str]:
        own = {node["Index Name"]} if "Index Name" in node else set()
        return own.union(*(indexes(child) for child in node.get("Plans", [])))

    found = {}
    for name, query, params in probes:
        plan = monitor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params).fetchone()[0][0]
        top = plan["Plan"]
        found[name] = {
            "buffers": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
            "ms": round(plan["Execution Time"], 3),
            "indexes": sorted(indexes(top)),
        }
    return found


def relation_files(monitor: psycopg.Connection) -> dict[str, tuple[int, int]]:
    """Per table: its size with its indexes' (bytes), and its file (a new one once truncated)."""
    return {table: (size, file) for table, size, file in monitor.execute(FILES)}


def sizes(monitor: psycopg.Connection, tables: list[str]) -> dict[str, dict[str, int]]:
    """Per table: its size and its indexes' (bytes), n_dead_tup and n_live_tup."""
    return {
        table: {"table_bytes": heap, "index_bytes": index, "n_dead_tup": dead, "n_live_tup": live}
        for table, heap, index, dead, live in monitor.execute(SIZES)
        if table in tables
    }


# -- a phase --------------------------------------------------------------------------------------


def quantile(values: list[float], p: float) -> float | None:
    from bench_callbacks import percentile

    return round(percentile(values, p), 2) if values else None


def window(mark: dict[str, dict[str, int]], end: dict[str, dict[str, int]], items: int) -> dict[str, dict]:
    """Per relation that did anything between the two readings: its counters' growth per item."""
    found = {}
    for key, after in end.items():
        before = mark.get(key, {})
        delta = {field: value - before.get(field, 0) for field, value in after.items()}
        if not any(delta.values()):
            continue
        row: dict[str, Any] = {"buffers_per_item": round(delta["blocks"] / items, 3)}
        if "idx_scan" in delta:
            row["scans_per_item"] = round(delta["idx_scan"] / items, 3)
            row["entries_read_per_item"] = round(delta["idx_tup_read"] / items, 2)
            row["heap_fetches_per_item"] = round(delta["idx_tup_fetch"] / items, 2)
        elif "n_tup_upd" in delta:
            row["seq_rows_read_per_item"] = round(delta["seq_tup_read"] / items, 2)
            row["updates_per_item"] = round(delta["n_tup_upd"] / items, 3)
            row["hot_share"] = round(delta["n_tup_hot_upd"] / delta["n_tup_upd"], 3) if delta["n_tup_upd"] else None
        found[key] = row
    return found


def drive(
    engine: Engine, url: str, monitor: psycopg.Connection, rate: float, n: int, window_from: float, vacuum_every: float
) -> dict:
    """The producer's ``n`` items at ``rate`` to the running worker, vacuums every ``vacuum_every`` seconds, until
    every item is handled; the counters at the mark (``window_from`` items sent) and the figures of the run."""
    vacuums = Vacuums(url, vacuum_every)
    producer = Producer(engine.sender(url), rate, n)
    began = time.monotonic()
    vacuums.start()
    try:
        producer.start()
        while producer.sent < window_from and producer.is_alive():
            time.sleep(0.02)
        mark = counters(monitor)
        mark_sent, mark_at, mark_wall, mark_handled = (
            producer.sent,
            time.monotonic(),
            time.time(),
            engine.handled(monitor),
        )
        producer.finish()
        produced_at = time.monotonic()
        while (handled := engine.handled(monitor)) < n and time.monotonic() < produced_at + CATCH_UP:
            time.sleep(0.05)
        ended = time.monotonic()
    finally:
        vacuums.stop()
    items = n - mark_sent
    tail = producer.durations[mark_sent:]
    sent_seconds = producer.ends[n - 1] - producer.ends[mark_sent - 1] if mark_sent else None
    latencies = engine.latencies(mark_wall)
    return {
        "mark": mark,
        "window_items": items,
        "seconds": round(ended - began, 1),
        "producer_seconds": round(produced_at - began, 1),
        "window_seconds": round(ended - mark_at, 1),
        "sent_per_s": round(items / sent_seconds, 1) if sent_seconds else None,
        "handled_per_s": round((handled - mark_handled) / (ended - mark_at), 1),
        "send_p50_ms": quantile([d * 1000 for d in tail], 50),
        "send_p99_ms": quantile([d * 1000 for d in tail], 99),
        "latency_p50_ms": quantile(latencies, 50),
        "latency_p99_ms": quantile(latencies, 99),
        "flags": [f"{n - handled} items not handled {CATCH_UP:g}s after the last was sent"] if handled < n else [],
        "vacuum_rounds": vacuums.rounds,
    }


def watch_release(
    engine: Engine,
    url: str,
    monitor: psycopg.Connection,
    holder: psycopg.Connection,
    rate: float,
    tables: list[str],
    a_end: dict[str, int],
    vacuum_every: float,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The engine at work again at ``rate`` (phase "R"), then the snapshot released: each second, each table's size
    (heap and indexes) against ``a_end`` (its size at A's end), until every table is at once within ACCEPTED of it
    or truncated since the release (a new file, or gone), for WATCH seconds at most, the vacuum rounds running from
    the release. Returns the run's figures (``back_within_s``: that moment), and per table its sizes, when it was
    first within and whether it was at the end."""

    def within(now: dict[str, tuple[int, int]], table: str) -> bool:
        size, file = now.get(table, (0, -1))
        reference = a_end.get(table)
        return file != at_release[table][1] or (reference is not None and size <= ACCEPTED * reference)

    with tempfile.TemporaryDirectory() as out:
        engine.phase = "R"
        engine.start(url, out)
        try:
            producer = Producer(engine.sender(url), rate, math.ceil(2 * WATCH * rate))  # halted before its end
            producer.start()
            try:
                at_release = relation_files(monitor)
                holder.rollback()
                released = time.monotonic()
                vacuums = Vacuums(url, vacuum_every)
                vacuums.start()
                first_within: dict[str, float | None] = dict.fromkeys(tables)
                back = None
                try:
                    second = 0
                    while back is None and second <= WATCH:
                        time.sleep(max(0.0, released + second - time.monotonic()))
                        now = relation_files(monitor)
                        at = round(time.monotonic() - released, 1)
                        for table in tables:
                            if first_within[table] is None and within(now, table):
                                first_within[table] = at
                        if all(within(now, table) for table in tables):
                            back = at
                        second += 1
                    watched = time.monotonic() - released
                finally:
                    vacuums.stop()
            finally:
                producer.halt()
        finally:
            errors = engine.stop()
    per_table = {
        table: {
            "a_end_bytes": a_end.get(table),
            "released_bytes": at_release[table][0],
            "watch_end_bytes": now.get(table, (None, None))[0],
            "truncated": now.get(table, (None, None))[1] != at_release[table][1],
            "first_within_s": first_within[table],
            "within_at_end": within(now, table),
        }
        for table in tables
    }
    figures = {
        "back_within_s": back,
        "watched_s": round(watched, 1),
        "items_sent": producer.sent,
        "vacuum_rounds": vacuums.rounds,
        "errors_logged": len(errors),
        "error_lines": errors[-5:],
    }
    return figures, per_table


def run_phase(  # type: ignore[no-untyped-def]
    engine: Engine,
    url: str,
    monitor: psycopg.Connection,
    rate: float,
    n: int,
    phase: str,
    args,
    a_end: dict[str, int] | None = None,
) -> dict:
    """One phase of ``n`` items at ``rate``; phase "B" with the snapshot held from before its first item until its
    figures are read, then released as ``watch_release`` tells (``a_end``: A's end size of each table)."""
    window_from = n - max(1, round(rate * args.window)) if args.window else WINDOW * n
    before_sessions, began_changes = sessions(monitor), changes(monitor)
    holder = None
    try:
        with tempfile.TemporaryDirectory() as out:
            engine.phase = phase
            engine.start(url, out)
            try:
                holder = hold_snapshot(url) if phase == "B" else None
                result = drive(engine, url, monitor, rate, n, window_from, args.vacuum_every)
            finally:
                result_errors = engine.stop()
        left = wait_sessions_gone(monitor, before_sessions)
        if left:
            result["flags"].append(f"sessions {left} still open when the counters were read")
        result["errors_logged"] = len(result_errors)
        result["error_lines"] = result_errors[-5:]
        result["relations"] = window(result.pop("mark"), counters(monitor), result["window_items"])
        result["probes"] = explain(monitor, engine.probes(monitor))
        tables, _ = changed_since(monitor, began_changes)
        result["tables"] = sizes(monitor, tables)
        with psycopg.connect(url, autocommit=True, options=COUNTED) as counted:
            final = vacuum(counted, tables)  # counted: each table's n_dead_tup becomes the dead rows it kept
            for table, figures in sizes(monitor, tables).items():
                result["tables"][table]["n_dead_tup"] = figures["n_dead_tup"]
            result["final_vacuum"] = {t: f for t, f in final.items() if not t.startswith("pg_toast.")}
            if holder is not None:
                result["held_xmin_age"] = monitor.execute(
                    "SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = %s", (holder.info.backend_pid,)
                ).fetchone()[0]
                result["release"], watched = watch_release(
                    engine, url, monitor, holder, rate, tables, a_end or {}, args.vacuum_every
                )
                holder.close()
                released = vacuum(counted, tables)  # what a vacuum gets back, the engine stopped
                result["after_release"] = {
                    table: {**figures, "dead_kept": released.get(table, {}).get("dead_kept"), **watched[table]}
                    for table, figures in sizes(monitor, tables).items()
                }
    finally:
        if holder is not None:
            holder.close()
    return {"items": n, **result}


# -- report ----------------------------------------------------------------------------------------


def megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def window_text(args: argparse.Namespace) -> str:
    return f"last {args.window:g}s" if args.window else "last fifth"


def times(ratio: float | None) -> str:
    return "-" if ratio is None else f"x{ratio:.2f}"


def print_engine(name: str, figures: dict, window: str) -> None:
    a, b = figures["phases"]["A"], figures["phases"]["B"]
    peer = f" (peer of {', '.join(figures['peer_of'])})" if figures["peer_of"] else ""
    print(
        f"\n{name}{peer}: {figures['rate']:g} items/s, {a['items']:,} items a phase; {window} "
        f"({a['window_items']:,} items)"
    )
    for label, phase in (("A (nothing held)", a), ("B (snapshot held)", b)):
        latency = (
            f"; {figures['latency']} p50 {phase['latency_p50_ms']} ms, p99 {phase['latency_p99_ms']} ms"
            if figures["latency"]
            else ""
        )
        held = f"; the held xmin {phase['held_xmin_age']:,} xids old at the end" if "held_xmin_age" in phase else ""
        flags = (
            f"  [{'; '.join(phase['flags'] + phase['error_lines'][-2:])}]"
            if phase["flags"] or phase["errors_logged"]
            else ""
        )
        print(
            f"  {label}: {phase['seconds']:.0f}s; producer {phase['sent_per_s']}/s (send p50 "
            f"{phase['send_p50_ms']} ms, p99 {phase['send_p99_ms']} ms), handled {phase['handled_per_s']}/s{latency}; "
            f"{phase['errors_logged']} error lines{held}{flags}"
        )
    release = b["release"]
    print(
        f"  B/A: handled items/s {times(figures['ratio']['items_per_s'])}, p99 latency "
        f"{times(figures['ratio']['latency_p99'])}; after the release, the engine at work again "
        f"({release['items_sent']:,} items sent, {release['errors_logged']} error lines): "
        + (
            f"each table back within {ACCEPTED:g}x of its size at A's end (or truncated) in {release['back_within_s']}s"
            if release["back_within_s"] is not None
            else f"not back within {release['watched_s']:g}s: "
            + ", ".join(
                f"{table} {megabytes(t['watch_end_bytes'] or 0)} (A {megabytes(t['a_end_bytes'] or 0)})"
                for table, t in b["after_release"].items()
                if not t["within_at_end"]
            )
        )
    )
    keys = sorted(
        set(a["relations"]) | set(b["relations"]),
        key=lambda k: -b["relations"].get(k, {}).get("buffers_per_item", 0),
    )
    print(
        f"  {'relation':64} {'buffers/item A':>14} {'B':>8} {'B/A':>7}   {'entries read/item A':>19} {'B':>8}"
        f"   {'HOT share A':>11} {'B':>5}"
    )
    for key in keys:
        ra, rb = a["relations"].get(key, {}), b["relations"].get(key, {})
        buf_a, buf_b = ra.get("buffers_per_item", 0), rb.get("buffers_per_item", 0)
        if max(buf_a, buf_b) < SHOWN:
            continue
        ratio = f"x{buf_b / buf_a:.1f}" if buf_a else "-"
        read_a, read_b = ra.get("entries_read_per_item", ""), rb.get("entries_read_per_item", "")
        hot_a, hot_b = ra.get("hot_share"), rb.get("hot_share")
        hot = f"{hot_a if hot_a is not None else '':>11} {hot_b if hot_b is not None else '':>5}"
        print(f"  {key:64} {buf_a:14.2f} {buf_b:8.2f} {ratio:>7}   {read_a!s:>19} {read_b!s:>8}   {hot}")
    for table in sorted(set(a["tables"]) | set(b["tables"])):
        ta, tb = a["tables"].get(table), b["tables"].get(table)
        if not ta or not tb or (max(ta["n_dead_tup"], tb["n_dead_tup"]) == 0 and tb["table_bytes"] < 2**20):
            continue
        released = b["after_release"].get(table, {})
        print(
            f"  {table}: n_dead_tup A {ta['n_dead_tup']:,}, B {tb['n_dead_tup']:,} (after the release and a vacuum "
            f"{released.get('n_dead_tup', 0):,}); size A {megabytes(ta['table_bytes'])} + indexes "
            f"{megabytes(ta['index_bytes'])}, B {megabytes(tb['table_bytes'])} + {megabytes(tb['index_bytes'])}; "
            f"after the release {watched_text(released)}"
        )
    for probe, pa in a["probes"].items():
        pb = b["probes"].get(probe, {})
        print(f"  EXPLAIN {probe}: A {explained(pa)}, B {explained(pb)}")


def watched_text(table: dict[str, Any]) -> str:
    """What a table's size did once the snapshot was released, against its size at A's end."""
    end = f"{megabytes(table['watch_end_bytes'] or 0)} at the end"
    if table["truncated"]:
        return f"truncated, {end}"
    if table["first_within_s"] is None:
        return f"never within {ACCEPTED:g}x of A's, {end}"
    return f"within {ACCEPTED:g}x of A's from {table['first_within_s']}s, {end}"


def print_acceptance(results: dict[str, dict], window: str) -> None:
    """One line per engine: issue 48's figures, B over A over the window and the tables after the release."""
    print(
        f"\nissue 48 (B/A over the {window}; within {ACCEPTED:g}x, every table back within {ACCEPTED:g}x of its size "
        f"at A's end or truncated by {BACK_BY:g}s after the release):"
    )
    print(
        f"  {'engine':14} {'peer of':21} {'items/s A':>9} {'B':>7} {'B/A':>6}   {'p99 ms A':>8} {'B':>8} {'B/A':>6}"
        f"   {'tables back':>11}   within"
    )
    for name, figures in results.items():
        a, b = figures["phases"]["A"], figures["phases"]["B"]
        back = figures["back_within_s"]
        print(
            f"  {name:14} {', '.join(figures['peer_of']):21} {a['handled_per_s']!s:>9} {b['handled_per_s']!s:>7} "
            f"{times(figures['ratio']['items_per_s']):>6}   {a['latency_p99_ms']!s:>8} {b['latency_p99_ms']!s:>8} "
            f"{times(figures['ratio']['latency_p99']):>6}   {(f'{back}s' if back is not None else 'no'):>11}   "
            f"{'yes' if figures['within_acceptance'] else 'no'}"
        )


def explained(probe: dict[str, Any]) -> str:
    indexes = ", ".join(probe.get("indexes", [])) or "no index"
    return f"{probe.get('buffers')} buffers {probe.get('ms')} ms ({indexes})"


# -- main --------------------------------------------------------------------------------------------


def parse_rates(text: str | None, engines: list[str]) -> dict[str, float]:
    rates: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        engine, _, value = part.partition("=")
        if engine not in engines:
            raise SystemExit(f"--rates: {engine!r} is not one of the engines run ({', '.join(engines)})")
        rates[engine] = float(value)
    return rates


def run_engine(name: str, rate: float, args: argparse.Namespace) -> dict:
    from bench_callbacks import bench_database

    engine = engine_of(name)
    n = round(rate * args.seconds)
    with bench_database() as db:
        url = db.url
        db.close()  # the engine's own sessions only, from here
        engine.setup(url)
        try:
            monitor = psycopg.connect(url, autocommit=True, options=UNCOUNTED)
        except psycopg.Error as exc:
            raise SystemExit(f"this probe needs a role that may set track_counts (a superuser): {exc}") from None
        with monitor:
            a = run_phase(engine, url, monitor, rate, n, "A", args)
            a_end = {table: f["table_bytes"] + f["index_bytes"] for table, f in a["tables"].items()}
            phases = {"A": a, "B": run_phase(engine, url, monitor, rate, n, "B", args, a_end)}
    ratios = {}
    for key, rb in phases["B"]["relations"].items():
        buf_a = phases["A"]["relations"].get(key, {}).get("buffers_per_item", 0)
        if buf_a >= SHOWN or rb["buffers_per_item"] >= SHOWN:
            ratios[key] = round(rb["buffers_per_item"] / buf_a, 2) if buf_a else None
    b = phases["B"]
    ratio = {
        "items_per_s": quotient(b["handled_per_s"], a["handled_per_s"]),
        "latency_p99": quotient(b["latency_p99_ms"], a["latency_p99_ms"]),
    }
    back = b["release"]["back_within_s"]
    return {
        "rate": rate,
        "latency": engine.latency,
        "peer_of": list(PEERS.get(name, ())),
        "ratio": ratio,
        "back_within_s": back,
        "within_acceptance": (ratio["items_per_s"] or 0) >= 1 / ACCEPTED
        and (engine.latency is None or (ratio["latency_p99"] or ACCEPTED + 1) <= ACCEPTED)
        and back is not None
        and back <= BACK_BY,
        "phases": phases,
        "buffers_per_item_b_over_a": ratios,
    }


def quotient(b: float | None, a: float | None) -> float | None:
    return round(b / a, 2) if a and b is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"among {', '.join(ENGINES)} (the default) and the peers {', '.join(PEERS)}",
    )
    parser.add_argument("--rate", type=float, default=400.0, help="items per second of the producer (default 400)")
    parser.add_argument("--rates", default=None, help="an engine's own rate: e.g. stages=200,callbacks=300")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of a phase at the rate (default 60)")
    parser.add_argument("--vacuum-every", type=float, default=10.0, help="seconds between vacuums (default 10)")
    parser.add_argument(
        "--window", type=float, default=None, help="figures over a phase's last SECONDS (default: its last fifth)"
    )
    args = parser.parse_args()
    if args.role == "eventqueue-worker":
        return run_eventqueue_worker(args.url, args.out, json.loads(args.config))
    if args.role == "pubsub-consumer":
        return run_pubsub_consumer(args.url, args.out)
    if args.role == "pgqueuer-consumer":
        return asyncio.run(run_pgqueuer_consumer(args.url, args.out))

    from bench_callbacks import LOG_DIR, server_url
    from bench_eventqueue import server_info

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES) - set(PEERS))
    if unknown:
        parser.error(f"unknown engines: {', '.join(unknown)}")
    rates = {engine: args.rate for engine in engines} | parse_rates(args.rates, engines)
    if any(r <= 0 for r in rates.values()) or args.seconds <= 0 or args.vacuum_every <= 0:
        parser.error("rates, --seconds and --vacuum-every must be positive")
    if args.window is not None and not 0 < args.window < args.seconds:
        parser.error("--window must be positive and shorter than --seconds")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the workers and drop the databases on the way out
    info = server_info(server_url())
    load_start = os.getloadavg()[0]
    began = time.monotonic()
    results = {}
    try:
        for name in engines:
            results[name] = run_engine(name, rates[name], args)
    finally:
        if LOG_DIR.exists():
            for log in LOG_DIR.glob("held-xmin-*.log"):
                log.unlink()
            if not any(LOG_DIR.iterdir()):
                LOG_DIR.rmdir()
    print(
        f"server: Postgres {info['server_version']}, autovacuum={info['autovacuum']}, fsync={info['fsync']}, "
        f"shared_buffers={info['shared_buffers']}; {os.cpu_count()} cores; load average {load_start:.2f} at the "
        f"start, {os.getloadavg()[0]:.2f} at the end; phases of {args.seconds:g}s at the rate, vacuums every "
        f"{args.vacuum_every:g}s"
    )
    for name, figures in results.items():
        print_engine(name, figures, window_text(args))
    print_acceptance(results, window_text(args))
    sys.stdout.flush()
    print(
        json.dumps(
            {
                "benchmark": "held_xmin",
                "server": info,
                "machine": {"cores": os.cpu_count()},
                "setup": {
                    "seconds": args.seconds,
                    "vacuum_every": args.vacuum_every,
                    "window_seconds": args.window,
                    "window_share": None if args.window else round(1 - WINDOW, 2),
                    "accepted_factor": ACCEPTED,
                    "back_by_s": BACK_BY,
                    "release_watch_s": WATCH,
                    "peers": {name: version(name) for name in engines if name in PEERS},
                },
                "engines": results,
                "seconds": round(time.monotonic() - began, 1),
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main()
