"""What the steps of one reactive tick share (:class:`Tick`, passed from step to step), and what the scheduler
knows of its tables from one tick to the next (:class:`Known`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from cmb_dagster.reactive.models import SchedulerSettings, TickReport
from cmb_dagster.workers import Lease, Leases


@dataclass
class Tick:
    """One tick being run: its scheduler, evaluation time, lease and settings, the report of what it did, and the
    tasks its steps mark for evaluation and leave marked.

    ``leases`` renews its lease while user code runs; ``started``: ``time.monotonic()`` when it started.
    """

    scheduler: str
    now: datetime
    lease: Lease
    leases: Leases
    settings: SchedulerSettings
    report: TickReport
    started: float
    marked: set[str] = field(default_factory=set)  # tasks marked for evaluation
    single: set[str] = field(default_factory=set)  # those of them with a mark of their own (the others are in batches)
    batches: set[int] = field(default_factory=set)  # the batches of marks it evaluates
    left: set[str] = field(default_factory=set)  # tasks it leaves marked (not evaluated, or evaluated again)
    user_code_until: float | None = None  # after it the tick starts no user code (None: none started)
    renew_at: float = 0.0  # when its lease is renewed while user code runs

    def __post_init__(self) -> None:
        self.renew_at = time.monotonic() + self.leases.ttl / 3

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` when the tick's time box ends."""
        return self.started + self.settings.tick_seconds

    @property
    def params(self) -> dict[str, Any]:
        """The parameters every statement of the tick takes."""
        return {"scheduler": self.scheduler, "now": self.now}

    def backoff(self, failures_before: int) -> timedelta:
        """How long a task waits after a failure that ``failures_before`` failures in a row preceded."""
        return timedelta(seconds=self.settings.backoff.delay(failures_before))

    def keep_lease(self) -> None:
        """Renew the tick's lease while user code runs (a slow call must not cost the scheduler its lease)."""
        if time.monotonic() >= self.renew_at:
            self.leases.acquire([self.scheduler])
            self.renew_at = time.monotonic() + self.leases.ttl / 3


@dataclass
class Known:
    """What the scheduler's tables hold beyond what a tick reads anew, as the tick of ``token`` left them: valid
    while no other tick ran (the next tick finds that token stored) and no other process held the scheduler's lease
    (its ``fence`` is this one's, or the next). ``marked``: tasks left marked for evaluation (besides marks by
    hand); ``in_flight``: tasks with a run in flight; ``ready``: whether tasks may be stored as ready."""

    token: str
    fence: int
    marked: set[str]
    in_flight: int
    ready: bool

    def valid_for(self, lease: Lease, token: str | None) -> bool:
        return token == self.token and lease.fence in (self.fence, self.fence + 1)
