"""Stage worker processes for the flow-control tests: each ``process`` call records its start and end (server
clock) in ``public.stage_runs``.

Run as ``python stages_flow_workers.py SETUP INDEX WORKERS LEASE_TTL`` with ``CMB_DATABASE_URL`` set; SIGTERM stops it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import psycopg
from pydantic import BaseModel

from cmb_dagster.database import Database
from cmb_dagster.flow import RateLimit
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult, StageWorker
from cmb_dagster.workers import stop_workers_on_signals

RUNS = """
CREATE TABLE IF NOT EXISTS public.stage_runs (
    id         bigserial PRIMARY KEY,
    stage      text        NOT NULL,
    entity_id  text        NOT NULL,
    key        text,
    pid        integer     NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at   timestamptz
)
"""

_local = threading.local()


def _conn() -> psycopg.Connection:
    if getattr(_local, "conn", None) is None:
        _local.conn = psycopg.connect(os.environ["CMB_DATABASE_URL"], autocommit=True)
    return _local.conn


class Recorded(Stage):
    """Records each call; holds it ``hold`` seconds, or until ``public.stage_release`` has a row (``wait``)."""

    def __init__(self, name: str, hold: float = 0.0, wait: bool = False, **kw: object) -> None:
        super().__init__(**kw)
        self.name = name  # type: ignore[misc]
        self.hold, self.wait = hold, wait

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        conn = _conn()
        key = entity.payload.get("tenant")
        run = conn.execute(
            "INSERT INTO public.stage_runs (stage, entity_id, key, pid, started_at)"
            " VALUES (%s, %s, %s, %s, clock_timestamp()) RETURNING id",
            (self.name, entity.id, key, os.getpid()),
        ).fetchone()[0]
        time.sleep(self.hold)
        while self.wait and not conn.execute("SELECT count(*) FROM public.stage_release").fetchone()[0]:
            time.sleep(0.02)
        conn.execute("UPDATE public.stage_runs SET ended_at = clock_timestamp() WHERE id = %s", (run,))
        return StageResult(update=MergePatch({self.name: True}))


SETUPS = {
    "rate": lambda: [Recorded("rated", rate_limit=RateLimit(rate=20, burst=10))],
    "parallel": lambda: [Recorded("one_at_a_time", hold=0.02, max_parallelism=1)],
    "keyed_rate": lambda: [Recorded("per_tenant", rate_limit=20, key=lambda e: e.payload["tenant"])],
    "held": lambda: [Recorded("held", wait=True, max_parallelism=1)],
}


def main() -> None:
    setup, index, workers, ttl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    options = StageOptions(
        stages=SETUPS[setup](), shard_count=4, workers=workers, idle_sleep=0.05, lease_ttl=ttl, listen=False
    )
    worker = StageWorker(Database(os.environ["CMB_DATABASE_URL"]), options, owner=f"w{index}", index=index)
    with stop_workers_on_signals():
        worker.run()


if __name__ == "__main__":
    main()
