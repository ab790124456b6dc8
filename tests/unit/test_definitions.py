"""cmb_definitions: one options object per engine, names under a prefix, the user's definitions merged in."""

import subprocess
import sys

import pytest
from dagster import Definitions, job, op
from tags import invalid_tag_keys

from cmb_dagster import (
    CallbackOptions,
    ConsumerSpec,
    InvalidInput,
    PubSubOptions,
    ReactiveOptions,
    ReactiveTask,
    cmb_definitions,
)
from cmb_dagster.triggers import Delta


@op
def noop() -> None:
    pass


@job
def report() -> None:
    noop()


def names(defs: Definitions) -> set[str]:
    repo = defs.get_repository_def()
    return (
        {j.name for j in repo.get_all_jobs()}
        | {s.name for s in repo.sensor_defs}
        | {s.name for s in repo.schedule_defs}
    )


def everything(prefix: str) -> Definitions:
    return cmb_definitions(
        prefix=prefix,
        reactive=ReactiveOptions(tasks=[ReactiveTask("t", report, Delta("a/b", "p", "1h"))]),
        pubsub=PubSubOptions(consumers=[ConsumerSpec(consumer_id="c", handler="m:f")]),
        callbacks=CallbackOptions(),
    )


def test_two_locations_with_different_prefixes_share_no_name():
    ours = names(everything("team_a_")) - {"__ASSET_JOB", "report"}
    theirs = names(everything("team_b_")) - {"__ASSET_JOB", "report"}
    assert ours and not ours & theirs
    assert all(name.startswith("team_a_") for name in ours)


def test_every_tag_the_engines_put_on_their_jobs_and_schedules_is_a_key_dagster_accepts():
    from cmb_dagster.examples import eventqueue, stages

    defs = cmb_definitions(
        reactive=ReactiveOptions(tasks=[ReactiveTask("t", report, Delta("a/b", "p", "1h"))]),
        pubsub=PubSubOptions(consumers=[ConsumerSpec(consumer_id="c", handler="m:f")]),
        callbacks=CallbackOptions(workers=2),
        stages=stages.options,
        events=eventqueue.options,
        jobs=eventqueue.example_jobs,
    )
    repo = defs.get_repository_def()
    tagged = [*repo.get_all_jobs(), *repo.schedule_defs]
    assert {name for item in tagged for name in item.tags} >= {"cmb/worker"}
    assert [(item.name, invalid_tag_keys(item.tags)) for item in tagged if invalid_tag_keys(item.tags)] == []


def test_nothing_is_added_that_was_not_asked_for():
    defs = cmb_definitions(jobs=[report])
    assert names(defs) - {"__ASSET_JOB"} == {"report"}
    assert "cmb" in defs.get_repository_def().get_top_level_resources()


def test_reactive_names_take_the_prefix_too():
    defs = cmb_definitions(
        prefix="x_", reactive=ReactiveOptions(tasks=[ReactiveTask("t", report, Delta("a/b", "p", "1h"))])
    )
    assert "x_reactive_scheduler" in names(defs)


@pytest.mark.parametrize(
    "make",
    [lambda: CallbackOptions(workers=0), lambda: PubSubOptions(trim_cron="often"), lambda: CallbackOptions(unknown=1)],
)
def test_bad_options_are_invalid_input_naming_the_field(make):
    with pytest.raises(InvalidInput, match="workers|trim_cron|unknown"):
        make()


def test_example_location_loads_without_beta_warnings() -> None:
    """A code location loads in every Dagster process, many times: a warning there floods the terminal."""
    loaded = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import cmb_dagster.examples.definitions"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "BetaWarning" not in loaded.stderr, loaded.stderr


def test_a_translator_chooses_the_key_and_group_of_every_asset_the_engines_add():
    from dagster import AssetKey

    from cmb_dagster import CmbTranslator
    from cmb_dagster.examples import eventqueue, stages

    class Translator(CmbTranslator):
        def get_asset_key(self, engine, name):
            return AssetKey(["ops", engine, *name])

        def get_group_name(self, engine):
            return f"monitoring_{engine}"

    def assets(translator):
        defs = cmb_definitions(
            reactive=ReactiveOptions(tasks=[ReactiveTask("t", report, Delta("a/b", "p", "1h"))]),
            pubsub=PubSubOptions(consumers=[ConsumerSpec(consumer_id="c", handler="m:f")]),
            callbacks=CallbackOptions(),
            stages=stages.options,
            events=eventqueue.options,
            jobs=eventqueue.example_jobs,
            **({"translator": translator} if translator else {}),
        )
        return {spec.key: spec for spec in defs.resolve_all_asset_specs()}

    default = assets(None)
    engines = {key.path[0] for key in default}
    assert engines == {"callbacks", "database", "eventqueue", "pubsub", "reactive", "stages"}
    chosen = assets(Translator())
    assert set(chosen) == {AssetKey(["ops", *key.path]) for key in default}
    assert {key: asset.group_name for key, asset in chosen.items()} == {
        key: f"monitoring_{key.path[1]}" for key in chosen
    }


def test_the_locations_own_executor_is_kept_as_given():
    from dagster import in_process_executor

    defs = cmb_definitions(
        reactive=ReactiveOptions(tasks=[ReactiveTask("t", report, Delta("a/b", "p", "1h"))]),
        executor=in_process_executor,
    )
    assert defs.executor is in_process_executor
    assert (
        cmb_definitions(reactive=ReactiveOptions(tasks=[ReactiveTask("t", report, Delta("a/b", "p", "1h"))])).executor
        is None
    )


def test_the_translator_tags_the_runs_of_every_worker_job():
    import json

    from cmb_dagster import CmbTranslator
    from cmb_dagster.examples import eventqueue, stages

    pod = {"container_config": {"resources": {"requests": {"cpu": "250m"}}}}

    class Translator(CmbTranslator):
        def get_worker_tags(self, engine, job_name):
            return {"dagster-k8s/config": json.dumps(pod), "team": f"{engine}:{job_name}"}

    defs = cmb_definitions(
        pubsub=PubSubOptions(consumers=[ConsumerSpec(consumer_id="c", handler="m:f")]),
        callbacks=CallbackOptions(workers=2),
        stages=stages.options,
        events=eventqueue.options,
        jobs=eventqueue.example_jobs,
        translator=Translator(),
    )
    workers = [w for w in defs.get_repository_def().get_all_jobs() if "cmb/worker" in w.tags]
    assert {w.tags["team"].split(":")[0] for w in workers} == {"callbacks", "eventqueue", "pubsub", "stages"}
    assert len(workers) == 5
    for worker in workers:
        assert worker.tags["team"].split(":")[1] == worker.name
        assert worker.tags["cmb/worker"] == worker.name
        assert json.loads(worker.tags["dagster-k8s/config"]) == pod
