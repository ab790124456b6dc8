"""The Dagster shell every engine shares: bounded-time worker jobs and the sensors that keep them running, the
launcher of queued runs, the status sensor, the observable assets and the asset checks that bring an engine's
status into the UI."""

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
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    Definitions,
    JobDefinition,
    ObserveResult,
    OpExecutionContext,
    QueuedRunCoordinator,
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
)

# Dagster has no public API to create a run of another job of the code location from inside a run: these are the
# origins ``dagster job launch`` builds.
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
from pydantic import Field

from cmb_dagster import health
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


def worker_job_names(prefix: str, base: str, workers: int) -> list[str]:
    """Names of an engine's worker jobs: ``<prefix><base>`` for one, ``<prefix><base>_<i>_of_<n>`` for several."""
    if workers == 1:
        return [f"{prefix}{base}"]
    return [f"{prefix}{base}_{i}_of_{workers}" for i in range(workers)]


class QueuedRunLauncher:
    """Launches runs of jobs in the worker's own code location, queued for the daemon.

    A run is tagged with its run key (``run_key_tag``); launching the same key again returns the run
    launched before, also when it was tagged with one of ``also_tags``. The run's origins are the current run's.
    """

    def __init__(
        self,
        instance: DagsterInstance,
        repository: RepositoryDefinition,
        remote_origin: RemoteRepositoryOrigin,
        python_origin: RepositoryPythonOrigin,
        *,
        run_key_tag: str,
        also_tags: Sequence[str] = (),
    ) -> None:
        self.instance = instance
        self.repository = repository
        self.remote_origin = remote_origin
        self.python_origin = python_origin
        self.run_key_tag = run_key_tag
        self.also_tags = tuple(also_tags)

    @classmethod
    def from_context(
        cls, context: OpExecutionContext, *, run_key_tag: str, also_tags: Sequence[str] = ()
    ) -> "QueuedRunLauncher | None":
        """The launcher for the code location of the run ``context`` belongs to (None when run in process)."""
        run = context.dagster_run
        if run.remote_job_origin is None or run.job_code_origin is None:
            return None
        return cls(
            context.instance,
            context.repository_def,
            run.remote_job_origin.repository_origin,
            run.job_code_origin.repository_origin,
            run_key_tag=run_key_tag,
            also_tags=also_tags,
        )

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """Queue a run of ``job_name`` (once per ``run_key``); return its run id."""
        for tag in (self.run_key_tag, *self.also_tags):
            existing = self.instance.get_run_ids(RunsFilter(tags={tag: run_key}), limit=1)
            if existing:
                return existing[0]
        if not self.repository.has_job(job_name):
            raise LookupError(f"code location has no job {job_name!r}")
        if not isinstance(self.instance.run_coordinator, QueuedRunCoordinator):
            raise RuntimeError(  # the deployment's setting is wrong, not an argument's type
                f"launching {job_name!r} needs the QueuedRunCoordinator (see dagster.yaml)"
            )
        run = self.instance.create_run_for_job(
            job_def=self.repository.get_job(job_name),
            run_config=dict(run_config),
            tags={**tags, self.run_key_tag: run_key},
            remote_job_origin=RemoteJobOrigin(repository_origin=self.remote_origin, job_name=job_name),
            job_code_origin=JobPythonOrigin(job_name, self.python_origin),
        )
        self.instance.submit_run(run.run_id, workspace=None)  # type: ignore[arg-type]
        return run.run_id


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

    @multi_observable_source_asset(specs=[spec], name=f"observe_{re.sub(r'[^A-Za-z0-9_]', '_', '__'.join(key.path))}")
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
