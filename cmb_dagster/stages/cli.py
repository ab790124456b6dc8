"""``cmb-dagster stages``: run a worker outside Dagster, inspect queues, read and CAS states, retry, rescan."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import click

from cmb_dagster.cli_common import BIGINT_MAX, DURATION, liveness_options, open_database
from cmb_dagster.inputs import load_reference, shorten
from cmb_dagster.stages import admin
from cmb_dagster.stages.engine import Engine
from cmb_dagster.stages.errors import InvalidStageInput
from cmb_dagster.stages.models import MAX_SHARDS, StageOptions
from cmb_dagster.stages.store import StageStore
from cmb_dagster.stages.worker import StageWorker
from cmb_dagster.workers import stop_workers_on_signals

STAGES_HELP = "module:attribute of a StageOptions or a list of Stage instances (default: $CMB_STAGES)."


class ShardList(click.ParamType):
    """A comma-separated list of shard ids, each within 0..4095; at least one."""

    name = "shard,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        shards = []
        for part in filter(str.strip, str(value).split(",")):
            try:
                shard = int(part)
            except ValueError:
                self.fail(f"{shorten(part.strip())} is not a shard id", param, ctx)
            if not 0 <= shard < MAX_SHARDS:
                self.fail(f"shard {shorten(shard)} is outside 0..{MAX_SHARDS - 1}", param, ctx)
            shards.append(shard)
        if not shards:
            self.fail("name at least one shard id, e.g. 0,1,5", param, ctx)
        return list(dict.fromkeys(shards))


def load_options(path: str | None) -> StageOptions:
    """The StageOptions (or list of stages) at ``module:attribute``."""
    path = path or os.environ.get("CMB_STAGES")
    if not path:
        raise click.UsageError("name your stages with --stages module:attribute (or set CMB_STAGES)")
    value = load_reference(path, "stages", error=InvalidStageInput)
    return value if isinstance(value, StageOptions) else StageOptions(stages=list(value))


def _json(value: str, name: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidStageInput(f"{name}: not valid JSON ({exc.msg})") from None


stages_option = click.option("--stages", "stages_path", default=None, help=STAGES_HELP)


@click.group()
def stages() -> None:
    """Stage scheduler: per-entity stages with queues, timers and private state."""


@stages.command()
@stages_option
@click.option(
    "--index",
    default=0,
    show_default=True,
    type=click.IntRange(0, MAX_SHARDS - 1),
    help="This worker's index (serves shards with id % workers == index).",
)
@click.option(
    "--workers",
    default=None,
    type=click.IntRange(1, MAX_SHARDS),
    help="Number of workers splitting the shards (default: the options').",
)
@click.option(
    "--shards", default=None, type=ShardList(), help=f"Only these shards (ids within 0..{MAX_SHARDS - 1}), e.g. 0,1,5."
)
@click.option("--duration", default=None, type=DURATION, help="Seconds to run (default: until SIGTERM/SIGINT).")
@liveness_options
def worker(
    stages_path: str | None, index: int, workers: int | None, shards: list[int] | None, duration: float | None
) -> None:
    """Run a stage worker: long-running; SIGTERM or Ctrl-C lets the calls in flight end and stops."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = load_options(stages_path)
    runner = StageWorker(open_database(), options, index=index, workers=workers, shards=shards)
    click.echo(f"stage worker {index}: stages {', '.join(s.name for s in options.stages)}", err=True)
    with stop_workers_on_signals():
        report = runner.run(duration)
    click.echo(f"handled {report.items} entries in {report.steps} steps, {report.errors} errors, {report.seconds:.1f}s")


@stages.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per stage.")
def status(as_json: bool) -> None:
    """Queue depths, oldest due entry, parked entries and counters per stage; a limited stage's limits and
    their use per key."""
    report = admin.status(open_database())
    if not report.stages:
        click.echo("no stages", err=as_json)  # with --json, stdout stays JSON lines (none)
        if not as_json:
            click.echo(f"shards: {report.shard_count}")
        return
    if as_json:
        for row in report.stages:
            click.echo(row.model_dump_json())
        return
    click.echo(
        f"{'stage':20} {'queued':>8} {'timers':>8} {'low':>8} {'oldest s':>9} {'parked':>7} {'failing':>7} "
        f"{'processed':>10} {'conflicts':>9} {'errors':>7} {'capped':>7}"
    )
    for r in report.stages:
        click.echo(
            f"{r.stage:20} {r.queued:8} {r.timers:8} {r.low_priority:8} {r.oldest_seconds:9.1f} {r.parked:7} "
            f"{r.failing:7} {r.processed:10} {r.conflicts:9} {r.errors:7} {r.capped:7}"
        )
    limited = [r for r in report.stages if r.limits is not None]
    if limited:
        click.echo(f"\n{'stage':20} {'key':20} {'rate/s':>8} {'burst':>6} {'tokens':>8} {'parallel':>8} {'batches':>7}")
    for r in limited:
        lim = r.limits
        for use in lim.keys or [None]:  # type: ignore[union-attr]
            click.echo(
                f"{r.stage:20} {shorten(use.key) if use else '-':20} {_figure(lim.rate_per_second):>8} "  # type: ignore[union-attr]
                f"{_figure(lim.burst):>6} {_figure(use.tokens if use else None):>8} "  # type: ignore[union-attr]
                f"{_figure(lim.max_parallelism):>8} {use.batches if use else 0:7}"  # type: ignore[union-attr]
            )
    click.echo(f"shards: {report.shard_count}")


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, int) else f"{value:.1f}"


