"""The example code location: what ``cmb-dagster dev`` shows a new user."""

from dagster import Definitions

from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.examples import callbacks as callbacks_example
from cmb_dagster.examples import pubsub as pubsub_example
from cmb_dagster.examples import reactive

defs = cmb_definitions(
    reactive_tasks=reactive.reactive_tasks,
    jobs=[*reactive.example_jobs, pubsub_example.pubsub_demo_place_orders],
    assets=reactive.example_assets,
    sensors=reactive.example_sensors,
    consumers=[pubsub_example.consumer],
    callbacks=callbacks_example.JOBS,  # opens 127.0.0.1 for the demo sink
)
defs = Definitions.merge(defs, callbacks_example.definitions)
