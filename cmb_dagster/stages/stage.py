"""``Stage``: the unit of work of the scheduler, pure code over one entity and its private state."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from cmb_dagster.errors import InvalidInput
from cmb_dagster.flow import FlowLimits, RateLimit
from cmb_dagster.inputs import shorten
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES
from cmb_dagster.models import Backoff, describe
from cmb_dagster.stages.errors import InvalidStageInput, InvalidStageResult, UnknownStage
from cmb_dagster.stages.models import STAGE_NAME_PATTERN, Entity, StageResult, Timer


class NoState(BaseModel):
    """The state of a stage that keeps none."""


class Stage:
    """A stage: subclass it, set ``name`` (and ``state_model``), implement ``process``.

    ``should_process(entity, state)`` is asked after every change of the entity (by the API, plain SQL
    or another stage); it must be fast and return True (enqueue now), False, or a timer (a
    ``timedelta`` or an aware ``datetime``). If it raises, the entity is enqueued anyway, so ``process``
    checks again whether there is work. ``process(entity, state)`` returns a
    :class:`StageResult`; it must have no side effects (it may run again after a conflict or a
    crash): side effects go to ``after_commit(saved)``, run after the commit at least once, keyed by
    ``saved.event_id``.

    Class attributes (override in a subclass, or pass to the constructor):
    ``fields`` (payload keys the stage cares about: changes elsewhere do not ask it; None: all),
    ``max_attempts`` (failed calls before the entry is parked), ``backoff`` (the wait before an entry
    whose call failed runs again: 1 s, doubling, at most 300 s), ``rate_limit`` (process calls across all
    workers: calls per second, a :class:`~cmb_dagster.flow.RateLimit` or text such as ``"600/m"``),
    ``max_parallelism`` (``process`` calls running at once across all workers, each holding a slot until it has
    ended and its outcome is committed), ``limits_version`` (the version of those two limits: workers with a lower
    one leave the registered limits as they are; raise it with each change),
    ``key`` (a function of the entity, e.g. ``lambda entity: entity.payload["tenant"]``: ``rate_limit`` and
    ``max_parallelism`` then hold per key, each key with its own tokens and slots; it must be fast, and an
    entry whose key raises fails like a ``process`` that raised), ``max_triggers`` per
    ``trigger_window`` seconds (re-trigger cap; later triggers wait for the next window), ``timeout``
    (seconds a ``process`` call may run before it fails: an ``async def`` one is cancelled then, one in a child
    process killed, a thread keeps its entity until it returns), ``max_crashes`` (runs on one entity that
    ended with the death of their worker before the entry is parked). ``process`` may be ``async def``.
    """

    name: ClassVar[str] = ""
    state_model: ClassVar[type[BaseModel]] = NoState
    fields: ClassVar[tuple[str, ...] | None] = None
    max_attempts: int = 5
    backoff: Backoff = Backoff(first=1.0, factor=2, max=300.0)
    rate_limit: float | str | RateLimit | None = None
    max_parallelism: int | None = None
    limits_version: int = 0
    key: Any = None  # Callable[[Entity], str] | None
    max_triggers: int | None = None
    trigger_window: float = 60.0
    max_conflicts: int = 20  # in a row, before the entry backs off a second (counted and logged)
    timeout: float = 60.0
    max_crashes: int = DEFAULT_MAX_CRASHES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        renamed = {key: cls.__dict__[key] for key in _RENAMED if key in cls.__dict__}
        if renamed:
            for key in renamed:
                delattr(cls, key)
            cls.backoff = _renamed_backoff(cls.backoff, renamed)

    def __init__(self, **overrides: Any) -> None:
        renamed = {key: overrides.pop(key) for key in _RENAMED if key in overrides}
        for key, value in overrides.items():
            if not hasattr(type(self), key) or key.startswith("_"):
                raise InvalidStageInput(f"{key}: not a stage setting")
            setattr(self, key, value)
        if renamed:
            self.backoff = _renamed_backoff(self.backoff, renamed)

    def should_process(self, entity: Entity, state: Any) -> bool | Timer:
        return True

    def process(self, entity: Entity, state: Any) -> StageResult:  # pragma: no cover - abstract
        raise NotImplementedError

    after_commit: Any = None  # Callable[[SavedEntity], None] | None

    def __repr__(self) -> str:
        return f"<Stage {self.name}>"

    # -- engine helpers ------------------------------------------------------------------------

    def rate(self) -> RateLimit | None:
        """``rate_limit`` as a :class:`~cmb_dagster.flow.RateLimit` (a number: calls per second)."""
        if self.rate_limit is None or isinstance(self.rate_limit, RateLimit):
            return self.rate_limit
        if isinstance(self.rate_limit, str):
            return RateLimit.model_validate(self.rate_limit)
        return RateLimit(rate=self.rate_limit)

    def flow_limits(self) -> dict[str, FlowLimits]:
        """The stage's scopes of :mod:`cmb_dagster.flow` and their limits (None: not limited)."""
        rate, parallel = self.rate(), self.max_parallelism
        return {
            rate_scope(self.name): FlowLimits(rate_limit=rate, version=self.limits_version),
            parallel_scope(self.name): FlowLimits(concurrency=parallel, version=self.limits_version),
        }

    def key_of(self, entity: Entity) -> str:
        """The flow-control key of ``entity`` ("" without a key function)."""
        if self.key is None:
            return ""
        value = self.key(entity)
        return value if isinstance(value, str) else str(value)

    def load_state(self, raw: Any) -> BaseModel:
        """The stored JSON as the stage's state model (defaults when none is stored)."""
        if raw is None:
            return self.state_model()
        return self.state_model.model_validate(raw)

    def dump_state(self, state: Any, what: str = "new_state") -> dict[str, Any]:
        if not isinstance(state, self.state_model):
            raise InvalidStageResult(
                f"{what}: stage {self.name!r} must return a {self.state_model.__name__}, not {type(state).__name__}"
            )
        return state.model_dump(mode="json")


