"""The worker loop keeps going when the database fails it: a renewal waits a bounded time, a failed question for the
partitions is retried like any other database error."""

from __future__ import annotations

import threading

import psycopg
from running import Running
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.workers import Leases, Worker


def test_a_renewal_that_gets_no_connection_gives_up_within_a_third_of_the_ttl(database_url: str) -> None:
    db = Database(database_url, max_pool_size=1)
    leases = Leases(db, "test.kind", owner="a", ttl=1.5)
    outcome: list[BaseException] = []

    def renew() -> None:
        try:
            leases.acquire(["p"])
        except psycopg.OperationalError as exc:  # psycopg_pool.PoolTimeout
            outcome.append(exc)

    try:
        with db.connection():  # the pool's only connection is taken: a renewal gets none
            renewal = threading.Thread(target=renew, daemon=True)
            renewal.start()
            wait_until(lambda: outcome, leases.ttl, "the renewal gave up within one TTL")
    finally:
        db.close()


def test_a_worker_whose_partitions_query_fails_retries_it(db: Database) -> None:
    asked: list[int] = []
    stepped = threading.Event()

    def partitions() -> list[str]:
        asked.append(1)
        with db.connection() as conn:  # the first question fails in the database (division by zero)
            conn.execute("SELECT 1 / %s", (0 if len(asked) == 1 else 1,))
        return ["p"]

    def step(lease: object) -> int:
        stepped.set()
        return 0

    worker = Worker(db, "test.kind", partitions, step, ttl=0.6, idle_sleep=0.05)
    with Running(worker):
        wait_until(stepped.is_set, 10, "a step after the failed question for the partitions")
    assert len(asked) >= 2
