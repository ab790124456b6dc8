"""Stages run by `cmb-dagster stages worker` in the kill -9 test (imported by the worker processes)."""

import random
import time
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel

from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult


class Seen(BaseModel):
    runs: int = 0
    last_version: int = 0


class Step(Stage):
    state_model = Seen

    def __init__(self, name: str, source: str, target: str) -> None:
        super().__init__()
        self.name = name  # type: ignore[misc]
        self.source, self.target = source, target

    def should_process(self, entity: Entity, state: Seen) -> bool:
        return self.source in entity.payload and self.target not in entity.payload

    def process(self, entity: Entity, state: Seen) -> StageResult:
        time.sleep(random.random() * 0.004)  # so that kills land inside process()
        if self.source not in entity.payload or self.target in entity.payload:
            return StageResult()
        return StageResult(
            update=MergePatch({self.target: entity.payload[self.source] + 1}),
            new_state=Seen(runs=state.runs + 1, last_version=entity.version),
        )


class Expire(Stage):
    """Sets a timer 1 s after it first sees ``d``; marks the entity expired when it fires (never early)."""

    name = "expire"
    state_model = Seen
    fields = ("d",)

    def should_process(self, entity: Entity, state: Seen) -> bool:
        return "d" in entity.payload and "expired_late_ms" not in entity.payload

    def process(self, entity: Entity, state: Seen) -> StageResult:
        now = datetime.now(UTC)
        due = entity.payload.get("due")
        if due is None:
            due_at = now + timedelta(seconds=1)
            return StageResult(update=MergePatch({"due": due_at.timestamp()}), timer=due_at)
        if now.timestamp() < due:
            return StageResult(update=MergePatch({"early": True}))  # must never happen
        return StageResult(
            update=MergePatch({"expired_late_ms": round((now.timestamp() - due) * 1000)}),
            new_state=Seen(runs=state.runs + 1, last_version=entity.version),
        )


options = StageOptions(
    stages=[Step("first", "a", "b"), Step("second", "b", "c"), Step("third", "c", "d"), Expire()],
    shard_count=4,
    batch_size=25,
    lease_ttl=2.0,
    idle_sleep=0.2,
)
