import subprocess
import sys

import pytest
from dagster import (
    AssetKey,
    RunRequest,
    build_sensor_context,
    instance_for_test,
    job,
    op,
)
from observed import observations
from tags import invalid_tag_keys

from cmb_dagster import PubSubOptions, cmb_definitions
from cmb_dagster.examples import pubsub as demo
from cmb_dagster.pubsub import InvalidPubSubInput, publish
from cmb_dagster.pubsub.dagster_defs import pubsub_sensor
from cmb_dagster.resources import CmbResource


@op
def handle_event() -> None:
    pass


@job
def per_change() -> None:
    handle_event()


def test_demo_orders_flow_through_the_consumer_job_and_lag_is_observed(db, database_url):
    defs = cmb_definitions(
        resource=CmbResource(database_url=database_url),
        jobs=[demo.pubsub_demo_place_orders],
        pubsub=PubSubOptions(consumers=[demo.consumer]),
    )
    consumer_job = defs.resolve_job_def("cmb_pubsub_consumer_demo_order_totals_branch_100")
    assert consumer_job.tags["cmb/worker"] == consumer_job.name  # one run per consumer (dagster.yaml limit)
    with instance_for_test() as instance:
        assert defs.resolve_job_def("pubsub_demo_place_orders").execute_in_process(instance=instance).success
        result = consumer_job.execute_in_process(
            instance=instance,
            run_config={"ops": {f"{consumer_job.name}_op": {"config": {"duration_seconds": 1.0}}}},
        )
        assert result.success
        with build_sensor_context(instance=instance, resources={"cmb": CmbResource(database_url=database_url)}) as ctx:
            [observation] = observations(defs.resolve_sensor_def("cmb_pubsub_status").evaluate_tick(ctx))
        assert observation.asset_key == AssetKey(["pubsub", "demo_order_totals", "branch_100"])
        metadata = observation.metadata
        assert metadata["lag_events"].value == 0 and metadata["delivered"].value == 100
        keeper = defs.resolve_sensor_def(f"{consumer_job.name}_keeper")
        assert isinstance(keeper(build_sensor_context(instance=instance)), RunRequest)
    with db.connection() as conn:
        totals = conn.execute("SELECT sum(orders), sum(amount) FROM public.pubsub_demo_totals").fetchone()
        assert totals == conn.execute("SELECT count(*), sum(amount) FROM public.pubsub_demo_orders").fetchone()
    assert defs.resolve_schedule_def("cmb_pubsub_trim_schedule").cron_schedule == "17 * * * *"
    with instance_for_test() as instance:
        assert (
            defs.resolve_job_def("cmb_pubsub_trim")
            .execute_in_process(
                instance=instance, run_config={"ops": {"cmb_pubsub_trim_op": {"config": {"retain_days": 0}}}}
            )
            .success
        )
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM pubsub_events WHERE branch_id = 100").fetchone() == (0,)


def test_the_sensor_requests_one_run_per_event_with_the_watermark_as_cursor(db, database_url):
    sensor = pubsub_sensor(
        per_change, branch_id=3, batch_size=2, run_config=lambda e: {"tags": {"n": str(e.payload["n"])}}
    )
    resources = {"cmb": CmbResource(database_url=database_url)}
    with db.connection() as conn:
        ids = [publish(3, {"n": n}, conn=conn) for n in range(3)]
        publish(0, {"n": "other branch"}, conn=conn)
    cursor = None
    requested = []
    with instance_for_test() as instance:
        for _ in range(4):
            result = sensor(build_sensor_context(instance=instance, cursor=cursor, resources=resources))
            requested += [r.run_key for r in result.run_requests]
            cursor = result.cursor
        assert requested == [str(i) for i in ids]
        assert observations(result)[0].metadata["lag_events"].value == 0
        with db.connection() as conn:
            late = publish(3, {"n": 3}, conn=conn)
            row = conn.execute(
                "SELECT delivered FROM pubsub_watermarks WHERE consumer_id = 'sensor.per_change_pubsub_branch_3'"
            ).fetchone()
        assert row == (3,)  # the trailing watermark that trim honours
        result = sensor(build_sensor_context(instance=instance, cursor=cursor, resources=resources))
        assert [(r.run_key, r.tags["cmb/pubsub.event"]) for r in result.run_requests] == [(str(late), str(late))]
        assert invalid_tag_keys(result.run_requests[0].tags) == []
        again = sensor(build_sensor_context(instance=instance, cursor=cursor, resources=resources))
        assert [r.run_key for r in again.run_requests] == [str(late)]  # re-evaluated: same run key, deduplicated


def test_engine_modules_do_not_import_dagster():
    code = (
        "import sys, cmb_dagster.pubsub, cmb_dagster.pubsub.cli; "
        "print(sorted(m for m in sys.modules if m == 'dagster' or m.startswith('dagster.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_definitions_refuse_consumers_whose_job_names_collide():
    with pytest.raises(InvalidPubSubInput, match="job name"):
        cmb_definitions(
            pubsub=PubSubOptions(
                consumers=[{"consumer_id": "a.b", "handler": "m:f"}, {"consumer_id": "a_b", "handler": "m:f"}]
            )
        )
    with pytest.raises(InvalidPubSubInput, match="consumer_id"):
        cmb_definitions(pubsub=PubSubOptions(consumers=[{"consumer_id": "", "handler": "m:f"}]))


def test_the_lag_asset_is_observable_only():
    defs = cmb_definitions(pubsub=PubSubOptions(consumers=[demo.consumer]))
    asset = defs.resolve_assets_def(AssetKey(["pubsub", "demo_order_totals", "branch_100"]))
    assert asset.is_observable and not asset.is_materializable  # an Observe button, no Materialize that would fail
