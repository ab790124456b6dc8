import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from dagster import (
    AssetKey,
    Config,
    Definitions,
    SkipReason,
    build_sensor_context,
    instance_for_test,
    job,
    op,
)
from observed import observations
from running import Running
from tags import invalid_tag_keys
from waiting import wait_until

from cmb_dagster.callbacks import (
    CallbackClient,
    CallbackOptions,
    CallbackSettings,
    CallbackWorker,
    InvalidCallbackInput,
)
from cmb_dagster.callbacks.client import CREATE_CHUNK
from cmb_dagster.callbacks.sink import CallbackSink
from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.jobs import DEFAULT_LOCATION, RunRequestLauncher
from cmb_dagster.models import Backoff
from cmb_dagster.resources import CmbResource

FAST = CallbackSettings(
    poll_interval=0.2, lease_ttl=3, timeout=1, backoff=Backoff(first=0.01), lookahead=1, allowed_hosts=["127.0.0.1"]
)


class ReportConfig(Config):
    day: str


@op
def build_report(config: ReportConfig) -> str:
    return config.day


@job
def nightly_report() -> None:
    build_report()


def defs(database_url: str, **options) -> Definitions:
    return cmb_definitions(
        resource=CmbResource(database_url=database_url),
        callbacks=CallbackOptions(settings=FAST, **options),
        jobs=[nightly_report],
    )


def test_definitions_hold_worker_jobs_keepers_cleanup_and_materializer(database_url):
    d = defs(database_url, workers=2, cleanup_cron="30 19 * * *")
    repo = d.get_repository_def()
    assert {"cmb_callbacks_worker_0_of_2", "cmb_callbacks_worker_1_of_2", "cmb_callbacks_cleanup"} <= set(
        repo.job_names
    )
    sensors = {s.name for s in repo.sensor_defs}
    assert {
        "cmb_callbacks_worker_0_of_2_keeper",
        "cmb_callbacks_worker_1_of_2_keeper",
        "cmb_callbacks_schedules_materializer",
    } <= sensors
    assert repo.get_schedule_def("cmb_callbacks_cleanup_schedule").cron_schedule == "30 19 * * *"
    assert repo.get_job("cmb_callbacks_worker_0_of_2").tags["cmb/worker"] == "cmb_callbacks_worker_0_of_2"
    with pytest.raises(ValueError, match="cron"):
        CallbackOptions(cleanup_cron="every evening")


def test_worker_job_calls_events_back_in_process(db, database_url):
    with CallbackSink() as sink, CallbackClient(db, FAST) as client:
        now = datetime.now(UTC)
        for i in range(30):
            client.create("a", "g", f"k{i}", now - timedelta(seconds=i % 3), f"{sink.url}/cb")
        job_def = defs(database_url).resolve_job_def("cmb_callbacks_worker")
        runs = []

        def one_short_run() -> bool:  # runs follow one another, as the keeper sensor hands over
            with instance_for_test() as instance:
                runs.append(
                    job_def.execute_in_process(
                        instance=instance,
                        run_config={"ops": {"cmb_callbacks_worker_op": {"config": {"duration_seconds": 0.5}}}},
                    )
                )
            return {e.status for e in client.list()} == {"notified"}

        wait_until(one_short_run, timeout=60, what="every event notified by worker runs")
        assert all(r.success for r in runs)
        assert len(sink.received) == 30


def test_materializer_sensor_and_cleanup_job(db, database_url):
    d = defs(database_url)
    with CallbackClient(db, FAST) as client:
        client.create_schedule("a", "g", "hourly", "0 * * * *", "http://127.0.0.1:9/cb", horizon=3 * 3600)
        sensor = d.resolve_sensor_def("cmb_callbacks_schedules_materializer")
        with build_sensor_context(resources={"cmb": CmbResource(database_url=database_url)}) as context:
            result = sensor(context)
        assert isinstance(result, SkipReason) and "created 3" in result.skip_message
        assert len(client.list()) == 3

        client.cancel("a", "g", client.list()[0].event_key)
        with db.connection() as conn:
            conn.execute("UPDATE callback_events SET run_at = now() - interval '3 days' WHERE status = 'cancelled'")
        cleanup = d.resolve_job_def("cmb_callbacks_cleanup")
        with instance_for_test() as instance:
            run = cleanup.execute_in_process(
                instance=instance, run_config={"ops": {"cmb_callbacks_clean_op": {"config": {"ttl_days": 2}}}}
            )
        assert run.success
        assert len(client.list()) == 2


def stored_requests(db) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM run_requests").fetchone()[0]


