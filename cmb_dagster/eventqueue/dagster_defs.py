"""Dagster shell of the event queue: worker jobs kept running by sensors, per-handler observations, the
``events`` resource for ops, and the launcher behind Dagster-job handlers.

Each handler has an external asset ``eventqueue/<handler>``; the ``<prefix>events_status`` sensor observes
it with ``queued``, ``delayed``, ``locked``, ``held``, ``dead`` and ``oldest_queued_seconds`` (plotted on the
asset page) and ``paused`` / ``blocked`` / ``rules``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
from dagster import (
    AssetKey,
    AssetObservation,
    ConfigurableResource,
    DagsterInstance,
    DefaultSensorStatus,
    Definitions,
    ObserveResult,
    OpExecutionContext,
    RepositoryDefinition,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SourceAsset,
    observable_source_asset,
    sensor,
)
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.run_coordinator import QueuedRunCoordinator
from pydantic import Field

from cmb_dagster.database import Database
from cmb_dagster.eventqueue import admin
from cmb_dagster.eventqueue.errors import InvalidInput
from cmb_dagster.eventqueue.models import DEFAULT_MODIFIER, DEFAULT_MODULE, EventQueueOptions, HandlerStatus
from cmb_dagster.eventqueue.queue import emit, emit_many
from cmb_dagster.eventqueue.worker import EventWorker
from cmb_dagster.jobs import keep_running_sensor, worker_job
from cmb_dagster.resources import CmbResource
from cmb_dagster.workers import WorkerReport

RUN_KEY_TAG = "cmb/eventqueue/run_key"


class EventQueueResource(ConfigurableResource):
    """Emit events from ops, inside the op's own transaction:

    >>> with events.connection() as conn:
    ...     conn.execute("INSERT INTO orders ...")
    ...     events.emit("shop", "send_receipt", {"order": 42}, conn=conn)   # only if the insert commits
    """

    database_url: str | None = Field(default=None, description="Postgres URL; unset means CMB_DATABASE_URL or embedded.")
    schema_name: str | None = Field(default=None, description="Schema of cmb tables; unset means CMB_SCHEMA or 'cmb'.")

    @property
    def database(self) -> Database:
        return Database.shared(self.database_url, self.schema_name)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection whose transaction commits when the block succeeds."""
        with self.database.connection() as conn:
            yield conn

    def emit(self, namespace: str, handler: str, value: Any, *, module: str = DEFAULT_MODULE,
             modifier: str = DEFAULT_MODIFIER, delay: float | timedelta | None = None,
             conn: psycopg.Connection | None = None) -> int:
        """:func:`cmb_dagster.eventqueue.emit` on this database (in ``conn``'s transaction when given)."""
        return emit(namespace, handler, value, module=module, modifier=modifier, delay=delay, conn=conn,
                    db=None if conn is not None else self.database)

    def emit_many(self, events: list[Mapping[str, Any]], *, conn: psycopg.Connection | None = None) -> list[int]:
        """:func:`cmb_dagster.eventqueue.emit_many` on this database."""
        return emit_many(events, conn=conn, db=None if conn is not None else self.database)


class EventRunLauncher:
    """Launches the runs of Dagster-job handlers in the worker's own code location, queued for the daemon.

    The run key (``eventqueue:<event id>``) is a tag: an event retried after its run was created finds that
    run instead of launching a second one.
    """

    def __init__(self, instance: DagsterInstance, repository: RepositoryDefinition,
                 remote_origin: RemoteRepositoryOrigin, python_origin: RepositoryPythonOrigin) -> None:
        self.instance = instance
        self.repository = repository
        self.remote_origin = remote_origin
        self.python_origin = python_origin

    @classmethod
    def from_context(cls, context: OpExecutionContext) -> EventRunLauncher | None:
        """The launcher of the code location ``context``'s run belongs to (None when run in process)."""
        run = context.dagster_run
        if run.remote_job_origin is None or run.job_code_origin is None:
            return None
        return cls(context.instance, context.repository_def, run.remote_job_origin.repository_origin,
                   run.job_code_origin.repository_origin)

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        existing = self.instance.get_run_ids(RunsFilter(tags={RUN_KEY_TAG: run_key}), limit=1)
        if existing:
            return existing[0]
        if not self.repository.has_job(job_name):
            raise LookupError(f"code location has no job {job_name!r}")
        if not isinstance(self.instance.run_coordinator, QueuedRunCoordinator):
            raise RuntimeError("Dagster-job handlers need the QueuedRunCoordinator (see dagster.yaml)")
        run = self.instance.create_run_for_job(
            job_def=self.repository.get_job(job_name),
            run_config=dict(run_config),
            tags={**tags, RUN_KEY_TAG: run_key},
            remote_job_origin=RemoteJobOrigin(repository_origin=self.remote_origin, job_name=job_name),
            job_code_origin=JobPythonOrigin(job_name, self.python_origin),
        )
        self.instance.submit_run(run.run_id, workspace=None)  # type: ignore[arg-type]
        return run.run_id


