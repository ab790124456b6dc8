"""The stage scheduler against real Postgres: batches, change paths, timers, failures, limits, sharding."""

from __future__ import annotations

import random
import threading
import time
import warnings
from datetime import UTC, datetime

import psycopg
import pytest
from pydantic import BaseModel
from running import Running
from stages_helpers import Seen, Step, drain, pipeline
from waiting import wait_until

from cmb_dagster.models import Backoff
from cmb_dagster.stages import (
    Engine,
    Entity,
    EntityNotFound,
    InvalidStageInput,
    MergePatch,
    Stage,
    StageOptions,
    StageResult,
    StagesStatus,
    StageStore,
    StageWorker,
    UnknownStage,
    entries,
    retry,
    set_shard_count,
    status,
)
from cmb_dagster.stages.models import entity_hash


def by_stage(db):
    return {s.stage: s for s in status(db).stages}


def test_three_stages_run_in_turn_and_keep_state(db):
    stages = pipeline()
    store = StageStore(db, stages)
    store.put_many({f"e{i}": {"a": i} for i in range(50)})
    drain(StageWorker(db, stages))
    for i in range(50):
        entity = store.get(f"e{i}")
        assert entity.payload == {"a": i, "b": i + 1, "c": i + 2, "d": i + 3}
        assert entity.version == 4  # put + three stages, each changed it once
    state, version = store.read_state("e7", "second")
    assert (state, version) == (Seen(runs=1, last_version=2), 1)
    counts = by_stage(db)
    assert [counts[n].processed for n in ("first", "second", "third")] == [50, 50, 50]
    assert all(s.queued == 0 and s.timers == 0 for s in counts.values())
    with db.connection() as conn:  # one post-save publication per commit, with entity and state
        rows = conn.execute("SELECT topic, payload FROM pubsub_events WHERE op = 'publish' ORDER BY id").fetchall()
    assert len(rows) == 150
    _, payload = next(r for r in rows if r[1]["entity_id"] == "e7" and r[0] == "stages.second")
    assert payload["payload"]["c"] == 9 and payload["version"] == 3
    assert payload["state"] == {"runs": 1, "last_version": 2}


def test_sql_hash_matches_python(db):
    ids = ["", "a", "offer-42", "ünïcode", "x" * 256]
    with db.connection() as conn:
        got = [conn.execute("SELECT stage_hash(%s)", (i,)).fetchone()[0] for i in ids]
    assert got == [entity_hash(i) for i in ids]


def test_write_bypassing_the_api_is_processed_like_one_through_it(db):
    stages = pipeline()
    worker = StageWorker(db, stages)
    worker.setup()  # installs the capture
    with db.connection() as conn:
        conn.execute("""INSERT INTO stage_entities (entity_id, payload) VALUES ('sql-1', '{"a": 1}')""")
    drain(worker)
    store = StageStore(db, stages)
    assert store.get("sql-1").payload == {"a": 1, "b": 2, "c": 3, "d": 4}
    with db.connection() as conn:  # a plain UPDATE bumps the version and is processed again
        conn.execute("""UPDATE stage_entities SET payload = payload || '{"a": 10}' WHERE entity_id = 'sql-1'""")
    assert store.get("sql-1").version == 5
    drain(worker)
    assert store.get("sql-1").payload == {"a": 10, "b": 11, "c": 12, "d": 13}


