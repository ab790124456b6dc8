"""``cmb-dagster ctl ...``: read and write CTL values."""

from __future__ import annotations

from datetime import datetime

import click

from cmb_dagster.cli_common import open_database
from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.ctl.store import MAX_HISTORY, CtlStore, default_actor
from cmb_dagster.inputs import shorten


def _moment(value: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidCtlInput(
            f"value: {shorten(value)} is not an ISO datetime such as 2024-05-01T00:00:00+00:00"
        ) from None
    if moment.utcoffset() is None:
        raise InvalidCtlInput(f"value: {shorten(value)} has no time zone; add one, e.g. {value}+00:00")
    return moment


@click.group()
def ctl() -> None:
    """CTL values: (entity, parameter) -> timestamp, with the history of every change."""


@ctl.command("set")
@click.argument("entity")
@click.argument("parameter")
@click.argument("value")
@click.option("--by", default=None, help="Who makes the change (default: user@host).")
def set_value(entity: str, parameter: str, value: str, by: str | None) -> None:
    """Set ENTITY/PARAMETER to VALUE (an ISO datetime with a time zone)."""
    change = CtlStore(open_database(), actor=f"cli {default_actor()}").set(entity, parameter, _moment(value), by=by)
    if change is None:
        click.echo(f"{entity}/{parameter} is already {value}")
    else:
        flag = "  (BACKWARDS: tasks with Delta triggers on it stop firing until it passes their last value)"
        click.echo(f"{entity}/{parameter}: {change.old_value} -> {change.new_value}{flag if change.backwards else ''}")


@ctl.command("get")
@click.argument("entity", required=False)
def get_values(entity: str | None) -> None:
    """Show current values (of one ENTITY)."""
    rows = CtlStore(open_database()).values(entity)
    if not rows:
        click.echo("no values")
    for row in rows:
        click.echo(
            f"{row['entity']}/{row['parameter']} = {row['value'].isoformat()}  "
            f"(v{row['version']}, {row['updated_at']:%Y-%m-%d %H:%M:%S} by {row['updated_by']})"
        )


@ctl.command()
@click.argument("entity", required=False)
@click.argument("parameter", required=False)
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, MAX_HISTORY), help="Most changes shown.")
@click.option("--backwards", is_flag=True, help="Only changes that moved a value backwards.")
def history(entity: str | None, parameter: str | None, limit: int, backwards: bool) -> None:
    """Recorded changes, newest first."""
    changes = CtlStore(open_database()).history(entity, parameter, limit=limit, backwards_only=backwards)
    if not changes:
        click.echo("no changes")
    for c in changes:
        flag = "  BACKWARDS" if c.backwards else ""
        click.echo(
            f"#{c.id} {c.changed_at:%Y-%m-%d %H:%M:%S} {c.entity}/{c.parameter}: "
            f"{c.old_value} -> {c.new_value} by {c.changed_by}{flag}"
        )
