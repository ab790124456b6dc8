"""Trigger models: CTL triggers (Delta, Delay, RefDelay, their chunk versions, Settle) and aggregates (All, Any).

Triggers are frozen pydantic models with a ``kind`` discriminator, so they compare,
hash and round-trip through JSON. Arguments are checked when a trigger is defined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Annotated, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationInfo,
)

from cmb_dagster.triggers.chunks import get_zone, parse_scale
from cmb_dagster.triggers.durations import MAX_DURATION, compact_duration, parse_duration

ParameterKey = tuple[str, str]
"""A CTL parameter: ``(entity, parameter)``."""


def display_key(key: ParameterKey) -> str:
    """``('shop/orders', 'loaded_until')`` -> ``'shop/orders/loaded_until'``."""
    return f"{key[0]}/{key[1]}"


def _name(value: object, info: ValidationInfo) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{info.field_name} must be a non-empty string, got {value!r}")
    return value


def _positive_duration(value: object, info: ValidationInfo) -> timedelta:
    try:
        duration = parse_duration(value)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(f"{info.field_name}: {error}") from None
    if duration <= timedelta():
        raise ValueError(f"{info.field_name} must be a positive duration, got {value!r}")
    if duration > MAX_DURATION:
        raise ValueError(f"{info.field_name} must be at most {MAX_DURATION.days} days (100 years), got {value!r}")
    return duration


def _scale(value: object, info: ValidationInfo) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{info.field_name} must be a string such as '30min', 'day' or 'month', got {value!r}")
    try:
        return parse_scale(value).name
    except ValueError as error:
        raise ValueError(f"{info.field_name}: {error}") from None


def _zone_name(value: object, info: ValidationInfo) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{info.field_name} must be an IANA time zone name, got {value!r}")
    try:
        get_zone(value)
    except ValueError as error:
        raise ValueError(f"{info.field_name}: {error}") from None
    return value


def _chunk_count(minimum: int) -> Callable[[object, ValidationInfo], int | None]:
    def whole_chunks(value: object, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{info.field_name} must be a whole number of chunks, got {value!r}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{info.field_name} must be a whole number of chunks, got {value!r}")
        if value < minimum:
            raise ValueError(f"{info.field_name} must be at least {minimum} chunk(s), got {value!r}")
        return int(value)

    return whole_chunks


Name = Annotated[str, BeforeValidator(_name)]
Duration = Annotated[
    timedelta,
    BeforeValidator(_positive_duration),
    PlainSerializer(compact_duration, return_type=str, when_used="json"),
]
Scale = Annotated[str, BeforeValidator(_scale)]
TimeZoneName = Annotated[str | None, BeforeValidator(_zone_name)]
NewChunks = Annotated[int | None, BeforeValidator(_chunk_count(1))]
LagChunks = Annotated[int | None, BeforeValidator(_chunk_count(0))]


def _shown(value: object) -> str:
    return repr(compact_duration(value)) if isinstance(value, timedelta) else repr(value)


class TriggerBase(BaseModel):
    """Common behaviour of all triggers: ``a & b`` is ``All(a, b)``, ``a | b`` is ``Any(a, b)``.

    Constructors take their arguments positionally; their ``**data`` carries ``kind`` when
    pydantic rebuilds a trigger from stored data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    positional: ClassVar[tuple[str, ...]] = ()
    """Fields the constructor takes positionally, in order; ``repr`` writes them that way."""

    def __and__(self, other: object) -> All:
        if not isinstance(other, TriggerBase):
            return NotImplemented
        return combine(All, self, other)

    def __or__(self, other: object) -> Any:
        if not isinstance(other, TriggerBase):
            return NotImplemented
        return combine(Any, self, other)

    def __repr__(self) -> str:
        arguments: list[str] = []
        keyword_only = False
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name == "kind" or value is None:
                keyword_only = keyword_only or name in self.positional
                continue
            if name in self.positional and not keyword_only:
                arguments.append(_shown(value))
            else:
                arguments.append(f"{name}={_shown(value)}")
        return f"{type(self).__name__}({', '.join(arguments)})"

    __str__ = __repr__