_RENAMED = {"retry_backoff": "first", "max_backoff": "max"}  # deprecated stage settings -> backoff fields


def _renamed_backoff(backoff: Backoff, renamed: dict[str, Any]) -> Backoff:
    """``backoff`` with the deprecated ``retry_backoff`` / ``max_backoff`` settings applied; warns the code that
    set them (a subclass's body or a constructor call)."""
    names = " and ".join(renamed)
    warnings.warn(
        f"Stage {names}: deprecated, set backoff = Backoff(first=..., factor=2, max=...) instead",
        DeprecationWarning,
        stacklevel=3,
    )
    try:
        return Backoff(**(backoff.model_dump() | {_RENAMED[key]: value for key, value in renamed.items()}))
    except InvalidInput as exc:
        raise InvalidStageInput(f"{names}: {exc}") from None


def check_stages(stages: Sequence[Any]) -> dict[str, Stage]:
    """Stages by name; raises InvalidStageInput for non-stages, bad names, duplicates, bad settings."""
    by_name: dict[str, Stage] = {}
    for index, stage in enumerate(stages):
        where = f"stages[{index}]"
        if not isinstance(stage, Stage):
            raise InvalidStageInput(f"{where}: must be a Stage instance, not {type(stage).__name__}")
        if not isinstance(stage.name, str) or not STAGE_NAME_PATTERN.match(stage.name):
            raise InvalidStageInput(f"{where}.name: {stage.name!r} must match {STAGE_NAME_PATTERN.pattern}")
        if stage.name in by_name:
            raise InvalidStageInput(f"{where}.name: two stages are named {stage.name!r}")
        if not (isinstance(stage.state_model, type) and issubclass(stage.state_model, BaseModel)):
            raise InvalidStageInput(f"{where}.state_model: must be a pydantic model class")
        if not isinstance(stage.backoff, Backoff):
            raise InvalidStageInput(f"{where}.backoff: must be a Backoff, not {type(stage.backoff).__name__}")
        for setting, low, high in _BOUNDS:
            value = getattr(stage, setting)
            if setting == "rate_limit" and isinstance(value, str | RateLimit):
                continue
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high
            ):
                raise InvalidStageInput(f"{where}.{setting}: {shorten(value)} is outside {low:g}..{high:g}")
        if isinstance(stage.rate_limit, str | RateLimit):
            try:
                stage.rate()
            except ValidationError as exc:
                raise InvalidStageInput(f"{where}.rate_limit: {describe(exc)}") from None
        if stage.key is not None and not callable(stage.key):
            raise InvalidStageInput(f"{where}.key: must be a function of the entity, not {type(stage.key).__name__}")
        if stage.fields is not None and not all(isinstance(f, str) for f in stage.fields):
            raise InvalidStageInput(f"{where}.fields: must be payload key names")
        by_name[stage.name] = stage
    return by_name


_BOUNDS = (  # (setting, lowest, highest) of every number a stage sets
    ("max_attempts", 1, 10_000),
    ("rate_limit", 0.001, 1_000_000),
    ("max_parallelism", 1, 1024),
    ("max_triggers", 1, 1_000_000),
    ("trigger_window", 0.001, 30 * 86400),
    ("max_conflicts", 1, 10_000),
    ("timeout", 0.001, 86400),
    ("max_crashes", 1, 1000),
)


def rate_scope(stage: str) -> str:
    """The flow scope of a stage's rate limit: one token per ``process`` call."""
    return f"stages/{stage}"


def parallel_scope(stage: str) -> str:
    """The flow scope of a stage's max parallelism: one slot per batch."""
    return f"stages/{stage}/parallel"


def stage_named(stages: dict[str, Stage], name: str) -> Stage:
    try:
        return stages[name]
    except KeyError:
        known = ", ".join(sorted(stages)) or "none"
        raise UnknownStage(f"stage: no stage named {name!r} (known: {known})") from None


def due_of(value: Any, now: datetime, what: str) -> datetime | None:
    """A timer (``timedelta`` or aware ``datetime``, True = now, False/None = none) as a due time."""
    if value is None or value is False:
        return None
    if value is True:
        return now
    if isinstance(value, timedelta):
        return now + value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidStageResult(f"{what}: a naive datetime {value.isoformat()} (give a timezone)")
        return value
    raise InvalidStageResult(f"{what}: must be a bool, timedelta or aware datetime, not {type(value).__name__}")


__all__ = ["NoState", "Stage", "check_stages", "due_of", "parallel_scope", "rate_scope", "stage_named"]
