import time

import psycopg
import pytest
from running import Running
from waiting import wait_until

from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, publish

HOLD_SECONDS = 8  # a reader of the events below xmin would deliver nothing for as long (past the 3 s bound)


@pytest.mark.slow
def test_a_transaction_held_open_elsewhere_delays_nothing_committed_meanwhile(db):
    received: dict[int, float] = {}
    duplicates: list[int] = []

    def handler(conn, events):
        now = time.monotonic()
        for e in events:
            if e.id in received:
                duplicates.append(e.id)
            received[e.id] = now

    consumer = ConsumerWorker(db, ConsumerSpec(consumer_id="patient", handler=handler, idle_sleep=0.05))
    running = Running(consumer)
    long_writer = db.connect()  # holds a txid and an uncommitted event for HOLD_SECONDS
    held = publish(0, {"from": "the long transaction"}, conn=long_writer)
    report = db.connect()  # a long report: holds back xmin without a txid of its own
    report.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    report.execute("SELECT count(*) FROM pubsub_events")

    committed: dict[int, float] = {}
    below_xmin = 0
    with db.connect(autocommit=True) as producer:
        started = time.monotonic()
        while time.monotonic() - started < HOLD_SECONDS:
            event_id = publish(0, {"at": time.monotonic() - started}, conn=producer)
            committed[event_id] = time.monotonic()
            time.sleep(0.1)  # a steady producer: 10 events/s
        below_xmin = producer.execute(
            "SELECT count(*) FROM pubsub_events WHERE txid < pg_snapshot_xmin(pubsub_snapshot())"
        ).fetchone()[0]
    wait_until(lambda: all(i in received for i in committed), timeout=5)
    assert held not in received
    long_writer.commit()
    report.rollback()
    wait_until(lambda: held in received, timeout=5)
    running.stop()
    long_writer.close()
    report.close()

    delays = sorted(received[i] - committed[i] for i in committed)
    print(f"delivery delay over {len(delays)} events: p50 {delays[len(delays) // 2]:.3f}s, max {delays[-1]:.3f}s")
    assert delays[-1] < 3.0, f"p50 {delays[len(delays) // 2]:.3f}s, max {delays[-1]:.3f}s"
    assert not duplicates and set(received) == set(committed) | {held}
    assert below_xmin == 0  # a reader of the events below xmin would have delivered none of them yet
    with psycopg.connect(db.url) as conn:
        assert conn.execute("SELECT delivered FROM cmb.pubsub_watermarks").fetchone() == (len(committed) + 1,)
