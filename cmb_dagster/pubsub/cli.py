"""``cmb-dagster pubsub``: run a consumer, show lag, rewind a consumer, backfill a table, trim delivered events,
re-base after a restore."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import click
import psycopg

from cmb_dagster.cli_common import BRANCH, DURATION, ROW_ID, FloatRange, liveness_options, open_database
from cmb_dagster.errors import DatabaseUnavailable
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES
from cmb_dagster.pubsub.admin import (
    backfills,
    dead_letters,
    drop_consumer,
    registered_handler,
    replay,
    reset,
    reset_consumer,
    status,
    trim,
)
from cmb_dagster.pubsub.backfill import backfill
from cmb_dagster.pubsub.errors import InvalidPubSubInput
from cmb_dagster.pubsub.filters import MAX_FILTER_LENGTH
from cmb_dagster.pubsub.models import MAX_TOPIC_LENGTH, MAX_TOPICS, BackfillProgress, ConsumerSpec
from cmb_dagster.pubsub.worker import ConsumerWorker
from cmb_dagster.workers import stop_workers_on_signals


@click.group()
def pubsub() -> None:
    """Pub/sub change stream: consumers, lag, retention, restore."""


@pubsub.command()
@click.argument("consumer_id")
@click.option("--branch", "branch_id", default=0, show_default=True, type=BRANCH, help="Branch the consumer reads.")
@click.option("--handler", default=None, help="'module:function' (default: the one the consumer registered).")
@click.option("--duration", type=DURATION, default=None, help="Seconds to run (default: until Ctrl-C or SIGTERM).")
@click.option(
    "--batch-size",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Most events per handler call.",
)
@click.option(
    "--lease-ttl",
    default=10.0,
    show_default=True,
    type=FloatRange(1, 3600),
    help="Seconds a standby waits after this one dies.",
)
@click.option(
    "--max-attempts",
    default=10,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Failed attempts on one event before --on-poison applies.",
)
@click.option(
    "--on-poison",
    type=click.Choice(["park", "stop"]),
    default="park",
    show_default=True,
    help="park: move the event to the dead letters and go on; stop: keep retrying it.",
)
@click.option(
    "--max-crashes",
    default=DEFAULT_MAX_CRASHES,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Deliveries of one event that may kill their worker before --on-poison applies.",
)
@click.option(
    "--handler-timeout",
    default=300.0,
    show_default=True,
    type=FloatRange(0.001, 86400),
    help="Seconds a handler call may run before it fails.",
)
@click.option(
    "--order",
    type=click.Choice(["snapshot", "txid"]),
    default="snapshot",
    show_default=True,
    help="txid: strict txid order, waiting for every older transaction to end.",
)
@click.option(
    "--start",
    type=click.Choice(["beginning", "now", "earliest_kept"]),
    default="beginning",
    show_default=True,
    help="Where a consumer seen for the first time starts.",
)
@click.option(
    "--topic",
    "topics",
    multiple=True,
    type=click.STRING,
    help=f"Deliver only events of this topic (repeatable, at most {MAX_TOPICS}).",
)
@click.option(
    "--where",
    default=None,
    help="Deliver only events this SQL/JSON path predicate is true for ($ is the payload; $topic, $op, $key), "
    f"e.g. '$.kind == \"refund\"' (at most {MAX_FILTER_LENGTH} characters).",
)
@liveness_options
def consume(
    consumer_id: str,
    branch_id: int,
    handler: str | None,
    duration: float | None,
    topics: tuple[str, ...],
    where: str | None,
    **options: object,
) -> None:
    """Run a registered consumer outside Dagster; identical consumers elsewhere stand by."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    db = open_database()
    spec = ConsumerSpec(
        consumer_id=consumer_id,
        branch_id=branch_id,
        handler=handler or registered_handler(db, consumer_id, branch_id),
        topics=topics or None,
        where=where,
        **options,
    )
    worker = ConsumerWorker(db, spec)
    try:
        worker.check()  # refuses at once after a restore
    except (psycopg.OperationalError, DatabaseUnavailable) as exc:  # away (a failover): the loop registers later
        logging.getLogger("cmb_dagster.pubsub").warning("consumer %s: not registered yet (%s)", consumer_id, exc)
    with stop_workers_on_signals():
        click.echo(f"consumer {consumer_id} (branch {branch_id}) started; SIGTERM or Ctrl-C stops it", err=True)
        report = worker.run(duration)
    click.echo(
        f"consumer {consumer_id} (branch {branch_id}): {report.items} events in {report.steps} batches, "
        f"{report.errors} errors, {report.seconds:.1f}s"
    )


