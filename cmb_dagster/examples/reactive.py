"""Reactive example: two loaders advance CTL values; a reactive job runs when both say new data is there.

- ``orders_loader`` (an op job) writes ``shop/orders loaded_until`` through the ``ctl`` resource;
- ``prices_loader`` (an asset job) materializes ``shop/prices`` with a ``cmb/ctl`` metadata entry, which
  the reactive scheduler sensor applies to CTL by itself;
- ``sales_report`` runs when orders reached a new 5-minute chunk since its last run AND prices are
  at most 10 minutes old. ``example_loaders`` launches both loaders every 5 minutes (at once after a
  start), so the first reactive run appears within a minute of starting the UI.
- ``heartbeat_report`` has a deadline: a successful run every minute. It runs once ``demo/heartbeat sent_at``
  (set by hand: ``cmb-dagster ctl set demo/heartbeat sent_at <now>``) has not changed for 10 seconds, so its
  deadline check on the ``reactive/tasks`` asset (evaluated every 10 s with ``options``) turns red a minute
  after the last heartbeat and green after the next one.
"""

from datetime import UTC, datetime

from dagster import (
    DefaultSensorStatus,
    MaterializeResult,
    OpExecutionContext,
    RunRequest,
    SensorEvaluationContext,
    asset,
    define_asset_job,
    job,
    op,
    sensor,
)

from cmb_dagster import CmbResource, CtlResource, ReactiveOptions, ReactiveTask, ctl_metadata, launched_values
from cmb_dagster.reactive import Deadline
from cmb_dagster.triggers import All, ChunkDelta, Delay, Settle

ORDERS = ("shop/orders", "loaded_until")
PRICES = ("shop/prices", "loaded_until")
HEARTBEAT = ("demo/heartbeat", "sent_at")


def _loaded_until() -> datetime:
    return datetime.now(UTC).replace(second=0, microsecond=0)


@op(description="Pretends to load orders, then records how far they are loaded in CTL.")
def load_orders(context: OpExecutionContext, ctl: CtlResource) -> None:
    moment = _loaded_until()
    change = ctl.set(*ORDERS, moment)
    context.log.info(f"orders loaded until {moment}" + ("" if change else " (unchanged)"))


@job(description="Loads orders and advances CTL shop/orders loaded_until.")
def orders_loader() -> None:
    load_orders()


@asset(key=["shop", "prices"], description="Prices; the cmb/ctl metadata entry advances CTL shop/prices loaded_until.")
def prices() -> MaterializeResult:
    return MaterializeResult(metadata={**ctl_metadata(loaded_until=_loaded_until()), "rows": 42})


prices_loader = define_asset_job("prices_loader", selection=[prices])


@sensor(jobs=[orders_loader, prices_loader], minimum_interval_seconds=30, default_status=DefaultSensorStatus.RUNNING)
def example_loaders(context: SensorEvaluationContext) -> list[RunRequest]:
    """Launches both loaders every 5 minutes."""
    now = _loaded_until()
    slot = now.replace(minute=now.minute - now.minute % 5).isoformat()
    return [RunRequest(run_key=f"{name}:{slot}", job_name=name) for name in ("orders_loader", "prices_loader")]


@op(description="Builds the report for the CTL values the reactive scheduler launched it on.")
def build_sales_report(context: OpExecutionContext, cmb: CmbResource) -> None:
    values = launched_values(context.run.tags, cmb)  # why it runs: the run's first log entry
    context.log.info(f"sales report for orders up to {values.get(ORDERS)} with prices as of {values.get(PRICES)}")


@job(description="Reactive: runs when orders reach a new 5-minute chunk and prices are fresh.")
def sales_report() -> None:
    build_sales_report()


@op(description="Reports the heartbeat the reactive scheduler launched it on.")
def report_heartbeat(context: OpExecutionContext, cmb: CmbResource) -> None:
    context.log.info(f"heartbeat sent at {launched_values(context.run.tags, cmb).get(HEARTBEAT)}")


@job(description="Reactive, with a deadline: must succeed every minute; runs 10 s after each heartbeat.")
def heartbeat_report() -> None:
    report_heartbeat()


reactive_tasks = [
    ReactiveTask(
        "sales_report",
        sales_report,
        All(ChunkDelta(*ORDERS, "5min"), Delay(*PRICES, "10min")),
        priority=10,
    ),
    ReactiveTask("heartbeat_report", heartbeat_report, Settle(*HEARTBEAT, "10s"), deadline=Deadline(cron="* * * * *")),
]
options = ReactiveOptions(tasks=reactive_tasks, observe_interval_seconds=10)  # checks evaluated every 10 s
example_jobs = [orders_loader, prices_loader]
example_assets = [prices]
example_sensors = [example_loaders]
