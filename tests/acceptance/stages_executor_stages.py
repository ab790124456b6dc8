"""Stages run by `cmb-dagster stages worker` in the executor tests (imported by the worker processes).

Every call records its start and end (server clock) in ``public.stage_calls`` over a connection of its own (one per
call: it works in a forked child too). What ``process`` does depends on the entity's ``do``: ``sleep`` sleeps
``seconds`` (only on the entity's first call of that stage with ``first_only``), ``exit`` calls ``sys.exit(3)``,
``spin`` holds the GIL in a regular expression that never ends; ``napping`` (async) awaits ``seconds``. A stage
is asked about an entity until it has run on it once.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time

import psycopg
from pydantic import BaseModel

from cmb_dagster.models import Backoff
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult

CALLS = """
CREATE TABLE IF NOT EXISTS public.stage_calls (
    id         bigserial PRIMARY KEY,
    stage      text        NOT NULL,
    entity_id  text        NOT NULL,
    pid        integer     NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at   timestamptz,
    how        text
)
"""


class Call:
    """One recorded call: started when made, ended by :meth:`end`."""

    def __init__(self, stage: str, entity: Entity) -> None:
        self.conn = psycopg.connect(os.environ["CMB_DATABASE_URL"], autocommit=True)
        self.earlier = self.conn.execute(
            "SELECT count(*) FROM public.stage_calls WHERE stage = %s AND entity_id = %s", (stage, entity.id)
        ).fetchone()[0]
        self.id = self.conn.execute(
            "INSERT INTO public.stage_calls (stage, entity_id, pid, started_at) VALUES (%s, %s, %s, clock_timestamp())"
            " RETURNING id",
            (stage, entity.id, os.getpid()),
        ).fetchone()[0]

    def end(self, how: str = "returned") -> None:
        self.conn.execute(
            "UPDATE public.stage_calls SET ended_at = clock_timestamp(), how = %s WHERE id = %s", (how, self.id)
        )
        self.conn.close()


class Recorded(Stage):
    def __init__(self, name: str, **kw: object) -> None:
        super().__init__(**kw)
        self.name = name  # type: ignore[misc]

    def should_process(self, entity: Entity, state: BaseModel) -> bool:
        return self.name not in entity.payload

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        call = Call(self.name, entity)
        do = entity.payload.get("do")
        if do == "sleep" and not (entity.payload.get("first_only") and call.earlier):
            time.sleep(entity.payload["seconds"])
        elif do == "exit":
            sys.exit(3)
        elif do == "spin":
            re.match(r"(a+)+$", "a" * 64 + "b")  # exponential backtracking inside the re module: the GIL is held
        call.end()
        return StageResult(update=MergePatch({self.name: call.earlier + 1}))


class Napping(Stage):
    name = "napping"

    async def process(self, entity: Entity, state: BaseModel) -> StageResult:
        call = await asyncio.to_thread(Call, self.name, entity)  # off the event loop: the other calls go on
        try:
            await asyncio.sleep(entity.payload.get("seconds", 0.0))
        except asyncio.CancelledError:
            call.end("cancelled")
            raise
        await asyncio.to_thread(call.end)
        return StageResult(update=MergePatch({self.name: True}))


def _options(stages: list[Stage], **kw: object) -> StageOptions:
    return StageOptions(stages=stages, shard_count=2, lease_ttl=2.0, idle_sleep=0.2, **kw)


concurrent = _options([Recorded("slow")], worker_concurrency=4)
# a first call past its timeout, retried at once; another stage due on the same entity
held = _options([Recorded("a_slow", timeout=0.5, backoff=Backoff(first=0.0)), Recorded("b_fast")])
exits = _options([Recorded("exits", max_attempts=1)])
spins = _options([Recorded("spins", timeout=1.0, max_attempts=1)], isolation="process")
naps = _options([Napping(timeout=2.0, max_attempts=1)])