def test_concurrent_external_writes_never_lose_to_a_stage_result(database_url):
    """Property: random external merge patches land while process runs; no stage result is written over
    a newer version, the stages rerun on the new version, and the final state is a fixpoint."""
    from cmb_dagster import Database

    db = Database(database_url)
    rng = random.Random(12)
    external = psycopg.connect(database_url, autocommit=True)
    writes: list[int] = []
    last_x: dict[str, int] = {}
    a_bumps: dict[str, int] = {}

    class Racing(Step):
        def process(self, entity: Entity, state: Seen) -> StageResult:
            result = super().process(entity, state)
            if rng.random() < 0.3:  # an external write to another field, committed while we run
                bump = rng.randint(1, 1000)
                external.execute(
                    "UPDATE cmb.stage_entities SET payload = jsonb_set(payload, '{x}', %s::jsonb) WHERE entity_id = %s",
                    (str(bump), entity.id),
                )
                writes.append(bump)
                last_x[entity.id] = bump
            if rng.random() < 0.1:
                external.execute(
                    "UPDATE cmb.stage_entities SET payload = jsonb_set(payload, '{a}', "
                    "to_jsonb((payload->>'a')::int + 100)) WHERE entity_id = %s",
                    (entity.id,),
                )
                a_bumps[entity.id] = a_bumps.get(entity.id, 0) + 1
            return result

    stages = [Racing("first", "a", "b"), Racing("second", "b", "c"), Racing("third", "c", "d")]
    store = StageStore(db, stages)
    store.put_many({f"e{i}": {"a": i} for i in range(40)})
    drain(StageWorker(db, stages))
    assert writes, "the property needs external writes"
    for i in range(40):
        p = store.get(f"e{i}").payload
        assert p["b"] == p["a"] + 1 and p["c"] == p["a"] + 2 and p["d"] == p["a"] + 3, p
        # no external write was overwritten by a stage result computed before it
        assert p.get("x") == last_x.get(f"e{i}") and p["a"] == i + 100 * a_bumps.get(f"e{i}", 0), p
    conflicts = sum(s.conflicts for s in status(db).stages)
    assert conflicts > 0
    # every committed result was computed from the version it replaced: the state remembers it
    with db.connection() as conn:
        bad = conn.execute("""
            SELECT count(*) FROM pubsub_events WHERE op = 'publish' AND (payload->>'changed')::bool
              AND (payload->'state'->>'last_version')::int <> (payload->>'version')::int - 1""").fetchone()[0]
    assert bad == 0
    external.close()
    db.close()


class Reminder(BaseModel):
    fired: list[float] = []


class TimerStage(Stage):
    """Withdraws an entity ``after`` seconds after it first saw it."""

    name = "withdraw"
    state_model = Reminder

    def __init__(self, after: float) -> None:
        super().__init__()
        self.after = after
        self.calls: list[tuple[str, float, float | None]] = []

    def should_process(self, entity: Entity, state: Reminder) -> bool:
        return entity.payload.get("status") == "active" and "due" not in entity.payload

    def process(self, entity: Entity, state: Reminder) -> StageResult:
        now = time.time()
        due = entity.payload.get("due")
        self.calls.append((entity.id, now, due))
        if due is None:
            due = now + self.after
            return StageResult(update=MergePatch({"due": due}), timer=datetime.fromtimestamp(due, UTC))
        if now < due:  # woken early by something else: wait for the timer
            return StageResult(timer=datetime.fromtimestamp(due, UTC))
        return StageResult(update=MergePatch({"status": "withdrawn"}), new_state=Reminder(fired=[now]))


def test_timers_fire_at_their_time_never_before_also_after_a_restart(db):
    stage = TimerStage(after=0.6)
    store = StageStore(db, [stage])
    store.put_many({f"t{i}": {"status": "active"} for i in range(5)})
    first = StageWorker(db, [stage])
    drain(first)
    assert all(store.get(f"t{i}").payload["status"] == "active" for i in range(5))
    assert by_stage(db)["withdraw"].timers == 5
    before = len(stage.calls)
    # the queue itself refuses entries not yet due (not only the worker's plan)
    assert first.engine.process_batch(range(8), ["withdraw"]).taken == 0
    assert len(stage.calls) == before
    # a new worker (a restart) fires them
    with Running(StageWorker(db, StageOptions(stages=[stage], listen=False), owner="second")):
        wait_until(
            lambda: all(store.get(f"t{i}").payload["status"] == "withdrawn" for i in range(5)), 10, "timers fired"
        )
    fired = [(now, due) for _, now, due in stage.calls if due is not None]
    assert fired and all(now >= due for now, due in fired)  # never early
    lateness = max(now - due for now, due in fired)
    assert lateness < 5


class Flaky(Stage):
    name = "flaky"
    max_attempts = 3
    backoff = Backoff(first=0.05, factor=2, max=300)

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        if entity.payload.get("fail"):
            raise RuntimeError(f"cannot handle {entity.id}")
        return StageResult(update=MergePatch({"ok": True}))


def test_failing_process_retries_with_backoff_then_parks_and_can_be_retried(db):
    stage = Flaky()
    store = StageStore(db, [stage])
    store.put_many({"bad": {"fail": True}, "good": {}})
    worker = StageWorker(db, [stage])
    drain(worker, settle=0.6)
    assert store.get("good").payload == {"ok": True}
    bad = store.get("bad")
    assert bad.payload == {"fail": True} and bad.version == 1  # left unchanged
    [entry] = entries(db, stage="flaky", problems=True)
    assert entry.attempts == 3 and entry.parked_at is not None and "RuntimeError: cannot handle bad" in entry.last_error
    assert by_stage(db)["flaky"].parked == 1 and by_stage(db)["flaky"].errors == 3
    store.put("bad", {"fail": False})  # fixed; a change does not unpark it
    drain(worker)
    assert by_stage(db)["flaky"].parked == 1
    assert retry(db, stage="flaky") == 1
    drain(worker)
    assert store.get("bad").payload == {"fail": False, "ok": True}
    assert entries(db, stage="flaky") == []


