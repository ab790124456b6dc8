"""The processing engine: the original design's algorithm, many shards and stages per transaction.

A batch (one transaction) of stages S1..Sn over the shards a worker holds:

1. checks the worker's leases of the shards (fences, share-locked until commit) and the shard count;
2. takes a max-parallelism slot of each S that has one (an advisory lock held until commit);
3. peeks due entries (``FOR UPDATE SKIP LOCKED``) of each stage and shard, the low-priority lane
   only where the main one has nothing due, keeps one entry per entity (one stage works on an
   entity at a time) up to ``batch_size``, and loads each entity, its version and every stage's
   state of it. Steps 1 and 3 are one round trip;
4. calls ``S.process`` for each (pure code: the transaction stays open, nothing is locked but the
   queue entries, so external writers are not blocked);
5. locks the entities (``FOR NO KEY UPDATE``) and compares versions: the entity version and S's
   state version must be those loaded. Each entity is checked on its own: a conflicted entity keeps
   its queue entry (counted) and is loaded again by the next batch, the others commit;
6. writes the changed entities (version + 1), the states, the timers (or deletes the entries), asks
   every other stage ``should_process`` on changed entities and offers them (an exception offers
   anyway), publishes each saved entity + state to the pub/sub stream, counts, and commits, all in
   one round trip. A crash anywhere before the commit leaves everything as it was.

A ``process`` that raises (or returns something invalid) leaves the entity unchanged; its entry is
retried after a doubling backoff and parked after ``max_attempts``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from cmb_dagster.database import Database
from cmb_dagster.stages import sql as q
from cmb_dagster.stages.errors import InvalidStageInput, InvalidStageResult
from cmb_dagster.stages.models import Entity, MergePatch, StageResult, changed_fields, dump_payload, merge_patch
from cmb_dagster.stages.stage import Stage, check_stages, due_of
from cmb_dagster.workers import Lease, LeaseLost, Leases

log = logging.getLogger("cmb_dagster.stages")

MAIN, LOW = 0, 1
ERROR_LIMIT = 2000  # characters of an error message kept on the queue entry


class ShardCountChanged(LeaseLost):
    """The shard count changed under a worker: its shard leases mean something else now."""


@dataclass
class BatchReport:
    """What one batch did."""

    taken: int = 0
    processed: int = 0
    changed: int = 0
    conflicts: int = 0
    errors: int = 0
    parked: int = 0
    capped: int = 0
    offered: int = 0
    blocked_until: float | None = None  # monotonic time a rate limit / parallelism lets the stage go again


@dataclass
class _Writes:
    """What a batch writes for one stage."""

    state_ids: list[str] = field(default_factory=list)
    state_texts: list[str | None] = field(default_factory=list)
    state_flags: list[bool] = field(default_factory=list)
    no_timer: list[str] = field(default_factory=list)
    timer_ids: list[str] = field(default_factory=list)
    timer_dues: list[datetime] = field(default_factory=list)
    published_ids: list[str] = field(default_factory=list)
    published_changed: list[bool] = field(default_factory=list)


@dataclass
class _Counts:
    by_stage: dict[str, list[int]] = field(default_factory=dict)  # processed, changed, conflicts, errors, parked, capped

    def add(self, stage: str, index: int, n: int = 1) -> None:
        if n:
            self.by_stage.setdefault(stage, [0] * 6)[index] += n


def _within_limits(rows: list[tuple[Any, ...]], limits: dict[str, int]) -> list[tuple[Any, ...]]:
    """At most ``limits[stage]`` rows of each stage (the rest stay queued)."""
    taken: dict[str, int] = {}
    kept = []
    for row in rows:
        stage = row[1]
        if taken.get(stage, 0) < limits[stage]:
            taken[stage] = taken.get(stage, 0) + 1
            kept.append(row)
    return kept


class Engine:
    """Runs batches of stages over shards; used by :class:`~cmb_dagster.stages.worker.StageWorker`,
    the rescan and tests."""

    def __init__(
        self,
        db: Database,
        stages: Sequence[Stage],
        *,
        batch_size: int = 500,
        publish: bool = True,
        batch_seconds: float = 2.0,
        idle_timeout: float = 30.0,
    ) -> None:
        self.db = db
        self.stages = check_stages(stages)
        self.batch_size = batch_size
        self.publish = publish
        self.batch_seconds = batch_seconds
        self.idle_timeout_ms = f"{int(idle_timeout * 1000)}ms"

    # -- one batch of stages over shards ---------------------------------------------------------

    def process_batch(
        self, shards: Sequence[int], stage_names: Sequence[str] | None = None, *, leases: Sequence[Lease] = (),
        shard_count: int | None = None,
    ) -> BatchReport:
        """One transaction: due entries of ``stage_names`` (default: all) in ``shards``, at most one
        stage per entity, each stage's main queue before its low-priority one."""
        names = list(self.stages) if stage_names is None else list(stage_names)
        report = BatchReport()
        shards = list(shards)
        if not shards:
            return report
        limits: dict[str, int] = {}
        for name in names:
            stage = self.stages[name]
            limit = self.batch_size
            if stage.rate_limit is not None:
                limit, wait = self._take_tokens(stage, limit)
                if limit == 0:
                    report.blocked_until = time.monotonic() + wait
                    continue
            limits[name] = limit
        if not limits:
            return report
        with self.db.connection() as conn:
            for name in [n for n in limits if self.stages[n].max_parallelism is not None]:
                key = f"cmb_dagster.stages.parallel:{name}"
                if conn.execute(q.TAKE_SLOT, {"slots": self.stages[name].max_parallelism, "key": key}).fetchone() is None:
                    report.blocked_until = time.monotonic() + 0.05
                    del limits[name]
            if not limits:
                return report
            per_shard = -(-self.batch_size // len(shards))  # shards are hash-balanced: lock little more than used
            with conn.pipeline():  # one round trip: leases, settings and the due entries
                confirm = self._begin(conn, leases)
                picked = conn.execute(q.PEEK_AND_LOAD, {
                    "shards": shards, "stages": list(limits), "limits": [min(n, per_shard) for n in limits.values()],
                    "limit": self.batch_size})
                count, branch = confirm(shard_count)
                rows = _within_limits(picked.fetchall(), limits)
            if rows:
                report.taken = len(rows)
                self._process_rows(conn, shards[0], count, branch, rows, report)
        return report

    def _begin(self, conn: psycopg.Connection, leases: Sequence[Lease]) -> Callable[[int | None], tuple[int, int]]:
        """Send the lease check (share-locked until commit) and the batch settings; the returned
        function checks both and gives the shard count and the results branch."""
        leases_held = Leases.check_many(conn, leases)
        settings = conn.execute(q.BEGIN_BATCH, {"idle_timeout": self.idle_timeout_ms})

        def confirm(shard_count: int | None) -> tuple[int, int]:
            leases_held()
            count, branch, _, _, _ = settings.fetchone()
            if shard_count is not None and count != shard_count:
                raise ShardCountChanged(f"shard count is now {count}, not {shard_count}: leases are taken again")
            return count, branch

        return confirm

    def _process_rows(self, conn: psycopg.Connection, count_shard: int, shard_count: int, branch: int,
                      rows: list[tuple[Any, ...]], report: BatchReport) -> None:
        now = datetime.now(UTC)
        deadline = time.monotonic() + self.batch_seconds
        done: list[tuple[Stage, Entity, dict[str, Any], set[str], dict[str, Any] | None, str | None, str | None, bool, datetime | None]] = []
        failures: dict[str, list[tuple[str, str, float]]] = {}
        gone: dict[str, list[str]] = {}
        counts = _Counts()
        for entity_id, stage_name, attempts, version, payload, states, ready in rows:
            stage = self.stages[stage_name]
            if version is None:
                gone.setdefault(stage_name, []).append(entity_id)
                continue
            if time.monotonic() > deadline:  # the rest stays queued (and locked until commit)
                break
            entity = Entity(entity_id, version, payload)
            states = states or {}
            own = states.get(stage_name)
            try:
                state = stage.load_state(own[0] if own else None)
                result = stage.process(entity, state)
                new_payload, payload_text, state_text, state_changed, due = self._validated(stage, entity, own, result, now)
            except Exception as exc:  # noqa: BLE001 - any failure of user code leaves the entity unchanged
                delay = min(stage.max_backoff, stage.retry_backoff * 2 ** attempts)
                failures.setdefault(stage_name, []).append((entity_id, f"{type(exc).__name__}: {exc}"[:ERROR_LIMIT], delay))
                counts.add(stage_name, 3)
                if attempts + 1 >= stage.max_attempts:
                    report.parked += 1
                    counts.add(stage_name, 4)
                    log.error("stage %s: entity %r parked after %d attempts: %s: %s",
                              stage_name, entity_id, attempts + 1, type(exc).__name__, exc)
                else:
                    log.warning("stage %s: entity %r failed (attempt %d of %d, retry in %.1fs): %s: %s",
                                stage_name, entity_id, attempts + 1, stage.max_attempts, delay, type(exc).__name__, exc)
                continue
            done.append((stage, entity, states, set(ready or ()), new_payload, payload_text, state_text, state_changed, due))
        report.processed = len(done)
        report.errors = sum(len(f) for f in failures.values())

        ok: list[Any] = []
        conflicted: dict[str, list[str]] = {}
        if done:
            ids = [d[1].id for d in done]
            with conn.pipeline():  # lock first, then read the versions in a snapshot taken after the locks
                conn.execute(q.LOCK_PROCESSED, {"ids": sorted(ids)})
                current = {(r[0], r[1]): (r[2], r[3]) for r in conn.execute(
                    q.CHECK_VERSIONS, {"ids": ids, "stages": [d[0].name for d in done]})}
            for item in done:
                stage, entity, states = item[0], item[1], item[2]
                own = states.get(stage.name)
                loaded_state_version = own[1] if own else 0
                now_version = current.get((entity.id, stage.name))
                if now_version is None:
                    gone.setdefault(stage.name, []).append(entity.id)
                elif now_version != (entity.version, loaded_state_version):
                    conflicted.setdefault(stage.name, []).append(entity.id)
                    counts.add(stage.name, 2)
                else:
                    ok.append(item)
        report.conflicts = sum(len(c) for c in conflicted.values())

        saves_ids, saves_payloads = [], []
        by_stage: dict[str, _Writes] = {}
        offers: list[tuple[str, str, datetime]] = []
        for stage, entity, states, ready, new_payload, payload_text, state_text, state_changed, due in ok:
            writes = by_stage.setdefault(stage.name, _Writes())
            if new_payload is not None:
                saves_ids.append(entity.id)
                saves_payloads.append(payload_text)
                new_entity = Entity(entity.id, entity.version + 1, new_payload)
                fields = changed_fields(entity.payload, new_payload)
                offers.extend(self._ask(new_entity, states, ready, fields, now, counts, skip=stage.name))
                counts.add(stage.name, 1)
            counts.add(stage.name, 0)
            if state_changed or stage.max_triggers is not None:
                writes.state_ids.append(entity.id)
                writes.state_texts.append(state_text)
                writes.state_flags.append(state_changed)
            if due is None:
                writes.no_timer.append(entity.id)
            else:
                writes.timer_ids.append(entity.id)
                writes.timer_dues.append(due)
            if self.publish:
                writes.published_ids.append(entity.id)
                writes.published_changed.append(new_payload is not None)
        report.changed = len(saves_ids)
        report.offered = len(offers)
        report.capped = sum(c[5] for c in counts.by_stage.values())

        with conn.pipeline():
            if saves_ids:
                conn.execute(q.SAVE_ENTITIES, {"ids": saves_ids, "payloads": saves_payloads})
            for name in sorted(set(by_stage) | set(gone) | set(failures) | set(conflicted)):
                stage = self.stages[name]
                writes = by_stage.get(name, _Writes())
                if writes.state_ids:
                    conn.execute(q.SAVE_STATES, {"stage": name, "ids": writes.state_ids, "states": writes.state_texts,
                                                 "changed": writes.state_flags, "window": stage.trigger_window})
                no_timer = writes.no_timer + gone.get(name, [])
                if no_timer:
                    conn.execute(q.DELETE_ENTRIES, {"stage": name, "ids": no_timer})
                if writes.timer_ids:
                    conn.execute(q.SET_TIMERS, {"stage": name, "ids": writes.timer_ids, "dues": writes.timer_dues})
                if name in failures:
                    failed = failures[name]
                    conn.execute(q.FAILED, {"stage": name, "max_attempts": stage.max_attempts,
                                            "ids": [f[0] for f in failed], "errors": [f[1] for f in failed],
                                            "delays": [f[2] for f in failed]})
                if name in conflicted:
                    conn.execute(q.CONFLICTED, {"stage": name, "ids": conflicted[name], "max_conflicts": stage.max_conflicts})
                if writes.published_ids:
                    conn.execute(q.PUBLISH, {"branch": branch, "topic": f"stages.{name}", "stage": name,
                                             "ids": writes.published_ids, "changed": writes.published_changed})
            if offers:
                self._offer(conn, shard_count, offers)
            self._count(conn, count_shard, counts)
            conn.commit()
        for name, ids in conflicted.items():
            log.info("stage %s: %d entities changed while processed; they run again on the new version", name, len(ids))

    def _validated(self, stage: Stage, entity: Entity, own: Any, result: Any, now: datetime):  # type: ignore[no-untyped-def]
        if not isinstance(result, StageResult):
            raise InvalidStageResult(f"result: stage {stage.name!r} must return a StageResult, not {type(result).__name__}")
        update = result.update
        new_payload = payload_text = None
        if update is not None:
            if not isinstance(update, dict):
                raise InvalidStageResult(f"update: stage {stage.name!r} must return a dict or MergePatch, not {type(update).__name__}")
            candidate = merge_patch(entity.payload, dict(update)) if isinstance(update, MergePatch) else update
            try:
                text = dump_payload(candidate, "update")
            except InvalidStageInput as exc:
                raise InvalidStageResult(f"{exc} (stage {stage.name!r})") from None
            if candidate != entity.payload:
                new_payload, payload_text = json.loads(text), text
        state_text, state_changed = None, False
        if result.new_state is not None:
            dumped = stage.dump_state(result.new_state)
            if own is None or dumped != own[0]:
                state_text, state_changed = json.dumps(dumped), True
        if isinstance(result.timer, bool):
            raise InvalidStageResult(f"timer: must be None, a timedelta or an aware datetime, not {result.timer}")
        due = due_of(result.timer, now, "timer")
        return new_payload, payload_text, state_text, state_changed, due

    # -- fan-out -------------------------------------------------------------------------------

    def _ask(self, entity: Entity, states: dict[str, Any], ready: set[str], fields: set[str] | None,
             now: datetime, counts: _Counts, *, skip: str | None = None) -> list[tuple[str, str, datetime]]:
        """Offers (entity, stage, due) of the stages that want to see ``entity`` after a change."""
        offers = []
        for name, other in self.stages.items():
            if name == skip or name in ready:
                continue
            if other.fields is not None and fields is not None and not fields.intersection(other.fields):
                continue
            raw = states.get(name)
            try:
                answer = other.should_process(entity, other.load_state(raw[0] if raw else None))
                due = due_of(answer, now, "should_process")
            except Exception as exc:  # noqa: BLE001 - the original design's rule: enqueue when should_process fails
                log.warning("stage %s: should_process failed on %r (%s: %s); enqueued anyway",
                            name, entity.id, type(exc).__name__, exc)
                due = now
            if due is None:
                continue
            if other.max_triggers is not None and raw is not None:
                runs, window_start = raw[2], datetime.fromtimestamp(float(raw[3]), UTC)
                window_end = window_start + timedelta(seconds=other.trigger_window)
                if runs >= other.max_triggers and window_end > now and due < window_end:
                    log.warning("stage %s: entity %r re-triggered %d times within %.0fs (cap %d); deferred to %s",
                                name, entity.id, runs, other.trigger_window, other.max_triggers, window_end.isoformat())
                    counts.add(name, 5)
                    due = window_end
            offers.append((entity.id, name, due))
        return offers

    def _offer(self, conn: psycopg.Connection, shard_count: int, offers: list[tuple[str, str, datetime]], lane: int = MAIN) -> None:
        offers.sort(key=lambda o: (o[0], o[1]))
        conn.execute(q.OFFER if lane == MAIN else q.OFFER_LOW, {
            "shard_count": shard_count, "ids": [o[0] for o in offers], "stages": [o[1] for o in offers],
            "dues": [o[2] for o in offers],
        })

    def changes_batch(self, shards: Sequence[int], *, leases: Sequence[Lease] = (), shard_count: int | None = None) -> int:
        """Ask the stages about entities changed through the API or plain SQL (the change path)."""
        with self.db.connection() as conn:
            with conn.pipeline():
                confirm = self._begin(conn, leases)
                picked = conn.execute(q.PEEK_CHANGES, {"shards": list(shards), "limit": self.batch_size})
                count, _ = confirm(shard_count)
                rows = picked.fetchall()
            if not rows:
                return 0
            now = datetime.now(UTC)
            counts = _Counts()
            offers: list[tuple[str, str, datetime]] = []
            for entity_id, fields, version, payload, states, ready in rows:
                if version is None:  # deleted meanwhile
                    continue
                entity = Entity(entity_id, version, payload)
                offers.extend(self._ask(entity, states or {}, set(ready or ()), None if fields is None else set(fields), now, counts))
            with conn.pipeline():
                if offers:
                    self._offer(conn, count, offers)
                conn.execute(q.DELETE_CHANGES, {"ids": [r[0] for r in rows]})
                self._count(conn, shards[0], counts)
                conn.commit()
        return len(rows)

    # -- limits, counters ----------------------------------------------------------------------

    def _take_tokens(self, stage: Stage, want: int) -> tuple[int, float]:
        rate = float(stage.rate_limit)  # type: ignore[arg-type]
        burst = max(1.0, rate)
        with self.db.connection() as conn:
            conn.execute(q.RATE_ROW, {"stage": stage.name, "burst": burst})
            taken, available = conn.execute(q.TAKE_TOKENS, {"stage": stage.name, "burst": burst, "rate": rate, "want": want}).fetchone()
        wait = 0.0 if taken else max(0.01, (1.0 - float(available)) / rate)
        return int(taken), wait

    def _count(self, conn: psycopg.Connection, shard: int, counts: _Counts) -> None:
        if not counts.by_stage:
            return
        names = sorted(counts.by_stage)
        columns = list(zip(*(counts.by_stage[n] for n in names), strict=True))
        conn.execute(q.COUNT, {
            "stages": names, "shards": [shard] * len(names), "processed": list(columns[0]), "changed": list(columns[1]),
            "conflicts": list(columns[2]), "errors": list(columns[3]), "parked": list(columns[4]), "capped": list(columns[5]),
        })

    # -- planning, rescan ----------------------------------------------------------------------

    def plan(self, shards: Sequence[int]) -> tuple[dict[tuple[str, int], float], bool]:
        """Seconds until the earliest entry of each (stage, lane) in ``shards`` is due (<= 0: due now),
        and whether the change path has entries."""
        with self.db.connection() as conn:
            rows = conn.execute(q.PLAN, {"shards": list(shards), "stages": list(self.stages)}).fetchall()
        waits: dict[tuple[str, int], float] = {}
        changes = False
        for stage, lane, due, now in rows:
            if due is None:
                continue
            if lane == -1:
                changes = True
            else:
                waits[(stage, lane)] = (due - now).total_seconds()
        return waits, changes

    def rescan(self, *, duration: float | None = None, page: int = 1000, after: str = "") -> tuple[int, int, str | None]:
        """Ask every stage ``should_process`` about every entity not in its queue; offer the ones that
        ask to the low-priority queue. Returns (entities seen, entries offered, where it stopped or None)."""
        deadline = None if duration is None else time.monotonic() + duration
        seen = offered = 0
        while deadline is None or time.monotonic() < deadline:
            with self.db.connection() as conn:
                count = conn.execute(q.BEGIN_WRITE).fetchone()[0]
                rows = conn.execute(q.RESCAN_PAGE, {"after": after, "limit": page}).fetchall()
                if not rows:
                    return seen, offered, None
                now = datetime.now(UTC)
                offers: list[tuple[str, str, datetime]] = []
                counts = _Counts()
                for entity_id, version, payload, states, queued in rows:
                    offers.extend(self._ask(Entity(entity_id, version, payload), states or {}, set(queued or ()), None, now, counts))
                if offers:
                    self._offer(conn, count, offers, LOW)
                seen += len(rows)
                offered += len(offers)
                after = rows[-1][0]
        return seen, offered, after