@pubsub.command("status")
@click.option("--json", "as_json", is_flag=True, help="The whole status as one JSON object.")
def status_command(as_json: bool) -> None:
    """Every registered consumer: delivered events, lag, filter, last rewind; the backfills under way."""
    found = status(open_database())
    if as_json:
        click.echo(found.model_dump_json())
        return
    if not found.consumers:
        click.echo("no consumers registered")
    for lag in found.consumers:
        click.echo(
            f"{lag.consumer_id}  branch {lag.branch_id}  delivered {lag.delivered}  behind {lag.events} "
            f"({lag.seconds:.1f}s)  handler {lag.handler or '-'}"
        )
        if lag.topics or lag.where:
            click.echo(f"  reads topics {', '.join(lag.topics or ['*'])}  where {lag.where or '-'}")
        if lag.last_rewind:
            click.echo(f"  rewound {lag.last_rewind}")
        if lag.problem:
            click.echo(f"  ! {lag.problem}")
    for progress in found.backfills:
        click.echo(_describe(progress))


def _describe(progress: BackfillProgress) -> str:
    line = (
        f"backfill {progress.id}  {progress.table} -> branch {progress.branch_id}  {progress.state}  "
        f"{progress.rows_done} rows in {progress.batches} batches  last key {progress.last_key or '-'}  "
        f"updated {progress.updated_at:%Y-%m-%d %H:%M:%S}"
    )
    if progress.where:
        line += f"  where {progress.where}"
    if progress.rows_skipped:
        line += f"\n  ! passed over {progress.rows_skipped} rows the filter raised on (the last: {progress.last_skip})"
    return line + (f"\n  ! {progress.error}" if progress.error else "")


@pubsub.command("rewind")
@click.argument("consumer_id")
@click.option("--branch", "branch_id", default=0, show_default=True, type=BRANCH)
@click.option(
    "--to",
    "point",
    required=True,
    help="An event id, or an ISO 8601 time with its zone (the first event created at or after it).",
)
def rewind_command(consumer_id: str, branch_id: int, point: str) -> None:
    """Deliver a consumer's events again from a point on, in order; a running worker of it needs no stopping."""
    to: int | datetime
    if point.isdigit() and len(point) <= 19:
        to = int(point)
    else:
        try:
            to = datetime.fromisoformat(point[:64])
        except ValueError:
            raise InvalidPubSubInput(f"to: {point[:64]!r} is neither an event id nor an ISO 8601 time") from None
    after = reset_consumer(open_database(), consumer_id, branch_id, to=to)
    click.echo(
        f"rewound consumer {consumer_id} (branch {branch_id}): it reads on after txid {after.txid} "
        f"event {after.event_id}"
    )


