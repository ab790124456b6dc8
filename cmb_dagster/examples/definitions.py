"""The example code location: what ``cmb-dagster dev`` shows a new user."""

from cmb_dagster import PubSubOptions, cmb_definitions
from cmb_dagster.examples import callbacks as callbacks_example
from cmb_dagster.examples import eventqueue as eventqueue_example
from cmb_dagster.examples import health, reactive
from cmb_dagster.examples import pubsub as pubsub_example
from cmb_dagster.examples import stages as stages_example

defs = cmb_definitions(
    reactive=reactive.options,
    pubsub=PubSubOptions(consumers=[pubsub_example.consumer]),
    callbacks=callbacks_example.OPTIONS,  # opens 127.0.0.1 for the demo sink
    stages=stages_example.options,
    events=eventqueue_example.options,
    jobs=[
        health.health_check,
        *reactive.example_jobs,
        pubsub_example.pubsub_demo_place_orders,
        *callbacks_example.jobs,
        stages_example.stages_demo_offers,
        *eventqueue_example.example_jobs,
    ],
    assets=reactive.example_assets,
    sensors=reactive.example_sensors,
    schedules=callbacks_example.schedules,
)
