"""``cmb-dagster events``: emit events, run a worker, manage pause/block rules, dead letters and replay."""

from __future__ import annotations

import json
import logging
from typing import Any

import click

from cmb_dagster.cli_common import (
    DAY,
    DURATION,
    ROW_ID,
    FloatRange,
    echo_key_use,
    key_use,
    liveness_options,
    open_database,
)
from cmb_dagster.eventqueue import admin
from cmb_dagster.eventqueue.errors import InvalidEventQueueInput
from cmb_dagster.eventqueue.handlers import scope
from cmb_dagster.eventqueue.models import (
    DEFAULT_MODIFIER,
    DEFAULT_MODULE,
    MAX_PRIORITY,
    EventQueueOptions,
    WorkerSettings,
)
from cmb_dagster.eventqueue.queue import emit as emit_event
from cmb_dagster.eventqueue.worker import EventWorker
from cmb_dagster.flow import describe_limits
from cmb_dagster.workers import stop_workers_on_signals

HANDLERS_HELP = "Handlers to serve: 'module:attribute' naming a HandlerRegistry (or a list of handlers)."


@click.group()
def events() -> None:
    """Handler event queue: events emitted to named handlers, with pause/block rules and dead letters."""


@events.command()
@click.option("--handlers", "handlers_ref", required=True, help=HANDLERS_HELP)
@click.option("--duration", type=DURATION, default=None, help="Seconds to run (default: until SIGTERM).")
@click.option("--batch-size", type=click.IntRange(1, 10_000), default=None, help="Events claimed per statement.")
@click.option(
    "--sweep-interval", type=FloatRange(0.01, 3600), default=None, help="Seconds between sweeps without notifications."
)
@click.option("--listen/--no-listen", default=True, show_default=True, help="Wake on LISTEN/NOTIFY hints.")
@click.option(
    "--worker-concurrency", type=click.IntRange(1, 1_000), default=None, help="Handler calls at once (default: 10)."
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1_000),
    deprecated="use --worker-concurrency instead",
    hidden=True,
)
@click.option(
    "--isolation",
    type=click.Choice(["thread", "process"]),
    default=None,
    help="process: each sync call in a child process, killed at its timeout (default: thread).",
)
@liveness_options
def worker(
    handlers_ref: str,
    duration: float | None,
    batch_size: int | None,
    sweep_interval: float | None,
    listen: bool,
    worker_concurrency: int | None,
    concurrency: int | None,
    isolation: str | None,
) -> None:
    """Run handlers as a long-running process (SIGTERM lets the calls running end, then exits)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {
        "batch_size": batch_size,
        "sweep_interval": sweep_interval,
        "listen": listen,
        "worker_concurrency": worker_concurrency or concurrency,
        "isolation": isolation,
    }
    settings = WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
    runner = EventWorker(open_database(), EventQueueOptions(handlers=handlers_ref, worker=settings))
    click.echo(f"events worker {runner.owner} serving {', '.join(runner.names)}", err=True)
    with stop_workers_on_signals():
        report = runner.run(duration)
    click.echo(f"handled {report.items} events in {report.seconds:.1f}s ({report.errors} errors)", err=True)


@events.command()
@click.option("--handlers", "handlers_ref", required=True, help=HANDLERS_HELP)
def register(handlers_ref: str) -> None:
    """Record handlers and their settings, so events can be emitted to them before a worker starts."""
    names = admin.register(open_database(), handlers_ref)
    click.echo(f"registered {', '.join(names)}")


@events.command()
@click.argument("namespace")
@click.argument("handler")
@click.argument("value")
@click.option("--module", default=DEFAULT_MODULE, show_default=True, help="Event space.")
@click.option("--modifier", default=DEFAULT_MODIFIER, show_default=True)
@click.option("--delay", type=FloatRange(0, 100 * 365.25 * DAY), default=None, help="Seconds before the event may run.")
@click.option(
    "--priority",
    type=click.IntRange(-MAX_PRIORITY, MAX_PRIORITY),
    default=0,
    show_default=True,
    help="Higher runs first among the events ready.",
)
def emit(
    namespace: str, handler: str, value: str, module: str, modifier: str, delay: float | None, priority: int
) -> None:
    """Emit VALUE (JSON) to HANDLER in NAMESPACE; prints the event id."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidEventQueueInput(f"value: not valid JSON ({exc.msg})") from None
    event_id = emit_event(
        namespace, handler, parsed, module=module, modifier=modifier, delay=delay, priority=priority, db=open_database()
    )
    click.echo(event_id)


