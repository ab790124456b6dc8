"""The processing engine: the original design's algorithm, one shard and one stage per transaction.

A batch (one transaction) of stage S in shard k:

1. checks the worker's lease of the shard (fence, share-locked until commit) and the shard count;
2. takes a max-parallelism slot of S if it has one (an advisory lock held until commit);
3. peeks up to ``batch_size`` due entries of S (``FOR UPDATE SKIP LOCKED``) and loads each entity,
   its version and every stage's state of it, in one query;
4. calls ``S.process`` for each (pure code: the transaction stays open, nothing is locked but the
   queue entries, so external writers are not blocked);
5. locks the entities (``FOR NO KEY UPDATE``) and compares versions: the entity version and S's
   state version must be those loaded. Each entity is checked on its own: a conflicted entity keeps
   its queue entry (counted) and is loaded again by the next batch, the others commit;
6. writes the changed entities (version + 1), S's states, S's timers (or deletes its entries), asks
   every other stage ``should_process`` on changed entities and offers them (an exception offers
   anyway), publishes each saved entity + state to the pub/sub stream, and counts;
7. commits. A crash anywhere before that leaves everything as it was.

A ``process`` that raises (or returns something invalid) leaves the entity unchanged; its entry is
retried after a doubling backoff and parked after ``max_attempts``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
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
class _Counts:
    by_stage: dict[str, list[int]] = field(default_factory=dict)  # processed, changed, conflicts, errors, parked, capped

    def add(self, stage: str, index: int, n: int = 1) -> None:
        if n:
            self.by_stage.setdefault(stage, [0] * 6)[index] += n


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

    # -- one batch of one stage ----------------------------------------------------------------

    def process_batch(
        self, shard: int, stage_name: str, lane: int = MAIN, *, lease: Lease | None = None,
        shard_count: int | None = None,
    ) -> BatchReport:
        stage = self.stages[stage_name]
        report = BatchReport()
        limit = self.batch_size
        if stage.rate_limit is not None:
            limit, wait = self._take_tokens(stage, limit)
            if limit == 0:
                report.blocked_until = time.monotonic() + wait
                return report
        with self.db.connection() as conn:
            count, branch = self._begin(conn, lease, shard_count)
            if stage.max_parallelism is not None:
                key = f"cmb_dagster.stages.parallel:{stage.name}"
                if conn.execute(q.TAKE_SLOT, {"slots": stage.max_parallelism, "key": key}).fetchone() is None:
                    report.blocked_until = time.monotonic() + 0.05
                    return report
            rows = conn.execute(q.PEEK_AND_LOAD, {"shard": shard, "stage": stage.name, "lane": lane, "limit": limit}).fetchall()
            if not rows:
                return report
            report.taken = len(rows)
            self._process_rows(conn, stage, shard, count, branch, rows, report)
        return report

    def _begin(self, conn: psycopg.Connection, lease: Lease | None, shard_count: int | None) -> tuple[int, int]:
        if lease is not None:
            Leases.check(conn, lease)
        count, branch, _, _ = conn.execute(q.BEGIN_BATCH, {"idle_timeout": self.idle_timeout_ms}).fetchone()
        if shard_count is not None and count != shard_count:
            raise ShardCountChanged(f"shard count is now {count}, not {shard_count}: leases are taken again")
        return count, branch

    def _process_rows(self, conn: psycopg.Connection, stage: Stage, shard: int, shard_count: int, branch: int,
                      rows: list[tuple[Any, ...]], report: BatchReport) -> None:
        now = datetime.now(UTC)
        deadline = time.monotonic() + self.batch_seconds
        done: list[tuple[Entity, dict[str, Any], set[str], dict[str, Any] | None, str | None, str | None, bool, datetime | None]] = []
        failures: list[tuple[str, str, float]] = []
        gone: list[str] = []
        counts = _Counts()
        for entity_id, attempts, conflicts, version, payload, _due, states, ready in rows:
            if version is None:
                gone.append(entity_id)
                continue
            if time.monotonic() > deadline:  # the rest stays queued (and locked until commit)
                break
            entity = Entity(entity_id, version, payload)
            states = states or {}
            own = states.get(stage.name)
            try:
                state = stage.load_state(own[0] if own else None)
                result = stage.process(entity, state)
                new_payload, payload_text, state_text, state_changed, due = self._validated(stage, entity, own, result, now)
            except Exception as exc:  # noqa: BLE001 - any failure of user code leaves the entity unchanged
                delay = min(stage.max_backoff, stage.retry_backoff * 2 ** attempts)
                failures.append((entity_id, f"{type(exc).__name__}: {exc}"[:ERROR_LIMIT], delay))
                if attempts + 1 >= stage.max_attempts:
                    report.parked += 1
                    log.error("stage %s: entity %r parked after %d attempts: %s: %s",
                              stage.name, entity_id, attempts + 1, type(exc).__name__, exc)
                else:
                    log.warning("stage %s: entity %r failed (attempt %d of %d, retry in %.1fs): %s: %s",
                                stage.name, entity_id, attempts + 1, stage.max_attempts, delay, type(exc).__name__, exc)
                continue
            done.append((entity, states, set(ready or ()), new_payload, payload_text, state_text, state_changed, due))
        report.processed = len(done)
        report.errors = len(failures)

        ok: list[Any] = []
        conflicted: list[str] = []
        if done:
            current = {r[0]: (r[1], r[2]) for r in conn.execute(q.CHECK_VERSIONS, {"stage": stage.name, "ids": sorted(d[0].id for d in done)})}
            for item in done:
                entity, states = item[0], item[1]
                own = states.get(stage.name)
                loaded_state_version = own[1] if own else 0
                now_version = current.get(entity.id)
                if now_version is None:
                    gone.append(entity.id)
                elif now_version != (entity.version, loaded_state_version):
                    conflicted.append(entity.id)
                else:
                    ok.append(item)
        report.conflicts = len(conflicted)

        saves_ids, saves_payloads = [], []
        state_ids, state_texts, state_flags = [], [], []
        no_timer, timer_ids, timer_dues = list(gone), [], []
        offers: list[tuple[str, str, datetime]] = []
        published_ids, published = [], []
        for entity, states, ready, new_payload, payload_text, state_text, state_changed, due in ok:
            if new_payload is not None:
                saves_ids.append(entity.id)
                saves_payloads.append(payload_text)
                new_entity = Entity(entity.id, entity.version + 1, new_payload)
                fields = changed_fields(entity.payload, new_payload)
                offers.extend(self._ask(new_entity, states, ready, fields, now, counts, skip=stage.name))
            if state_changed or stage.max_triggers is not None:
                state_ids.append(entity.id)
                state_texts.append(state_text)
                state_flags.append(state_changed)
            if due is None:
                no_timer.append(entity.id)
            else:
                timer_ids.append(entity.id)
                timer_dues.append(due)
            if self.publish:
                published_ids.append(entity.id)
                own = states.get(stage.name)
                published.append(json.dumps({
                    "stage": stage.name, "entity_id": entity.id,
                    "version": entity.version + (new_payload is not None),
                    "payload": new_payload if new_payload is not None else entity.payload,
                    "state": json.loads(state_text) if state_changed else (own[0] if own else None),
                    "changed": new_payload is not None,
                }))
        report.changed = len(saves_ids)
        report.offered = len(offers)
        counts.add(stage.name, 0, len(ok))
        counts.add(stage.name, 1, len(saves_ids))
        counts.add(stage.name, 2, len(conflicted))
        counts.add(stage.name, 3, len(failures))
        counts.add(stage.name, 4, report.parked)
        report.capped = sum(c[5] for c in counts.by_stage.values())

        with conn.pipeline():
            if saves_ids:
                conn.execute(q.SAVE_ENTITIES, {"ids": saves_ids, "payloads": saves_payloads})
            if state_ids:
                conn.execute(q.SAVE_STATES, {"stage": stage.name, "ids": state_ids, "states": state_texts,
                                             "changed": state_flags, "window": stage.trigger_window})
            if no_timer:
                conn.execute(q.DELETE_ENTRIES, {"stage": stage.name, "ids": no_timer})
            if timer_ids:
                conn.execute(q.SET_TIMERS, {"stage": stage.name, "ids": timer_ids, "dues": timer_dues})
            if offers:
                self._offer(conn, shard_count, offers)
            if failures:
                conn.execute(q.FAILED, {"stage": stage.name, "max_attempts": stage.max_attempts,
                                        "ids": [f[0] for f in failures], "errors": [f[1] for f in failures],
                                        "delays": [f[2] for f in failures]})
            if conflicted:
                conn.execute(q.CONFLICTED, {"stage": stage.name, "ids": conflicted, "max_conflicts": stage.max_conflicts})
            if published_ids:
                conn.execute(q.PUBLISH, {"branch": branch, "topic": f"stages.{stage.name}",
                                         "ids": published_ids, "payloads": published})
            self._count(conn, shard, counts)
        if conflicted:
            log.info("stage %s: %d of %d entities changed while processed; they run again on the new version",
                     stage.name, len(conflicted), len(done))

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

    def changes_batch(self, shard: int, *, lease: Lease | None = None, shard_count: int | None = None) -> int:
        """Ask the stages about entities changed through the API or plain SQL (the change path)."""
        with self.db.connection() as conn:
            count, _ = self._begin(conn, lease, shard_count)
            rows = conn.execute(q.PEEK_CHANGES, {"shard": shard, "limit": self.batch_size}).fetchall()
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
                self._count(conn, shard, counts)
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

    def plan(self, shard: int) -> tuple[dict[tuple[str, int], float], bool]:
        """Seconds until the earliest entry of each (stage, lane) of ``shard`` is due (<= 0: due now),
        and whether the change path has entries."""
        with self.db.connection() as conn:
            rows = conn.execute(q.PLAN, {"shard": shard, "stages": list(self.stages)}).fetchall()
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
