"""Why a reactive task fired or waits: the facts a tick stores of a trigger's evaluation, and their text, rendered
when read (the status CLI, a run's launch entry, the tick log), not when evaluated.

The facts are what the evaluation read, as stored (JSON): the trigger's hash, the evaluation time and, for each
parameter the trigger reads, ``[entity, parameter, current, last-seen]`` (ISO 8601 or null; a Settle parameter adds
when its value was set), and the task's note. Evaluating the trigger again on them gives the same verdict and the same
text.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.triggers import Trigger, evaluate, trigger_from_dict

ALREADY_SEEN = "\nbut its last successful run already saw exactly these values: waiting for a change"
"""Said of a trigger that fires on the values its task's last successful run saw (the task waits for a change)."""


class Explanation:
    """Why a task fired or waits: ``text`` (the whole explanation, or the lines before the trigger's part when there
    are ``facts``), then the text of the trigger's evaluation rendered from its facts; ``str()`` renders it, once.

    ``trigger`` and ``timezone`` are the task's; None when the facts are of another definition of the trigger.
    """

    __slots__ = ("_rendered", "facts", "text", "timezone", "trigger")

    def __init__(
        self,
        text: str,
        facts: Mapping[str, Any] | None = None,
        trigger: Trigger | None = None,
        timezone: str = "UTC",
    ) -> None:
        self.text = text
        self.facts = facts
        self.trigger = trigger
        self.timezone = timezone
        self._rendered: str | None = text if facts is None else None

    @classmethod
    def stored(
        cls,
        text: str | None,
        facts: Mapping[str, Any] | None,
        trigger: Trigger | None,
        trigger_hash: str | None,
        timezone: str,
    ) -> Explanation:
        """An explanation as a task or launch stores it, for the task's ``trigger`` (of hash ``trigger_hash``)."""
        same = facts is not None and facts.get("trigger") == trigger_hash
        return cls(text or "", facts, trigger if same else None, timezone)

    def prefixed(self, text: str) -> Explanation:
        """This explanation after ``text``."""
        return Explanation(text + self.text, self.facts, self.trigger, self.timezone)

    def __str__(self) -> str:
        if self._rendered is None:
            self._rendered = self.text + render(self.facts or {}, self.trigger, self.timezone)
        return self._rendered

    def __repr__(self) -> str:
        return f"Explanation({str(self)!r})"


def stored_trigger(data: Mapping[str, Any] | None) -> Trigger | None:
    """A task's trigger as stored (None: none, or one this version of the package cannot read)."""
    if data is None:
        return None
    try:
        return trigger_from_dict(data)
    except ValueError:
        return None


def stored_facts(trigger_hash: str, at: str, values: list[list[str | None]], note: str | None = None) -> dict[str, Any]:
    """The stored facts of an evaluation at ``at`` (ISO 8601) of the trigger of hash ``trigger_hash``: ``values``,
    ``[entity, parameter, current, last]`` (and when it was set) for each parameter it read, and the task's note."""
    found: dict[str, Any] = {"trigger": trigger_hash, "at": at, "values": values}
    if note:
        found["note"] = note
    return found


def _column(facts: Mapping[str, Any], index: int) -> dict[ParameterKey, datetime]:
    """Column ``index`` of the facts' values (2: current, 3: last-seen, 4: set at), where there is one."""
    return {
        (row[0], row[1]): datetime.fromisoformat(row[index])
        for row in facts.get("values", ())
        if len(row) > index and row[index] is not None
    }


def render(facts: Mapping[str, Any], trigger: Trigger | None, timezone: str) -> str:
    """The text of the evaluation ``facts`` describe, as the tick that stored them would have written it."""
    current = _column(facts, 2)
    if trigger is None:
        values = ", ".join(f"{e}/{p} = {v}" for (e, p), v in sorted(current.items())) or "no values"
        return (
            f"evaluated at {facts.get('at')} on {values} with a definition of its trigger that has been replaced "
            "since: the explanation is no longer rendered"
        )
    last = _column(facts, 3)
    result = evaluate(
        trigger,
        now=datetime.fromisoformat(facts["at"]),
        current=current,
        last=last,
        timezone=timezone,
        changed=_column(facts, 4),
    )
    text = result.explanation
    if facts.get("note"):
        text += f"\nnote: {facts['note']}"
    if result.fired and not any(last.get(key) != value for key, value in result.used.items()):
        text += ALREADY_SEEN
    return text
