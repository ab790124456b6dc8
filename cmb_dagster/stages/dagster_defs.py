"""Dagster shell of the stage scheduler: worker jobs kept running, the rescan schedule, per-stage observations.

Each stage has an external asset ``stages/<name>`` whose observations carry ``queued``, ``timers``,
``low_priority``, ``oldest_seconds``, ``parked``, ``failing``, ``conflicts``, ``processed``, ``errors``
and ``capped`` (plotted on the asset page), recorded by the ``<prefix>stages_status`` sensor every
``observe_interval_seconds`` while they change or work waits.
"""

from dagster import (
    AssetKey,
    AssetObservation,
    DefaultScheduleStatus,
    Definitions,
    JobDefinition,
    OpExecutionContext,
    ScheduleDefinition,
    job,
    op,
)

from cmb_dagster.dagster_translator import DEFAULT_TRANSLATOR, CmbTranslator
from cmb_dagster.database import Database
from cmb_dagster.health import Verdict
from cmb_dagster.jobs import keep_running_sensor, status_definitions, worker_job, worker_job_names
from cmb_dagster.resources import CmbResource
from cmb_dagster.stages.admin import status
from cmb_dagster.stages.engine import Engine
from cmb_dagster.stages.models import StageOptions, StageStatus
from cmb_dagster.stages.worker import StageWorker
from cmb_dagster.workers import WorkerReport


def stage_asset_key(stage: str, translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetKey:
    """The external asset whose observations carry a stage's queues and counters."""
    return translator.get_asset_key("stages", [stage])


def stage_observation(row: StageStatus, translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetObservation:
    """An observation of one stage's queues and counters."""
    metadata = row.model_dump(exclude={"stage", "limits"})
    metadata["oldest_seconds"] = round(metadata["oldest_seconds"], 3)
    return AssetObservation(asset_key=stage_asset_key(row.stage, translator), metadata=metadata)


def _run_worker(options: StageOptions, index: int):  # type: ignore[no-untyped-def]
    def run(database: Database, duration: float, context: OpExecutionContext) -> WorkerReport:
        return StageWorker(database, options, index=index).run(duration)

    return run


def stages_definitions(
    options: StageOptions,
    *,
    prefix: str = "cmb_",
    resource: CmbResource | None = None,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
) -> Definitions:
    """Worker jobs (job i serves shards with id % workers == i) with keeper sensors, the rescan schedule,
    the status sensor and an observed asset per stage, for :func:`cmb_definitions(stages=...)`."""
    names = ", ".join(s.name for s in options.stages)
    workers: list[JobDefinition] = [
        worker_job(
            name,
            _run_worker(options, i),
            description=f"Runs stages ({names}) on shards with id % {options.workers} == {i} for a bounded time.",
            tags=translator.get_worker_tags("stages", name),
        )
        for i, name in enumerate(worker_job_names(prefix, "stages_worker", options.workers))
    ]
    jobs: list[JobDefinition] = list(workers)
    schedules = []
    if options.rescan_cron is not None:

        @op(
            name=f"{prefix}stages_rescan_op",
            description="Asks every stage about every entity; fills the low-priority queues.",
        )
        def rescan_op(context: OpExecutionContext, cmb: CmbResource) -> None:
            engine = Engine(
                cmb.database,
                options.stages,
                publish=options.publish,
                concurrency=options.worker_concurrency,
                isolation=options.isolation,
            )
            seen, offered, stopped = engine.rescan(duration=options.rescan_seconds)
            where = "done" if stopped is None else f"stopped after {stopped!r} (time box)"
            context.log.info(f"rescan: {seen} entities, {offered} low-priority entries offered; {where}")
            context.add_output_metadata({"entities": seen, "offered": offered})

        @job(name=f"{prefix}stages_rescan", description="Background rescan of every entity (low-priority queues).")
        def rescan_job() -> None:
            rescan_op()

        jobs.append(rescan_job)
        schedules.append(
            ScheduleDefinition(
                name=f"{prefix}stages_rescan_schedule",
                job=rescan_job,
                cron_schedule=options.rescan_cron,
                default_status=DefaultScheduleStatus.RUNNING,
            )
        )

    def observe(database: Database) -> list[AssetObservation | Verdict]:
        report = status(database)  # stages without entries yet show zeros
        found: list[AssetObservation | Verdict] = []
        for row in (report.stage(stage.name) for stage in options.stages):
            found.append(stage_observation(row, translator))
            found.extend(options.checks.verdicts(stage_asset_key(row.stage, translator).path, row))
        return found

    assets = {stage_asset_key(s.name, translator): f"Queues and counters of stage {s.name!r}." for s in options.stages}

    observed = status_definitions(
        f"{prefix}stages_status",
        observe,
        minimum_interval_seconds=options.observe_interval_seconds,
        description="Observes each stage's queues and counters (queued, timers, oldest age, parked, failing, "
        "conflicts, processed, errors).",
        group_name=translator.get_group_name("stages"),
        assets=assets,
        checks=dict.fromkeys(assets, options.checks.descriptions()),
    )
    return Definitions.merge(
        Definitions(
            jobs=jobs,
            sensors=[keep_running_sensor(w) for w in workers],
            schedules=schedules,
            resources={"cmb": resource or CmbResource()},
        ),
        observed,
    )
