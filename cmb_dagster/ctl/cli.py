"""``cmb-dagster ctl ...`` (read and write CTL values) and ``cmb-dagster reactive ...`` (task state)."""

from __future__ import annotations

import json
from datetime import datetime

import click

from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.ctl.scheduler import forget_last_values, task_states
from cmb_dagster.ctl.store import CtlStore, default_actor
from cmb_dagster.database import Database
from cmb_dagster.settings import Settings


def _database() -> Database:
    return Database.from_settings(Settings.from_env())


def _moment(value: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidCtlInput(f"value {value!r} is not an ISO datetime such as 2024-05-01T00:00:00+00:00") from None
    if moment.utcoffset() is None:
        raise InvalidCtlInput(f"value {value!r} has no time zone; add one, e.g. {value}+00:00")
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
    change = CtlStore(_database(), actor=f"cli {default_actor()}").set(entity, parameter, _moment(value), by=by)
    if change is None:
        click.echo(f"{entity}/{parameter} is already {value}")
    else:
        flag = "  (BACKWARDS: tasks with Delta triggers on it stop firing until it passes their last value)"
        click.echo(f"{entity}/{parameter}: {change.old_value} -> {change.new_value}{flag if change.backwards else ''}")


@ctl.command("get")
@click.argument("entity", required=False)
def get_values(entity: str | None) -> None:
    """Show current values (of one ENTITY)."""
    for row in CtlStore(_database()).values(entity):
        click.echo(f"{row['entity']}/{row['parameter']} = {row['value'].isoformat()}  "
                   f"(v{row['version']}, {row['updated_at']:%Y-%m-%d %H:%M:%S} by {row['updated_by']})")


@ctl.command()
@click.argument("entity", required=False)
@click.argument("parameter", required=False)
@click.option("--limit", default=20, show_default=True)
@click.option("--backwards", is_flag=True, help="Only changes that moved a value backwards.")
def history(entity: str | None, parameter: str | None, limit: int, backwards: bool) -> None:
    """Recorded changes, newest first."""
    for c in CtlStore(_database()).history(entity, parameter, limit=limit, backwards_only=backwards):
        flag = "  BACKWARDS" if c.backwards else ""
        click.echo(f"#{c.id} {c.changed_at:%Y-%m-%d %H:%M:%S} {c.entity}/{c.parameter}: "
                   f"{c.old_value} -> {c.new_value} by {c.changed_by}{flag}")


@click.group()
def reactive() -> None:
    """Reactive tasks: their trigger state, and manual fixes."""


@reactive.command()
@click.argument("scheduler", required=False)
@click.argument("task", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the stored state as JSON.")
def status(scheduler: str | None, task: str | None, as_json: bool) -> None:
    """Show each task's status, last-seen values, run in flight and why its trigger fired or waits."""
    states = task_states(_database(), scheduler, task)
    if as_json:
        click.echo(json.dumps([s.model_dump(mode="json") for s in states], indent=2))
        return
    if not states:
        click.echo("no reactive task found")
    for s in states:
        gone = "" if s.defined else "  (no longer defined)"
        click.echo(f"{s.scheduler}/{s.name}: {s.status}{' (to evaluate)' if s.dirty else ''}, priority {s.priority}{gone}")
        if s.run_key:
            click.echo(f"  run: {s.run_key} {s.run_id or ''} launched {s.launched_at}")
        if s.attempts:
            click.echo(f"  failed {s.attempts} time(s) in a row; retry after {s.backoff_until}")
        click.echo(f"  last-seen values: {json.dumps(s.last_values) if s.last_values else 'none (first run)'}")
        if s.explanation:
            click.echo(f"  evaluated {s.evaluated_at}:")
            for line in s.explanation.splitlines():
                click.echo(f"    {line}")
        if s.backwards_note:
            click.echo(f"  note: {s.backwards_note}")


@reactive.command()
@click.argument("scheduler")
@click.argument("task")
@click.option("--parameter", nargs=2, default=None, metavar="ENTITY PARAMETER", help="Forget only this parameter.")
def forget(scheduler: str, task: str, parameter: tuple[str, str] | None) -> None:
    """Forget a task's last-seen values (after a CTL value moved backwards); it is evaluated again."""
    if not forget_last_values(_database(), scheduler, task, parameter or None):
        raise click.ClickException(f"no reactive task {task!r} in scheduler {scheduler!r}")
    click.echo(f"{scheduler}/{task}: last-seen values forgotten; the next tick evaluates it as on a first release")
