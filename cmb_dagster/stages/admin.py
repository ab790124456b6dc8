"""Operator functions: status, queue listing, retry of parked entries, shard count."""

from __future__ import annotations

import psycopg

from cmb_dagster import flow
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.inputs import check_int, refused_input
from cmb_dagster.stages import sql
from cmb_dagster.stages.errors import InvalidStageInput
from cmb_dagster.stages.models import (
    MAX_SHARDS,
    QueueEntry,
    StageKeyUse,
    StageLimits,
    StagesStatus,
    StageStatus,
    check_entity_id,
    check_stage_name,
)

MAX_LISTED = 100_000
"""Queue entries one listing returns at most."""


def status(source: DatabaseSource) -> StagesStatus:
    """The shard count and, per stage: queue depths, oldest due entry's age, parked and failing entries, counters,
    and a limited stage's limits with their use per key."""
    rows: dict[str, StageStatus] = {}
    with Database.of(source).connection() as conn:
        for stage, queued, timers, low, oldest, parked, failing in conn.execute(sql.QUEUE_STATUS):
            rows[stage] = StageStatus(
                stage=stage,
                queued=queued,
                timers=timers,
                low_priority=low,
                oldest_seconds=oldest,
                parked=parked,
                failing=failing,
            )
        for stage, processed, changed, conflicts, errors, capped in conn.execute(sql.COUNTERS):
            rows[stage] = rows.get(stage, StageStatus(stage=stage)).model_copy(
                update={
                    "processed": processed,
                    "changed": changed,
                    "conflicts": conflicts,
                    "errors": errors,
                    "capped": capped,
                }
            )
        for stage, limits in _limits(conn).items():
            rows[stage] = rows.get(stage, StageStatus(stage=stage)).model_copy(update={"limits": limits})
        count = conn.execute(sql.SETTINGS).fetchone()[0]
    return StagesStatus(shard_count=count, stages=[rows[name] for name in sorted(rows)])


def _limits(conn: psycopg.Connection) -> dict[str, StageLimits]:
    """Each limited stage's limits and their use per key (at most 1000 keys in all)."""
    found: dict[str, StageLimits] = {}
    scopes = flow.scopes(conn, "stages/")
    for scope in scopes:
        stage, _, kind = scope.scope.removeprefix("stages/").partition("/")
        limits = found.setdefault(stage, StageLimits())
        if kind == "parallel":
            limits.max_parallelism = scope.concurrency
        else:
            limits.rate_per_second, limits.burst = scope.rate_per_second, scope.burst
    keys: dict[tuple[str, str], StageKeyUse] = {}
    for use in flow.usage(conn, [scope.scope for scope in scopes]):
        stage, _, kind = use.scope.removeprefix("stages/").partition("/")
        row = keys.get((stage, use.key))
        if row is None:
            row = keys[(stage, use.key)] = StageKeyUse(key=use.key)
            found[stage].keys.append(row)
        if kind == "parallel":
            row.batches = use.in_flight
        else:
            row.tokens = use.tokens
    return found


@refused_input(InvalidStageInput, "arguments")
def entries(
    source: DatabaseSource,
    *,
    stage: str | None = None,
    entity_id: str | None = None,
    problems: bool = False,
    limit: int = 100,
) -> list[QueueEntry]:
    """Queue entries (earliest due first), at most ``limit`` (1..100,000); ``problems``: only failing or parked
    ones."""
    db = Database.of(source)
    params = {
        **_selection(stage, entity_id),
        "problems": problems,
        "limit": check_int(limit, "limit", low=1, high=MAX_LISTED, error=InvalidStageInput),
    }
    with db.connection() as conn:
        rows = conn.execute(sql.LIST_ENTRIES, params).fetchall()
    keys = list(QueueEntry.model_fields)
    return [QueueEntry(**dict(zip(keys, row, strict=True))) for row in rows]


@refused_input(InvalidStageInput, "arguments")
def retry(source: DatabaseSource, *, stage: str | None = None, entity_id: str | None = None) -> int:
    """Put parked entries (all, or of one stage / entity) back in their queue, due now; return how many."""
    params = _selection(stage, entity_id)
    with Database.of(source).connection() as conn:
        return conn.execute(sql.RETRY, params).rowcount


def _selection(stage: str | None, entity_id: str | None) -> dict[str, str | None]:
    """The stage and entity a listing or a retry is narrowed to (each optional), checked."""
    return {
        "stage": None if stage is None else check_stage_name(stage),
        "entity": None if entity_id is None else check_entity_id(entity_id),
    }


def shard_count(source: DatabaseSource) -> int:
    """The current shard count."""
    with Database.of(source).connection() as conn:
        return conn.execute(sql.SETTINGS).fetchone()[0]


def set_shard_count(source: DatabaseSource, count: int) -> int:
    """Change the shard count while workers run: waits for batches in flight, re-shards the queues in the
    same transaction (nothing lost or duplicated); workers drop their old shard leases on their next
    batch. Returns the previous count."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SHARDS:
        raise InvalidStageInput(f"shard_count: must be an integer from 1 to {MAX_SHARDS}, not {count!r}")
    with Database.of(source).connection() as conn:
        previous = conn.execute(sql.LOCK_SETTINGS).fetchone()[0]
        if previous != count:
            conn.execute(sql.RESHARD_QUEUE, {"n": count})
            conn.execute(sql.RESHARD_CHANGES, {"n": count})
            conn.execute(sql.SET_SHARD_COUNT, {"n": count})
    return previous
