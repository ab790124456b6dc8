import gc
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest
from running import Running
from sessions_helpers import WatchedDatabase
from waiting import wait_until

from cmb_dagster.callbacks import (
    CallbackClient,
    CallbackConflict,
    CallbackInvalidState,
    CallbackNotFound,
    CallbackSettings,
    CallbackStatus,
    InvalidCallbackInput,
    NewCallback,
    RetryPolicy,
)
from cmb_dagster.callbacks.client import CREATE_CHUNK
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.writer import insert_events

URL = "http://127.0.0.1:9/cb"
LOCAL = CallbackSettings(allowed_hosts=["127.0.0.1"])  # private addresses are closed by default


@pytest.fixture
def client(db):
    with CallbackClient(db, LOCAL) as c:
        yield c


def later(seconds: float = 3600) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


def count(db, table: str = "callback_events") -> int:
    with db.connection() as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_create_get_and_idempotent_create(client):
    at = later()
    event_id = client.create("shop", "orders", "o-1", at, URL, {"order": 1}, RetryPolicy.exponential(10, max_delay=60))
    event = client.get("shop", "orders", "o-1")
    assert (event.event_id, event.status, event.run_at, event.originally_run_at) == (event_id, "pending", at, at)
    assert event.context == {"order": 1} and event.retry.backoff == "exponential" and event.attempts == 0
    assert (
        client.create("shop", "orders", "o-1", at, URL, {"order": 1}, RetryPolicy.exponential(10, max_delay=60))
        == event_id
    )
    with pytest.raises(CallbackConflict, match="shop/orders/o-1"):
        client.create("shop", "orders", "o-1", at, URL, {"order": 2})
    with pytest.raises(CallbackNotFound, match="no event shop/orders/nope"):
        client.get("shop", "orders", "nope")


def test_create_many_stores_each_event_as_given(client):
    at = later()
    fast, slow = RetryPolicy.constant(5, fast_retries=0), RetryPolicy.exponential(10, factor=3)
    given = [
        ("k0", at, "text", fast),
        ("k1", at.astimezone(timezone(timedelta(hours=-7, minutes=-30))) + timedelta(microseconds=1), None, None),
        ("k2", at, [1, {"é": None}], slow),
        ("k3", at, {"n": 1.5}, fast),
        ("k4", at.astimezone(timezone(timedelta(hours=5, minutes=30, seconds=15))), 2**70, None),  # offset in seconds
    ]
    ids = client.create_many(
        [
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": key,
                "run_at": run_at,
                "cb_url": URL,
                "context": context,
                "retry": retry,
            }
            for key, run_at, context, retry in given
        ]
    )
    assert len(set(ids)) == len(given)
    for event_id, (key, run_at, context, retry) in zip(ids, given, strict=True):
        event = client.get("a", "g", key)
        assert (event.event_id, event.run_at, event.context, event.retry) == (
            event_id,
            run_at,
            context,
            retry or RetryPolicy(),
        )


def test_create_many_is_all_or_nothing(client, db):
    at = later()
    client.create("a", "g", "taken", at, URL)
    rows = [
        {"owner_client_id": "a", "group_key": "g", "event_key": f"k{i}", "run_at": at, "cb_url": URL} for i in range(3)
    ]
    assert len(client.create_many(rows)) == 3
    clash = [{**rows[0], "event_key": "new"}, {**rows[0], "event_key": "taken", "context": "other"}]
    with pytest.raises(CallbackConflict):
        client.create_many(clash)
    assert count(db) == 4


def test_create_many_again_returns_the_stored_ids_and_adds_the_new(client, db):
    at = later()
    rows = [
        {"owner_client_id": "a", "group_key": "g", "event_key": f"k{i}", "run_at": at, "cb_url": URL} for i in range(4)
    ]
    first = client.create_many(rows[:2])
    with db.connection() as conn:
        drawn_before = conn.execute("SELECT last_value FROM callback_event_ids").fetchone()[0]
    again = client.create_many([rows[2], rows[0], rows[3], rows[1]])
    assert (again[1], again[3]) == (first[0], first[1])
    assert drawn_before < again[0] < again[2] and count(db) == 4
    assert [client.get("a", "g", f"k{i}").event_id for i in range(4)] == [first[0], first[1], again[0], again[2]]


