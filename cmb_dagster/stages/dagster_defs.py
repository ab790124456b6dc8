"""Dagster shell of the stage scheduler: worker jobs kept running, the rescan schedule, per-stage observations.

Each stage has an external asset ``stages/<name>`` whose observations carry ``queued``, ``timers``,
``low_priority``, ``oldest_seconds``, ``parked``, ``failing``, ``conflicts``, ``processed``, ``errors``
and ``capped`` (plotted on the asset page), recorded by worker job 0 every ``observe_seconds``.
"""

import time

from croniter import croniter
from dagster import (
    AssetKey,
    AssetObservation,
    DefaultScheduleStatus,
    Definitions,
    JobDefinition,
    ObserveResult,
    OpExecutionContext,
    ScheduleDefinition,
    SourceAsset,
    job,
    observable_source_asset,
    op,
)

from cmb_dagster.database import Database
from cmb_dagster.jobs import keep_running_sensor, worker_job
from cmb_dagster.resources import CmbResource
from cmb_dagster.stages.admin import status
from cmb_dagster.stages.engine import Engine
from cmb_dagster.stages.errors import InvalidStageInput
from cmb_dagster.stages.models import StageOptions, StageStatus
from cmb_dagster.stages.worker import StageWorker
from cmb_dagster.workers import WorkerReport


def stage_asset_key(stage: str) -> AssetKey:
    """The external asset whose observations carry a stage's queues and counters."""
    return AssetKey(["stages", stage])


def stage_observation(row: StageStatus) -> AssetObservation:
    """An observation of one stage's queues and counters."""
    metadata = row.model_dump(exclude={"stage"})
    metadata["oldest_seconds"] = round(metadata["oldest_seconds"], 3)
    return AssetObservation(asset_key=stage_asset_key(row.stage), metadata=metadata)


def observe(database: Database, options: StageOptions, context: OpExecutionContext) -> None:
    """Record an observation per stage (stages without entries yet show zeros)."""
    found = {row.stage: row for row in status(database)}
    for stage in options.stages:
        row = found.get(stage.name, StageStatus(stage=stage.name))
        context.log_event(stage_observation(row))


def _run_worker(options: StageOptions, index: int):  # type: ignore[no-untyped-def]
    def run(database: Database, duration: float, context: OpExecutionContext) -> WorkerReport:
        worker = StageWorker(database, options, index=index)
        next_observation = time.monotonic() + options.observe_seconds

        def on_progress(report: WorkerReport) -> None:
            nonlocal next_observation
            if index == 0 and time.monotonic() >= next_observation:
                next_observation = time.monotonic() + options.observe_seconds
                observe(database, options, context)

        report = worker.run(duration, on_progress=on_progress)
        if index == 0:
            observe(database, options, context)
        return report

    return run


def stages_definitions(options: StageOptions, *, prefix: str = "cmb_") -> Definitions:
    """Worker jobs (job i serves shards with id % workers == i) with keeper sensors, the rescan schedule
    and an observed asset per stage, for :func:`cmb_definitions(stages=...)`."""
    if options.rescan_cron is not None and not croniter.is_valid(options.rescan_cron):
        raise InvalidStageInput(f"rescan_cron: {options.rescan_cron!r} is not a valid cron expression")
    names = ", ".join(s.name for s in options.stages)
    workers: list[JobDefinition] = [
        worker_job(
            f"{prefix}stages_worker" if options.workers == 1 else f"{prefix}stages_worker_{i}_of_{options.workers}",
            _run_worker(options, i),
            description=f"Runs stages ({names}) on shards with id % {options.workers} == {i} for a bounded time.",
        )
        for i in range(options.workers)
    ]
    jobs: list[JobDefinition] = list(workers)
    schedules = []
    if options.rescan_cron is not None:

        @op(name=f"{prefix}stages_rescan_op", description="Asks every stage about every entity; fills the low-priority queues.")
        def rescan_op(context: OpExecutionContext, cmb: CmbResource) -> None:
            engine = Engine(cmb.database, options.stages, publish=options.publish)
            seen, offered, stopped = engine.rescan(duration=options.rescan_seconds)
            where = "done" if stopped is None else f"stopped after {stopped!r} (time box)"
            context.log.info(f"rescan: {seen} entities, {offered} low-priority entries offered; {where}")
            context.add_output_metadata({"entities": seen, "offered": offered})

        @job(name=f"{prefix}stages_rescan", description="Background rescan of every entity (low-priority queues).")
        def rescan_job() -> None:
            rescan_op()

        jobs.append(rescan_job)
        schedules.append(ScheduleDefinition(
            name=f"{prefix}stages_rescan_schedule", job=rescan_job, cron_schedule=options.rescan_cron,
            default_status=DefaultScheduleStatus.RUNNING,
        ))
    return Definitions(
        jobs=jobs,
        sensors=[keep_running_sensor(w) for w in workers],
        schedules=schedules,
        assets=[stage_asset(s.name) for s in options.stages],
    )


def stage_asset(name: str) -> SourceAsset:
    """An observable asset plotting a stage's queues and counters; Observe refreshes it (no Materialize)."""

    @observable_source_asset(
        key=stage_asset_key(name), description=f"Queues and counters of stage {name!r}.", group_name="cmb_stages"
    )
    def stage_queues(cmb: CmbResource) -> ObserveResult:
        row = next((r for r in status(cmb.database) if r.stage == name), StageStatus(stage=name))
        return ObserveResult(metadata=stage_observation(row).metadata)

    return stage_queues