@events.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per handler.")
def status(as_json: bool) -> None:
    """Per handler: queued, delayed, locked, held (paused/blocked), dead-lettered, oldest queued age, rules; then
    each limited handler's key path and limits, and each of its keys' tokens and events in flight."""
    now = admin.status(open_database())
    rows = now.handlers
    if not rows:
        click.echo("no handlers registered", err=as_json)  # with --json, stdout stays JSON lines (none)
        return
    keys = {r.handler: [k for k in now.keys if k.scope == scope(r.handler)] for r in rows}
    if as_json:
        for row in rows:
            click.echo(json.dumps({**row.model_dump(), "keys": [key_use(k) for k in keys[row.handler]]}))
        return
    click.echo(
        f"{'handler':24} {'queued':>7} {'delayed':>7} {'locked':>7} {'held':>7} {'dead':>7} {'oldest':>8}  rules"
    )
    for r in rows:
        click.echo(
            f"{r.handler:24} {r.queued:7} {r.delayed:7} {r.locked:7} {r.held:7} {r.dead:7} "
            f"{r.oldest_queued_seconds:7.1f}s  {', '.join(r.rules) or '-'}"
        )
    for r in rows:
        if r.key or r.rate_per_second or r.concurrency:
            click.echo(
                f"\n{r.handler}: key {r.key or '-'}, {describe_limits(r.rate_per_second, r.burst, r.concurrency)}"
            )
            echo_key_use(keys[r.handler])


@events.command(name="rules")
def list_rules() -> None:
    """Pause and block rules, with the events each holds."""
    rules = admin.rules(open_database())
    if not rules:
        click.echo("no rules")
    for r in rules:
        click.echo(
            f"{r.rule_type:6} {r.namespace}/{r.handler}/{r.event_space}  holds {r.held}  "
            f"since {r.created_at:%Y-%m-%d %H:%M:%S}"
        )


_DONE = {"pause": "paused", "unpause": "unpaused", "block": "blocked", "unblock": "unblocked"}


def _rule_command(name: str, doc: str) -> None:
    @events.command(name=name, help=doc)
    @click.argument("namespace")
    @click.argument("handler")
    @click.option("--event-space", default=DEFAULT_MODULE, show_default=True)
    def command(namespace: str, handler: str, event_space: str) -> None:
        result: Any = getattr(admin, name)(open_database(), namespace, handler, event_space)
        target = f"{namespace}/{handler}/{event_space}"
        if name in ("pause", "block"):
            click.echo(f"{_DONE[name]} {target}" if result else f"{target}: already {_DONE[name]}")
        else:
            click.echo(f"{_DONE[name]} {target}: {result} held events released")


_rule_command("pause", "Pause HANDLER in NAMESPACE (a user's rule): its events wait until unpause.")
_rule_command("unpause", "Lift a pause; the events it held run (unless also blocked).")
_rule_command("block", "Block HANDLER in NAMESPACE (an admin's rule): its events wait until unblock.")
_rule_command("unblock", "Lift a block; the events it held run (unless also paused).")


@events.command()
@click.option("--handler", default=None)
@click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True)
@click.option("--traceback", "with_traceback", is_flag=True, help="Print each traceback.")
def dead(handler: str | None, limit: int, with_traceback: bool) -> None:
    """Dead-lettered events with their last error."""
    letters = admin.dead_letters(open_database(), handler, limit)
    if not letters:
        click.echo("no dead-lettered events")
    for d in letters:
        click.echo(
            f"{d.id} {d.namespace}/{d.handler} retries={d.retries} died {d.died_at:%Y-%m-%d %H:%M:%S}: {d.error}"
        )
        if with_traceback:
            click.echo(d.traceback)


@events.command()
@click.argument("ids", nargs=-1, type=ROW_ID)
@click.option("--all", "replay_all", is_flag=True, help="Replay every dead-lettered event (of --handler).")
@click.option("--handler", default=None)
def replay(ids: tuple[int, ...], replay_all: bool, handler: str | None) -> None:
    """Put dead-lettered events back into the queue (by id, or --all)."""
    if bool(ids) == replay_all:
        raise click.UsageError("give event ids or --all")
    replayed = admin.replay(open_database(), None if replay_all else list(ids), handler=handler)
    click.echo(f"replayed {len(replayed)} events")