class CtlTriggerBase(TriggerBase):
    """A trigger on one CTL parameter ``(entity, parameter)``."""

    reads_last: ClassVar[bool] = False

    @property
    def key(self) -> ParameterKey:
        """The watched parameter ``(entity, parameter)``."""
        return (self.entity, self.parameter)


class Delta(CtlTriggerBase):
    """Fires when ``current - last >= min_delta``: enough new data arrived since the last run.

    >>> Delta("shop/orders", "loaded_until", "1d")
    Delta('shop/orders', 'loaded_until', '1d')
    """

    reads_last: ClassVar[bool] = True
    positional: ClassVar[tuple[str, ...]] = ("entity", "parameter", "min_delta")
    kind: Literal["Delta"] = "Delta"
    entity: Name
    parameter: Name
    min_delta: Duration

    def __init__(self, entity: str, parameter: str, min_delta: timedelta | str, **data: object) -> None:
        super().__init__(entity=entity, parameter=parameter, min_delta=min_delta, **data)


class Delay(CtlTriggerBase):
    """Fires when ``now - current <= max_delay``: the parameter is fresh enough.

    >>> Delay("shop/orders", "loaded_until", "2h")
    Delay('shop/orders', 'loaded_until', '2h')
    """

    positional: ClassVar[tuple[str, ...]] = ("entity", "parameter", "max_delay")
    kind: Literal["Delay"] = "Delay"
    entity: Name
    parameter: Name
    max_delay: Duration

    def __init__(self, entity: str, parameter: str, max_delay: timedelta | str, **data: object) -> None:
        super().__init__(entity=entity, parameter=parameter, max_delay=max_delay, **data)


class RefDelay(CtlTriggerBase):
    """Fires when ``ref_current - current <= max_delay``: the parameter caught up with a reference one.

    >>> RefDelay("mart/sales", "loaded_until", "shop/orders", "loaded_until", "1h")
    RefDelay('mart/sales', 'loaded_until', 'shop/orders', 'loaded_until', '1h')
    """

    positional: ClassVar[tuple[str, ...]] = ("entity", "parameter", "ref_entity", "ref_parameter", "max_delay")
    kind: Literal["RefDelay"] = "RefDelay"
    entity: Name
    parameter: Name
    ref_entity: Name
    ref_parameter: Name
    max_delay: Duration

    def __init__(
        self,
        entity: str,
        parameter: str,
        ref_entity: str,
        ref_parameter: str,
        max_delay: timedelta | str,
        **data: object,
    ) -> None:
        super().__init__(
            entity=entity,
            parameter=parameter,
            ref_entity=ref_entity,
            ref_parameter=ref_parameter,
            max_delay=max_delay,
            **data,
        )

    @property
    def ref_key(self) -> ParameterKey:
        """The reference parameter ``(ref_entity, ref_parameter)``."""
        return (self.ref_entity, self.ref_parameter)


class ChunkDelta(CtlTriggerBase):
    """Fires when ``current`` is at least ``min_delta`` chunks after ``last`` (default: in a newer chunk).

    >>> ChunkDelta("shop/orders", "loaded_until", "day", 2, timezone="Europe/Moscow")
    ChunkDelta('shop/orders', 'loaded_until', 'day', 2, timezone='Europe/Moscow')
    """

    reads_last: ClassVar[bool] = True
    positional: ClassVar[tuple[str, ...]] = ("entity", "parameter", "scale", "min_delta")
    kind: Literal["ChunkDelta"] = "ChunkDelta"
    entity: Name
    parameter: Name
    scale: Scale
    min_delta: NewChunks = None
    timezone: TimeZoneName = None

    def __init__(
        self,
        entity: str,
        parameter: str,
        scale: str,
        min_delta: int | None = None,
        *,
        timezone: str | None = None,
        **data: object,
    ) -> None:
        super().__init__(
            entity=entity, parameter=parameter, scale=scale, min_delta=min_delta, timezone=timezone, **data
        )