class Bad(Stage):
    name = "bad"

    class state_model(BaseModel):
        n: int = 0

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        kind = entity.payload["kind"]
        if kind == "state":
            return StageResult(new_state=Seen())
        if kind == "update":
            return StageResult(update=["not", "an", "object"])  # type: ignore[arg-type]
        if kind == "nan":
            return StageResult(update={"x": float("nan")})
        if kind == "timer":
            return StageResult(timer=datetime(2030, 1, 1))
        return "not a result"  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("state", "new_state: stage 'bad' must return a state_model, not Seen"),
        ("update", "update: stage 'bad' must return a dict or MergePatch, not list"),
        ("nan", "update: not JSON-serializable"),
        ("timer", "timer: a naive datetime"),
        ("result", "result: stage 'bad' must return a StageResult"),
    ],
)
def test_invalid_results_are_typed_errors_and_write_nothing(db, kind, message):
    stage = Bad(max_attempts=1)
    store = StageStore(db, [stage])
    store.put("x", {"kind": kind})
    drain(StageWorker(db, [stage]))
    [entry] = entries(db, stage="bad")
    assert entry.parked_at is not None and "InvalidStageResult" in entry.last_error and message in entry.last_error
    assert store.get("x").version == 1
    assert store.read_state("x", "bad")[1] == 0


def test_state_api_compare_and_set(db):
    stages = pipeline()
    store = StageStore(db, stages)
    store.put("s", {"z": 1})
    assert store.read_state("s", "first") == (Seen(), 0)
    assert store.update_state("s", "first", Seen(runs=5), 0) is True
    assert store.update_state("s", "first", Seen(runs=6), 0) is False  # stale version
    assert store.read_state("s", "first") == (Seen(runs=5), 1)
    assert store.update_state("s", "first", {"runs": 7}, 1) is True
    with pytest.raises(UnknownStage, match="stage: no stage named 'nope'"):
        store.read_state("s", "nope")
    with pytest.raises(UnknownStage):
        store.update_state("s", "nope", Seen(), 0)
    with pytest.raises(InvalidStageInput, match=r"^new_state: not a valid Seen: runs: [^\n]*$"):
        store.update_state("s", "first", {"runs": "many"}, 2)
    with pytest.raises(EntityNotFound):
        store.read_state("missing", "first")


def test_bad_input_is_refused_and_writes_nothing(db):
    store = StageStore(db, pipeline())
    with pytest.raises(InvalidStageInput, match="entity_id: 257 characters"):
        store.put("x" * 257, {})
    with pytest.raises(InvalidStageInput, match="payload of 'p': must be a JSON object, not list"):
        store.put("p", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidStageInput, match="payload of 'q': not JSON-serializable"):
        store.put_many({"ok": {"a": 1}, "q": {"a": object()}})
    store.put("r", {"a": 1})
    with pytest.raises(InvalidStageInput, match="patch: must be a JSON object"):
        store.patch("r", [1])  # type: ignore[arg-type]
    assert store.get("r").version == 1
    assert store.get("ok") is None  # nothing half-written
    with pytest.raises(EntityNotFound):
        store.patch("nobody", {"a": 1})


def test_merge_patch_through_the_api_and_delete(db):
    stages = pipeline()
    store = StageStore(db, stages)
    store.put("m", {"a": 1, "keep": {"x": 1, "y": 2}})
    v = store.patch("m", {"keep": {"y": None, "z": 3}})
    assert store.get("m").payload == {"a": 1, "keep": {"x": 1, "z": 3}} and v == 2
    assert store.patch("m", {"a": 1}) == 2  # no change, no version
    drain(StageWorker(db, stages))
    assert store.delete("m") is True and store.get("m") is None and store.delete("m") is False
    assert entries(db) == []


