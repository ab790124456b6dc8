"""Evaluating a trigger against the current time, current CTL values and the values seen by the last run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cmb_dagster.triggers.chunks import chunk_of, get_zone, parse_scale
from cmb_dagster.triggers.durations import compact_duration, human_duration
from cmb_dagster.triggers.models import (
    AggregateBase,
    All,
    Any,
    ChunkDelay,
    ChunkDelta,
    ChunkRefDelay,
    CtlTriggerBase,
    Delay,
    Delta,
    ParameterKey,
    RefDelay,
    Settle,
    Trigger,
    display_key,
)

CtlValues = Mapping[ParameterKey, datetime]
_NO_TIME = timedelta()


@dataclass(frozen=True, slots=True)
class TriggerResult:
    """Outcome of evaluating ``trigger``: whether it fired, why, and the current values it read.

    ``used`` maps ``(entity, parameter)`` to the current values the trigger read; on a
    successful run they become the task's last-seen values. ``children`` holds the results
    of an aggregate's triggers. ``explanation`` is rendered by ``render`` on access, so
    evaluation itself builds no text; ``brief`` renders what a CTL trigger's value is against its
    limit, in a few words. ``wake_at``: when a result that did not fire can fire on the same values
    with time alone (a ``Settle`` whose quiet time has not passed yet); None: only a change of a value can.
    """

    trigger: Trigger
    fired: bool
    used: dict[ParameterKey, datetime]
    render: Callable[[], str] = field(repr=False, compare=False)
    children: tuple[TriggerResult, ...] = ()
    wake_at: datetime | None = None
    brief: Callable[[], str] | None = field(default=None, repr=False, compare=False)

    @property
    def explanation(self) -> str:
        """Which condition was checked, on which values, and by how much it held or missed."""
        return self.render()

    @property
    def waits_on(self) -> list[str]:
        """One line per CTL trigger that did not fire: its label, the value it waits on and its limit,
        e.g. ``'Delay(shop/prices/loaded_until, 2h) waits on shop/prices/loaded_until = ..., 11:00:00 behind,
        allowed 2:00:00'``."""
        results = self.children if self.children else (self,)
        return [r.render_brief() for r in results if not r.fired]

    def render_brief(self) -> str:
        """``'<label> waits on <value against its limit>'`` (a CTL trigger), or the explanation."""
        if self.brief is None:
            return self.explanation
        return self.brief()


class _Inputs:
    """Evaluation inputs; CTL values are checked only when a trigger reads them."""

    __slots__ = ("changed", "current", "last", "now", "now_utc", "timezone")

    def __init__(self, now: datetime, current: CtlValues, last: CtlValues, timezone: str, changed: CtlValues) -> None:
        self.now = now
        self.now_utc = _utc(_require_aware(now, "now"))
        self.current = current
        self.last = last
        self.timezone = timezone
        self.changed = changed

    def changed_of(self, key: ParameterKey) -> datetime | None:
        value = self.changed.get(key)
        return None if value is None else _require_aware(value, "changed", key)

    def current_of(self, key: ParameterKey) -> datetime | None:
        value = self.current.get(key)
        return None if value is None else _require_aware(value, "current", key)

    def last_of(self, key: ParameterKey) -> datetime | None:
        value = self.last.get(key)
        return None if value is None else _require_aware(value, "last", key)


def _require_aware(value: datetime, name: str, key: ParameterKey | None = None) -> datetime:
    """``value``, if an aware datetime; its error names ``name`` (``name[key]`` with a key), written only then."""
    if isinstance(value, datetime) and value.utcoffset() is not None:
        return value
    shown = name if key is None else f"{name}[{key!r}]"
    if not isinstance(value, datetime):
        raise TypeError(f"{shown} must be a timezone-aware datetime, got {value!r}")
    raise ValueError(f"{shown} is a naive datetime ({value}); pass timezone-aware datetimes")


def _utc(value: datetime) -> datetime:
    """``value`` in UTC: aware datetimes sharing a ``ZoneInfo`` subtract by wall clock, UTC ones do not."""
    return value if value.tzinfo is UTC else value.astimezone(UTC)