def test_create_many_is_one_transaction_across_its_insert_statements(client, db):
    at = later()
    size = 2 * CREATE_CHUNK + 10  # three statements

    def batch(prefix: str) -> list[dict]:
        return [
            {"owner_client_id": "a", "group_key": "g", "event_key": f"{prefix}{i}", "run_at": at, "cb_url": URL}
            for i in range(size)
        ]

    bad_at_the_end = batch("bad")
    bad_at_the_end[-1]["cb_url"] = ""
    with pytest.raises(InvalidCallbackInput, match="cb_url"):
        client.create_many(bad_at_the_end)
    clash = batch("clash")
    clash[-1] = {**clash[0], "cb_url": "http://127.0.0.1:9/other"}  # the first statement's key, another payload
    with pytest.raises(CallbackConflict):
        client.create_many(clash)
    assert count(db) == 0
    twice = batch("twice")
    twice[-1] = dict(twice[0])
    ids = client.create_many(twice)
    assert ids[-1] == ids[0] and ids[:-1] == sorted(set(ids)) and count(db) == size - 1


def test_create_many_pauses_the_cyclic_collector_and_gives_it_back(client):
    seen = []

    def events():  # read inside the call
        seen.append(gc.isenabled())
        yield {"owner_client_id": "a", "group_key": "g", "event_key": "k", "run_at": later(), "cb_url": URL}

    client.create_many(events())
    assert seen == [False] and gc.isenabled()
    with pytest.raises(InvalidCallbackInput):
        client.create_many(
            [{"owner_client_id": "a", "group_key": "g", "event_key": "k", "run_at": later(), "cb_url": ""}]
        )
    assert gc.isenabled()


def test_bad_input_writes_nothing(client, db):
    with pytest.raises(InvalidCallbackInput, match="^run_at:"):
        client.create("a", "g", "k", datetime(2030, 1, 1), URL)
    with pytest.raises(InvalidCallbackInput, match="^cb_url:"):
        client.create("a", "g", "k", later(), "javascript:alert(1)")
    with pytest.raises(InvalidCallbackInput, match="^status:"):
        client.list(status="done")
    assert count(db) == 0


def test_allowlisted_client_refuses_internal_hosts(db):
    with CallbackClient(db, CallbackSettings(allowed_hosts=["hooks.example.com"])) as client:
        with pytest.raises(InvalidCallbackInput, match="169.254.169.254"):
            client.create("a", "g", "k", later(), "http://169.254.169.254/")
        client.create("a", "g", "k", later(), "https://hooks.example.com/x")
    assert count(db) == 1


def test_cancel_update_delete_follow_the_status_rules(client, db):
    client.create("a", "g", "k", later(), URL, {"v": 1})
    moved = later(7200)
    old_id = client.get("a", "g", "k").event_id
    updated = client.update("a", "g", "k", run_at=moved, context={"v": 2})
    assert (updated.run_at, updated.originally_run_at, updated.context) == (moved, moved, {"v": 2})
    assert updated.event_id > old_id  # re-sequenced: the poller sees it as new wherever run_at now falls

    client.cancel("a", "g", "k")
    with pytest.raises(CallbackInvalidState, match="only pending events can be cancelled"):
        client.cancel("a", "g", "k")
    with pytest.raises(CallbackInvalidState, match="i_ensure_pending"):
        client.update("a", "g", "k", cb_url="http://127.0.0.1:9/other")
    revived = client.update("a", "g", "k", cb_url="http://127.0.0.1:9/other", i_ensure_pending=True)
    assert revived.status == CallbackStatus.PENDING and revived.cb_url.endswith("/other")

    with pytest.raises(InvalidCallbackInput, match="at least one"):
        client.update("a", "g", "k")
    with pytest.raises(InvalidCallbackInput, match="^run_at:"):
        client.update("a", "g", "k", run_at=datetime(2030, 1, 1))

    client.create("a", "g", "soon", later(30), URL)
    with pytest.raises(CallbackInvalidState, match="due within 1 minute"):
        client.delete("a", "g", "soon")
    client.delete("a", "g", "soon", force=True)
    client.delete("a", "g", "k")  # due in two hours: allowed
    with pytest.raises(CallbackNotFound):
        client.delete("a", "g", "k")
    assert count(db) == 0

    actions = [c["action"] for c in client.change_log("a", "g", "k")]
    assert actions == ["update", "cancel", "update", "delete"]
    last = client.change_log("a", "g", "k")[-1]
    assert last["before"]["cb_url"].endswith("/other") and last["after"] is None


