"""Operator functions of the callbacks engine: what is pending, late, failed."""

from __future__ import annotations

from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.models import CallbackCounts
from cmb_dagster.database import Database, DatabaseSource


def callback_counts(database: DatabaseSource) -> CallbackCounts:
    """Events per status, overdue pending events and the age of the oldest one (one scan of the events)."""
    with Database.of(database).connection() as conn:
        cursor = conn.execute(sql.STATUS_COUNTS)
        columns = [c.name for c in cursor.description or ()]
        return CallbackCounts(**dict(zip(columns, cursor.fetchone(), strict=True)))
