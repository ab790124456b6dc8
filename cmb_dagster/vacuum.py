"""What keeps vacuum from cleaning the engines' tables: the oldest snapshot the server holds, who holds it, and the
share of dead rows in each table of the cmb schema.

Every engine's tables churn (rows claimed, called, deleted). A session in a long transaction, a prepared
transaction or a replication slot holding an old snapshot keeps every row deleted after it from being removed; the
checks of :class:`DatabaseChecks` turn red while that lasts, naming the holder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field

from cmb_dagster import sql
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.health import Checks, Threshold, Verdict
from cmb_dagster.models import Options

MIN_DEAD_ROWS = 10_000
"""Dead rows below which a table's dead share is not counted (a small queue table is often mostly dead rows between
two vacuums)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """The oldest snapshot held in the database: a ``session`` (pid), a ``prepared transaction`` (gid in ``name``)
    or a ``replication slot`` (slot name). ``state``, ``user`` and ``age_seconds`` are None where the server does
    not keep them or the role may not see them (another user's session without ``pg_read_all_stats``)."""

    kind: str
    pid: int | None
    name: str
    state: str | None
    user: str | None
    age_seconds: float | None
    age_xids: int

    def __str__(self) -> str:
        who = f"{self.kind} {self.pid}" if self.kind == "session" else f"{self.kind} {self.name!r}"
        details = [
            f"application {self.name!r}" if self.kind == "session" and self.name else "",
            f"user {self.user}" if self.user else "",
            f"state {self.state}" if self.state else "",
            f"{self.age_seconds:.0f} s old" if self.age_seconds is not None else "",
            f"{self.age_xids} transactions behind",
        ]
        return f"{who} ({', '.join(d for d in details if d)})"


@dataclass(frozen=True, slots=True)
class TableRows:
    """A table of the cmb schema: live and dead rows as the statistics last counted them."""

    table: str
    live: int
    dead: int

    @property
    def dead_share(self) -> float:
        """Dead rows over all rows (0 for an empty table)."""
        total = self.live + self.dead
        return self.dead / total if total else 0.0


@dataclass(frozen=True, slots=True)
class VacuumStatus:
    """The oldest holder of a snapshot (None: nothing holds one) and the rows of each table of the cmb schema."""

    holder: Holder | None
    tables: tuple[TableRows, ...]

    @property
    def horizon_seconds(self) -> float:
        """Seconds the oldest holder has held its snapshot (0 when nothing does or its age is unknown)."""
        return (self.holder.age_seconds or 0.0) if self.holder else 0.0

    @property
    def most_dead(self) -> TableRows | None:
        """The table with the largest dead share among those with at least :data:`MIN_DEAD_ROWS` dead rows."""
        counted = [t for t in self.tables if t.dead >= MIN_DEAD_ROWS]
        return max(counted, key=lambda t: t.dead_share, default=None)


def status(database: DatabaseSource) -> VacuumStatus:
    """The vacuum horizon and the tables' rows, read now."""
    db = Database.of(database)
    with db.connection() as conn:
        found = conn.execute(sql.VACUUM_HOLDER).fetchone()
        tables = tuple(TableRows(*row) for row in conn.execute(sql.TABLE_ROWS, {"schema": db.schema}))
    return VacuumStatus(Holder(*found) if found else None, tables)


class DatabaseChecks(Checks):
    """Limits of the checks of the database the engines share."""

    vacuum_horizon_seconds: Threshold = Field(
        default=Threshold(warn_at=300, error_at=1800),
        description="Seconds the oldest snapshot in the database has been held: rows deleted since cannot be removed.",
    )
    dead_rows_share: Threshold = Field(
        default=Threshold(warn_at=0.8),
        description=f"Dead share of the cmb table with the most (tables with {MIN_DEAD_ROWS:,} dead rows or more).",
    )

    def verdicts(self, asset: Sequence[str], found: VacuumStatus) -> list[Verdict]:
        """The checks of ``found``."""
        holder = f"held by {found.holder}" if found.holder else "no snapshot held"
        table = found.most_dead
        dead = (
            f"{table.table} is {table.dead_share:.0%} dead rows ({table.dead:,} dead, {table.live:,} live)"
            if table
            else f"no cmb table has {MIN_DEAD_ROWS:,} dead rows"
        )
        return self.judge(
            asset,
            {
                "vacuum_horizon_seconds": (found.horizon_seconds, f"the oldest snapshot is {holder}"),
                "dead_rows_share": (table.dead_share if table else 0.0, dead),
            },
        )


class DatabaseOptions(Options):
    """What ``cmb_definitions`` adds for the database the engines share: an observable asset whose checks say
    whether vacuum can clean the engines' tables."""

    observe_interval_seconds: int = Field(
        default=60, ge=5, le=86400, description="How often the status sensor reads the vacuum horizon."
    )
    checks: DatabaseChecks = Field(default_factory=DatabaseChecks, description="Limits of the asset checks.")
