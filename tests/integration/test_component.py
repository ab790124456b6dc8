"""The cmb_dagster Component: a code location's engines from a defs.yaml, loaded with Dagster's own component
test utilities."""

import re

import pytest
from dagster import AssetKey, Definitions
from dagster.components.testing import create_defs_folder_sandbox

from cmb_dagster import CmbComponent, InvalidInput
from cmb_dagster.examples.eventqueue import example_jobs
from cmb_dagster.pubsub import InvalidPubSubInput


def build(attributes: dict):
    with create_defs_folder_sandbox() as sandbox:
        path = sandbox.scaffold_component(
            CmbComponent, defs_yaml_contents={"type": "cmb_dagster.CmbComponent", "attributes": attributes}
        )
        with sandbox.load_component_and_build_defs(defs_path=path) as (component, defs):
            return component, defs


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
    ("attributes", "error", "says"),
    [
        ({"pubsub": {"consumers": [{"consumer_id": "bad id", "handler": "m:f"}]}}, InvalidPubSubInput, "consumer_id"),
        ({"pubsub": {"consumer": []}}, InvalidPubSubInput, "consumer"),
        ({"eventqueue": "nowhere.at_all:options"}, InvalidInput, "eventqueue: cannot load"),
        ({"eventqueue": "no reference"}, InvalidInput, "eventqueue: 'no reference' is not 'module:attribute'"),
        ({"stages": "cmb_dagster.examples.eventqueue:options"}, InvalidInput, "stages: .* not StageOptions"),
    ],
)
def test_bad_options_are_refused_naming_the_field(attributes, error, says):
    with pytest.raises(Exception) as caught:  # Dagster's error names the defs.yaml; ours, its cause, the field
        build(attributes)
    cause = caught.value
    while cause is not None and not isinstance(cause, error):
        cause = cause.__cause__
    assert cause is not None and re.search(says, str(cause)), caught.value
