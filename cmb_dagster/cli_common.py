"""What every command group shares: the database the environment names, and bounded number types (every
numeric option and argument is bounded, and NaN is refused)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from cmb_dagster.database import Database
from cmb_dagster.liveness import DEFAULT_STALL_AFTER, MAX_STALL_AFTER, serving_liveness

if TYPE_CHECKING:
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


def liveness_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--health-port``, ``--health-host`` and ``--stall-after`` for a worker command: while it runs, its
    liveness is served on http://HOST:PORT/healthz (see :mod:`cmb_dagster.liveness`)."""

    @functools.wraps(command)
    def serving(*args: Any, health_port: int | None, health_host: str, stall_after: float, **kwargs: Any) -> Any:
        with serving_liveness(health_port, host=health_host, stall_after=stall_after):
            return command(*args, **kwargs)

    options = [
        click.option(
            "--health-port",
            type=click.IntRange(1, 65535),
            default=None,
            help="Serve GET /healthz on this port: 200 while the worker's loops turn, 503 once one stalled.",
        ),
        click.option(
            "--health-host",
            default="127.0.0.1",
            show_default=True,
            help="Address of the health endpoint (0.0.0.0 for a probe from outside the host, as Kubernetes does).",
        ),
        click.option(
            "--stall-after",
            type=FloatRange(1, MAX_STALL_AFTER),
            default=DEFAULT_STALL_AFTER,
            show_default=True,
            help="Seconds a loop may go without turning before the health endpoint answers 503.",
        ),
    ]
    for option in reversed(options):
        serving = option(serving)
    return serving
