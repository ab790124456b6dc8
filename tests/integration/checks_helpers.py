"""What the health check and alert tests share: ticks of a status sensor, a worker job
run, a handler registry."""

from dagster import build_sensor_context, instance_for_test
from observed import evaluations
from waiting import wait_until

from cmb_dagster import health
from cmb_dagster.eventqueue import HandlerRegistry
from cmb_dagster.resources import CmbResource


class StatusTicks:
    """Ticks of one status sensor, each with the cursor the previous one left."""

    def __init__(self, definitions, sensor: str, database_url: str) -> None:
        self.sensor = definitions.resolve_sensor_def(sensor)
        self.resources = {"cmb": CmbResource(database_url=database_url)}
        self.cursor: str | None = None
        self.seen: dict[str, object] = {}

    def tick(self) -> dict[str, object]:
        """The evaluations this tick recorded (also kept in ``seen``, the latest of each check)."""
        with (
            instance_for_test() as instance,
            build_sensor_context(instance=instance, resources=self.resources, cursor=self.cursor) as context,
        ):
            result = self.sensor.evaluate_tick(context)
        self.cursor = result.cursor or self.cursor
        recorded = evaluations(result)
        self.seen.update(recorded)
        return recorded

    def until(self, check: str, passed: bool, timeout: float = 20) -> object:
        """Tick until ``check`` was recorded with ``passed``; return that evaluation."""

        def recorded() -> object:
            self.tick()
            evaluation = self.seen.get(check)
            return evaluation if evaluation is not None and evaluation.passed == passed else None

        return wait_until(recorded, timeout, f"{check} recorded as {'passed' if passed else 'failed'}", interval=0.1)


def transitions_of(db, check: str) -> list[tuple[str, str]]:
    asset, name = check.rsplit(":", 1)
    return [(t.previous, t.severity) for t in health.transitions(db) if ("/".join(t.asset), t.check) == (asset, name)]


def run_worker(definitions, job_name: str, seconds: float) -> None:
    job = definitions.resolve_job_def(job_name)
    with instance_for_test() as instance:
        config = {"ops": {f"{job_name}_op": {"config": {"duration_seconds": seconds}}}}
        assert job.execute_in_process(instance=instance, run_config=config).success


notes = HandlerRegistry()


@notes.handler("note")
def note(event) -> None:
    pass
