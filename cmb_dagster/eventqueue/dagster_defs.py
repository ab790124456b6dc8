"""Dagster shell of the event queue: worker jobs kept running by sensors, per-handler observations, the
``events`` resource for ops; a Dagster-job handler's runs are launched by the launch sensor of its job.

Each handler has an external asset ``eventqueue/<handler>``; the ``<prefix>events_status`` sensor observes
it with ``queued``, ``delayed``, ``locked``, ``held``, ``dead`` and ``oldest_queued_seconds`` (plotted on the
asset page) and ``paused`` / ``blocked`` / ``rules``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import psycopg
from dagster import AssetKey, AssetObservation, ConfigurableResource, Definitions, OpExecutionContext

from cmb_dagster.dagster_translator import DEFAULT_TRANSLATOR, CmbTranslator
from cmb_dagster.database import Database
from cmb_dagster.eventqueue import admin
from cmb_dagster.eventqueue.handlers import scope
from cmb_dagster.eventqueue.models import DEFAULT_MODIFIER, DEFAULT_MODULE, EventQueueOptions, HandlerStatus
from cmb_dagster.eventqueue.queue import emit, emit_many
from cmb_dagster.eventqueue.worker import EventWorker
from cmb_dagster.flow import KeyUse, describe_limits
from cmb_dagster.health import Verdict
from cmb_dagster.jobs import (
    RunRequestLauncher,
    dagster_name,
    keep_running_sensor,
    launch_sensor_name,
    launch_sensors,
    status_definitions,
    worker_job,
    worker_job_names,
)
from cmb_dagster.resources import CmbResource
from cmb_dagster.workers import WorkerReport

OLDER_RUN_KEY_TAGS = ("cmb/eventqueue.run_key", "cmb/eventqueue/run_key")  # a run of an older release counts too


class EventQueueResource(ConfigurableResource):
    """Emit events from ops, inside the op's own transaction (``cmb`` is the database's resource):

    >>> with events.connection() as conn:
    ...     conn.execute("INSERT INTO orders ...")
    ...     events.emit("shop", "send_receipt", {"order": 42}, conn=conn)   # only if the insert commits
    """

    cmb: CmbResource

    @property
    def database(self) -> Database:
        """The database of the ``cmb`` resource."""
        return self.cmb.database

    def connection(self) -> AbstractContextManager[psycopg.Connection]:
        """A pooled connection whose transaction commits when the block succeeds."""
        return self.cmb.connection()

    def emit(
        self,
        namespace: str,
        handler: str,
        value: Any,
        *,
        module: str = DEFAULT_MODULE,
        modifier: str = DEFAULT_MODIFIER,
        delay: float | timedelta | None = None,
        conn: psycopg.Connection | None = None,
    ) -> int:
        """:func:`cmb_dagster.eventqueue.emit` on this database (in ``conn``'s transaction when given)."""
        return emit(
            namespace,
            handler,
            value,
            module=module,
            modifier=modifier,
            delay=delay,
            conn=conn,
            db=self.database,  # with conn: the schema
        )

    def emit_many(self, events: list[Mapping[str, Any]], *, conn: psycopg.Connection | None = None) -> list[int]:
        """:func:`cmb_dagster.eventqueue.emit_many` on this database."""
        return emit_many(events, conn=conn, db=self.database)


def handler_asset_key(handler: str, translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetKey:
    """The external asset whose observations carry a handler's queue counts."""
    return translator.get_asset_key("eventqueue", [dagster_name(handler)])


def handler_observation(
    s: HandlerStatus, translator: CmbTranslator = DEFAULT_TRANSLATOR, keys: Sequence[KeyUse] = ()
) -> AssetObservation:
    """An observation of a handler's queue on its asset, with its limits and their use over its ``keys`` (events
    in flight, keys at their concurrency limit; tokens change all the time, so they are left to the CLI)."""
    limits = (
        {
            "key": s.key or "-",
            "limits": describe_limits(s.rate_per_second, s.burst, s.concurrency),
            "in_flight": sum(k.in_flight for k in keys),
            "keys_at_limit": sum(1 for k in keys if k.concurrency and k.in_flight >= k.concurrency),
        }
        if s.key or s.rate_per_second or s.concurrency
        else {}
    )
    return AssetObservation(
        asset_key=handler_asset_key(s.handler, translator),
        metadata={
            **limits,
            "queued": s.queued,
            "delayed": s.delayed,
            "locked": s.locked,
            "held": s.held,
            "dead": s.dead,
            "oldest_queued_seconds": round(s.oldest_queued_seconds, 3),
            "paused": any(r.startswith("pause ") for r in s.rules),
            "blocked": any(r.startswith("block ") for r in s.rules),
            "rules": ", ".join(s.rules) or "-",
        },
    )


def eventqueue_definitions(
    options: EventQueueOptions,
    *,
    prefix: str = "cmb_",
    resource: CmbResource | None = None,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
) -> Definitions:
    """Worker jobs (each runs the dequeue loop for a bounded time) with keeper sensors, the status sensor,
    one asset per handler and the ``events`` resource (on the database of ``resource``, the ``cmb`` one)."""
    registry = options.registry()
    resource = resource or CmbResource()
    launched = sorted({job for job in (registry[name].job_name for name in registry.names) if job})
    sensors = {job: launch_sensor_name(prefix, "events", job) for job in launched}

    def run_worker(database: Database, duration: float, context: OpExecutionContext) -> WorkerReport:
        launcher = RunRequestLauncher.from_context(database, context, sensors)
        worker = EventWorker(database, options, launcher=launcher)
        context.log.info(f"events worker {worker.owner} serving {', '.join(worker.names)}")
        return worker.run(duration)

    workers = [
        worker_job(
            name,
            run_worker,
            description="Runs event queue handlers for a bounded time (all workers claim from one queue).",
            tags=translator.get_worker_tags("eventqueue", name),
        )
        for name in worker_job_names(prefix, "events_worker", options.workers)
    ]

    def observe(database: Database) -> list[AssetObservation | Verdict]:
        admin.register(database, registry)  # emit refuses unknown handlers: record them before any worker ran
        found: list[AssetObservation | Verdict] = []
        now = admin.status(database)
        for row in (s for s in now.handlers if s.handler in registry):
            keys = [k for k in now.keys if k.scope == scope(row.handler)]
            found.append(handler_observation(row, translator, keys))
            found.extend(options.checks.verdicts(handler_asset_key(row.handler, translator).path, row))
        return found

    assets = {
        handler_asset_key(name, translator): f"Event queue of handler {name!r} ({registry[name].kind})."
        for name in registry.names
    }

    status = status_definitions(
        f"{prefix}events_status",
        observe,
        minimum_interval_seconds=options.observe_interval_seconds,
        description="Registers the event queue's handlers and observes each one's queue (queued, delayed, locked, "
        "held by pause/block, dead-lettered, oldest queued age).",
        group_name=translator.get_group_name("eventqueue"),
        assets=assets,
        checks=dict.fromkeys(assets, options.checks.descriptions()),
    )
    return Definitions.merge(
        Definitions(
            jobs=workers,
            sensors=[
                *(keep_running_sensor(w) for w in workers),
                *launch_sensors(prefix, "events", launched, older_run_key_tags=OLDER_RUN_KEY_TAGS),
            ],
            resources={"cmb": resource, "events": EventQueueResource(cmb=resource)},
        ),
        status,
    )
