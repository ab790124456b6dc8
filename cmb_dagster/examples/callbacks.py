"""Callbacks example: a job that schedules a demo HTTP callback and a one-off delayed Dagster run.

``cmb-dagster dev`` serves the local sink at http://127.0.0.1:8765 and prints each callback it receives
(elsewhere, run ``cmb-dagster callbacks sink``).
"""

from datetime import UTC, datetime, timedelta

from dagster import Config, DefaultScheduleStatus, OpExecutionContext, ScheduleDefinition, job, op

from cmb_dagster.callbacks import CallbackClient, CallbackOptions, CallbackSettings, RetryPolicy
from cmb_dagster.resources import CmbResource

DEMO_SINK = "http://127.0.0.1:8765"  # the sink `cmb-dagster dev` (or `cmb-dagster callbacks sink`) serves
# Private addresses are closed by default: open the local sink explicitly (and keep any public host open).
SETTINGS = CallbackSettings(allowed_hosts=["*", "127.0.0.1"])
OPTIONS = CallbackOptions(settings=SETTINGS, jobs=["callbacks_demo_target"])


class DemoConfig(Config):
    delay_seconds: float = 30.0


@op(description="Schedules an HTTP callback to the local sink and a delayed run of callbacks_demo_target.")
def schedule_demo_callbacks(context: OpExecutionContext, config: DemoConfig, cmb: CmbResource) -> None:
    client = CallbackClient(cmb.database, SETTINGS, buffered=False)
    at = datetime.now(UTC) + timedelta(seconds=config.delay_seconds)
    key = context.run_id[:8]
    client.create(
        "examples",
        "demo",
        f"http-{key}",
        at,
        f"{DEMO_SINK}/demo",
        {"hello": "from cmb_dagster"},
        RetryPolicy.constant(10, stop_after_delay=300),
    )
    message = f"launched by a callback scheduled in run {key}"
    client.create(
        "examples",
        "demo",
        f"dagster-{key}",
        at + timedelta(seconds=30),
        "dagster://callbacks_demo_target",
        {"run_config": {"ops": {"say_hello": {"config": {"message": message}}}}, "tags": {"cmb/demo": key}},
    )
    context.log.info(f"callbacks scheduled for {at.isoformat()} (HTTP) and 30 s later (Dagster run)")


@job(description="Schedules demo callbacks: an HTTP call to the local sink and a one-off delayed Dagster run.")
def callbacks_demo() -> None:
    schedule_demo_callbacks()


class HelloConfig(Config):
    message: str = "hello"


@op
def say_hello(context: OpExecutionContext, config: HelloConfig) -> None:
    context.log.info(config.message)


@job(description="Launched by a dagster:// callback at the time it was scheduled for.")
def callbacks_demo_target() -> None:
    say_hello()


jobs = [callbacks_demo, callbacks_demo_target]
schedules = [
    ScheduleDefinition(job=callbacks_demo, cron_schedule="0 * * * *", default_status=DefaultScheduleStatus.RUNNING)
]