def handler_asset_key(handler: str) -> AssetKey:
    """The external asset whose observations carry a handler's queue counts."""
    return AssetKey(["eventqueue", re.sub(r"[^A-Za-z0-9_]", "_", handler)])


def handler_observation(s: HandlerStatus) -> AssetObservation:
    """An observation of a handler's queue on its asset."""
    return AssetObservation(
        asset_key=handler_asset_key(s.handler),
        metadata={
            "queued": s.queued, "delayed": s.delayed, "locked": s.locked, "held": s.held, "dead": s.dead,
            "oldest_queued_seconds": round(s.oldest_queued_seconds, 3),
            "paused": any(r.startswith("pause ") for r in s.rules),
            "blocked": any(r.startswith("block ") for r in s.rules),
            "rules": ", ".join(s.rules) or "-",
        },
    )


def handler_asset(handler: str, description: str) -> SourceAsset:
    """An observable asset plotting a handler's queue; Observe refreshes it (no Materialize)."""

    @observable_source_asset(key=handler_asset_key(handler), description=description, group_name="cmb_eventqueue")
    def handler_queue(cmb: CmbResource) -> ObserveResult:
        rows = [s for s in admin.status(cmb.database) if s.handler == handler]
        return ObserveResult(metadata=handler_observation(rows[0]).metadata if rows else {"queued": 0})

    return handler_queue


def eventqueue_definitions(
    options: EventQueueOptions, *, prefix: str = "cmb_", resource: CmbResource | None = None
) -> Definitions:
    """Worker jobs (each runs the dequeue loop for a bounded time) with keeper sensors, the status sensor,
    one asset per handler and the ``events`` resource (on the database of ``resource``, the ``cmb`` one)."""
    registry = options.registry()
    if not registry.handlers:
        raise InvalidInput("events: EventQueueOptions needs at least one handler")

    def run_worker(database: Database, duration: float, context: OpExecutionContext) -> WorkerReport:
        worker = EventWorker(database, registry, options.worker, launcher=EventRunLauncher.from_context(context))
        context.log.info(f"events worker {worker.owner} serving {', '.join(worker.names)}")
        return worker.run(duration)

    names = [f"{prefix}events_worker" if options.workers == 1 else f"{prefix}events_worker_{i}_of_{options.workers}"
             for i in range(options.workers)]
    workers = [worker_job(name, run_worker, description="Runs event queue handlers for a bounded time "
                          "(all workers claim from one queue).") for name in names]

    @sensor(
        name=f"{prefix}events_status",
        minimum_interval_seconds=options.observe_interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="Registers the event queue's handlers and observes each one's queue (queued, delayed, locked, "
                    "held by pause/block, dead-lettered, oldest queued age).",
    )
    def status_sensor(context: SensorEvaluationContext, cmb: CmbResource) -> SensorResult:
        database = cmb.database
        admin.register(database, registry)  # emit refuses unknown handlers: record them before any worker ran
        rows = [s for s in admin.status(database) if s.handler in registry]
        return SensorResult(asset_events=[handler_observation(s) for s in rows])

    return Definitions(
        jobs=workers,
        sensors=[*(keep_running_sensor(w) for w in workers), status_sensor],
        assets=[handler_asset(name, f"Event queue of handler {name!r} ({registry[name].kind}).")
                for name in registry.names],
        resources={"events": EventQueueResource(database_url=resource.database_url, schema_name=resource.schema_name)
                   if resource is not None else EventQueueResource()},
    )