class Asks(Stage):
    def __init__(self, name: str, answer, fields=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.name = name  # type: ignore[misc]
        self.answer = answer
        self.fields = fields  # type: ignore[misc]
        self.asked = 0
        self.processed: list[str] = []

    def should_process(self, entity: Entity, state: BaseModel):  # type: ignore[no-untyped-def]
        self.asked += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        self.processed.append(entity.id)
        return StageResult()


def test_should_process_raising_enqueues_anyway_and_fields_filter(db):
    raising = Asks("raising", RuntimeError("boom"))
    no = Asks("no", False)
    price = Asks("price", True, fields=("price",))
    stages = [raising, no, price]
    store = StageStore(db, stages)
    store.put("f", {"title": "t"})
    worker = StageWorker(db, stages)
    drain(worker)
    assert raising.processed == ["f"] and no.processed == [] and no.asked == 1
    assert price.processed == ["f"]  # a new entity: every field is new
    store.patch("f", {"title": "u"})
    drain(worker)
    assert price.asked == 1 and price.processed == ["f"]  # title changes do not ask it
    store.patch("f", {"price": 3})
    drain(worker)
    assert price.asked == 2 and price.processed == ["f", "f"]


class Capped(Stage):
    """Flips a counter forever with its partner: a combinatorial explosion of triggers."""

    def __init__(self, name: str, counter: str) -> None:
        super().__init__(max_triggers=2, trigger_window=30)
        self.name = name  # type: ignore[misc]
        self.counter = counter

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        return StageResult(update=MergePatch({self.counter: entity.payload.get(self.counter, 0) + 1}))


def test_retrigger_cap_defers_and_counts(db, caplog):
    stages = [Capped("ping", "p"), Capped("pong", "q")]
    store = StageStore(db, stages)
    store.put("loop", {})
    drain(StageWorker(db, stages))
    payload = store.get("loop").payload
    assert payload["p"] <= 3 and payload["q"] <= 3  # not endless
    counts = by_stage(db)
    assert counts["ping"].capped + counts["pong"].capped >= 1
    assert counts["ping"].timers + counts["pong"].timers >= 1  # deferred to the next window, not dropped
    assert "re-triggered" in caplog.text


def test_rescan_fills_the_low_priority_queue_drained_after_the_main_one(db):
    order: list[tuple[str, int]] = []

    class Recorder(Stage):
        name = "recorder"

        def should_process(self, entity: Entity, state: BaseModel) -> bool:
            return entity.payload.get("n", 0) >= 0

        def process(self, entity: Entity, state: BaseModel) -> StageResult:
            order.append((entity.id, entity.payload.get("n", 0)))
            return StageResult()

    stage = Recorder()
    engine = Engine(db, [stage], batch_size=1000)
    with db.connection() as conn:  # old entities, never seen by the stage (as after a deploy)
        conn.execute(
            "INSERT INTO stage_entities (entity_id, payload) SELECT 'old' || i, '{}' FROM generate_series(1, 30) i"
        )
    seen, offered, stopped = engine.rescan()
    assert (seen, offered, stopped) == (30, 30, None)
    assert by_stage(db)["recorder"].low_priority == 30
    store = StageStore(db, [stage])
    store.put_many({f"new{i}": {"n": 1} for i in range(5)})
    set_shard_count(db, 1)
    worker = StageWorker(db, [stage])
    drain(worker)
    first_old = next(i for i, (eid, _) in enumerate(order) if eid.startswith("old"))
    assert {eid for eid, _ in order[:first_old]} == {f"new{i}" for i in range(5)}
    assert len(order) == 35
    assert engine.rescan()[1] == 35  # nothing queued any more: asked again


def test_two_workers_on_the_same_shards_never_overlap_on_an_entity(database_url):
    from cmb_dagster import Database

    db = Database(database_url)
    active: dict[str, str] = {}
    overlaps: list[str] = []
    lock = threading.Lock()

    class Slow(Step):
        def process(self, entity: Entity, state: Seen) -> StageResult:
            with lock:
                if entity.id in active:
                    overlaps.append(f"{entity.id}: {active[entity.id]} and {self.name}")
                active[entity.id] = self.name
            time.sleep(0.001)
            try:
                return super().process(entity, state)
            finally:
                with lock:
                    del active[entity.id]

    # three stages all due at once on every new entity: without one worker per shard they would overlap
    stages = [Slow("first", "a", "b"), Slow("second", "a", "c"), Slow("third", "a", "d")]
    store = StageStore(db, stages)
    set_shard_count(db, 2)
    options = StageOptions(stages=stages, batch_size=20, idle_sleep=0.05, lease_ttl=2.0, listen=False)
    workers = [StageWorker(Database(database_url), options, owner=f"w{i}") for i in range(2)]

    def done() -> bool:
        with db.connection() as conn:
            return (
                conn.execute("SELECT count(*) FROM stage_entities WHERE payload ?& array['b', 'c', 'd']").fetchone()[0]
                == 300
            )

    with Running(*workers):
        store.put_many({f"o{i}": {"a": i} for i in range(300)})
        wait_until(done, 30, "all entities through three stages")
    for w in workers:
        w.db.close()
    assert overlaps == []
    with db.connection() as conn:
        per_stage = conn.execute("SELECT stage, count(*) FROM stage_states GROUP BY stage").fetchall()
    assert sorted(per_stage) == [("first", 300), ("second", 300), ("third", 300)]
    db.close()


def test_changing_the_shard_count_while_workers_run_loses_nothing(database_url):
    from cmb_dagster import Database

    db = Database(database_url)
    stages = pipeline()
    store = StageStore(db, stages)
    worker = StageWorker(db, StageOptions(stages=stages, idle_sleep=0.05, lease_ttl=1.5, listen=False))
    with Running(worker), db.connection() as conn:
        for round_, count in enumerate([3, 16, 1, 5]):
            store.put_many({f"r{round_}-{i}": {"a": i} for i in range(100)})
            set_shard_count(db, count)
        wait_until(
            lambda: conn.execute("SELECT count(*) FROM stage_entities WHERE payload ? 'd'").fetchone()[0] == 400,
            30,
            "every entity processed",
        )
        calls = conn.execute("SELECT sum(processed) FROM stage_counters").fetchone()[0]
    assert calls == 1200  # each stage once per entity: nothing duplicated
    db.close()


def test_a_batch_whose_lease_was_taken_over_while_its_stage_ran_writes_nothing(db):
    """No transaction is open while a stage runs, so a lease that lapses meanwhile is taken over at once;
    the old holder's results are then refused by the fence, and the entry runs again under the new one."""
    from cmb_dagster.workers import LeaseLost, Leases

    entered, release = threading.Event(), threading.Event()
    runs: list[str] = []

    class Blocking(Stage):
        name = "blocking"

        def process(self, entity: Entity, state: BaseModel) -> StageResult:
            runs.append(threading.current_thread().name)
            entered.set()
            release.wait(10)
            return StageResult(update=MergePatch({"runs": len(runs)}))

    stage = Blocking()
    set_shard_count(db, 1)
    StageStore(db, [stage]).put("b", {})
    old = Engine(db, [stage])
    old.changes_batch([0])
    lease = Leases(db, "stages.shard", "A", ttl=1).acquire(["shard:0/1"])["shard:0/1"]
    report = old.start_batch([0], ["blocking"], leases=[lease], shard_count=1)
    assert report.taken == 1 and entered.wait(5)  # A's call runs, its claim committed
    taken = wait_until(lambda: Leases(db, "stages.shard", "B", ttl=30).acquire(["shard:0/1"]), 5, "B takes the shard")
    release.set()
    assert old.executor.wait_all(5), "A's call ends"
    with pytest.raises(LeaseLost):
        old.collect(leases=[lease])
    assert StageStore(db).get("b").payload == {}  # A's result was not written
    new = Engine(db, [stage])
    assert new.process_batch([0], ["blocking"], leases=[taken["shard:0/1"]], shard_count=1).processed == 1
    assert StageStore(db).get("b").payload == {"runs": 2} and not entries(db, stage="blocking")
    old.close()
    new.close()


def test_status_reports_the_shard_count_and_a_row_per_stage(db):
    stages = pipeline()
    StageStore(db, stages).put_many({f"s{i}": {"a": i} for i in range(3)})
    drain(StageWorker(db, stages))
    report = status(db)
    assert isinstance(report, StagesStatus) and report.shard_count == 8
    assert [row.stage for row in report.stages] == ["first", "second", "third"]
    assert report.stage("second").processed == 3 and report.stage("none yet").processed == 0
    with pytest.warns(DeprecationWarning, match=r"status\(\).stages"):
        rows = list(report)  # status() returned the list of rows before
    assert rows == report.stages


def test_the_listen_keyword_still_sets_the_option(db):
    with pytest.warns(DeprecationWarning, match="StageOptions"):
        worker = StageWorker(db, pipeline(), listen=False)
    assert worker.options.listen is False and [s.name for s in worker.options.stages] == ["first", "second", "third"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert StageWorker(db, StageOptions(stages=pipeline(), listen=False)).options.listen is False


def test_a_write_wakes_an_idle_worker_at_once(db):
    stages = pipeline()
    worker = StageWorker(db, StageOptions(stages=stages, idle_sleep=60))
    with Running(worker):
        wait_until(lambda: worker.listening, 10, "the worker listens")
        StageStore(db, stages).put("w", {"a": 1})
        wait_until(lambda: StageStore(db).get("w").payload.get("d") == 4, 10, "the entity through every stage")
