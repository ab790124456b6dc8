"""Static facts about triggers: which parameters they read, whether they read the last run's state, and advice."""

from __future__ import annotations

from cmb_dagster.triggers.models import (
    AggregateBase,
    All,
    ChunkRefDelay,
    CtlTriggerBase,
    ParameterKey,
    RefDelay,
    Trigger,
)


def _ctl_triggers(trigger: Trigger) -> tuple[CtlTriggerBase, ...]:
    return trigger.triggers if isinstance(trigger, AggregateBase) else (trigger,)


def parameters(trigger: Trigger) -> set[ParameterKey]:
    """Every ``(entity, parameter)`` the trigger reads, references included.

    >>> sorted(parameters(RefDelay("mart", "loaded_until", "sales", "loaded_until", "1h")))
    [('mart', 'loaded_until'), ('sales', 'loaded_until')]
    """
    keys: set[ParameterKey] = set()
    for ctl in _ctl_triggers(trigger):
        keys.add(ctl.key)
        if isinstance(ctl, RefDelay | ChunkRefDelay):
            keys.add(ctl.ref_key)
    return keys


def uses_last(trigger: Trigger) -> bool:
    """Whether the trigger reads the values seen by the task's last run (contains a Delta, ChunkDelta or Settle)."""
    return any(ctl.reads_last for ctl in _ctl_triggers(trigger))


def check(trigger: Trigger) -> list[str]:
    """Advice on triggers that can fire without new data beyond what the last run saw.

    Every way the trigger can fire should involve a Delta-type trigger (Delta, ChunkDelta, or Settle, which fires
    only on a value other than the last run's):
    a single CTL trigger must be one, ``All`` needs at least one, ``Any`` needs all children to be.
    Otherwise the task runs again after each run as soon as any value it reads changes while the
    condition holds (the engine never reruns it on exactly the values its last run saw).
    """
    again = (
        "it does not compare with the last run's values, so the task runs again whenever any value it reads "
        "changes while the condition holds, not once per increment of new data"
    )
    if isinstance(trigger, CtlTriggerBase):
        if trigger.reads_last:
            return []
        return [f"{trigger!r}: {again}; use Delta, ChunkDelta or Settle, or combine it with one in All(...)"]
    if isinstance(trigger, All):
        if uses_last(trigger):
            return []
        return [f"{trigger!r}: none of its triggers is Delta-type: {again}; add a Delta, ChunkDelta or Settle"]
    return [
        f"{trigger!r}: child {child!r} is not Delta-type and can fire alone: {again}; "
        "make every child of Any a Delta, ChunkDelta or Settle"
        for child in trigger.triggers
        if not child.reads_last
    ]
