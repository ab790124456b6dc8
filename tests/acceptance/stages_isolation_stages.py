"""Stages run by `cmb-dagster stages worker` in the isolation tests (imported by the worker processes).

What ``process`` does depends on the entity's ``do``: nothing special marks it done; ``nul`` / ``surrogate``
return an update Postgres cannot store; ``raise`` raises with NUL and a lone surrogate in the message;
``hold`` runs until the file named by ``CMB_TEST_HOLD`` is gone; ``crash`` kills its own process.
"""

import os
import signal
import time
from pathlib import Path

from pydantic import BaseModel

from cmb_dagster.models import Backoff
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult


class Mark(Stage):
    name = "mark"

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        do = entity.payload.get("do")
        if do == "nul":
            return StageResult(update=MergePatch({"x": "a\x00b"}))
        if do == "surrogate":
            return StageResult(update=MergePatch({"x": "\udc80"}))
        if do == "raise":
            raise ValueError("bad \x00 byte and \udc80 half a character")
        if do == "hold":
            hold = Path(os.environ["CMB_TEST_HOLD"])
            deadline = time.monotonic() + 300
            while hold.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if do == "crash":
            os.kill(os.getpid(), signal.SIGKILL)  # as a segfaulting library or the OOM killer would
        return StageResult(update=MergePatch({"done": True}))


poison = StageOptions(
    stages=[Mark(max_attempts=2, backoff=Backoff(first=0.1))],
    shard_count=4,
    batch_size=200,
    lease_ttl=2.0,
    idle_sleep=0.2,
)
slow = StageOptions(stages=[Mark(timeout=60.0)], shard_count=4, batch_size=200, lease_ttl=2.0, idle_sleep=0.2)
crash = StageOptions(stages=[Mark(max_crashes=3)], shard_count=4, batch_size=100, lease_ttl=1.0, idle_sleep=0.2)
