"""Retention: trim keeps events younger than ``retain``, and a consumer seen for the first time starts where
``start`` says (told once when trim had deleted events it would have read)."""

import logging

from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, publish, status, trim


def worker(db, consumer_id, handler, **options):
    return ConsumerWorker(db, ConsumerSpec(consumer_id=consumer_id, handler=handler, **options))


def test_trim_keeps_events_younger_than_retain_and_late_consumers_choose_where_to_start(db, caplog):
    with db.connection() as conn:
        old = [publish(0, {"n": n}, conn=conn) for n in range(3)]
    first = worker(db, "first", lambda conn, events: None)
    assert first.run_once() == 3
    with db.connect(autocommit=True) as conn:
        assert trim(conn) == 0  # read by every consumer, but younger than 7 days
        conn.execute(
            "UPDATE cmb.pubsub_events SET created_at = created_at - interval '8 days' WHERE id = ANY (%s)", (old[:2],)
        )
        assert trim(conn) == 2  # the week-old ones go
    with db.connection() as conn:
        new = publish(0, {"n": 3}, conn=conn)

    seen = {}
    for start in ("beginning", "earliest_kept", "now"):
        seen[start] = []
        consumer = worker(
            db, f"late-{start}", lambda conn, events, s=start: seen[s].extend(e.id for e in events), start=start
        )
        with caplog.at_level(logging.WARNING, logger="cmb_dagster.pubsub"):
            consumer.check()
            consumer.check()
    with db.connection() as conn:
        publish(0, {"n": 4}, conn=conn)
    for start in seen:
        worker(db, f"late-{start}", lambda conn, events, s=start: seen[s].extend(e.id for e in events)).run_once()
    assert seen["beginning"][:2] == [old[2], new] and seen["earliest_kept"][:2] == [old[2], new]
    assert len(seen["now"]) == 1 and seen["now"][0] > new
    warnings = [r.getMessage() for r in caplog.records if "trim had already deleted 2 of its events" in r.getMessage()]
    assert len(warnings) == 1 and "late-beginning" in warnings[0]  # once, and only for start="beginning"
    lags = {lag.consumer_id: lag for lag in status(db).consumers}
    assert "trim had already deleted 2" in lags["late-beginning"].problem
    assert lags["late-earliest_kept"].problem is None and lags["late-now"].problem is None
