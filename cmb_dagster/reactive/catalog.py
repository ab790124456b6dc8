"""The reactive tasks one scheduler's code defines, as its tick looks them up."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.reactive.explanations import Explanation
from cmb_dagster.reactive.models import LOWEST_PRIORITY, TaskSpec
from cmb_dagster.triggers import Settle, parameters


@dataclass(frozen=True)
class TaskCatalog:
    """The tasks by name; the CTL parameters each reads (``reads``) and those whose change time counts for its
    Settle conditions (``settles``); the tasks reading each parameter (``index``) and those each entity (asset key)
    is upstream of (``downstream``); the hash of the definitions as stored."""

    tasks: Mapping[str, TaskSpec]
    reads: Mapping[str, tuple[ParameterKey, ...]]
    settles: Mapping[str, tuple[ParameterKey, ...]]
    trigger_hashes: Mapping[str, str]
    index: Mapping[ParameterKey, list[str]]
    downstream: Mapping[str, list[str]]
    definitions_hash: str

    @classmethod
    def of(cls, tasks: Sequence[TaskSpec]) -> TaskCatalog:
        reads = {task.name: tuple(sorted(parameters(task.trigger))) for task in tasks}
        index: dict[ParameterKey, list[str]] = {}
        downstream: dict[str, list[str]] = {}
        for task in tasks:
            for key in reads[task.name]:
                index.setdefault(key, []).append(task.name)
            for entity in sorted(set(task.upstream)):
                downstream.setdefault(entity, []).append(task.name)
        definitions = sorted((t.name, t.trigger_hash, t.priority, t.produces, t.deadline_json) for t in tasks)
        return cls(
            tasks={task.name: task for task in tasks},
            reads=reads,
            settles={task.name: _settle_keys(task.trigger) for task in tasks},
            trigger_hashes={task.name: task.trigger_hash for task in tasks},
            index=index,
            downstream=downstream,
            definitions_hash=hashlib.sha256(json.dumps(definitions).encode()).hexdigest()[:16],
        )

    def rank(self, name: str) -> tuple[int, str]:
        """Highest priority first (a task this code does not define: last)."""
        spec = self.tasks.get(name)
        return -(spec.priority if spec is not None else LOWEST_PRIORITY), name

    def explained(self, name: str, text: str | None, facts: Mapping[str, Any] | None) -> Explanation:
        """A task's explanation as stored (``text`` and ``facts``), rendered with its trigger when read."""
        spec = self.tasks.get(name)
        if spec is None:
            return Explanation.stored(text, facts, None, None, "UTC")
        return Explanation.stored(text, facts, spec.trigger, self.trigger_hashes[name], spec.timezone)


def _settle_keys(trigger: Any) -> tuple[ParameterKey, ...]:
    """The parameters a trigger's Settle conditions watch (their change times are part of its evaluation)."""
    children = getattr(trigger, "triggers", (trigger,))
    return tuple(sorted({child.key for child in children if isinstance(child, Settle)}))