def test_notified_events_cannot_change(client, db):
    client.create("a", "g", "k", later(), URL)
    with db.connection() as conn:
        conn.execute("UPDATE callback_events SET status = 'notified'")
    for change in (
        lambda: client.cancel("a", "g", "k"),
        lambda: client.update("a", "g", "k", context=1, i_ensure_pending=True),
    ):
        with pytest.raises(CallbackInvalidState, match="is notified"):
            change()
    assert count(db, "callback_change_log") == 0


def test_buffered_creates_from_many_threads_are_written_in_batches(db):
    # that the poller misses no id committed out of order is tested in test_callbacks_guarantees.py (several processes)
    with (
        CallbackClient(db, CallbackSettings(write_linger=0.02, allowed_hosts=["127.0.0.1"])) as client,
        ThreadPoolExecutor(16) as pool,
    ):
        ids = list(pool.map(lambda i: client.create("a", "g", f"k{i}", later(), URL), range(400)))
    assert len(set(ids)) == 400
    with db.connection() as conn:
        batches = conn.execute("SELECT count(DISTINCT xmin::text) FROM callback_events").fetchone()[0]
    assert batches < 100, batches  # 400 creates in far fewer transactions


def test_buffered_creates_go_on_after_the_writers_connections_were_cut(client, db):
    client.create("a", "g", "before", later(), URL)  # the writers have their connections
    with db.connection() as conn:  # every other session of this database: the writers' too
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with ThreadPoolExecutor(4) as pool:  # both writer threads meet a cut connection
        ids = list(pool.map(lambda i: client.create("a", "g", f"after-{i}", later(), URL), range(8)))
    assert len(set(ids)) == 8 and count(db) == 9


def test_buckets_spread_events_and_can_be_raised_and_lowered(client, db):
    assert client.bucket_ids() == [0, 1, 2, 3]
    client.create_many(
        [
            {"owner_client_id": "a", "group_key": "g", "event_key": f"k{i}", "run_at": later(), "cb_url": URL}
            for i in range(200)
        ]
    )
    assert client.set_bucket_count(6) == [0, 1, 2, 3, 4, 5]
    client.create_many(
        [
            {"owner_client_id": "b", "group_key": "g", "event_key": f"k{i}", "run_at": later(), "cb_url": URL}
            for i in range(200)
        ]
    )
    with db.connection() as conn:
        used = dict(conn.execute("SELECT bucket_id, count(*) FROM callback_events GROUP BY 1").fetchall())
    assert set(used) == {0, 1, 2, 3, 4, 5}
    assert client.set_bucket_count(2) == [0, 1]  # no worker holds the removed ones: their events move at once
    with db.connection() as conn:
        used = dict(conn.execute("SELECT bucket_id, count(*) FROM callback_events GROUP BY 1").fetchall())
    assert set(used) == {0, 1} and sum(used.values()) == 400
    with pytest.raises(InvalidCallbackInput, match="count"):
        client.set_bucket_count(4097)


def test_clean_removes_only_old_finished_events_and_change_log(client, db):
    for key in ("old-done", "old-pending", "new-done"):
        client.create("a", "g", key, later(), URL)
    client.cancel("a", "g", "old-done")
    client.cancel("a", "g", "new-done")
    with db.connection() as conn:
        conn.execute("UPDATE callback_events SET run_at = now() - interval '40 days' WHERE event_key LIKE 'old-%'")
        conn.execute("UPDATE callback_change_log SET at = now() - interval '40 days' WHERE event_key = 'old-done'")
    report = client.clean(ttl_days=30)
    assert (report.events, report.change_log) == (1, 1)
    assert sorted(e.event_key for e in client.list()) == ["new-done", "old-pending"]
    with pytest.raises(InvalidCallbackInput, match="ttl_days"):
        client.clean(ttl_days=-1)


