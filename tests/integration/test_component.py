"""The cmb_dagster Component: a code location's engines from a defs.yaml, loaded with Dagster's own component
test utilities."""

import re
from datetime import UTC, datetime

import pytest
from dagster import AssetKey, Definitions, instance_for_test, job, op
from dagster.components.testing import create_defs_folder_sandbox

from cmb_dagster import (
    CallbacksComponent,
    CmbComponent,
    EventQueueComponent,
    PubSubComponent,
    ReactiveComponent,
    StagesComponent,
)
from cmb_dagster.ctl import CtlStore
from cmb_dagster.examples.eventqueue import example_jobs
from cmb_dagster.reactive import tick_reactive_sensor


def build(attributes: dict):
    with create_defs_folder_sandbox() as sandbox:
        path = sandbox.scaffold_component(
            CmbComponent, defs_yaml_contents={"type": "cmb_dagster.CmbComponent", "attributes": attributes}
        )
        with sandbox.load_component_and_build_defs(defs_path=path) as (component, defs):
            return component, defs


TRIGGER = {"kind": "ChunkDelta", "entity": "shop/orders", "parameter": "loaded_until", "scale": "day"}


def test_a_defs_yaml_turns_on_the_engines_it_names_with_their_options(monkeypatch, database_url):
    monkeypatch.setenv("MY_CMB_URL", database_url)
    component, defs = build(
        {
            "prefix": "shop_",
            "database_url": "{{ env.MY_CMB_URL }}",
            "pubsub": {
                "consumers": [{"consumer_id": "orders", "handler": "cmb_dagster.examples.pubsub:add_to_totals"}]
            },
            "eventqueue": "cmb_dagster.examples.eventqueue:options",
            "translation": {"key_prefix": ["ops"], "group_name": "monitoring"},
        }
    )
    assert isinstance(component, CmbComponent)
    defs = Definitions.merge(defs, Definitions(jobs=example_jobs))  # the team's own jobs, from the defs folder
    jobs = {job.name for job in defs.resolve_all_job_defs()}
    assert "shop_pubsub_consumer_orders_branch_0" in jobs and "shop_events_worker" in jobs
    assert not any(name.startswith("cmb_") for name in jobs)  # the prefix names everything added
    specs = {spec.key: spec for spec in defs.resolve_all_asset_specs()}
    assert AssetKey(["ops", "pubsub", "orders", "branch_0"]) in specs
    assert {spec.key.path[0] for spec in specs.values()} == {"ops"}
    assert {spec.group_name for spec in specs.values()} == {"monitoring"}
    assert defs.resources["cmb"].database_url == database_url


def test_no_engine_named_adds_only_the_resource():
    _, defs = build({})
    assert (
        list(defs.resolve_all_job_defs()) == [] and list(defs.sensors or []) == [] and list(defs.resources) == ["cmb"]
    )


@pytest.mark.parametrize(
    ("attributes", "says"),
    [
        ({"pubsub": {"consumers": [{"consumer_id": "bad id", "handler": "m:f"}]}}, "defs.yaml:4 .*consumer_id"),
        ({"pubsub": {"consumer": []}}, "consumer: Extra inputs are not permitted"),
        ({"eventqueue": "nowhere.at_all:options"}, "eventqueue: cannot load"),
        ({"eventqueue": "no reference"}, "eventqueue: 'no reference' is not 'module:attribute'"),
        ({"stages": "cmb_dagster.examples.eventqueue:options"}, "is a EventQueueOptions, not StageOptions"),
        ({"reactive": {"tasks": [{"name": "r", "assets": ["a"], "trigger": {"kind": "Dleta"}}]}}, "kind: expected one"),
        ({"reactive": {"tasks": [{"name": "r", "assets": ["a"], "trigger": TRIGGER, "job": "m:j"}]}}, "job or assets"),
    ],
)
def test_bad_options_are_refused_naming_the_file_line_and_field(attributes, says):
    with pytest.raises(Exception) as caught:
        build(attributes)
    text, cause = "", caught.value
    while cause is not None:  # Dagster's error names the component; its cause, the defs.yaml line and the field
        text, cause = text + str(cause), cause.__cause__
    assert re.search(r"defs\.yaml:\d+", text) and re.search(says, text), text


