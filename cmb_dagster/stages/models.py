"""The stage scheduler's models: entities, stage results, merge patches, options and status."""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar

from croniter import croniter
from pydantic import BaseModel, Field, field_validator

from cmb_dagster.executor import Isolation
from cmb_dagster.health import Checks, Threshold, Verdict
from cmb_dagster.inputs import check_text, shorten, to_json
from cmb_dagster.models import Options, deprecated_iteration
from cmb_dagster.stages.errors import InvalidStageInput

MAX_ENTITY_ID_LENGTH = 256
MAX_SHARDS = 4096
STAGE_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
LEASE_KIND = "stages.shard"
CHANNEL = "stages"  # NOTIFY channel (schema-qualified by cmb_dagster.notifications.channel_name)
DEFAULT_CONCURRENCY = 10
"""``process`` calls one worker runs at once by default: stages that wait on I/O (an API, a mail) overlap."""
MAX_CONCURRENCY = 1000


def entity_hash(entity_id: str) -> int:
    """Stable 32-bit hash of an entity id (the first 32 bits of its md5), as SQL's ``stage_hash``."""
    return int(hashlib.md5(entity_id.encode()).hexdigest()[:8], 16)


def shard_of(entity_id: str, shard_count: int) -> int:
    """The shard an entity belongs to: ``stage_hash(entity_id) % shard_count``."""
    return entity_hash(entity_id) % shard_count


@dataclass(frozen=True, slots=True)
class Entity:
    """An entity as a stage sees it: treat ``payload`` as read-only (return an update instead)."""

    id: str
    version: int
    payload: dict[str, Any]
    updated_at: datetime | None = None


class MergePatch(dict):
    """An RFC 7386 JSON merge patch: keys set to ``None`` are removed, objects merge recursively,
    anything else (lists included) replaces the target's value."""


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply an RFC 7386 merge patch to ``target`` (neither is modified; a new value is returned)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


Timer = datetime | timedelta


@dataclass(frozen=True, slots=True)
class StageResult:
    """What ``process`` returns.

    ``update``: None (entity unchanged), a dict (the new payload) or a :class:`MergePatch`.
    ``new_state``: None (state unchanged) or an instance of the stage's ``state_model``.
    ``timer``: None (no timer), a ``timedelta`` from now or an aware ``datetime``: when the stage
    wants to see the entity again, whatever happens to it meanwhile.
    """

    update: dict[str, Any] | MergePatch | None = None
    new_state: BaseModel | None = None
    timer: Timer | None = None


@dataclass(frozen=True, slots=True)
class SavedEntity:
    """The post-save publication of one stage commit, as an after-commit handler gets it.

    ``event_id`` is the pub/sub event id: use it as the idempotency key of side effects."""

    event_id: int
    stage: str
    entity_id: str
    version: int
    payload: dict[str, Any]
    state: dict[str, Any] | None
    changed: bool


CONFLICT_RATE_MINIMUM = 100
"""Processed entries below which a stage's conflict rate is not judged (too few to say)."""


class StageChecks(Checks):
    """Limits of the stage scheduler's asset checks, on each stage."""

    error = InvalidStageInput

    queue_age_seconds: Threshold = Field(
        default=Threshold(warn_at=60, error_at=600), description="Age of the oldest due entry of the main queue."
    )
    parked: Threshold = Field(default=Threshold(warn_at=1, error_at=100), description="Entries parked for good.")
    conflict_percent: Threshold = Field(
        default=Threshold(warn_at=20, error_at=50),
        description=f"Conflicts per 100 processed entries (judged from {CONFLICT_RATE_MINIMUM} processed on).",
    )

    def verdicts(self, asset: list[str], row: StageStatus) -> list[Verdict]:
        """The checks of one stage."""
        rate = 100 * row.conflicts / row.processed if row.processed >= CONFLICT_RATE_MINIMUM else 0.0
        return self.judge(
            asset,
            {
                "queue_age_seconds": (row.oldest_seconds, f"the oldest due entry waits {row.oldest_seconds:.0f} s"),
                "parked": (row.parked, f"{row.parked} parked entries"),
                "conflict_percent": (rate, f"{row.conflicts} conflicts in {row.processed} processed entries"),
            },
        )