def test_schedules_materialize_once_per_fire_time_even_concurrently(client, db):
    schedule = client.create_schedule("a", "g", "every-minute", "* * * * *", URL, horizon=600, context={"s": 1})
    assert client.create_schedule("a", "g", "every-minute", "* * * * *", URL, horizon=600, context={"s": 1}) == schedule
    with pytest.raises(CallbackConflict):
        client.create_schedule("a", "g", "every-minute", "*/2 * * * *", URL, horizon=600)
    with pytest.raises(InvalidCallbackInput, match="^timezone:"):
        client.create_schedule("a", "g", "bad", "* * * * *", URL, timezone="Nowhere/Land")

    barrier = threading.Barrier(4)

    def materialize() -> int:
        barrier.wait()
        return materialize_schedules(db)

    with ThreadPoolExecutor(4) as pool:
        created = sum(pool.map(lambda _: materialize(), range(4)))
    assert created in (10, 11)  # one per minute over the 10-minute horizon
    assert materialize_schedules(db) == 0
    with db.connection() as conn:
        dupes = conn.execute(
            "SELECT count(*) - count(DISTINCT originally_run_at) FROM callback_events WHERE schedule_id IS NOT NULL"
        ).fetchone()[0]
        linked = conn.execute("SELECT count(*) FROM callback_scheduled_events WHERE event_id IS NOT NULL").fetchone()[0]
    assert dupes == 0 and linked == created
    assert all(e.context == {"s": 1} and e.event_key.startswith("every-minute@") for e in client.list())

    client.pause_schedule("a", "g", "every-minute")
    assert client.list() == [] and materialize_schedules(db) == 0
    client.resume_schedule("a", "g", "every-minute")
    assert materialize_schedules(db) in (9, 10, 11)
    client.delete_schedule("a", "g", "every-minute")
    assert client.list() == [] and client.list_schedules() == []
    with pytest.raises(CallbackNotFound):
        client.pause_schedule("a", "g", "every-minute")


def test_deleting_a_schedule_unlinks_the_events_a_materializer_created_meanwhile(client, db):
    client.create_schedule("a", "g", "s", "* * * * *", URL, horizon=600)
    with db.connection() as materializer, ThreadPoolExecutor(1) as pool:
        schedule_id = materializer.execute("SELECT schedule_id FROM callback_schedules FOR UPDATE").fetchone()[0]
        past = NewCallback(owner_client_id="a", group_key="g", event_key="s@past", run_at=later(-60), cb_url=URL)
        insert_events(materializer, [past], schedule_id=schedule_id)
        deleting = pool.submit(client.delete_schedule, "a", "g", "s")
        wait_until(lambda: waiting_for_a_lock(db), what="the delete waiting for the schedule's lock")
        materializer.commit()
        deleting.result(timeout=10)
    assert client.get("a", "g", "s@past").schedule_id is None and client.list_schedules() == []


def waiting_for_a_lock(db) -> bool:
    with db.connection() as conn:
        return conn.execute(
            "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()[0]


def test_poller_queries_use_the_partial_indexes_at_one_million_pending_events(db):
    with db.connection() as conn:
        conn.execute("SET LOCAL synchronous_commit = off")
        conn.execute(
            """
            INSERT INTO callback_events (event_id, bucket_id, owner_client_id, group_key, event_key, status, run_at,
                                         originally_run_at, cb_url, retry)
            SELECT i, i % 4, 'o', 'g', i::text, CASE WHEN i % 10 = 0 THEN 'notified' ELSE 'pending' END, t, t,
                   'http://x', '{}'
            FROM generate_series(1, 1000000) AS i,
                 LATERAL (SELECT now() + make_interval(secs => i % 86400)) AS r(t)
            """
        )
    from cmb_dagster.callbacks import sql

    params = {
        "bucket": 1,
        "run_at": datetime.now(UTC),
        "event_id": 0,
        "max_event_id": 999000,
        "lookahead": 2.0,
        "limit": 1000,
    }
    with psycopg.connect(db.url, autocommit=True, **db.connect_kwargs) as conn:
        for statistics in ("without statistics", "analyzed"):  # the same plans either way
            if statistics == "analyzed":
                conn.execute("ANALYZE callback_events")
            ahead = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql.POLL_AHEAD, params))
            assert "Index Scan using callback_events_pending on" in ahead, (
                statistics,
                ahead,
            )  # in (run_at, event_id) order
            # query 2 starts at the seen horizon (by the pending ids' index or the primary key, as statistics say), not
            # at the bucket's oldest run_at, below which every called event leaves an entry until vacuum
            late = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql.POLL_LATE, params))
            assert re.search(r"Index Cond: .*event_id > ", late) and "callback_events_pending on" not in late, (
                statistics,
                late,
            )
            for plan in (ahead, late):
                assert "Seq Scan" not in plan and "Sort" not in plan, (statistics, plan)


