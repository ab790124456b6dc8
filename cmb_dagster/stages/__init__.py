"""Stage scheduler: per-entity stages with queues, timers, private state and optimistic locking.

Entities (any JSON object with an id) live in ``stage_entities``; stages are pure code that react to an
entity's change or to a timer, may change the entity (a new payload or an RFC 7386 merge patch), keep a
private pydantic state beside it, and schedule their next timer. Results commit only if the entity's
version is unchanged since it was loaded; side effects run after the commit from the published result.
See docs/stages.md.
"""

from cmb_dagster.flow import FlowLimits, RateLimit
from cmb_dagster.stages.admin import entries, retry, set_shard_count, shard_count, status
from cmb_dagster.stages.engine import Engine
from cmb_dagster.stages.errors import (
    EntityNotFound,
    InvalidStageInput,
    InvalidStageResult,
    StageError,
    UnknownStage,
    VersionConflict,
)
from cmb_dagster.stages.models import (
    Entity,
    MergePatch,
    SavedEntity,
    StageKeyUse,
    StageLimits,
    StageOptions,
    StageResult,
    StagesStatus,
    StageStatus,
    merge_patch,
    shard_of,
)
from cmb_dagster.stages.stage import NoState, Stage
from cmb_dagster.stages.store import StageStore, ensure_capture
from cmb_dagster.stages.worker import StageWorker

__all__ = [
    "Engine",
    "Entity",
    "EntityNotFound",
    "FlowLimits",
    "InvalidStageInput",
    "InvalidStageResult",
    "MergePatch",
    "NoState",
    "RateLimit",
    "SavedEntity",
    "Stage",
    "StageError",
    "StageKeyUse",
    "StageLimits",
    "StageOptions",
    "StageResult",
    "StageStatus",
    "StageStore",
    "StageWorker",
    "StagesStatus",
    "UnknownStage",
    "VersionConflict",
    "ensure_capture",
    "entries",
    "merge_patch",
    "retry",
    "set_shard_count",
    "shard_count",
    "shard_of",
    "status",
]
