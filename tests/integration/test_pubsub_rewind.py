"""Rewinding a consumer (issue 34): events from the point come again, in order, once more; nothing undelivered is
skipped; a running worker holding the consumer's lease needs no stopping."""

import threading
from datetime import UTC, datetime, timedelta

import pytest
from waiting import wait_until

from cmb_dagster.pubsub import (
    ConsumerSpec,
    ConsumerWorker,
    InvalidPubSubInput,
    publish,
    reset_consumer,
    status,
    trim,
)
from cmb_dagster.pubsub.engine import snapshot_before


def test_a_snapshot_before_a_txid_keeps_what_it_showed_committed_below_it():
    assert snapshot_before("10:20:12,15,18", 16) == "12:16:12,15"
    assert snapshot_before("10:20:12,15,18", 11) == "11:11:"
    assert snapshot_before("10:20:12,15,18", 25) == "10:20:12,15,18"
    assert snapshot_before("10:20:", 14) == "14:14:"


def record_handled(conn, events):
    """Same-database results: one row per delivery, saying whether the consumer had been rewound by then (the
    watermark row is this transaction's, locked)."""
    conn.execute(
        "INSERT INTO public.handled (event_id, after_rewind)"
        " SELECT unnest(%s::bigint[]), (SELECT rewound_at IS NOT NULL FROM pubsub_watermarks"
        "  WHERE consumer_id = 'rewound' AND branch_id = 0)",
        ([e.id for e in events],),
    )


def handled(db):
    with db.connection() as conn:
        return conn.execute("SELECT event_id, after_rewind FROM public.handled ORDER BY seq").fetchall()


def test_a_rewind_while_one_of_two_workers_holds_the_lease_replays_from_the_point_in_order_exactly_once(db):
    with db.connection() as conn:
        conn.execute(
            "CREATE TABLE public.handled (seq bigint GENERATED ALWAYS AS IDENTITY, event_id bigint NOT NULL,"
            " after_rewind boolean NOT NULL)"
        )
    ids = []
    with db.connection() as conn:
        for n in range(300):
            ids.append(publish(0, {"n": n}, conn=conn))
            conn.commit()  # one transaction per event: the stream's order is the id order
    spec = ConsumerSpec(consumer_id="rewound", handler=record_handled, batch_size=7, lease_ttl=2, idle_sleep=0.05)
    workers = [ConsumerWorker(db, spec) for _ in range(2)]
    threads = [threading.Thread(target=w.run, args=(120,)) for w in workers]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(handled(db)) >= 150, timeout=60, what="half of the events handled")
        point = ids[100]
        reset_consumer(db, "rewound", 0, to=point, by="test")  # through the watermark lock: no worker stopped
        with db.connection() as conn:
            for n in range(300, 350):  # more events while the consumer replays
                ids.append(publish(0, {"n": n}, conn=conn))
                conn.commit()
        wait_until(
            lambda: sum(after for _, after in handled(db)) >= len(ids) - 100,
            timeout=60,
            what="every event from the point handled after the rewind",
        )
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
    rows = handled(db)
    before = [e for e, after in rows if not after]
    again = [e for e, after in rows if after]
    assert before == sorted(before) and len(set(before)) == len(before)  # in order, once each, before the rewind
    assert again == ids[100:]  # from the point on, in order, each once, nothing skipped
    assert set(ids[:100]) <= set(before)  # before the point: once, never again
    assert len(before) >= 150 and set(before) - set(ids[:100])  # events of the point and after were seen twice
    lag = status(db, "rewound", 0).consumers[0]
    assert lag.events == 0 and "by test: from after event" in lag.last_rewind and f"to event {point}" in lag.last_rewind


def collect(db, consumer_id="c"):
    seen = []
    worker = ConsumerWorker(db, ConsumerSpec(consumer_id=consumer_id, handler=lambda conn, events: seen.extend(events)))

    def drain():
        while worker.run_once():
            pass
        return [e.id for e in seen]

    return drain, seen


def test_a_rewind_skips_nothing_undelivered_and_a_time_means_the_first_event_created_since(db):
    drain, seen = collect(db)
    with db.connection() as conn:
        first = [publish(0, {"n": n}, conn=conn) for n in range(3)]
    long = db.connect()  # a transaction with a lower txid than the point, committed after the rewind
    late = publish(0, {"n": "late"}, conn=long)
    ids = []
    with db.connection() as conn:
        for n in range(5):
            ids.append(publish(0, {"n": n}, conn=conn))
            conn.commit()
    assert drain() == first + ids
    with db.connection() as conn:
        created = conn.execute("SELECT created_at FROM pubsub_events WHERE id = %s", (ids[2],)).fetchone()[0]
    reset_consumer(db, "c", 0, to=created)
    long.commit()
    long.close()
    seen.clear()
    assert drain() == [*ids[2:], late]  # again from the point; the late transaction's event once, not skipped


def test_a_rewind_clears_a_failure_and_refuses_bad_points_naming_the_field(db):
    with db.connection() as conn:
        ids = [publish(0, {"n": n}, conn=conn) for n in range(3)]
    drain, _ = collect(db)
    drain()
    with db.connection() as conn:
        conn.execute("UPDATE pubsub_watermarks SET failing_event = %s, attempts = 4, last_error = 'x'", (ids[1],))
    reset_consumer(db, "c", 0, to=ids[0])
    lag = status(db, "c", 0).consumers[0]
    assert lag.failing_event is None and lag.attempts == 0 and lag.events == 3
    refused = {
        "in the future": datetime.now(UTC) + timedelta(hours=1),
        "no event 999999": 999_999,
        "has no time zone": datetime.now(),
        "an event id or a datetime": "yesterday",
    }
    for message, point in refused.items():
        with pytest.raises(InvalidPubSubInput, match=f"^to: .*{message}"):
            reset_consumer(db, "c", 0, to=point)
    with pytest.raises(InvalidPubSubInput, match="^consumer_id: no consumer 'nobody'"):
        reset_consumer(db, "nobody", 0, to=ids[0])
    with pytest.raises(InvalidPubSubInput, match="^consumer_id: 'sensor.s' mirrors a Dagster sensor"):
        reset_consumer(db, "sensor.s", 0, to=ids[0])
    drain()
    with db.connect(autocommit=True) as conn:
        assert trim(conn, retain=timedelta(0)) == 3
    with db.connection() as conn:
        kept = publish(0, {"n": "kept"}, conn=conn)
    drain()
    with pytest.raises(InvalidPubSubInput, match="^to: no event"):
        reset_consumer(db, "c", 0, to=ids[2])
    with pytest.raises(InvalidPubSubInput, match="^to: trim has deleted events of branch 0 after that point"):
        reset_consumer(db, "c", 0, to=datetime.now(UTC) - timedelta(days=1))
    reset_consumer(db, "c", 0, to=kept)
    assert status(db, "c", 0).consumers[0].events == 1
