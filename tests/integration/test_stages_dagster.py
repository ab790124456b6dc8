"""The stage scheduler's Dagster shell: definitions, worker jobs, status observations, keeper, rescan; the
after-commit consumer; limits across workers."""

import threading
import time

from dagster import AssetKey, RunRequest, build_sensor_context, instance_for_test
from observed import observations
from pydantic import BaseModel
from running import Running
from stages_helpers import drain, pipeline
from waiting import wait_until

from cmb_dagster import Database
from cmb_dagster.callbacks.sink import CallbackSink
from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.examples import stages as example
from cmb_dagster.resources import CmbResource
from cmb_dagster.stages import (
    Entity,
    MergePatch,
    SavedEntity,
    Stage,
    StageOptions,
    StageResult,
    StageStore,
    StageWorker,
)


def test_definitions_status_sensor_observes_stages_and_keeper_requests_a_run(database_url):
    options = StageOptions(stages=pipeline(), workers=2, shard_count=4, idle_sleep=0.1)
    defs = cmb_definitions(resource=CmbResource(database_url=database_url), stages=options)
    repo = defs.get_repository_def()
    assert {"cmb_stages_worker_0_of_2", "cmb_stages_worker_1_of_2", "cmb_stages_rescan"} <= set(repo.job_names)
    assert {"cmb_stages_worker_0_of_2_keeper", "cmb_stages_worker_1_of_2_keeper"} <= {s.name for s in repo.sensor_defs}
    assert "cmb_stages_rescan_schedule" in {s.name for s in repo.schedule_defs}
    db = Database(database_url)
    StageStore(db, options.stages).put_many({f"d{i}": {"a": i} for i in range(20)})
    with instance_for_test() as instance:
        for i in range(2):
            name = f"cmb_stages_worker_{i}_of_2"
            result = defs.resolve_job_def(name).execute_in_process(
                instance=instance, run_config={"ops": {f"{name}_op": {"config": {"duration_seconds": 2.0}}}}
            )
            assert result.success
        resources = {"cmb": CmbResource(database_url=database_url)}
        with build_sensor_context(instance=instance, resources=resources) as ctx:
            observed = observations(defs.resolve_sensor_def("cmb_stages_status").evaluate_tick(ctx))
        [metadata] = [o.metadata for o in observed if o.asset_key == AssetKey(["stages", "third"])]
        assert {"queued", "timers", "low_priority", "oldest_seconds", "parked", "conflicts"} <= set(metadata)
        keeper = defs.resolve_sensor_def("cmb_stages_worker_0_of_2_keeper")
        assert isinstance(keeper(build_sensor_context(instance=instance)), RunRequest)
        rescan = defs.resolve_job_def("cmb_stages_rescan").execute_in_process(instance=instance)
        assert rescan.success
    assert StageStore(db).get("d3").payload == {"a": 3, "b": 4, "c": 5, "d": 6}
    db.close()


def test_example_withdraws_and_notifies_the_sink_after_commit(db, monkeypatch):
    monkeypatch.setattr(example, "EXPOSURE", example.timedelta(seconds=0.3))
    with CallbackSink() as sink:
        monkeypatch.setattr(example, "SINK", f"{sink.url}/stages/withdrawn")
        store = StageStore(db, example.options.stages)
        store.put_many({"o1": {"title": "car", "status": "active", "category": "cars", "base_price": 100}})
        worker = StageWorker(db, example.options)
        drain(worker)
        assert store.get("o1").payload["predicted_price"] == 105.0
        time.sleep(0.35)
        drain(worker)
        assert store.get("o1").payload["status"] == "withdrawn"
        wait_until(lambda: sink.received, 5, "a notification")
        call = sink.received[0]
        assert call.body["offer"] == "o1" and call.path == "/stages/withdrawn"


def test_after_commit_runs_at_least_once_with_the_event_id(db):
    seen: list[SavedEntity] = []
    failures = [RuntimeError("first delivery fails")]

    class Notifies(Stage):
        name = "notifies"

        def process(self, entity: Entity, state: BaseModel) -> StageResult:
            return StageResult(update=MergePatch({"done": True}))

        @staticmethod
        def after_commit(saved: SavedEntity) -> None:
            if failures:
                raise failures.pop()
            seen.append(saved)

    stage = Notifies()
    StageStore(db, [stage]).put("n", {})
    with Running(StageWorker(db, [stage])):  # the change path, the stage, then its after-commit call, retried once
        wait_until(lambda: seen, 30, "the after-commit call")
    assert [s.entity_id for s in seen] == ["n"] and seen[0].payload == {"done": True} and seen[0].event_id > 0


class Counting(Stage):
    def __init__(self, name: str, **kw: object) -> None:
        super().__init__(**kw)
        self.name = name  # type: ignore[misc]
        self.lock = threading.Lock()
        self.active = 0
        self.most = 0
        self.times: list[float] = []

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.times.append(time.monotonic())
        time.sleep(0.002)
        with self.lock:
            self.active -= 1
        return StageResult(update=MergePatch({self.name: True}))


def run_two_workers(database_url: str, stage: Stage, count: int) -> None:
    db = Database(database_url)
    options = StageOptions(stages=[stage], shard_count=4, idle_sleep=0.05, batch_size=10, listen=False)
    workers = [StageWorker(Database(database_url), options, owner=f"w{i}", workers=2, index=i) for i in range(2)]
    StageStore(db, [stage]).put_many({f"x{i}": {} for i in range(count)})

    def done() -> bool:
        with db.connection() as conn:
            return (
                conn.execute("SELECT count(*) FROM stage_entities WHERE payload ? %s", (stage.name,)).fetchone()[0]
                == count
            )

    try:
        with Running(*workers):
            wait_until(done, 30, "all processed")
    finally:
        for w in workers:
            w.db.close()
        db.close()


def test_max_parallelism_holds_across_workers(database_url):
    stage = Counting("one_at_a_time", max_parallelism=1)
    run_two_workers(database_url, stage, 80)
    assert stage.most == 1
    free = Counting("free")
    run_two_workers(database_url, free, 200)
    assert free.most >= 2  # without the limit calls do overlap (the test can fail)


def test_rate_limit_holds_across_workers(database_url):
    stage = Counting("limited", rate_limit=20)
    run_two_workers(database_url, stage, 30)
    span = max(stage.times) - min(stage.times)
    # a bucket of 20 tokens, then 20 per second: 30 calls need at least (30 - 20) / 20 s
    assert span >= 0.45