def test_dagster_targets_request_one_run_per_event_of_the_opened_jobs(db, database_url):
    d = defs(database_url, jobs=["nightly_report"])
    sensor = d.resolve_sensor_def("cmb_callbacks_launch_nightly_report")
    launcher = RunRequestLauncher(
        db, d.get_repository_def(), {"nightly_report": sensor.name}, location=DEFAULT_LOCATION
    )
    day = {"run_config": {"ops": {"build_report": {"config": {"day": "2030-01-01"}}}}}
    with CallbackClient(db, FAST) as client:
        client.create(
            "a",
            "g",
            "report",
            datetime.now(UTC) + timedelta(milliseconds=300),
            "dagster://nightly_report",
            {**day, "tags": {"team": "data"}},
        )
        client.create("a", "g", "typo", datetime.now(UTC), "dagster://nightly_reprot")
        client.create("a", "g", "closed", datetime.now(UTC), "dagster://nightly_cleanup", day)
        client.create("a", "g", "refused", datetime.now(UTC), "dagster://nightly_report", {"run_config": {"ops": {}}})
        with Running(CallbackWorker(db, FAST, launcher=launcher)):
            wait_until(
                lambda: (
                    {e.event_key: e.status for e in client.list()}
                    == {"report": "notified", "typo": "failed", "closed": "failed", "refused": "failed"}
                )
            )
        assert "nightly_reprot" in client.get("a", "g", "typo").last_error
        assert "it launches: nightly_report" in client.get("a", "g", "closed").last_error
        assert "refuses the run config" in client.get("a", "g", "refused").last_error
        event = client.get("a", "g", "report")
    assert stored_requests(db) == 1

    resources = {"cmb": CmbResource(database_url=database_url)}
    with instance_for_test() as instance:
        with build_sensor_context(instance=instance, resources=resources, repository_def=d.get_repository_def()) as ctx:
            first = sensor(ctx)
        [request] = first.run_requests
        assert request.run_key == f"cmb-callback-{event.event_id}"
        assert request.tags["team"] == "data" and request.tags["cmb/callback"] == "a/g/report"
        assert request.tags["cmb/launched_by"] == "cmb callback a/g/report" and "user" not in request.tags
        assert invalid_tag_keys(request.tags) == []
        assert request.run_config == day["run_config"]
        # a second call for the same event (say, after a crash before its outcome was written) asks for no second run
        launcher.launch("nightly_report", run_key=request.run_key, run_config=day["run_config"], tags={})
        assert stored_requests(db) == 1
        with build_sensor_context(instance=instance, resources=resources, cursor=first.cursor) as ctx:
            assert sensor(ctx).run_requests == []
    assert stored_requests(db) == 0


def test_a_job_opened_for_callbacks_must_exist(database_url):
    with pytest.raises(Exception, match="nightly_reprot"):
        defs(database_url, jobs=["nightly_reprot"]).get_repository_def()
    with pytest.raises(InvalidCallbackInput, match="jobs"):
        CallbackOptions(jobs=["nightly report; DROP"])


CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


def stored_events(db) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM callback_events").fetchone()[0]


@pytest.mark.parametrize(
    ("context", "field"),
    [
        ({"run_config": {}, "tag": {"team": "data"}}, "context.tag"),  # a typo of tags
        ({"run_config": {}, "tags": {"team": 7}}, "context.tags.team"),
        ({"tags": {"dagster/solid_selection": "build_report"}}, "context.tags.dagster/solid_selection"),
        ({"run_config": "ops: {}"}, "context.run_config"),
    ],
)
def test_a_context_a_dagster_run_cannot_take_is_refused_and_nothing_is_written(db, database_url, context, field):
    at = datetime.now(UTC) + timedelta(hours=1)
    refused = rf"^{re.escape(field)}: "
    row = {"owner_client_id": "a", "group_key": "g", "run_at": at, "cb_url": "dagster://nightly_report"}
    good = {**row, "context": {"run_config": {}, "tags": {"team": "data"}}}
    with CallbackClient(db, FAST) as buffered, CallbackClient(db, FAST, buffered=False) as direct:
        for client in (buffered, direct):
            with pytest.raises(InvalidCallbackInput, match=refused):
                client.create("a", "g", "bad", at, "dagster://nightly_report", context)
            # the bad event last, after more good ones than one insert statement takes
            batch = [{**good, "event_key": f"good-{i}"} for i in range(CREATE_CHUNK + 1)]
            with pytest.raises(InvalidCallbackInput, match=refused):
                client.create_many([*batch, {**row, "event_key": "bad", "context": context}])
        assert stored_events(db) == 0
        direct.create("a", "g", "http", at, "http://127.0.0.1:9/cb", context)  # any JSON for an HTTP target
        with pytest.raises(InvalidCallbackInput, match=refused):
            direct.update("a", "g", "http", cb_url="dagster://nightly_report")  # keeping its context
        assert direct.get("a", "g", "http").cb_url == "http://127.0.0.1:9/cb"
    assert stored_events(db) == 1  # the HTTP event alone


