"""Your code location: a minimal reactive pipeline on cmb_dagster, to edit into your own.

- ``orders`` stands for a load. When it is materialized, its ``ctl_metadata`` entry records in CTL how far
  the orders are loaded: the value ``shop/orders loaded_until`` (the entity is the asset's key).
- ``orders_report`` is a reactive task: the ``cmb_reactive_scheduler`` sensor materializes it as soon as
  ``shop/orders loaded_until`` reaches a new 15-minute chunk. No schedule: it runs when the data is there.

Try it: ``cmb-dagster dev`` in this folder, open the UI, launch the job ``load_orders`` (or materialize
``shop/orders``); within a minute the sensor launches ``cmb_reactive_orders_report``.
``cmb-dagster reactive status`` shows each task's state, ``cmb-dagster ctl get`` the CTL values.
"""

from datetime import UTC, datetime

from dagster import AssetExecutionContext, MaterializeResult, asset, define_asset_job

from cmb_dagster import ReactiveOptions, ReactiveTask, cmb_definitions, ctl_metadata
from cmb_dagster.triggers import ChunkDelta


@asset(key=["shop", "orders"], description="Loads orders; its cmb/ctl metadata advances CTL shop/orders loaded_until.")
def orders(context: AssetExecutionContext) -> MaterializeResult:
    # Load your data here, then say how far it is loaded (e.g. the newest timestamp you loaded).
    loaded_until = datetime.now(UTC).replace(second=0, microsecond=0)
    context.log.info(f"orders loaded until {loaded_until}")
    return MaterializeResult(metadata={**ctl_metadata(loaded_until=loaded_until), "rows": 0})


@asset(deps=[orders], description="Reactive: materialized when orders reach a new 15-minute chunk.")
def orders_report(context: AssetExecutionContext) -> None:
    context.log.info("building the orders report")  # read what `orders` loaded and build the report here


load_orders = define_asset_job("load_orders", selection=[orders])

defs = cmb_definitions(
    assets=[orders, orders_report],  # the reactive scheduler needs the asset graph: pass every asset here
    jobs=[load_orders],
    reactive=ReactiveOptions(
        tasks=[
            # name, what to run (a job, or assets), when: a trigger on CTL values (see cmb_dagster.triggers)
            ReactiveTask("orders_report", [orders_report], ChunkDelta("shop/orders", "loaded_until", "15min")),
        ]
    ),
    # More engines: pubsub=PubSubOptions(...), callbacks=CallbackOptions(...), stages=StageOptions(...),
    # events=EventQueueOptions(...); each adds its workers and jobs (see the package's docs).
)