class ChunkDelay(CtlTriggerBase):
    """Fires when ``current`` is at most ``max_delay`` chunks behind now (default: in now's chunk or later).

    >>> ChunkDelay("shop/orders", "loaded_until", "day")
    ChunkDelay('shop/orders', 'loaded_until', 'day')
    """

    positional: ClassVar[tuple[str, ...]] = ("entity", "parameter", "scale", "max_delay")
    kind: Literal["ChunkDelay"] = "ChunkDelay"
    entity: Name
    parameter: Name
    scale: Scale
    max_delay: LagChunks = None
    timezone: TimeZoneName = None

    def __init__(
        self,
        entity: str,
        parameter: str,
        scale: str,
        max_delay: int | None = None,
        *,
        timezone: str | None = None,
        **data: object,
    ) -> None:
        super().__init__(
            entity=entity, parameter=parameter, scale=scale, max_delay=max_delay, timezone=timezone, **data
        )


class ChunkRefDelay(CtlTriggerBase):
    """Fires when ``current`` is at most ``max_delay`` chunks behind the reference (default: same chunk or later).

    >>> ChunkRefDelay("mart/sales", "loaded_until", "shop/orders", "loaded_until", "day")
    ChunkRefDelay('mart/sales', 'loaded_until', 'shop/orders', 'loaded_until', 'day')
    """

    positional: ClassVar[tuple[str, ...]] = (
        "entity",
        "parameter",
        "ref_entity",
        "ref_parameter",
        "scale",
        "max_delay",
    )
    kind: Literal["ChunkRefDelay"] = "ChunkRefDelay"
    entity: Name
    parameter: Name
    ref_entity: Name
    ref_parameter: Name
    scale: Scale
    max_delay: LagChunks = None
    timezone: TimeZoneName = None

    def __init__(
        self,
        entity: str,
        parameter: str,
        ref_entity: str,
        ref_parameter: str,
        scale: str,
        max_delay: int | None = None,
        *,
        timezone: str | None = None,
        **data: object,
    ) -> None:
        super().__init__(
            entity=entity,
            parameter=parameter,
            ref_entity=ref_entity,
            ref_parameter=ref_parameter,
            scale=scale,
            max_delay=max_delay,
            timezone=timezone,
            **data,
        )

    @property
    def ref_key(self) -> ParameterKey:
        """The reference parameter ``(ref_entity, ref_parameter)``."""
        return (self.ref_entity, self.ref_parameter)


class Settle(CtlTriggerBase):
    """Fires when the parameter has not changed for ``quiet`` and differs from the last run's value (no last
    value: it fires): e.g. an upstream stopped loading for 15 minutes.

    The time of the last change is CTL's (``ctl_values.updated_at``).

    >>> Settle("shop/prices", "loaded_until", "15min")
    Settle('shop/prices', 'loaded_until', '15min')
    """

    reads_last: ClassVar[bool] = True
    positional: ClassVar[tuple[str, ...]] = ("entity", "parameter", "quiet")
    kind: Literal["Settle"] = "Settle"
    entity: Name
    parameter: Name
    quiet: Duration

    def __init__(self, entity: str, parameter: str, quiet: timedelta | str, **data: object) -> None:
        super().__init__(entity=entity, parameter=parameter, quiet=quiet, **data)


CTL_TRIGGER_TYPES = (Delta, Delay, RefDelay, ChunkDelta, ChunkDelay, ChunkRefDelay, Settle)
CtlTrigger = Annotated[
    Delta | Delay | RefDelay | ChunkDelta | ChunkDelay | ChunkRefDelay | Settle, Field(discriminator="kind")
]
"""Any CTL trigger; usable as a pydantic field type."""

_AGGREGATE_KINDS = ("All", "Any")


def _ctl_children(value: object, info: ValidationInfo) -> tuple[object, ...]:
    aggregate = info.config.get("title") if info.config else None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ValueError(f"{aggregate} takes CTL triggers, got {value!r}")
    children = tuple(value)
    if not children:
        raise ValueError(f"{aggregate} needs at least one trigger")
    for child in children:
        kind = child.get("kind") if isinstance(child, Mapping) else getattr(child, "kind", None)
        if kind in _AGGREGATE_KINDS:
            raise ValueError(
                f"{aggregate} cannot contain {kind}(...): aggregate triggers take CTL triggers only "
                "and cannot be nested"
            )
        if not isinstance(child, Mapping | CtlTriggerBase):
            raise ValueError(f"{aggregate} takes CTL triggers (Delta, Delay, RefDelay, Chunk*, Settle), got {child!r}")
    return children


CtlTriggers = Annotated[tuple[CtlTrigger, ...], BeforeValidator(_ctl_children)]