@pubsub.command("backfill")
@click.option(
    "--table",
    required=True,
    help="The table (a name the catalog finds, e.g. public.orders or '\"Orders\"'), readable by the role.",
)
@click.option("--branch", "branch_id", default=0, show_default=True, type=BRANCH, help="Branch the events go to.")
@click.option(
    "--where",
    default=None,
    help="Only the rows this SQL/JSON path predicate over the row ($) is true for, e.g. '$.status == \"paid\"' "
    f"(at most {MAX_FILTER_LENGTH} characters).",
)
@click.option(
    "--batch-size",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Rows per batch (one transaction each).",
)
@click.option("--topic", default=None, help=f"Default: 'schema.table' (at most {MAX_TOPIC_LENGTH} characters).")
@click.option(
    "--lock-timeout",
    default=0.5,
    show_default=True,
    type=FloatRange(0.001, 60),
    help="Seconds a batch waits for a row a writer holds before it is tried again.",
)
@click.option("--again", is_flag=True, help="Publish the rows again when the same backfill is done already.")
def backfill_command(
    table: str, branch_id: int, where: str | None, batch_size: int, topic: str | None, lock_timeout: float, again: bool
) -> None:
    """Publish a table's existing rows as snapshot events; run it again to resume after a crash."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    done = backfill(
        open_database(),
        table,
        branch_id,
        where=where,
        batch_size=batch_size,
        topic=topic,
        lock_timeout=lock_timeout,
        again=again,
        on_progress=lambda progress: click.echo(_describe(progress), err=True),
    )
    click.echo(f"backfill {done.id} of {done.table}: {done.rows_done} rows in {done.batches} batches, {done.state}")


@pubsub.command("backfills")
@click.option("--all", "include_done", is_flag=True, help="Also those done more than a day ago.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per backfill.")
def backfills_command(include_done: bool, as_json: bool) -> None:
    """Backfills: unfinished ones (interrupted or failed: run the same backfill again to resume) and recent ones."""
    found = backfills(open_database(), include_done=include_done)
    if not found and not as_json:
        click.echo("no backfills")
    for progress in found:
        click.echo(progress.model_dump_json() if as_json else _describe(progress))


@pubsub.command("dead")
@click.argument("consumer_id", required=False)
@click.option("--branch", "branch_id", type=BRANCH, default=None, help="Only this branch.")
@click.option("--all", "include_replayed", is_flag=True, help="Also the events replayed already.")
@click.option("--traceback", "show_traceback", is_flag=True, help="Print each event's last traceback.")
def dead_command(consumer_id: str | None, branch_id: int | None, include_replayed: bool, show_traceback: bool) -> None:
    """Events consumers parked after failing on them max_attempts times."""
    with open_database().connection() as conn:
        letters = dead_letters(conn, consumer_id, branch_id, include_replayed=include_replayed)
    if not letters:
        click.echo("no parked events")
    for d in letters:
        state = f"replayed {d.replayed_at:%Y-%m-%d %H:%M:%S}" if d.replayed_at else "parked"
        click.echo(
            f"{d.consumer_id}  branch {d.branch_id}  event {d.event.id} ({d.event.topic} {d.event.op})  "
            f"{d.attempts} attempts {d.first_failed_at:%Y-%m-%d %H:%M:%S}..{d.last_failed_at:%H:%M:%S}  "
            f"{state}: {d.error}"
        )
        if show_traceback and d.traceback:
            click.echo(d.traceback)


@pubsub.command("replay")
@click.argument("consumer_id")
@click.option("--branch", "branch_id", default=0, show_default=True, type=BRANCH)
@click.option("--handler", default=None, help="'module:function' (default: the one the consumer registered).")
@click.option("--event", "event_ids", type=ROW_ID, multiple=True, help="Only this parked event (repeatable).")
def replay_command(consumer_id: str, branch_id: int, handler: str | None, event_ids: tuple[int, ...]) -> None:
    """Run a consumer's parked events through its handler again, one transaction each."""
    done, failed = replay(open_database(), consumer_id, branch_id, handler, event_ids=event_ids or None)
    click.echo(f"replayed {done} parked events; {failed} failed again and stay parked")
    if failed:
        raise SystemExit(1)


@pubsub.command("trim")
@click.option(
    "--batch-size",
    default=10_000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Events deleted per transaction and branch.",
)
@click.option(
    "--retain-days",
    default=7.0,
    show_default=True,
    type=FloatRange(0, 36500),
    help="Keep events younger than this, read or not.",
)
def trim_command(batch_size: int, retain_days: float) -> None:
    """Delete the events older than --retain-days every registered consumer of their branch has delivered."""
    with open_database().connect(autocommit=True) as conn:
        deleted = trim(conn, batch_size=batch_size, retain=timedelta(days=retain_days))
        click.echo(f"deleted {deleted} delivered events")


@pubsub.command("reset")
def reset_command() -> None:
    """After pg_dump/pg_restore into another cluster: re-base the stream's txids (one transaction)."""
    with open_database().connect(autocommit=True) as conn:
        old, new = reset(conn)
    if old == new:
        click.echo(f"the stream's txids are this server's: nothing to re-base (shift {new})")
    else:
        click.echo(f"re-based the stream's txids (shift {old} -> {new}): consumers resume where they stopped")


@pubsub.command("drop")
@click.argument("consumer_id")
@click.option("--branch", "branch_id", default=0, show_default=True, type=BRANCH)
def drop_command(consumer_id: str, branch_id: int) -> None:
    """Forget a consumer, so it no longer holds events back from trim."""
    with open_database().connection() as conn:
        dropped = drop_consumer(conn, consumer_id, branch_id)
    click.echo(f"dropped consumer {consumer_id} (branch {branch_id})" if dropped else "no such consumer")