class StageOptions(Options):
    """The stage scheduler of a code location: its stages and how its workers run.

    ``stages`` are :class:`~cmb_dagster.stages.Stage` instances. ``shard_count`` is applied to the
    database when a worker starts (re-sharding what is queued, losing nothing); ``workers`` Dagster
    worker jobs split the shards (job i serves shards with id % workers == i). Each worker runs up to
    ``worker_concurrency`` ``process`` calls at once (``async def`` ones on its event loop, others in threads, or in
    child processes killed at their timeout with ``isolation="process"``).
    """

    error = InvalidStageInput
    DEPRECATED_NAMES: ClassVar[Mapping[str, str]] = {"concurrency": "worker_concurrency"}

    stages: list[Any] = Field(description="The Stage instances of this code location.")
    shard_count: int | None = Field(
        default=None, ge=1, le=MAX_SHARDS, description="Shards; None keeps the database's (8 after migration)."
    )
    workers: int = Field(default=1, ge=1, le=64, description="Worker jobs; job i serves shards with id % workers == i.")
    batch_size: int = Field(default=500, ge=1, le=10_000, description="Queue entries per transaction.")
    worker_concurrency: int = Field(
        default=DEFAULT_CONCURRENCY,
        ge=1,
        le=MAX_CONCURRENCY,
        description="process calls one worker runs at once (async def ones on its event loop, others in threads).",
    )
    isolation: Isolation = Field(
        default="thread",
        description="'process': each sync call runs in a child process, killed at its stage's timeout.",
    )
    idle_sleep: float = Field(
        default=1.0, gt=0, le=60, description="Longest sleep of an idle worker (timers and NOTIFY wake it sooner)."
    )
    listen: bool = Field(
        default=True, description="Wake on LISTEN/NOTIFY hints of writers (off: timers and idle_sleep only)."
    )
    lease_ttl: float = Field(
        default=10.0, ge=1, le=300, description="A dead worker's shards are taken over after this."
    )
    publish: bool = Field(default=True, description="Publish every saved entity + state to the pub/sub stream.")
    observe_interval_seconds: int = Field(
        default=10, ge=1, le=3600, description="How often the status sensor observes the stages."
    )
    checks: StageChecks = Field(default_factory=StageChecks, description="Limits of the asset checks.")
    rescan_cron: str | None = Field(default="0 3 * * *", description="When the background rescan runs (None: never).")
    rescan_seconds: float = Field(default=600.0, gt=0, le=86400, description="Time box of one rescan run.")

    def __init__(self, /, **values: Any) -> None:
        from cmb_dagster.stages.stage import check_stages

        if "observe_seconds" in values:
            warnings.warn(
                "StageOptions(observe_seconds=...) is deprecated: use observe_interval_seconds",
                DeprecationWarning,
                stacklevel=2,
            )
            values["observe_interval_seconds"] = max(1, round(values.pop("observe_seconds")))
        super().__init__(**values)
        check_stages(self.stages)  # raises InvalidStageInput naming the stage and its setting

    @field_validator("rescan_cron")
    @classmethod
    def _cron_is_valid(cls, value: str | None) -> str | None:
        if value is not None and not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a valid cron expression")
        return value


class StageKeyUse(BaseModel):
    """One key's use of a stage's limits now ("" for a stage without a key function)."""

    key: str
    tokens: float | None = None  # left in its bucket (rate_limit)
    batches: int = 0  # flow slots held (max_parallelism): process calls running


class StageLimits(BaseModel):
    """A stage's limits as its workers registered them, applied to each key, and their use per key."""

    rate_per_second: float | None = None
    burst: float | None = None
    max_parallelism: int | None = None
    keys: list[StageKeyUse] = Field(default_factory=list)


class StageStatus(BaseModel):
    """One stage's queues, counters and limits."""

    stage: str
    queued: int = 0  # main queue, due now
    timers: int = 0  # main queue, due later
    low_priority: int = 0  # rescan queue
    oldest_seconds: float = 0  # age of the oldest due entry (main queue)
    parked: int = 0
    failing: int = 0  # entries with a failed attempt, not parked
    processed: int = 0
    changed: int = 0
    conflicts: int = 0
    errors: int = 0
    capped: int = 0
    limits: StageLimits | None = None  # None: no rate limit or max parallelism


class StagesStatus(BaseModel):
    """The stage scheduler's status (``cmb-dagster stages status``, the Dagster observations): the shard count
    and a row per stage that has entries or counters, by name."""

    shard_count: int
    stages: list[StageStatus] = Field(default_factory=list)

    def stage(self, name: str) -> StageStatus:
        """The row of stage ``name`` (zeros when it has none yet)."""
        return next((row for row in self.stages if row.stage == name), StageStatus(stage=name))

    def __iter__(self) -> Any:  # type: ignore[override]
        """Deprecated: iterate over :attr:`stages` (``status()`` returned that list before)."""
        return deprecated_iteration(
            self.stages, "iterating over stages.status() is deprecated: iterate over status().stages"
        )


class QueueEntry(BaseModel):
    """One queue entry (``cmb-dagster stages queue``)."""

    entity_id: str
    stage: str
    shard_id: int
    lane: int
    due_at: datetime
    attempts: int
    conflicts: int
    crashes: int
    last_error: str | None
    parked_at: datetime | None


def check_entity_id(entity_id: Any) -> str:
    """``entity_id`` if it is a storable id of 1 to 256 characters."""
    return check_text(entity_id, "entity_id", max_length=MAX_ENTITY_ID_LENGTH, error=InvalidStageInput)


def check_stage_name(stage: Any) -> str:
    """``stage`` if it can name a stage (``STAGE_NAME_PATTERN``)."""
    if not isinstance(stage, str) or not STAGE_NAME_PATTERN.match(stage):
        raise InvalidStageInput(f"stage: {shorten(stage)} is not a stage name ({STAGE_NAME_PATTERN.pattern})")
    return stage


def dump_payload(payload: Any, what: str = "payload") -> str:
    """``payload`` as JSON text, refusing anything but a JSON object within the payload limit."""
    if not isinstance(payload, dict):
        raise InvalidStageInput(f"{what}: must be a JSON object, not {type(payload).__name__}")
    return to_json(payload, what, error=InvalidStageInput)


def changed_fields(old: dict[str, Any] | None, new: dict[str, Any]) -> set[str]:
    """Top-level keys whose values differ between ``old`` and ``new``."""
    if old is None:
        return set(new)
    return {k for k in old.keys() | new.keys() if old.get(k, _MISSING) != new.get(k, _MISSING)}


_MISSING = object()

__all__ = [
    "Entity",
    "MergePatch",
    "QueueEntry",
    "SavedEntity",
    "StageKeyUse",
    "StageLimits",
    "StageOptions",
    "StageResult",
    "StageStatus",
    "StagesStatus",
    "changed_fields",
    "entity_hash",
    "merge_patch",
    "shard_of",
]
