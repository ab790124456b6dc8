"""Your assets: a minimal reactive pipeline on cmb_dagster, to edit into your own.

- ``orders`` stands for a load. When it is materialized, its ``ctl_metadata`` entry records in CTL how far
  the orders are loaded: the value ``shop/orders loaded_until`` (the entity is the asset's key).
- ``orders_report`` is materialized by the reactive task in ``../reactive/defs.yaml`` as soon as
  ``shop/orders loaded_until`` reaches a new 15-minute chunk. No schedule: it runs when the data is there.

Try it: ``cmb-dagster dev`` in the project's folder, open the UI, materialize ``shop/orders`` (or
``dg launch --assets shop/orders``); within a minute the reactive scheduler materializes ``orders_report``.
``cmb-dagster reactive status`` shows each task's state, ``cmb-dagster ctl get`` the CTL values.
"""

from datetime import UTC, datetime

from dagster import AssetExecutionContext, MaterializeResult, asset

from cmb_dagster import ctl_metadata


@asset(key=["shop", "orders"], description="Loads orders; its cmb/ctl metadata advances CTL shop/orders loaded_until.")
def orders(context: AssetExecutionContext) -> MaterializeResult:
    # Load your data here, then say how far it is loaded (e.g. the newest timestamp you loaded).
    loaded_until = datetime.now(UTC).replace(second=0, microsecond=0)
    context.log.info(f"orders loaded until {loaded_until}")
    return MaterializeResult(metadata={**ctl_metadata(loaded_until=loaded_until), "rows": 0})


@asset(deps=[orders], description="Reactive: materialized when orders reach a new 15-minute chunk.")
def orders_report(context: AssetExecutionContext) -> None:
    context.log.info("building the orders report")  # read what `orders` loaded and build the report here