def evaluate(
    trigger: Trigger,
    *,
    now: datetime,
    current: CtlValues,
    last: CtlValues,
    timezone: str | None = None,
    changed: CtlValues | None = None,
) -> TriggerResult:
    """Decide whether ``trigger`` fires at ``now`` and explain why.

    ``current`` and ``last`` map ``(entity, parameter)`` to aware datetimes (a missing key is
    a missing value); ``timezone`` is the task's IANA zone for chunk triggers without their
    own (default UTC); ``changed`` maps a parameter to when its current value was set (CTL's
    ``updated_at``), which ``Settle`` reads.
    """
    if timezone is not None:
        try:
            get_zone(timezone)
        except ValueError as error:
            raise ValueError(f"timezone: {error}") from None
    return _evaluate(trigger, _Inputs(now, current, last, timezone or "UTC", changed or {}))


def _evaluate(trigger: Trigger, inputs: _Inputs) -> TriggerResult:
    try:
        evaluator = _EVALUATORS[type(trigger)]
    except KeyError:
        raise TypeError(f"evaluate expects a trigger (Delta, Delay, ..., All, Any), got {trigger!r}") from None
    return evaluator(trigger, inputs)


_LABELS: dict[tuple[int, str], tuple[CtlTriggerBase, str]] = {}
_MAX_LABELS = 65536


def _label(trigger: CtlTriggerBase, task_timezone: str) -> str:
    """``'Delay(shop/prices/loaded_until, 2h)'``, ``'ChunkDelta(sales/loaded_until, day in Europe/Moscow, 1)'``:
    the trigger's kind, what it watches and its threshold.

    Cached by the trigger object's identity (the cache holds the trigger, so its id is not reused while cached):
    a label is part of each of its explanations, tick after tick, and comparing triggers by value is slow.
    """
    cached = _LABELS.get((id(trigger), task_timezone))
    if cached is not None and cached[0] is trigger:
        return cached[1]
    watched = display_key(trigger.key)
    if isinstance(trigger, RefDelay | ChunkRefDelay):
        watched += f" behind {display_key(trigger.ref_key)}"
    if isinstance(trigger, ChunkDelta):
        watched += f", {trigger.scale} in {trigger.timezone or task_timezone}, {trigger.min_delta or 1}"
    elif isinstance(trigger, ChunkDelay | ChunkRefDelay):
        watched += f", {trigger.scale} in {trigger.timezone or task_timezone}, {trigger.max_delay or 0}"
    elif isinstance(trigger, Settle):
        watched += f", {compact_duration(trigger.quiet)}"
    else:
        watched += f", {compact_duration(trigger.min_delta if isinstance(trigger, Delta) else trigger.max_delay)}"
    label = f"{trigger.kind}({watched})"
    if len(_LABELS) >= _MAX_LABELS:
        _LABELS.clear()
    _LABELS[(id(trigger), task_timezone)] = (trigger, label)
    return label


def _waiting_to_appear(trigger: CtlTriggerBase, task_timezone: str, key: ParameterKey, used: dict) -> TriggerResult:
    return TriggerResult(
        trigger,
        False,
        used,
        lambda: (
            f"{_label(trigger, task_timezone)} waits: {display_key(key)} has no current value yet "
            "(waiting for it to appear)"
        ),
        brief=lambda: f"{_label(trigger, task_timezone)} waits on {display_key(key)}: no value yet",
    )


def _first_time(trigger: Delta | ChunkDelta, task_timezone: str, current: datetime) -> TriggerResult:
    return TriggerResult(
        trigger,
        True,
        {trigger.key: current},
        lambda: (
            f"{_label(trigger, task_timezone)} fires: no last value of {display_key(trigger.key)} "
            f"(first run, or the parameter is new to the trigger); current = {current}"
        ),
    )


def _moved_back(moved_back: bool) -> str:
    return "; current is before last: the parameter moved back, reset the task's last state" if moved_back else ""


