"""Typed errors of the stage scheduler; each message names the field (or entity and stage) and what is wrong."""

from cmb_dagster.errors import CmbError, InvalidInput
from cmb_dagster.workers import LeaseLost


class StageError(CmbError):
    """Base class of stage scheduler errors."""


class InvalidStageInput(StageError, InvalidInput):
    """Bad input to the API (entity id, payload, patch, stage name, state, options): nothing was written."""


class InvalidStageResult(InvalidStageInput):
    """A stage's ``process`` (or ``should_process``) returned something the engine cannot store.

    The entity is left unchanged and the queue entry is retried like one whose ``process`` raised."""


class UnknownStage(InvalidStageInput):
    """No stage of this name is registered."""


class EntityNotFound(StageError):
    """No entity has this id."""


class VersionConflict(StageError):
    """The entity's version is not the one the caller expected (compare-and-set lost)."""


class ShardCountChanged(StageError, LeaseLost):
    """The shard count changed under a worker: its shard leases mean something else now."""
