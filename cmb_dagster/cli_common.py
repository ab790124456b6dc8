"""What every command group shares: the database the environment names, and bounded number types (every
numeric option and argument is bounded, and NaN is refused)."""

from __future__ import annotations

import math
from typing import Any

import click

from cmb_dagster.database import Database
from cmb_dagster.flow import KeyUse


def open_database(schema: str | None = None) -> Database:
    """The database named by the environment (starting the embedded server if needed), one per process: its
    pool lives until the command exits and is closed then, never half-open by the garbage collector."""
    return Database.shared(schema=schema)


BIGINT_MAX = 2**63 - 1
DAY = 86_400.0


class FloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses NaN (which passes every comparison)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        result = super().convert(value, param, ctx)
        if isinstance(result, float) and math.isnan(result):
            self.fail(f"{value!r} is not a number.", param, ctx)
        return result


DURATION = FloatRange(0, 366 * DAY, min_open=True)  # seconds a worker or a time box runs
BRANCH = click.IntRange(-BIGINT_MAX - 1, BIGINT_MAX)  # a pub/sub branch id (bigint)
ROW_ID = click.IntRange(1, BIGINT_MAX)  # an id drawn from a sequence


def key_use(use: KeyUse) -> dict[str, Any]:
    """One key's use as JSON: key, tokens now, items in flight."""
    return {"key": use.key, "tokens": use.tokens, "in_flight": use.in_flight}


def echo_key_use(keys: list[KeyUse]) -> None:
    """Print each key's tokens now and items in flight under its limits."""
    if not keys:
        click.echo("  no key has used its limits yet")
        return
    click.echo(f"  {'key':30} {'tokens':>9} {'in flight':>9}")
    for k in keys:
        tokens = "-" if k.tokens is None else f"{k.tokens:.1f}"
        in_flight = f"{k.in_flight}/{k.concurrency}" if k.concurrency else "-"
        key = k.key or "''"
        click.echo(f"  {key:30} {tokens:>9} {in_flight:>9}")