@pytest.mark.parametrize("statistics", [False, True], ids=["without-statistics", "analyzed"])
def test_outcome_write_reads_events_by_id_with_or_without_statistics(db, statistics):
    with db.connection() as conn:
        conn.execute("SET LOCAL synchronous_commit = off")
        conn.execute(
            """
            INSERT INTO callback_events (event_id, bucket_id, owner_client_id, group_key, event_key, run_at,
                                         originally_run_at, cb_url, retry)
            SELECT i, i % 4, 'o', 'g', i::text, now(), now(), 'http://x', '{"stop_after_delay": 60}'
            FROM generate_series(1, 100000) AS i
            """
        )
    with psycopg.connect(db.url, autocommit=True, **db.connect_kwargs) as conn:
        if statistics:
            conn.execute("ANALYZE callback_events")
        from cmb_dagster.callbacks import sql

        ids = list(range(5000, 5500))
        params = {
            "ids": ids,
            "outcomes": ["notified"] * 500,
            "errors": [None] * 500,
            "delays": [0.0] * 500,
            "codes": [200] * 500,
            "responses": [None] * 500,
            "probed": [None] * 500,
            "cursor_run_at": datetime.now(UTC),
        }
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql.FINISH_EVENTS, params))
        assert "callback_events_pending" not in plan, plan  # every pending event read, for each batch
        assert "Seq Scan on callback_events" not in plan, plan


def test_worker_plans_its_statements_for_the_table_as_it_grows(db):
    """A worker started on a small table keeps index-driven plans once it has grown (statistics unchanged): a plan
    cached while the table was small reads the whole table at every call."""
    from psycopg import ClientCursor

    from cmb_dagster.callbacks import sql
    from cmb_dagster.callbacks.worker import CallbackWorker

    def insert(first: int, last: int) -> None:
        with db.connection() as conn:
            conn.execute("SET LOCAL synchronous_commit = off")
            conn.execute(
                """
                INSERT INTO callback_events (event_id, bucket_id, owner_client_id, group_key, event_key, run_at,
                                             originally_run_at, cb_url, retry)
                SELECT i, i %% 4, 'o', 'g', i::text, t, t, 'http://x', '{}'
                FROM generate_series(%s::int, %s::int) AS i, LATERAL (SELECT now() + make_interval(secs => i)) AS r(t)
                """,
                (first, last),
            )
            conn.execute(  # endpoints, a few of them open, each holding an event
                """
                INSERT INTO callback_endpoints (owner_client_id, endpoint, state, opened_at, probe_at)
                SELECT 'o', 'http://x/' || i, CASE WHEN i %% 100 = 0 THEN 'open' ELSE 'closed' END, now(), now()
                FROM generate_series(%s::int, %s::int) AS i
                """,
                (first, last),
            )

    now = datetime.now(UTC)
    ids = [21, 25, 29]
    upkeep = ("work", "probe", "release", "disable")  # the worker's endpoint upkeep runs with seq scans off
    statements = {
        "gate": (
            sql.GATE,
            {
                "kind": "callbacks.bucket",
                "owner": "me",
                "partitions": ["1"],
                "fences": [1],
                "ids": ids,
                "owners": ["o"],
                "endpoints": ["http://x/"],
                "pairs": [1, 1, 1],
            },
        ),
        "finish": (
            sql.FINISH_EVENTS,
            {
                "ids": ids,
                "outcomes": ["notified"] * 3,
                "errors": [None] * 3,
                "delays": [0.0] * 3,
                "codes": [200] * 3,
                "responses": [None] * 3,
                "probed": [None] * 3,
                "cursor_run_at": now,
            },
        ),
        "record": (
            sql.RECORD_ENDPOINTS,
            {
                "owners": ["o"] * 2,
                "endpoints": ["http://x/3", "http://x/7"],
                "calls": [1, 1],
                "failures": [1, 0],
                "trailing": [1, 0],
                "errors": ["HTTP 503", None],
                "codes": [503, None],
                "window": 60.0,
            },
        ),
        "work": (sql.ENDPOINT_WORK, {}),
        "probe": (sql.PROBE_HELD, {}),
        "release": (sql.RELEASE_HELD, {"limit": 1000}),
        "disable": (
            sql.DISABLE_ENDPOINTS,
            {"disable_after": 3600.0, "group": "cmb.failure", "retry": "{}", "lock_timeout": "0"},
        ),
        "ahead": (sql.POLL_AHEAD, {"bucket": 1, "lookahead": 2.0, "limit": 1000, "run_at": now, "event_id": 0}),
        "late": (sql.POLL_LATE, {"bucket": 1, "limit": 1000, "run_at": now, "max_event_id": 20}),
    }
    watched = WatchedDatabase(db.url)
    try:
        with Running(CallbackWorker(watched, LOCAL)):
            wait_until(lambda: watched.connections, what="the worker's own connection")
    finally:
        watched.close()
    [worker_settings] = watched.session_settings
    insert(1, 40)
    with db.connect(autocommit=True) as conn:  # set up as the worker's connection was
        for name, value in worker_settings.items():
            conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        executions = {}  # name: (EXECUTE statement, its arguments)
        for name, (statement, params) in statements.items():
            names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
            text = re.sub(r"%\((\w+)\)s", lambda m, names=names: f"${names.index(m.group(1)) + 1}", statement)
            conn.execute(f"PREPARE {name} AS {text.replace('%%', '%')}")
            arguments = f"({', '.join(['%s'] * len(names))})" if names else ""
            executions[name] = (f"EXECUTE {name}{arguments}", [params[n] for n in names])
            with conn.transaction(force_rollback=True):
                if name in upkeep:
                    conn.execute(sql.NO_SEQSCAN)
                for _ in range(8):  # past the executions after which Postgres may cache a plan for good
                    ClientCursor(conn).execute(*executions[name])
        insert(41, 50_000)
        plans = {}
        for name, (run, args) in executions.items():
            with conn.transaction(force_rollback=True):
                if name in upkeep:
                    conn.execute(sql.NO_SEQSCAN)
                plans[name] = "\n".join(r[0] for r in ClientCursor(conn).execute("EXPLAIN " + run, args))
    for plan in plans.values():
        assert "Seq Scan on callback_events" not in plan, plans
        assert "Seq Scan on callback_endpoints" not in plan, plans
    assert "callback_events_pkey" in plans["gate"] and "callback_events_pkey" in plans["finish"], plans
    assert "Index Scan using callback_events_pending on" in plans["ahead"] and "Sort" not in plans["ahead"], plans
    assert re.search(r"Index Cond: .*event_id > ", plans["late"]), plans


