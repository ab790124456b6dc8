"""A reactive tick's reading of the CTL changes: those since the scheduler's watermark, read from the pub/sub
stream batch by batch, mark the tasks that use the changed parameters (the watermark commits with the marks)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from cmb_dagster import pubsub
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import CTL_BRANCH_ID
from cmb_dagster.database import Database
from cmb_dagster.isolation import sanitize
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.tick import Tick
from cmb_dagster.workers import Leases

log = logging.getLogger("cmb_dagster.reactive")


class ChangeReader:
    """The scheduler's consumer of the CTL change stream; ``index`` maps a parameter to the tasks that read it."""

    def __init__(self, database: Database, scheduler: str, index: Mapping[ParameterKey, Sequence[str]]) -> None:
        self.scheduler = scheduler
        self.index = index
        self._tick: Tick | None = None  # the tick reading changes, while it does (the stream calls the handler back)

        def mark_changed(conn: psycopg.Connection, events: list[pubsub.Event]) -> None:
            self._mark_changed(conn, events)  # a closure: not registered as an importable handler

        spec = pubsub.ConsumerSpec(consumer_id=f"reactive.{scheduler}", branch_id=CTL_BRANCH_ID, handler=mark_changed)
        self.consumer = pubsub.ConsumerWorker(database, spec)  # read batch by batch, within the tick

    def read(self, tick: Tick) -> None:
        """Read the changes, at least one batch (so every tick makes progress), until none is left or the tick's
        time box ends."""
        self._tick = tick
        try:
            while self.consumer.run_once():
                if time.monotonic() >= tick.deadline:
                    tick.report.complete = False
                    return
        finally:
            self._tick = None

    def close(self) -> None:
        """Close the connection kept between batches."""
        self.consumer.close()

    def _mark_changed(self, conn: psycopg.Connection, events: Sequence[pubsub.Event]) -> None:
        """Pub/sub handler, inside the consumer's transaction: mark the tasks that use changed parameters."""
        tick = self._tick
        assert tick is not None, "CTL changes are read inside a tick"
        Leases.check(conn, tick.lease)
        affected: set[str] = set()
        notes: dict[str, str] = {}
        changes = [change for event in events for change in _changes(event)]
        for payload in changes:
            key = (payload["entity"], payload["parameter"])
            names = self.index.get(key, ())
            affected.update(names)
            if payload.get("backwards") and names:
                note = sanitize(
                    f"{key[0]}/{key[1]} moved backwards from {payload.get('old')} to {payload.get('new')} "
                    f"(by {payload.get('by')}); Delta triggers on it wait until it passes the last-seen value "
                    f"(move the last-seen value back: cmb-dagster reactive set-last {self.scheduler} TASK "
                    f"--parameter {key[0]} {key[1]} --value VALUE, or forget it: cmb-dagster reactive forget "
                    f"{self.scheduler} TASK)"
                )
                notes.update(dict.fromkeys(names, note))
        params = {"scheduler": self.scheduler}
        if affected:
            tick.batches.add(conn.execute(sql.MARK_TASKS, {**params, "names": sorted(affected)}).fetchone()[0])
            tick.marked |= affected
        if notes:
            conn.execute(sql.NOTE_BACKWARDS, {**params, "names": list(notes), "notes": list(notes.values())})
        tick.report.changes += len(changes)


def _changes(event: pubsub.Event) -> list[dict[str, Any]]:
    """The CTL changes an event carries; those the CTL store would not have written (an event published by hand)
    are skipped with a warning."""
    changes = event.payload.get("changes") if isinstance(event.payload, dict) else None
    if not isinstance(changes, list):
        changes = [changes]
    valid = [
        c
        for c in changes
        if isinstance(c, dict) and isinstance(c.get("entity"), str) and isinstance(c.get("parameter"), str)
    ]
    if len(valid) < len(changes):
        log.warning(
            "CTL event %s: %d change(s) naming no entity and parameter skipped", event.id, len(changes) - len(valid)
        )
    return valid