def _current(trigger: CtlTriggerBase, inputs: _Inputs) -> TriggerResult | datetime:
    """The current value of the trigger's parameter, or its result while the parameter has none."""
    current = inputs.current_of(trigger.key)
    if current is None:
        return _waiting_to_appear(trigger, inputs.timezone, trigger.key, {})
    return current


def _current_and_last(trigger: Delta | ChunkDelta, inputs: _Inputs) -> TriggerResult | tuple[datetime, datetime]:
    """The current and last values a Delta-type trigger compares, or its result when one of them is missing."""
    current = _current(trigger, inputs)
    if isinstance(current, TriggerResult):
        return current
    last = inputs.last_of(trigger.key)
    if last is None:
        return _first_time(trigger, inputs.timezone, current)
    return current, last


def _current_and_reference(
    trigger: RefDelay | ChunkRefDelay, inputs: _Inputs
) -> TriggerResult | tuple[datetime, datetime, dict[ParameterKey, datetime]]:
    """The current and reference values a RefDelay-type trigger compares and the values it read, or its result
    when one of them is missing."""
    key, ref_key = trigger.key, trigger.ref_key
    current = inputs.current_of(key)
    reference = inputs.current_of(ref_key)
    used = {k: v for k, v in ((key, current), (ref_key, reference)) if v is not None}
    if current is None:
        return _waiting_to_appear(trigger, inputs.timezone, key, used)
    if reference is None:
        return _waiting_to_appear(trigger, inputs.timezone, ref_key, used)
    return current, reference, used


def _current_and_ahead(
    trigger: Delay | RefDelay | ChunkDelay | ChunkRefDelay, inputs: _Inputs
) -> TriggerResult | tuple[datetime, dict[ParameterKey, datetime], str, datetime]:
    """What a Delay-type trigger compares: the current value, the values it read, and what the current value must
    not lag far behind, by name (the reference value, or now); or its result when a value is missing."""
    if isinstance(trigger, RefDelay | ChunkRefDelay):
        values = _current_and_reference(trigger, inputs)
        if isinstance(values, TriggerResult):
            return values
        current, reference, used = values
        return current, used, "reference", reference
    current = _current(trigger, inputs)
    if isinstance(current, TriggerResult):
        return current
    return current, {trigger.key: current}, "now", inputs.now


def _delta(trigger: Delta, inputs: _Inputs) -> TriggerResult:
    values = _current_and_last(trigger, inputs)
    if isinstance(values, TriggerResult):
        return values
    (current, last), key, task_timezone = values, trigger.key, inputs.timezone
    difference = _utc(current) - _utc(last)
    fired = difference >= trigger.min_delta

    def render() -> str:
        verdict = "fires" if fired else "waits"
        shown = f"{_label(trigger, task_timezone)} {verdict}: current − last = {current} − {last} = "
        compared = f"{shown}{human_duration(difference)}"
        minimum = human_duration(trigger.min_delta)
        if fired:
            return f"{compared} >= {minimum}"
        short_by = human_duration(trigger.min_delta - difference)
        return f"{compared} < {minimum} (short by {short_by}){_moved_back(difference < _NO_TIME)}"

    def brief() -> str:
        return (
            f"{_label(trigger, task_timezone)} waits on {display_key(key)} = {current}, "
            f"{human_duration(difference)} past the last run's {last}, needs {human_duration(trigger.min_delta)}"
        )

    return TriggerResult(trigger, fired, {key: current}, render, brief=brief)


def _delay(trigger: Delay | RefDelay, inputs: _Inputs) -> TriggerResult:
    values = _current_and_ahead(trigger, inputs)
    if isinstance(values, TriggerResult):
        return values
    (current, used, name, ahead), task_timezone = values, inputs.timezone
    behind = f"{display_key(trigger.ref_key)} = {ahead}" if isinstance(trigger, RefDelay) else "now"
    lag = _utc(ahead) - _utc(current)
    return TriggerResult(
        trigger,
        lag <= trigger.max_delay,
        used,
        lambda: _lag_text(
            _label(trigger, task_timezone), f"{name} − current = {ahead} − {current}", lag, trigger.max_delay
        ),
        brief=lambda: (
            f"{_label(trigger, task_timezone)} waits on {display_key(trigger.key)} = {current}, "
            f"{human_duration(lag)} behind {behind}, allowed {human_duration(trigger.max_delay)}"
        ),
    )


