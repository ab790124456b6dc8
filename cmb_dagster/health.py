"""Health checks of the engines: thresholds, the verdict of one check, and the check states kept in Postgres.

An engine turns its status model into verdicts (``judge``); the Dagster shell shows them as asset checks. Every
change of a check's severity is recorded once in ``check_transitions`` (by whichever process saw it first), which
is what alerts are sent from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from psycopg.types.json import Jsonb
from pydantic import Field, model_validator

from cmb_dagster import sql
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.models import Options

Severity = Literal["ok", "warn", "error"]

MAX_THRESHOLD = 1e12


class Threshold(Options):
    """A figure's limits: at or above ``warn_at`` the check warns, at or above ``error_at`` it fails (None: never)."""

    warn_at: float | None = Field(default=None, ge=0, le=MAX_THRESHOLD)
    error_at: float | None = Field(default=None, ge=0, le=MAX_THRESHOLD)

    @model_validator(mode="after")
    def _ordered(self) -> Threshold:
        if self.warn_at is not None and self.error_at is not None and self.warn_at > self.error_at:
            raise ValueError(f"warn_at ({self.warn_at:g}) must not be above error_at ({self.error_at:g})")
        return self

    def severity(self, value: float) -> Severity:
        """The severity of ``value`` against these limits."""
        if self.error_at is not None and value >= self.error_at:
            return "error"
        if self.warn_at is not None and value >= self.warn_at:
            return "warn"
        return "ok"

    def __str__(self) -> str:
        limits = [
            f"{name} at {limit:g}"
            for name, limit in (("warn", self.warn_at), ("error", self.error_at))
            if limit is not None
        ]
        return ", ".join(limits) or "no limits"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one check of one asset: its severity and a line saying what was measured against what.

    ``asset`` is the asset's path (``AssetKey.path``); ``value`` the figure compared, when there is one; ``scope``
    the code location's part of a check several locations evaluate on one asset (the reactive scheduler's name).
    """

    asset: tuple[str, ...]
    check: str
    severity: Severity
    text: str
    value: float | None = None
    threshold: Threshold | None = None
    scope: str = ""

    @property
    def passed(self) -> bool:
        return self.severity == "ok"


def check_label(check: str, scope: str) -> str:
    """A check's name as shown, with its code location's part when it has one."""
    return f"{check} ({scope})" if scope else check


def judge(asset: Sequence[str], check: str, value: float, threshold: Threshold, what: str) -> Verdict:
    """The verdict of ``value`` (described as ``what``, e.g. "12 events behind") against ``threshold``."""
    severity = threshold.severity(value)
    return Verdict(tuple(asset), check, severity, f"{what} ({threshold})", float(value), threshold)


@dataclass(frozen=True, slots=True)
class Transition:
    """A check whose severity changed: from ``previous`` to ``severity`` at ``at``; ``id`` orders transitions."""

    id: int
    asset: tuple[str, ...]
    check: str
    scope: str
    previous: Severity
    severity: Severity
    text: str
    at: datetime

    @classmethod
    def of(cls, row: Sequence[Any]) -> Transition:
        """The transition a ``check_transitions`` row holds (id, asset, check_name, scope, previous, severity, text,
        at, in that order)."""
        i, asset, check, scope, previous, severity, text, at = row[:8]
        return cls(i, tuple(asset), check, scope, previous, severity, text, at)


def record(database: DatabaseSource, verdicts: Sequence[Verdict]) -> list[Transition]:
    """Store the verdicts as the checks' states; return the transitions this call recorded (a check never seen
    before counts as having been ``ok``). Two processes recording the same change record it once."""
    verdicts = list({(v.asset, v.check, v.scope): v for v in verdicts}.values())  # one row per check: the last verdict
    if not verdicts:
        return []
    params = {
        "assets": [Jsonb(list(v.asset)) for v in verdicts],
        "checks": [v.check for v in verdicts],
        "scopes": [v.scope for v in verdicts],
        "severities": [v.severity for v in verdicts],
        "texts": [v.text for v in verdicts],
    }
    with Database.of(database).connection() as conn:
        rows = conn.execute(sql.RECORD_CHECK_STATES, params).fetchall()
    return [Transition.of(row) for row in rows]


def transitions(database: DatabaseSource, *, after: int = 0, limit: int = 100) -> list[Transition]:
    """Recorded transitions with an id above ``after``, oldest first."""
    with Database.of(database).connection() as conn:
        rows = conn.execute(sql.CHECK_TRANSITIONS, {"after": after, "limit": limit}).fetchall()
    return [Transition.of(row) for row in rows]


class Checks(Options):
    """An engine's check limits: a :class:`Threshold` field per check, named as the check, whose description says
    what it checks."""

    @classmethod
    def descriptions(cls) -> dict[str, str]:
        """Check name -> what it checks."""
        return {name: field.description or name for name, field in cls.model_fields.items()}

    def judge(self, asset: Sequence[str], figures: Mapping[str, tuple[float, str]]) -> list[Verdict]:
        """The verdicts of ``figures`` (check name -> (value, what it says)) against this engine's limits."""
        return [judge(asset, name, value, getattr(self, name), what) for name, (value, what) in figures.items()]


@dataclass(frozen=True, slots=True)
class CheckState:
    """A check's latest severity, since when it has it, and the line of the verdict that set it."""

    asset: tuple[str, ...]
    check: str
    scope: str
    severity: Severity
    text: str
    since: datetime


def states(database: DatabaseSource, *, failing: bool = False) -> list[CheckState]:
    """Every check's state (only those not ok with ``failing``), by asset and check."""
    with Database.of(database).connection() as conn:
        rows = conn.execute(sql.CHECK_STATES, {"failing": failing}).fetchall()
    return [CheckState(tuple(a), c, scope, s, t, at) for a, c, scope, s, t, at in rows]
