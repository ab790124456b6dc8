"""The Dagster shell every engine shares: bounded-time worker jobs and the sensors that keep them running, the
launcher of runs of other jobs with its launch sensors, the status sensor, the observable assets and the asset
checks that bring an engine's status into the UI."""

import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetKey,
    AssetObservation,
    AssetsDefinition,
    AssetSpec,
    Config,
    DagsterExecutionInterruptedError,
    DagsterInvalidConfigError,
    DagsterRunStatus,
    DefaultSensorStatus,
    Definitions,
    JobDefinition,
    ObserveResult,
    OpExecutionContext,
    RepositoryDefinition,
    RunRecord,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    in_process_executor,
    job,
    multi_asset_check,
    multi_observable_source_asset,
    op,
    sensor,
    validate_run_config,
)
from pydantic import Field

from cmb_dagster import health, run_requests
from cmb_dagster.alerts import AlertOptions, send_alerts
from cmb_dagster.callbacks.models import CallbackSettings
from cmb_dagster.database import Database
from cmb_dagster.health import Verdict
from cmb_dagster.resources import CmbResource
from cmb_dagster.settings import Settings
from cmb_dagster.workers import WorkerReport, stop_workers_on_signals

WAITING_STATUSES = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING]
WORKING_STATUSES = [DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]

RunWorker = Callable[[Database, float, OpExecutionContext], WorkerReport]


HANDOVER_SECONDS = 60
"""How long before a worker run ends its successor is launched."""


class WorkerConfig(Config):
    """How long one run of a worker job works; its successor is launched shortly before it ends."""

    duration_seconds: float = Field(
        default=Settings.model_fields["worker_run_seconds"].default,
        gt=0,
        le=7 * 86400,
        description="Seconds this run keeps working (the keeper sets CMB_WORKER_RUN_SECONDS, one hour by default).",
    )


def worker_job(
    name: str, run_worker: RunWorker, *, description: str, tags: Mapping[str, str] | None = None
) -> JobDefinition:
    """A job whose single op runs ``run_worker(database, duration, context)`` and reports what it did; its runs
    carry ``tags`` besides ``cmb/worker``."""

    @op(name=f"{name}_op", description=description)
    def _worker_op(context: OpExecutionContext, config: WorkerConfig, cmb: CmbResource) -> None:
        try:
            with stop_workers_on_signals() as signalled:  # a shutdown ends the run as a success: the next resumes
                report = run_worker(cmb.database, config.duration_seconds, context)
        except DagsterExecutionInterruptedError:  # a signal before the workers started: nothing was in flight
            context.log.info(f"{name} stopped by a shutdown signal before it started working")
            return
        stopped = "; stopped early by a shutdown signal, the next run resumes" if signalled.is_set() else ""
        context.log.info(
            f"worker {report.owner} held {sorted(report.held)}: {report.items} items in {report.steps} steps, "
            f"{report.errors} errors, {report.seconds:.1f}s{stopped}"
        )
        context.add_output_metadata(
            {"items": report.items, "steps": report.steps, "errors": report.errors, "seconds": report.seconds}
        )

    @job(
        name=name, description=description, tags={**(tags or {}), "cmb/worker": name}, executor_def=in_process_executor
    )
    def _worker_job() -> None:
        _worker_op()

    return _worker_job