def _lag_text(label: str, shown: str, lag: timedelta, limit: timedelta) -> str:
    if lag <= limit:
        return f"{label} fires: {shown} = {human_duration(lag)} <= {human_duration(limit)}"
    return (
        f"{label} waits: {shown} = {human_duration(lag)} > {human_duration(limit)} "
        f"(over by {human_duration(lag - limit)})"
    )


def _chunks(count: int) -> str:
    return f"{count} chunk" if count in (1, -1) else f"{count} chunks"


def _chunk_delta(trigger: ChunkDelta, inputs: _Inputs) -> TriggerResult:
    values = _current_and_last(trigger, inputs)
    if isinstance(values, TriggerResult):
        return values
    (current, last), key, task_timezone = values, trigger.key, inputs.timezone
    scale, zone = parse_scale(trigger.scale), get_zone(trigger.timezone or task_timezone)
    current_index, current_local = chunk_of(current, scale, zone)
    last_index, last_local = chunk_of(last, scale, zone)
    advanced = current_index - last_index
    needed = trigger.min_delta or 1
    fired = advanced >= needed

    def render() -> str:
        shown = (
            f"{_label(trigger, task_timezone)} {'fires' if fired else 'waits'}: "
            f"current {current} is in chunk {scale.label_of(current_local)}, "
            f"last {last} in chunk {scale.label_of(last_local)}: {_chunks(advanced)} apart"
        )
        if fired:
            return f"{shown} >= {needed}"
        return f"{shown} < {needed} (short by {_chunks(needed - advanced)}){_moved_back(advanced < 0)}"

    def brief() -> str:
        return (
            f"{_label(trigger, task_timezone)} waits on {display_key(key)} = {current} (chunk "
            f"{scale.label_of(current_local)}), {_chunks(advanced)} past the last run's chunk "
            f"{scale.label_of(last_local)}, needs {needed}"
        )

    return TriggerResult(trigger, fired, {key: current}, render, brief=brief)


def _chunk_delay(trigger: ChunkDelay | ChunkRefDelay, inputs: _Inputs) -> TriggerResult:
    values = _current_and_ahead(trigger, inputs)
    if isinstance(values, TriggerResult):
        return values
    (current, used, name, ahead), task_timezone = values, inputs.timezone
    behind = f"{display_key(trigger.ref_key)}'s" if isinstance(trigger, ChunkRefDelay) else "now's"
    scale, zone = parse_scale(trigger.scale), get_zone(trigger.timezone or task_timezone)
    ahead_index, ahead_local = chunk_of(ahead, scale, zone)
    current_index, current_local = chunk_of(current, scale, zone)
    lag = ahead_index - current_index
    allowed = trigger.max_delay or 0
    return TriggerResult(
        trigger,
        lag <= allowed,
        used,
        lambda: _chunk_lag_text(
            _label(trigger, task_timezone),
            f"current {current} is in chunk {scale.label_of(current_local)}, "
            f"{name} {ahead} in chunk {scale.label_of(ahead_local)}",
            lag,
            allowed,
        ),
        brief=lambda: (
            f"{_label(trigger, task_timezone)} waits on {display_key(trigger.key)} = {current} (chunk "
            f"{scale.label_of(current_local)}), {_chunks(lag)} behind {behind} chunk {scale.label_of(ahead_local)}, "
            f"allowed {allowed}"
        ),
    )


def _chunk_lag_text(label: str, shown: str, lag: int, allowed: int) -> str:
    if lag <= allowed:
        return f"{label} fires: {shown}: {_chunks(lag)} behind <= {allowed}"
    return f"{label} waits: {shown}: {_chunks(lag)} behind > {allowed} (over by {_chunks(lag - allowed)})"


