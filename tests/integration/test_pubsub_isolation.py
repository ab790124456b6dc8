"""Isolation in the pub/sub consumer against real Postgres: an error Postgres cannot store as it is, a handler
past its time limit, and a handler that kills its consumer process, each parked alone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from waiting import wait_until

from cmb_dagster.isolation import WorkerStuck
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, HandlerFailed, InvalidPubSubInput, dead_letters, publish
from cmb_dagster.workers import list_leases

ACCEPTANCE = Path(__file__).parents[1] / "acceptance"


def results(db) -> list[int]:
    with db.connection() as conn:
        return [r[0] for r in conn.execute("SELECT event_id FROM public.results ORDER BY event_id")]


def publish_all(db, payloads: list[dict]) -> list[int]:
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint PRIMARY KEY)")
        return [publish(0, p, conn=conn) for p in payloads]


def parked(db, consumer_id: str):
    with db.connection() as conn:
        return dead_letters(conn, consumer_id, 0)


def drain(consumer: ConsumerWorker, rounds: int = 100) -> None:
    for _ in range(rounds):
        try:
            if consumer.run_once() == 0:
                return
        except HandlerFailed:
            continue
    raise AssertionError("the consumer is still busy")


def test_an_error_message_postgres_cannot_store_as_it_is_parks_the_event_and_the_others_go_on(db):
    ids = publish_all(db, [{"n": n} for n in range(20)])

    def handler(conn, events):
        if any(e.payload["n"] == 3 for e in events):
            raise ValueError("bad \x00 byte and \udc80 half a character")
        conn.execute("INSERT INTO public.results SELECT unnest(%s::bigint[])", ([e.id for e in events],))

    consumer = ConsumerWorker(db, ConsumerSpec(consumer_id="poisoned", handler=handler, max_attempts=2))
    drain(consumer)
    assert results(db) == [i for i in ids if i != ids[3]]
    [dead] = parked(db, "poisoned")
    assert dead.event.id == ids[3] and dead.error == "ValueError: bad \\0 byte and \ufffd half a character"
    consumer.close()


def test_a_handler_past_its_time_limit_has_its_transaction_ended_and_fails(db):
    ids = publish_all(db, [{"n": n} for n in range(5)])

    def handler(conn, events):
        conn.execute("INSERT INTO public.results SELECT unnest(%s::bigint[])", ([e.id for e in events],))
        if any(e.payload["n"] == 2 for e in events):
            conn.execute("SELECT pg_sleep(30)")  # holds its transaction open (and the watermark locked) till its end

    spec = ConsumerSpec(consumer_id="slow", handler=handler, max_attempts=2, handler_timeout=0.5)
    consumer = ConsumerWorker(db, spec)
    drain(consumer)  # the server ends the sleeping transaction at the deadline: the call ends (else: WorkerStuck)
    assert results(db) == [i for i in ids if i != ids[2]]  # its insert was rolled back with its transaction
    [dead] = parked(db, "slow")
    assert dead.event.id == ids[2] and dead.error.startswith("TimedOut: timed out after 0.5 s")
    consumer.close()


def test_an_async_handler_writes_in_the_consumers_transaction_and_is_cancelled_at_its_time_limit(db):
    ids = publish_all(db, [{"n": n} for n in range(5)])
    cancelled = []

    async def handler(conn, events):
        await asyncio.sleep(0)
        conn.execute("INSERT INTO public.results SELECT unnest(%s::bigint[])", ([e.id for e in events],))
        if any(e.payload["n"] == 2 for e in events):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append([e.id for e in events])
                raise

    spec = ConsumerSpec(consumer_id="async", handler=handler, max_attempts=2, handler_timeout=0.5)
    consumer = ConsumerWorker(db, spec)
    drain(consumer)  # a call left running past twice its limit would raise WorkerStuck
    assert results(db) == [i for i in ids if i != ids[2]]  # its insert was rolled back with its transaction
    [dead] = parked(db, "async")
    assert dead.event.id == ids[2] and dead.error.startswith("TimedOut: timed out after 0.5 s")
    assert [ids[2]] in cancelled
    consumer.close()


def test_a_worker_stuck_in_its_handler_stops_and_leaves_its_lease_to_lapse(db):
    publish_all(db, [{"n": 0}])
    release = threading.Event()

    def handler(conn, events):
        release.wait(30)  # neither returns nor uses its connection: past twice its limit, the worker is stuck

    spec = ConsumerSpec(consumer_id="stuck", handler=handler, handler_timeout=0.5, lease_ttl=60)
    consumer = ConsumerWorker(db, spec)
    try:
        with pytest.raises(WorkerStuck, match="still running past their time limit"):
            consumer.run(30)
        [lease] = [lease for lease in list_leases(db) if lease.partition == "stuck@0"]
        assert lease.expires_in > 0  # not released while the call runs: no standby delivers beside it
    finally:
        release.set()


@pytest.mark.slow
def test_an_event_whose_delivery_kills_the_consumer_is_parked_after_its_crashes(db, database_url):
    ids = publish_all(db, [{"crash": n == 30} for n in range(100)])
    command = [
        sys.executable,
        "-c",
        "from cmb_dagster.cli import run; run()",
        "pubsub",
        "consume",
        "fragile",
        "--handler",
        "pubsub_handlers:record",
        "--lease-ttl",
        "1",
        "--batch-size",
        "50",
    ]
    env = {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "PYTHONPATH": f"{ACCEPTANCE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    deaths = 0

    def settled() -> bool:
        nonlocal deaths
        for i, proc in enumerate(procs):
            if proc.poll() is not None:
                deaths += 1
                procs[i] = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return len(results(db)) == 99

    try:
        wait_until(settled, 120, "every other event delivered once and the crashing one parked", interval=0.2)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(20)
    assert results(db) == [i for i in ids if i != ids[30]]  # exactly once each (a primary key)
    [dead] = parked(db, "fragile")
    assert dead.event.id == ids[30] and "deliveries in a row ended with the death of their worker" in dead.error
    assert 4 <= deaths <= 5, deaths  # the batch it was in, then max_crashes deliveries alone


@pytest.mark.parametrize(
    ("field", "arguments"),
    [
        ("payload", {"payload": {"text": "a\x00b"}}),
        ("payload", {"payload": {"text": "\udc80"}}),
        ("payload", {"payload": "x" * (5 * 1024 * 1024)}),
        ("key", {"key": {"id": "\ud800"}}),
        ("topic", {"topic": "t\x00"}),
        ("branch_id", {"branch_id": 2**63}),
        ("branch_id", {"branch_id": True}),
    ],
)
def test_publish_refuses_what_postgres_cannot_store_naming_the_field(db, field, arguments):
    with db.connection() as conn:
        with pytest.raises(InvalidPubSubInput, match=f"^{field}: "):
            publish(**{"branch_id": 0, "payload": {}, **arguments}, conn=conn)
        assert conn.execute("SELECT count(*) FROM pubsub_events").fetchone() == (0,)  # the transaction goes on