def test_the_cli_refuses_a_context_a_dagster_run_cannot_take_and_writes_nothing(db, database_url):
    def create(key: str, context: dict) -> subprocess.CompletedProcess[str]:
        arguments = ["callbacks", "create", "a", "g", key, "--in", "3600", "--url", "dagster://nightly_report"]
        return subprocess.run(
            [*CLI, *arguments, "--context", json.dumps(context)],
            env={**os.environ, "CMB_DATABASE_URL": database_url},
            capture_output=True,
            text=True,
            timeout=120,
        )

    refused = create("bad", {"run_config": {}, "tag": {"team": "data"}})
    assert refused.returncode == 1 and "context.tag: unknown key" in refused.stderr, refused.stderr
    refused = create("bad", {"tags": {"team": ["data"]}})
    assert refused.returncode == 1 and "context.tags.team: must be a string" in refused.stderr, refused.stderr
    assert stored_events(db) == 0
    created = create("good", {"run_config": {"ops": {}}, "tags": {"team": "data", "dagster/priority": "3"}})
    assert created.returncode == 0 and stored_events(db) == 1, created.stderr


def test_counts_are_observed_when_they_change_and_the_asset_can_be_observed(db, database_url):
    d = defs(database_url)
    sensor = d.resolve_sensor_def("cmb_callbacks_status")
    resources = {"cmb": CmbResource(database_url=database_url)}
    with build_sensor_context(resources=resources) as context:
        first = sensor.evaluate_tick(context)
        [observation] = observations(first)
        assert observation.asset_key == AssetKey(["callbacks", "events"]) and observation.metadata["pending"].value == 0
        with build_sensor_context(resources=resources, cursor=first.cursor) as again:
            assert sensor.evaluate_tick(again).skip_message == "no change"
        with CallbackClient(db, FAST) as client:
            client.create("a", "g", "later", datetime.now(UTC) + timedelta(hours=1), "http://127.0.0.1:9/cb")
        with build_sensor_context(resources=resources, cursor=first.cursor) as changed:
            [observation] = observations(sensor.evaluate_tick(changed))
        assert observation.metadata["pending"].value == 1 and observation.metadata["overdue"].value == 0
    asset = d.resolve_assets_def(AssetKey(["callbacks", "events"]))
    assert asset.is_observable and not asset.is_materializable  # an Observe button, no Materialize that would fail


def test_each_bucket_set_is_observed_on_its_own_asset(db, database_url):
    d = defs(database_url, workers=2)
    keys = [AssetKey(["callbacks", "events_0_of_2"]), AssetKey(["callbacks", "events_1_of_2"])]
    assert all(d.resolve_assets_def(k).is_observable for k in keys)
    sensor = d.resolve_sensor_def("cmb_callbacks_status")
    resources = {"cmb": CmbResource(database_url=database_url)}
    now = datetime.now(UTC)
    with CallbackClient(db, FAST) as client:
        for i in range(40):
            client.create("a", "g", f"k{i}", now + timedelta(hours=1), "http://127.0.0.1:9/cb")
        events = client.list(limit=100)
    in_set = {s: [e for e in events if e.bucket_id % 2 == s] for s in (0, 1)}
    with build_sensor_context(resources=resources) as context:
        first = sensor.evaluate_tick(context)
    figures = {o.asset_key: {k: v.value for k, v in o.metadata.items()} for o in observations(first)}
    assert [figures[k]["pending"] for k in keys] == [len(in_set[0]), len(in_set[1])]
    late, failed = in_set[1][0], in_set[1][1]
    with db.connection() as conn:  # one overdue event and one failed in the last hour, both in set 1
        conn.execute(
            "UPDATE callback_events SET run_at = now() - interval '90 seconds' WHERE event_id = %s", (late.event_id,)
        )
        conn.execute(
            "UPDATE callback_events SET status = 'failed', finished_at = now() WHERE event_id = %s", (failed.event_id,)
        )
    with build_sensor_context(resources=resources, cursor=first.cursor) as context:
        second = sensor.evaluate_tick(context)
    [observation] = observations(second)  # set 0 did not change
    assert observation.asset_key == keys[1]
    seen = {k: v.value for k, v in observation.metadata.items()}
    assert seen["pending"] == len(in_set[1]) - 1 and seen["overdue"] == 1 and seen["failed_last_hour"] == 1
    assert 89 <= seen["oldest_overdue_seconds"] < 3600 and seen["notified_last_hour"] == seen["rejected_last_hour"] == 0
    with build_sensor_context(resources=resources, cursor=second.cursor) as context:
        [again] = observations(sensor.evaluate_tick(context))  # overdue: observed again, its age grows
    assert again.asset_key == keys[1]


def test_the_options_moved_to_models_and_the_asset_key_to_a_function_keep_their_old_paths():
    from cmb_dagster.callbacks import dagster_defs

    options = CallbackOptions(workers=2)
    assert dagster_defs.CallbackOptions is CallbackOptions
    with pytest.deprecated_call(match="counts_asset_key"):
        assert options.counts_asset_key(1) == dagster_defs.counts_asset_key(options, 1)
    assert dagster_defs.counts_asset_key(options, 1) == AssetKey(["callbacks", "events_1_of_2"])