def test_status_reports_totals_and_each_bucket_set(client, db):
    from cmb_dagster.callbacks import admin

    client.create("a", "g", "late", datetime.now(UTC) - timedelta(minutes=5), URL)
    client.create("a", "g", "later", later(), URL)
    client.cancel("a", "g", "later")
    report = admin.status(db, bucket_sets=2)
    assert (report.totals.pending, report.totals.overdue, report.totals.cancelled) == (1, 1, 1)
    assert report.totals.oldest_overdue_seconds >= 299
    assert [s.bucket_set for s in report.bucket_sets] == [0, 1]
    assert sum(s.pending for s in report.bucket_sets) == 1 == sum(s.overdue for s in report.bucket_sets)
    assert admin.status(db).bucket_sets == [] and admin.status(db, bucket_sets=2, totals=False).totals is None
    with pytest.raises(InvalidCallbackInput, match="bucket_sets"):
        admin.status(db, bucket_sets=-1)


def test_the_old_status_functions_are_deprecated_aliases(db):
    from cmb_dagster.callbacks import admin, callback_counts

    with pytest.deprecated_call(match="status"):
        assert callback_counts(db) == admin.status(db).totals
    with pytest.deprecated_call(match="status"):
        assert admin.bucket_set_counts(db, 3) == admin.status(db, bucket_sets=3, totals=False).bucket_sets


def test_a_context_only_body_is_stored_compared_and_refused_without_a_context(client, db):
    at = later()
    event_id = client.create("hooks", "chat", "k", at, URL, {"text": "hello"}, body="context")
    assert client.get("hooks", "chat", "k").body == "context"
    assert client.create("hooks", "chat", "k", at, URL, {"text": "hello"}, body="context") == event_id
    with pytest.raises(CallbackConflict, match="hooks/chat/k"):
        client.create("hooks", "chat", "k", at, URL, {"text": "hello"})
    with pytest.raises(InvalidCallbackInput, match="body: 'context' sends the context"):
        client.create("hooks", "chat", "none", at, URL, body="context")
    with pytest.raises(InvalidCallbackInput, match="body"):
        client.create("hooks", "chat", "other", at, URL, {"text": "x"}, body="raw")
    assert client.get("hooks", "chat", "k").event_id == event_id and count(db) == 1
    row = {"owner_client_id": "hooks", "group_key": "chat", "run_at": at, "cb_url": URL, "body": "context"}
    with pytest.raises(InvalidCallbackInput, match="body: 'context' sends the context"):  # create_many: the same rule
        client.create_many([{**row, "event_key": "many", "context": {"text": "x"}}, {**row, "event_key": "none"}])
    assert count(db) == 1