def keep_running_sensor(
    worker: JobDefinition,
    *,
    minimum_interval_seconds: int = 15,
    handover_seconds: int = HANDOVER_SECONDS,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """A sensor that keeps ``worker`` running: it launches a run (working ``CMB_WORKER_RUN_SECONDS``) when none
    works, and the next run ``handover_seconds`` before the working one ends.

    For that while both run (dagster.yaml allows two runs per ``cmb/worker`` tag): the successor waits for the
    partitions, which the ending run releases and announces, so the successor takes them at once.
    """

    @sensor(
        name=f"{worker.name}_keeper",
        job=worker,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Keeps {worker.name} running; launches each run's successor before it ends.",
    )
    def _keeper(context: SensorEvaluationContext) -> RunRequest | SkipReason:
        runs = context.instance.get_runs(RunsFilter(job_name=worker.name, statuses=WAITING_STATUSES), limit=1)
        if runs:
            return SkipReason(f"run {runs[0].run_id} of {worker.name} is {runs[0].status.value}: it takes over")
        working = context.instance.get_run_records(RunsFilter(job_name=worker.name, statuses=WORKING_STATUSES), limit=2)
        if len(working) > 1:
            return SkipReason(f"{len(working)} runs of {worker.name} are working")
        if working:
            handover_at = _ends_at(working[0], worker.name) - handover_seconds
            if handover_at > time.time():
                return SkipReason(
                    f"run {working[0].dagster_run.run_id} works; its successor is launched in "
                    f"{handover_at - time.time():.0f} s"
                )
        seconds = Settings.from_env().worker_run_seconds
        return RunRequest(run_config={"ops": {f"{worker.name}_op": {"config": {"duration_seconds": seconds}}}})

    return _keeper


def _ends_at(record: RunRecord, job_name: str) -> float:
    """When a working run of a worker job ends (epoch seconds), from its start and its configured duration."""
    started = record.start_time or time.time()  # STARTED but no start event yet: it has just started
    config = record.dagster_run.run_config.get("ops", {}).get(f"{job_name}_op", {}).get("config", {})
    return started + float(config.get("duration_seconds", WorkerConfig().duration_seconds))


def dagster_name(text: str) -> str:
    """``text`` as a part of a Dagster name: every character but A-Z a-z 0-9 _ as ``_``."""
    return re.sub(r"[^A-Za-z0-9_]", "_", text)


def worker_job_names(prefix: str, base: str, workers: int) -> list[str]:
    """Names of an engine's worker jobs: ``<prefix><base>`` for one, ``<prefix><base>_<i>_of_<n>`` for several."""
    if workers == 1:
        return [f"{prefix}{base}"]
    return [f"{prefix}{base}_{i}_of_{workers}" for i in range(workers)]


LAUNCH_INTERVAL_SECONDS = 5
"""Seconds between the ticks of a launch sensor."""


def launch_sensor_name(prefix: str, engine: str, job_name: str) -> str:
    """The sensor that launches the runs of ``job_name`` an engine asks for."""
    return f"{prefix}{engine}_launch_{job_name}"


def launch_sensors(
    prefix: str, engine: str, job_names: Sequence[str], *, older_run_key_tags: Sequence[str] = ()
) -> list[SensorDefinition]:
    """One sensor per job an engine launches: it turns the stored requests of its code location into
    ``RunRequest``s with their run keys (one run per key) and deletes them on its next tick.

    A request whose run config the job refuses is dropped with a log line; one whose key a run of an older release
    carries in ``older_run_key_tags`` is not launched again.
    """
    return [_launch_sensor(launch_sensor_name(prefix, engine, name), name, older_run_key_tags) for name in job_names]


def _launch_sensor(name: str, job_name: str, older_tags: Sequence[str]) -> SensorDefinition:
    @sensor(
        name=name,
        job_name=job_name,
        minimum_interval_seconds=LAUNCH_INTERVAL_SECONDS,
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Launches the runs of {job_name} that cmb_dagster's workers ask for, one per run key.",
    )
    def _launch(context: SensorEvaluationContext, cmb: CmbResource) -> SensorResult:
        done = _launched(context.cursor)
        taken = run_requests.take(cmb.database, location=location_of(context), sensor=name, done=done)
        job = context.repository_def.get_job(job_name) if context.repository_def is not None else None
        requests = []
        for request in taken:
            if any(context.instance.get_run_ids(RunsFilter(tags={t: request.run_key}), limit=1) for t in older_tags):
                continue
            refused = config_error(job, request.run_config) if job is not None else None
            if refused is not None:
                context.log.warning(f"run {request.run_key} of {job_name} not launched: {refused}")
                continue
            requests.append(
                RunRequest(run_key=request.run_key, run_config=dict(request.run_config), tags=dict(request.tags))
            )
        cursor = json.dumps([r.id for r in taken])
        if not requests:
            return SensorResult(skip_reason=SkipReason("no run requested"), cursor=cursor)
        return SensorResult(run_requests=requests, cursor=cursor)

    return _launch


def _launched(cursor: str | None) -> list[int]:
    """The request ids a launch sensor's cursor names (an operator may set any text: what is not ids is none)."""
    try:
        ids = json.loads(cursor or "[]")
        ids = [int(i) for i in ids] if isinstance(ids, list) else []
    except (ValueError, TypeError):
        return []
    return [i for i in ids if 0 < i < 2**63][: run_requests.MAX_TAKEN]


def config_error(job: JobDefinition, run_config: Mapping[str, Any]) -> str | None:
    """Why ``job`` refuses ``run_config`` (None: it accepts it)."""
    try:
        validate_run_config(job, dict(run_config))
    except DagsterInvalidConfigError as exc:
        return f"job {job.name!r} refuses the run config: {'; '.join(e.message for e in exc.errors)[:500]}"
    return None


def location_of(context: SensorEvaluationContext) -> str:
    """The name of the code location a sensor runs in (``default`` when evaluated outside one, as in tests)."""
    origin = context.code_location_origin
    return origin.location_name if origin is not None else DEFAULT_LOCATION


DEFAULT_LOCATION = "default"


class RunRequestLauncher:
    """Launches runs of jobs of the worker's code location: stores a request the job's launch sensor turns into a
    run, once per run key. ``sensors`` maps each job the engine may launch to its launch sensor."""

    def __init__(
        self, database: Database, repository: RepositoryDefinition, sensors: Mapping[str, str], *, location: str
    ) -> None:
        self.database = database
        self.repository = repository
        self.sensors = dict(sensors)
        self.location = location

    @classmethod
    def from_context(
        cls, database: Database, context: OpExecutionContext, sensors: Mapping[str, str]
    ) -> "RunRequestLauncher | None":
        """The launcher of the code location the run ``context`` belongs to (None when run outside one)."""
        origin = context.run.remote_job_origin
        if origin is None:
            return None
        return cls(database, context.repository_def, sensors, location=origin.location_name)

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        """Ask for a run of ``job_name`` (once per ``run_key``). LookupError: not a job this engine launches;
        ValueError: the job refuses ``run_config``."""
        sensor_name = self.sensors.get(job_name)
        if sensor_name is None or not self.repository.has_job(job_name):
            opened = ", ".join(sorted(self.sensors)) or "none"
            raise LookupError(f"{job_name!r} is not a job of this code location it launches (it launches: {opened})")
        refused = config_error(self.repository.get_job(job_name), run_config)
        if refused is not None:
            raise ValueError(refused)
        run_requests.store(
            self.database, location=self.location, sensor=sensor_name, run_key=run_key, run_config=run_config, tags=tags
        )


Observe = Callable[[Database], Sequence[AssetObservation | Verdict]]
"""Reads an engine's status once: an observation per asset and the verdicts of its health checks."""

CheckSpecs = Mapping[AssetKey, Mapping[str, str]]
"""The health checks of each asset: check name -> what it checks."""


def check_evaluation(verdict: Verdict) -> AssetCheckEvaluation:
    """The asset check evaluation showing ``verdict`` (WARN or ERROR when it did not pass)."""
    metadata: dict[str, Any] = {} if verdict.value is None else {"value": verdict.value}
    if verdict.threshold is not None:
        metadata.update(
            {
                f"{k}_at": v
                for k, v in (("warn", verdict.threshold.warn_at), ("error", verdict.threshold.error_at))
                if v is not None
            }
        )
    return AssetCheckEvaluation(
        asset_key=AssetKey(list(verdict.asset)),
        check_name=verdict.check,
        passed=verdict.passed,
        severity=AssetCheckSeverity.WARN if verdict.severity == "warn" else AssetCheckSeverity.ERROR,
        description=verdict.text,
        metadata=metadata,
    )


def status_sensor(
    name: str, observe: Observe, *, minimum_interval_seconds: int, description: str, checks: CheckSpecs | None = None
) -> SensorDefinition:
    """The sensor that brings an engine's status into the UI as observations of its assets and evaluations of
    their checks.

    An observation is recorded when one of its figures changed (ages, the ``*_seconds`` entries, aside) or while
    an age is above zero, i.e. while work waits; an idle engine records nothing. The verdicts are stored in
    Postgres (:func:`cmb_dagster.health.record`, what alerts are sent from); a check's evaluation is recorded when
    its severity changed, and while it fails, when its text did (the UI shows the latest).
    """
    known = {(tuple(key.path), check) for key, names in (checks or {}).items() for check in names}

    @sensor(
        name=name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description=description,
    )
    def _status(context: SensorEvaluationContext, cmb: CmbResource) -> SensorResult | SkipReason:
        previous = json.loads(context.cursor or "{}")
        latest, recorded = {}, []
        found = observe(cmb.database)
        verdicts = [v for v in found if isinstance(v, Verdict)]
        changed = {(t.asset, t.check) for t in health.record(cmb.database, verdicts)}
        for verdict in verdicts:
            if (verdict.asset, verdict.check) not in known:
                continue
            key = f"{AssetKey(list(verdict.asset)).to_user_string()}#{verdict.check}"
            latest[key] = verdict.severity if verdict.passed else f"{verdict.severity}: {verdict.text}"
            if (verdict.asset, verdict.check) in changed or previous.get(key) != latest[key]:
                recorded.append(check_evaluation(verdict))
        for observation in (o for o in found if isinstance(o, AssetObservation)):
            key = observation.asset_key.to_user_string()
            figures = {k: v.value for k, v in observation.metadata.items()}
            latest[key] = json.dumps({k: v for k, v in figures.items() if not k.endswith("_seconds")}, sort_keys=True)
            waiting = any(v for k, v in figures.items() if k.endswith("_seconds"))
            if waiting or latest[key] != previous.get(key):
                recorded.append(observation)
        if not recorded:
            return SkipReason("no change")
        return SensorResult(asset_events=recorded, cursor=json.dumps(latest))

    return _status


def status_definitions(
    name: str,
    observe: Observe,
    *,
    minimum_interval_seconds: int,
    description: str,
    group_name: str,
    assets: Mapping[AssetKey, str],
    checks: CheckSpecs | None = None,
) -> Definitions:
    """An engine's way into the UI: the :func:`status_sensor` ``name``, an observable asset for each key of
    ``assets`` (key -> the asset's description) in ``group_name``, whose Observe button records ``observe``'s
    figures for it, and the asset checks ``checks`` (evaluated by the sensor, or at once by executing them)."""
    return Definitions(
        sensors=[
            status_sensor(
                name, observe, minimum_interval_seconds=minimum_interval_seconds, description=description, checks=checks
            )
        ],
        assets=[_observed_asset(key, group_name, text, observe) for key, text in assets.items()],
        asset_checks=[_checks(f"{name}_checks", observe, checks)] if checks else [],
    )


def _observed_asset(key: AssetKey, group_name: str, description: str, observe: Observe) -> AssetsDefinition:
    """An observable asset whose Observe button records what ``observe`` reports for ``key`` (no Materialize)."""
    spec = AssetSpec(key, group_name=group_name, description=description)

    @multi_observable_source_asset(specs=[spec], name=f"observe_{dagster_name('__'.join(key.path))}")
    def _observed(cmb: CmbResource) -> Iterator[ObserveResult]:
        found = [o for o in observe(cmb.database) if isinstance(o, AssetObservation) and o.asset_key == key]
        yield ObserveResult(asset_key=key, metadata=found[0].metadata if found else {})

    return _observed


def _checks(name: str, observe: Observe, checks: CheckSpecs) -> Any:
    """The asset checks ``checks``, whose execution evaluates them from one ``observe``."""
    specs = [
        AssetCheckSpec(check, asset=key, description=text)
        for key, names in checks.items()
        for check, text in names.items()
    ]

    @multi_asset_check(specs=specs, name=name, can_subset=True)  # a job of a checked asset selects its checks
    def _evaluate(context: AssetCheckExecutionContext, cmb: CmbResource) -> Any:
        verdicts = {(v.asset, v.check): v for v in observe(cmb.database) if isinstance(v, Verdict)}
        health.record(cmb.database, list(verdicts.values()))
        for spec in (s for s in specs if s.key in context.selected_asset_check_keys):
            verdict = verdicts.get((tuple(spec.asset_key.path), spec.name))
            if verdict is None:
                yield AssetCheckResult(
                    asset_key=spec.asset_key, check_name=spec.name, passed=True, description="nothing to check yet"
                )
                continue
            evaluation = check_evaluation(verdict)
            yield AssetCheckResult(
                asset_key=spec.asset_key,
                check_name=spec.name,
                passed=evaluation.passed,
                severity=evaluation.severity,
                description=evaluation.description,
                metadata=evaluation.metadata,
            )

    return _evaluate


def alerts_sensor(options: AlertOptions, settings: CallbackSettings, *, prefix: str = "cmb_") -> SensorDefinition:
    """The sensor that sends an alert to ``options.webhook`` for each check that changed severity (through the
    callbacks engine, whose ``settings`` decide which hosts may be called)."""

    @sensor(
        name=f"{prefix}alerts",
        minimum_interval_seconds=options.interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="Sends a message to the alerts webhook when a check turns red, or green again.",
    )
    def _alerts(context: SensorEvaluationContext, cmb: CmbResource) -> SkipReason:
        sent = send_alerts(cmb.database, options, settings)
        return SkipReason(f"{sent} alerts handed to the callbacks engine" if sent else "no check changed")

    return _alerts
