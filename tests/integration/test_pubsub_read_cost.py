"""A consumer that has caught up reads its next batch through the index from its position, however many delivered
events the branch still keeps (they stay until trimmed, and while vacuum is held back their dead versions too)."""

from __future__ import annotations

from cmb_dagster import pubsub
from cmb_dagster.pubsub import sql

BRANCH = 7


def event_buffers(plan: dict) -> int:
    """Shared buffers the executed plan's scans of pubsub_events touched."""
    own = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"] if plan.get("Relation Name") == "pubsub_events" else 0
    return own + sum(event_buffers(child) for child in plan.get("Plans", ()))


def batch_buffers(db, snapshot: str) -> int:
    """Shared buffers of pubsub_events one READ_BATCH touches for a consumer whose watermark is ``snapshot`` and
    that has no batch half delivered."""
    params = {
        "target": None,
        "strict": False,
        "snapshot": snapshot,
        "branch_id": BRANCH,
        "txid": "0",
        "event_id": 0,
        "limit": 100,
    }
    with db.connection() as conn:
        [[[plan]]] = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.READ_BATCH, params).fetchall()
    return event_buffers(plan["Plan"])


def publish(db, transactions: int) -> str:
    """``transactions`` transactions of 50 events each; the snapshot after them (a consumer caught up)."""
    with db.connection() as conn:
        for i in range(transactions):
            with conn.transaction():
                for j in range(50):
                    pubsub.publish(BRANCH, {"i": i, "j": j}, conn=conn)
        return conn.execute("SELECT pg_current_snapshot()::text").fetchone()[0]


def test_a_caught_up_read_costs_the_same_with_ten_or_ten_thousand_events_kept(db):
    few = batch_buffers(db, publish(db, 1))
    many = batch_buffers(db, publish(db, 200))
    assert many <= few + 4, (few, many)  # the index one or two levels deeper, not a page per 100 events
