"""status(db): every registered consumer's lag with the totals, from a Database, a pool or a URL."""

import pytest
from psycopg_pool import ConnectionPool

from cmb_dagster.database import Database
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, PubSubStatus, consumer_lag, publish, status


def figures(report: PubSubStatus) -> list[tuple[str, int, int]]:
    return [(lag.consumer_id, lag.delivered, lag.events) for lag in report.consumers]


def test_status_reports_each_consumer_and_the_totals(db):
    assert status(db) == PubSubStatus(consumers=[])
    with db.connection() as conn:
        for n in range(5):
            publish(0, {"n": n}, conn=conn)
    for consumer_id, batch_size in (("ahead", 4), ("behind", 1)):
        ConsumerWorker(
            db, ConsumerSpec(consumer_id=consumer_id, handler=lambda conn, events: None, batch_size=batch_size)
        ).run_once()
    report = status(db)
    assert figures(report) == [("ahead", 4, 1), ("behind", 1, 4)]
    assert (report.behind, report.parked, report.stuck) == (5, 0, 0)
    assert report.model_dump()["behind"] == 5
    assert [lag.consumer_id for lag in status(db, "behind", 0).consumers] == ["behind"]
    with ConnectionPool(db.url, min_size=1, max_size=1, open=True) as pool:
        assert figures(status(Database.of(pool, schema=db.schema))) == figures(report)
    url_db = Database(db.url, schema=db.schema)
    try:
        assert figures(status(url_db)) == figures(report)
    finally:
        url_db.close()

    with db.connection() as conn, pytest.warns(DeprecationWarning, match="status"):
        old = consumer_lag(conn)  # the old form, for one release
    assert figures(PubSubStatus(consumers=old)) == figures(report)