def _settle(trigger: Settle, inputs: _Inputs) -> TriggerResult:
    current = _current(trigger, inputs)
    if isinstance(current, TriggerResult):
        return current
    key, task_timezone, now = trigger.key, inputs.timezone, inputs.now
    changed = inputs.changed_of(key)
    label = _label(trigger, task_timezone)
    if changed is None:
        return TriggerResult(
            trigger,
            False,
            {key: current},
            lambda: f"{label} waits: the time {display_key(key)} last changed is unknown (not given to evaluate)",
            brief=lambda: f"{label} waits on {display_key(key)} = {current}: the time of its last change is unknown",
        )
    quiet_for = inputs.now_utc - _utc(changed)
    settled = quiet_for >= trigger.quiet
    last = inputs.last_of(key)
    new = last is None or _utc(last) != _utc(current)
    fired = settled and new
    shown = (
        f"{display_key(key)} = {current} has not changed for {human_duration(quiet_for)} (since {changed}, now {now})"
    )
    if last is None:
        compared = "no last value (first run, or the parameter is new to the trigger)"
    elif new:
        compared = f"it differs from the last run's {last}"
    else:
        compared = "it is the value the last run saw: waiting for a new value"

    def render() -> str:
        if fired:
            return f"{label} fires: {shown} >= {human_duration(trigger.quiet)}, and {compared}"
        if not settled:
            to_go = human_duration(trigger.quiet - quiet_for)
            return f"{label} waits: {shown}, needs {human_duration(trigger.quiet)} ({to_go} to go); {compared}"
        return f"{label} waits: {shown} >= {human_duration(trigger.quiet)}, but {compared}"

    def brief() -> str:
        if not new:
            return f"{label} waits on {display_key(key)} = {current}, the value the last run saw"
        return (
            f"{label} waits on {display_key(key)} = {current}, unchanged for {human_duration(quiet_for)}, "
            f"needs {human_duration(trigger.quiet)}"
        )

    wake_at = _utc(changed) + trigger.quiet if new and not settled else None
    return TriggerResult(trigger, fired, {key: current}, render, wake_at=wake_at, brief=brief)


def _aggregate(
    trigger: AggregateBase,
    inputs: _Inputs,
    fired_when: Callable[[int, int], bool],
    wake: Callable[[tuple[TriggerResult, ...]], datetime | None],
) -> TriggerResult:
    children = tuple([_evaluate(child, inputs) for child in trigger.triggers])
    used: dict[ParameterKey, datetime] = {}
    fired_count = 0
    for child in children:
        used.update(child.used)
        fired_count += child.fired
    fired = fired_when(fired_count, len(children))

    def render() -> str:
        verdict = "fires" if fired else "waits"
        header = f"{trigger.kind} {verdict}: {fired_count} of {len(children)} triggers fired"
        return "\n".join([header, *(f"  - {child.explanation}" for child in children)])

    return TriggerResult(trigger, fired, used, render, children, None if fired else wake(children))


def _all_wake_at(children: tuple[TriggerResult, ...]) -> datetime | None:
    """Every child must fire: the latest wake of the children that did not (None if one only a change fixes)."""
    wakes = [child.wake_at for child in children if not child.fired]
    return None if not wakes or None in wakes else max(wakes)  # type: ignore[type-var]


def _any_wake_at(children: tuple[TriggerResult, ...]) -> datetime | None:
    """One child firing is enough: the earliest wake of the children that did not fire."""
    wakes = [child.wake_at for child in children if not child.fired and child.wake_at is not None]
    return min(wakes) if wakes else None


def _all(trigger: All, inputs: _Inputs) -> TriggerResult:
    return _aggregate(trigger, inputs, lambda fired, total: fired == total, _all_wake_at)


def _any(trigger: Any, inputs: _Inputs) -> TriggerResult:
    return _aggregate(trigger, inputs, lambda fired, total: fired > 0, _any_wake_at)


_EVALUATORS: dict[type, Callable[[Trigger, _Inputs], TriggerResult]] = {
    Delta: _delta,
    Delay: _delay,
    RefDelay: _delay,
    ChunkDelta: _chunk_delta,
    ChunkDelay: _chunk_delay,
    ChunkRefDelay: _chunk_delay,
    Settle: _settle,
    All: _all,
    Any: _any,
}