class AggregateBase(TriggerBase):
    """A combination of CTL triggers; aggregates cannot be nested."""

    def __init__(self, *triggers: CtlTriggerBase, **data: object) -> None:
        super().__init__(**{"triggers": triggers, **data})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.triggers))})"

    __str__ = __repr__


class All(AggregateBase):
    """Fires when every child trigger fires.

    >>> All(Delta("sales", "loaded_until", "1d"), Delay("prices", "loaded_until", "2h"))
    All(Delta('sales', 'loaded_until', '1d'), Delay('prices', 'loaded_until', '2h'))
    """

    model_config = ConfigDict(title="All")
    kind: Literal["All"] = "All"
    triggers: CtlTriggers


class Any(AggregateBase):
    """Fires when at least one child trigger fires.

    >>> Any(ChunkDelta("sales", "loaded_until", "day"), ChunkDelta("prices", "loaded_until", "day"))
    Any(ChunkDelta('sales', 'loaded_until', 'day'), ChunkDelta('prices', 'loaded_until', 'day'))
    """

    model_config = ConfigDict(title="Any")
    kind: Literal["Any"] = "Any"
    triggers: CtlTriggers


Trigger = Annotated[
    Delta | Delay | RefDelay | ChunkDelta | ChunkDelay | ChunkRefDelay | Settle | All | Any,
    Field(discriminator="kind"),
]
"""Any trigger, CTL or aggregate; usable as a pydantic field type."""

_TRIGGER = TypeAdapter(Trigger)


def trigger_from_json(data: str | bytes) -> Trigger:
    """Read a trigger from ``trigger.model_dump_json()`` output."""
    return _TRIGGER.validate_json(data)


def trigger_from_dict(data: Mapping[str, object]) -> Trigger:
    """Read a trigger from ``trigger.model_dump()`` or ``model_dump(mode='json')`` output (or a ``defs.yaml``);
    ValueError naming the field when a field is unknown or missing."""
    problems = trigger_data_problems(data)
    if problems:
        raise ValueError("; ".join(f"{'.'.join(map(str, path)) or 'trigger'}: {text}" for path, text in problems))
    return _TRIGGER.validate_python(data)


_KINDS: dict[str, type[TriggerBase]] = {
    cls.model_fields["kind"].default: cls
    for cls in (Delta, Delay, RefDelay, ChunkDelta, ChunkDelay, ChunkRefDelay, Settle, All, Any)
}


def trigger_data_problems(data: object, path: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], str]]:
    """What keeps ``data`` from being a trigger's fields: an unknown kind, an unknown or a missing field, each with
    its path (the constructors take positional arguments, so pydantic alone would report a missing one as a
    TypeError without its field)."""
    if not isinstance(data, Mapping):
        return [(path, f"expected a mapping with a kind ({', '.join(_KINDS)}), got {type(data).__name__}")]
    kind = _KINDS.get(str(data.get("kind")))
    if kind is None:
        return [((*path, "kind"), f"expected one of {', '.join(_KINDS)}, got {data.get('kind')!r}")]
    fields = kind.model_fields
    problems = [((*path, str(k)), "unknown field") for k in data if k not in fields]
    problems += [((*path, k), "missing") for k, f in fields.items() if f.is_required() and k not in data]
    children = data.get("triggers")
    if issubclass(kind, AggregateBase) and isinstance(children, list):
        for i, child in enumerate(children):
            problems += trigger_data_problems(child, (*path, "triggers", i))
    return problems


def combine(aggregate: type[All] | type[Any], *triggers: TriggerBase) -> All | Any:
    """``aggregate(*triggers)`` with children of the same aggregate type flattened in.

    >>> combine(All, All(Delta("a", "p", "1d")), Delay("b", "p", "1h"))
    All(Delta('a', 'p', '1d'), Delay('b', 'p', '1h'))
    """
    children: list[CtlTriggerBase] = []
    for trigger in triggers:
        if isinstance(trigger, aggregate):
            children.extend(trigger.triggers)
        elif isinstance(trigger, AggregateBase):
            raise ValueError(f"cannot put {trigger!r} inside {aggregate.__name__}: aggregate triggers cannot be nested")
        else:
            children.append(trigger)  # type: ignore[arg-type]
    return aggregate(*children)