ASSETS_PY = """\
from dagster import DailyPartitionsDefinition, asset

daily = DailyPartitionsDefinition(start_date="2026-01-01")


@asset(key=["shop", "orders"])
def orders() -> None: ...


@asset(key=["shop", "sales_mart"], deps=[orders], partitions_def=daily)
def sales_mart() -> None: ...
"""


@op
def write_report() -> None: ...


@job
def report_job() -> None:
    write_report()


def reactive_yaml(entity: str = "shop/orders") -> dict:
    return {
        "type": "cmb_dagster.ReactiveComponent",
        "attributes": {
            "database_url": "{{ env.MY_CMB_URL }}",
            "options": {
                "name": "yaml",
                "assets_from": ["shop"],
                "tasks": [
                    {
                        "name": "sales_mart",
                        "assets": ["shop/sales_mart"],
                        "partition": [entity, "loaded_until"],
                        "trigger": {**TRIGGER, "entity": entity},
                        "deadline": "0 7 * * *",
                    },
                    {"name": "report", "job": "test_component:report_job", "trigger": TRIGGER, "priority": 5},
                ],
            },
        },
    }


def test_reactive_tasks_written_in_yaml_launch_the_partition_their_new_data_covers(monkeypatch, db, database_url):
    monkeypatch.setenv("MY_CMB_URL", database_url)
    with create_defs_folder_sandbox() as sandbox:
        (sandbox.defs_folder_path / "shop").mkdir()
        (sandbox.defs_folder_path / "shop" / "assets.py").write_text(ASSETS_PY)
        sandbox.scaffold_component(ReactiveComponent, defs_path="reports", defs_yaml_contents=reactive_yaml())
        with sandbox.build_all_defs() as defs, instance_for_test() as instance:
            assert {"cmb_reactive_sales_mart", "report_job"} <= {j.name for j in defs.resolve_all_job_defs()}
            CtlStore(db).set("shop/orders", "loaded_until", datetime(2026, 3, 3, 5, tzinfo=UTC))
            result = tick_reactive_sensor(defs, instance=instance)
    launched = {r.tags["cmb/reactive.task"]: r for r in result.run_requests}
    assert set(launched) == {"sales_mart", "report"}, result.skip_message
    assert launched["sales_mart"].partition_key == "2026-03-03"  # the day holding the newest data
    assert launched["report"].job_name == "report_job"


def test_a_misspelt_entity_of_a_yaml_task_fails_at_its_line(monkeypatch, database_url):
    monkeypatch.setenv("MY_CMB_URL", database_url)
    with create_defs_folder_sandbox() as sandbox:
        (sandbox.defs_folder_path / "shop").mkdir()
        (sandbox.defs_folder_path / "shop" / "assets.py").write_text(ASSETS_PY)
        sandbox.scaffold_component(
            ReactiveComponent, defs_path="reports", defs_yaml_contents=reactive_yaml(entity="shop/ordres")
        )
        with pytest.raises(Exception) as caught, sandbox.build_all_defs():
            pass
    text, cause = "", caught.value
    while cause is not None:
        text, cause = text + str(cause), cause.__cause__
    assert re.search(
        r"reports/defs\.yaml:\d+: reactive task 'sales_mart': .*shop/ordres.*did you mean shop/orders", text
    )


@pytest.mark.parametrize(
    "component", [ReactiveComponent, PubSubComponent, CallbacksComponent, StagesComponent, EventQueueComponent]
)
def test_each_engine_component_scaffolds_a_defs_yaml_that_loads(component):
    with create_defs_folder_sandbox() as sandbox:
        path = sandbox.scaffold_component(component, defs_path="engine")
        assert re.match(
            rf"type: cmb_dagster\.(dagster_component\.)?{component.__name__}\n", (path / "defs.yaml").read_text()
        )
        with sandbox.load_component_and_build_defs(defs_path=path) as (loaded, defs):
            assert isinstance(loaded, component) and defs.resolve_all_job_defs() is not None