@stages.command()
@click.option("--stage", default=None)
@click.option("--entity", "entity_id", default=None)
@click.option("--problems", is_flag=True, help="Only failing or parked entries.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
def queue(stage: str | None, entity_id: str | None, problems: bool, limit: int) -> None:
    """List queue entries (earliest due first) with attempts, conflicts, crashes and the last error."""
    entries = admin.entries(open_database(), stage=stage, entity_id=entity_id, problems=problems, limit=limit)
    if not entries:
        click.echo("no entries")
    for e in entries:
        state = "parked" if e.parked_at else ("low" if e.lane else "main")
        click.echo(
            f"{e.stage}\t{e.entity_id}\t{state}\tdue {e.due_at.isoformat()}\tattempts {e.attempts}\t"
            f"conflicts {e.conflicts}\tcrashes {e.crashes}\t{e.last_error or ''}"
        )


@stages.command()
@click.option("--stage", default=None, help="Only this stage's parked entries.")
@click.option("--entity", "entity_id", default=None, help="Only this entity's parked entries.")
def retry(stage: str | None, entity_id: str | None) -> None:
    """Put parked entries back in their queue, due now."""
    click.echo(f"{admin.retry(open_database(), stage=stage, entity_id=entity_id)} entries back in their queue")


@stages.command()
@stages_option
@click.option("--duration", default=None, type=DURATION, help="Time box in seconds.")
def rescan(stages_path: str | None, duration: float | None) -> None:
    """Ask every stage about every entity; fill the low-priority queues."""
    options = load_options(stages_path)
    engine = Engine(
        open_database(), options.stages, concurrency=options.worker_concurrency, isolation=options.isolation
    )
    seen, offered, stopped = engine.rescan(duration=duration)
    where = "" if stopped is None else f"; stopped after {stopped!r}"
    click.echo(f"{seen} entities, {offered} low-priority entries{where}")


@stages.command()
@click.argument("count", required=False, type=click.IntRange(1, MAX_SHARDS))
def shards(count: int | None) -> None:
    """Show the shard count, or change it (workers keep running; nothing is lost)."""
    db = open_database()
    if count is None:
        click.echo(admin.shard_count(db))
    else:
        click.echo(f"shards: {admin.set_shard_count(db, count)} -> {count}")


@stages.command()
@click.argument("entity_id")
@click.argument("payload")
def put(entity_id: str, payload: str) -> None:
    """Create or replace an entity (PAYLOAD is a JSON object); print its version."""
    click.echo(StageStore(open_database()).put(entity_id, _json(payload, "payload")))


@stages.command()
@click.argument("entity_id")
@click.argument("patch")
def patch(entity_id: str, patch: str) -> None:
    """Apply an RFC 7386 merge patch (a JSON object) to an entity; print its version."""
    click.echo(StageStore(open_database()).patch(entity_id, _json(patch, "patch")))


@stages.command()
@click.argument("entity_id")
def get(entity_id: str) -> None:
    """Print an entity as JSON."""
    entity = StageStore(open_database()).get(entity_id)
    if entity is None:
        raise click.ClickException(f"no entity {shorten(entity_id)}")
    click.echo(json.dumps({"entity_id": entity.id, "version": entity.version, "payload": entity.payload}))


@stages.group()
def state() -> None:
    """Read a stage's state of an entity, or compare-and-set it."""


@state.command("read")
@stages_option
@click.argument("entity_id")
@click.argument("stage")
def state_read(stages_path: str | None, entity_id: str, stage: str) -> None:
    """Print {"state": ..., "version": N}."""
    value, version = StageStore(open_database(), load_options(stages_path).stages).read_state(entity_id, stage)
    click.echo(json.dumps({"state": value.model_dump(mode="json"), "version": version}))


@state.command("update")
@stages_option
@click.argument("entity_id")
@click.argument("stage")
@click.argument("new_state")
@click.option(
    "--version",
    "version",
    required=True,
    type=click.IntRange(0, BIGINT_MAX),
    help="The version read; the update is refused if it moved.",
)
def state_update(stages_path: str | None, entity_id: str, stage: str, new_state: str, version: int) -> None:
    """Compare-and-set a stage's state (NEW_STATE is JSON); exit code 2 if the version moved."""
    store = StageStore(open_database(), load_options(stages_path).stages)
    if store.update_state(entity_id, stage, _json(new_state, "new_state"), version):
        click.echo("updated")
    else:
        click.echo(
            f"not updated: the state of {shorten(stage)} for {shorten(entity_id)} is no longer at version {version}",
            err=True,
        )
        raise SystemExit(2)
