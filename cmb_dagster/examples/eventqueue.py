"""Event queue example: an op that records an order and emits a receipt event in the same transaction,
a Python handler, a cron handler, and a handler that is a Dagster job."""

from dagster import Config, OpExecutionContext, job, op

from cmb_dagster.eventqueue import Backoff, EventQueueOptions, HandlerRegistry
from cmb_dagster.eventqueue.dagster_defs import EventQueueResource

handlers = HandlerRegistry()


@handlers.handler("send_receipt", max_retries=5, backoff=Backoff(first=2.0), lock_expiry=60)
def send_receipt(event) -> None:  # type: ignore[no-untyped-def]
    print(f"receipt for order {event.value['order']} (event {event.id}, attempt {event.retries + 1})")


@handlers.handler("heartbeat")
def heartbeat(event) -> None:  # type: ignore[no-untyped-def]
    print(f"cron heartbeat {event.value}")


handlers.cron("heartbeat_every_5_minutes", "*/5 * * * *", handler="heartbeat", value={"from": "cron"})
handlers.dagster_job("daily_report", job_name="eventqueue_demo_report")

# Checks every 10 s; a single held event fails the "held" check (README: "See a check turn red").
options = EventQueueOptions(
    handlers=handlers, workers=1, observe_interval_seconds=10, checks={"held": {"warn_at": None, "error_at": 1}}
)


class OrderConfig(Config):
    order: int = 42


@op(description="Records an order and emits send_receipt and daily_report events in the op's own transaction.")
def place_order(context: OpExecutionContext, config: OrderConfig, events: EventQueueResource) -> None:
    with events.connection() as conn:
        conn.execute("SELECT 1")  # your own writes go here: the events exist only if they commit
        receipt = events.emit("shop", "send_receipt", {"order": config.order}, conn=conn)
        report = events.emit(
            "shop", "daily_report", {"ops": {"write_report": {"config": {"order": config.order}}}}, delay=10, conn=conn
        )
    context.log.info(f"emitted events {receipt} and {report}")


@job(description="Emits an event queue demo: a receipt now, a Dagster-job handler run 10 s later.")
def eventqueue_demo_place_order() -> None:
    place_order()


class ReportConfig(Config):
    order: int = 0


@op
def write_report(context: OpExecutionContext, config: ReportConfig) -> None:
    context.log.info(f"report after order {config.order}")


@job(description="Launched by the daily_report event handler with the event's value as run config.")
def eventqueue_demo_report() -> None:
    write_report()


example_jobs = [eventqueue_demo_place_order, eventqueue_demo_report]
