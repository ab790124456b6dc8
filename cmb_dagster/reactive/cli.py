"""``cmb-dagster reactive ...``: reactive tasks' trigger state, and manual fixes."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click

from cmb_dagster.cli_common import open_database
from cmb_dagster.reactive import admin


@click.group()
def reactive() -> None:
    """Reactive tasks: their trigger state, and manual fixes."""


@reactive.command()
@click.argument("scheduler", required=False)
@click.argument("task", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the stored state as JSON.")
def status(scheduler: str | None, task: str | None, as_json: bool) -> None:
    """Show each task's status, last-seen values, run in flight, deadline and why its trigger fired or waits, and
    each scheduler's last tick."""
    database = open_database()
    found = admin.status(database, scheduler, task)
    states, now = found.tasks, datetime.now(UTC)
    if as_json:
        click.echo(json.dumps([s.model_dump(mode="json") for s in states], indent=2))
        return
    if not states:
        scope = f" of scheduler {scheduler!r}" if scheduler else ""
        click.echo(f"none (no reactive task{' ' + repr(task) if task else ''}{scope} found)")
    if task is None:
        for ticks in found.schedulers:
            took = f", took {ticks.tick_seconds:.2f} s" if ticks.tick_seconds is not None else ""
            click.echo(f"scheduler {ticks.name}: last tick {ticks.ticked_at or 'never'}{took}")
    for s in states:
        gone = "" if s.defined else "  (no longer defined)"
        dirty = " (to evaluate)" if s.dirty else ""
        click.echo(f"{s.scheduler}/{s.name}: {s.status}{dirty}, priority {s.priority}{gone}")
        deadline = s.deadline_state(now)
        if deadline is not None:
            click.echo(f"  deadline ({s.deadline_text()}): {'LATE, ' if deadline.late else ''}{deadline.text()}")
            if deadline.late:
                for line in admin.waits_on(database, s, now):
                    click.echo(f"    {line}")
        if s.run_key:
            click.echo(f"  run: {s.run_key} {s.run_id or ''} launched {s.launched_at}")
        if s.attempts:
            click.echo(f"  failed {s.attempts} time(s) in a row; retry after {s.backoff_until}")
        elif s.status == "backoff":
            click.echo(f"  backing off until {s.backoff_until}")
        click.echo(f"  last-seen values: {json.dumps(s.last_values) if s.last_values else 'none (first run)'}")
        if s.explanation:
            what = "waits for" if s.status == "waiting" else "evaluated"
            click.echo(f"  {what} ({s.evaluated_at}):")
            for line in s.explanation.splitlines():
                click.echo(f"    {line}")
        else:
            click.echo("  explanation: none (not evaluated yet)")
        if s.backwards_note:
            click.echo(f"  note: {s.backwards_note}")


@reactive.command()
@click.argument("scheduler")
@click.argument("task")
@click.option("--parameter", nargs=2, default=None, metavar="ENTITY PARAMETER", help="Forget only this parameter.")
def forget(scheduler: str, task: str, parameter: tuple[str, str] | None) -> None:
    """Forget a task's last-seen values (after a CTL value moved backwards); it is evaluated again."""
    if not admin.forget_last_values(open_database(), scheduler, task, parameter or None):
        raise click.ClickException(f"no reactive task {task!r} in scheduler {scheduler!r}")
    click.echo(f"{scheduler}/{task}: last-seen values forgotten; the next tick evaluates it as on a first release")


@reactive.command()
@click.argument("scheduler")
@click.argument("task")
def retry(scheduler: str, task: str) -> None:
    """Run a task again that is parked for the crashes of its user code (or backing off)."""
    if not admin.retry_task(open_database(), scheduler, task):
        raise click.ClickException(f"no reactive task {task!r} in scheduler {scheduler!r}")
    click.echo(f"{scheduler}/{task}: retried; the next tick evaluates it")


@reactive.command("set-last")
@click.argument("scheduler")
@click.argument("task")
@click.option("--parameter", nargs=2, required=True, metavar="ENTITY PARAMETER", help="The parameter to move.")
@click.option("--value", required=True, help="The value its last run saw, ISO 8601 with an offset (into the past too).")
def set_last(scheduler: str, task: str, parameter: tuple[str, str], value: str) -> None:
    """Move a task's last-seen value (after a CTL value moved backwards); it is evaluated again."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 date-time", param_hint="--value") from None
    if moment.utcoffset() is None:
        raise click.BadParameter(f"{value!r} has no UTC offset (e.g. +00:00)", param_hint="--value")
    last = admin.set_last_value(open_database(), scheduler, task, parameter, moment)
    if last is None:
        raise click.ClickException(f"no reactive task {task!r} in scheduler {scheduler!r}")
    click.echo(f"{scheduler}/{task}: last-seen values now {json.dumps(last)}; the next tick evaluates it again")
