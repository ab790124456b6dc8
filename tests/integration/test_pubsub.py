import random
import threading
import time
from datetime import timedelta

import pytest
from psycopg_pool import ConnectionPool
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.pubsub import (
    ConsumerBusy,
    ConsumerSpec,
    ConsumerWorker,
    HandlerFailed,
    InvalidInput,
    StreamRestored,
    drop_consumer,
    install_capture,
    lock_watermark,
    publish,
    remove_capture,
    reset,
    status,
    trim,
)


def consumer_of(db, consumer_id, branch_id, handler, **options):
    """A consumer worker of ``handler`` with the ConsumerSpec ``options``."""
    return ConsumerWorker(db, ConsumerSpec(consumer_id=consumer_id, branch_id=branch_id, handler=handler, **options))


def collect(db, consumer_id="c", branch_id=0, **kwargs):
    """A consumer whose handler appends to the returned list."""
    seen = []
    return consumer_of(db, consumer_id, branch_id, lambda conn, events: seen.extend(events), **kwargs), seen


def drain(consumer):
    total = 0
    while n := consumer.run_once():
        total += n
    return total


def count(db, query, params=None):
    with db.connection() as conn:
        return conn.execute(query, params).fetchone()[0]


@pytest.fixture
def commits(db):
    """The seed's table: trunk commits go to branch 0, approved ones to their approved branch."""
    with db.connection() as conn:
        conn.execute(
            "CREATE TABLE public.commits (id bigint PRIMARY KEY, branch text NOT NULL,"
            " state text NOT NULL DEFAULT 'draft',"
            " approved_branch bigint, body text)"
        )
        install_capture(
            conn,
            "public.commits",
            branch="CASE WHEN state = 'approved' THEN approved_branch WHEN branch = 'trunk' THEN 0 END",
            ops=("insert", "update", "delete"),
        )
    return db


def test_captured_rows_and_published_events_arrive_in_commit_order(commits):
    db = commits
    with db.connection() as conn:
        conn.execute(
            "INSERT INTO commits (id, branch, body) VALUES (1, 'trunk', 'a'), (2, 'trunk', 'b'), (3, 'feature', 'x')"
        )
        publish(0, {"note": "outbox"}, topic="notes", key={"n": 1}, conn=conn)
    with db.connection() as conn:
        conn.execute("UPDATE commits SET state = 'approved', approved_branch = 7 WHERE id = 1")
        conn.execute("DELETE FROM commits WHERE id = 2")
    trunk, seen = collect(db, batch_size=2)
    assert drain(trunk) == 4
    assert [(e.op, e.topic, e.key) for e in seen] == [
        ("insert", "public.commits", {"id": 1}),
        ("insert", "public.commits", {"id": 2}),
        ("publish", "notes", {"n": 1}),
        ("delete", "public.commits", {"id": 2}),
    ]
    assert seen[0].payload == {"id": 1, "branch": "trunk", "state": "draft", "approved_branch": None, "body": "a"}
    assert seen[0].txid == seen[1].txid < seen[3].txid and all(e.branch_id == 0 for e in seen)
    approved, on_seven = collect(db, "c", 7)
    assert drain(approved) == 1 and on_seven[0].payload["state"] == "approved"


def test_tables_with_long_multibyte_names_each_get_their_own_capture(db):
    at_limit = "таблица_заказов_магазина_" + "я" * 8  # 63 bytes: Postgres's limit for a name
    twin = at_limit[:-1] + "ю"  # the same 61 bytes first
    over = "заказы_" * 8 + "один"  # 108 bytes: Postgres keeps the first 63
    with db.connection() as conn:
        names = []
        for name in (at_limit, twin, over):
            conn.execute(f'CREATE TABLE public."{name}" (id int PRIMARY KEY)')
            install_capture(conn, f'public."{name}"')
            names.append(
                conn.execute("SELECT relname FROM pg_class WHERE oid = %s::regclass", (f'public."{name}"',)).fetchone()[
                    0
                ]
            )
        assert len(at_limit.encode()) == len(twin.encode()) == 63 and len(names[2].encode()) <= 63 < len(over.encode())
        functions = conn.execute(
            "SELECT DISTINCT p.proname FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid "
            "WHERE t.tgrelid = ANY(%s::regclass[])",
            ([f'public."{n}"' for n in names],),
        ).fetchall()
        assert len(functions) == 3 and all(len(f[0].encode()) <= 63 for f in functions)
    for i, name in enumerate(names):
        with db.connection() as conn:
            conn.execute(f'INSERT INTO public."{name}" VALUES (%s)', (i,))
    reader, seen = collect(db)
    drain(reader)
    assert [(e.topic, e.key) for e in seen] == [(f"public.{name}", {"id": i}) for i, name in enumerate(names)]
    with db.connection() as conn:
        for name in names:
            remove_capture(conn, f'public."{name}"')
        assert conn.execute("SELECT count(*) FROM pg_proc WHERE proname LIKE 'pubsub_capture_%'").fetchone()[0] == 0


def test_bad_input_is_refused_by_field_and_writes_nothing(commits):
    db = commits
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.plain (id int PRIMARY KEY, v int)")
    cases = [
        (dict(table="public.nope"), "table: no table"),
        (dict(table="plain", key=["nope"]), "key: no column 'nope'"),
        (dict(table="plain", columns=["v", "w"]), "columns: no column 'w'"),
        (dict(table="plain", branch="v +"), r"branch: 'v \+' is not a bigint expression .*syntax error"),
        (dict(table="plain", branch="'text'"), "branch: .*invalid input syntax for type bigint"),
        (dict(table="plain", branch="missing_column"), "branch: .*missing_column"),
        (dict(table="plain", ops=["truncate"]), "ops.0"),
    ]
    for kwargs, message in cases:
        with db.connection() as conn, pytest.raises(InvalidInput, match=message):
            install_capture(conn, **kwargs)
    with db.connection() as conn:
        triggers = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.plain'::regclass").fetchone()[
            0
        ]
        assert triggers == 0
        with pytest.raises(InvalidInput, match="payload: not JSON"):
            publish(0, {"when": object()}, conn=conn)
        with pytest.raises(InvalidInput, match="branch_id: expected an integer"):
            publish("0", {}, conn=conn)
    with pytest.raises(InvalidInput, match="consumer_id: String should match"):
        consumer_of(db, "x" * 64, 0, print)
    with pytest.raises(InvalidInput, match="batch_size"):
        consumer_of(db, "ok", 0, print, batch_size=0)
    with pytest.raises(InvalidInput, match="handler: cannot load"):
        consumer_of(db, "ok", 0, "nowhere.at_all:handler")
    with db.connection() as conn, pytest.raises(InvalidInput, match="consumer_id"):
        lock_watermark(conn, "bad id", 0)
    assert count(db, "SELECT count(*) FROM pubsub_events") == 0
    assert count(db, "SELECT count(*) FROM pubsub_watermarks") == 0


def test_remove_capture_stops_events(commits):
    with commits.connection() as conn:
        remove_capture(conn, "commits")
        conn.execute("INSERT INTO commits (id, branch) VALUES (1, 'trunk')")
    assert count(commits, "SELECT count(*) FROM pubsub_events") == 0


def test_a_raising_handler_rolls_back_and_the_failing_event_is_named(db):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint)")
        ids = [publish(0, {"n": n}, conn=conn) for n in range(5)]

    def handler(conn, events):
        conn.execute("INSERT INTO public.results SELECT unnest(%s::bigint[])", ([e.id for e in events],))
        if any(e.payload["n"] == 3 for e in events):
            raise ValueError("poison")

    consumer = consumer_of(db, "fragile", 0, handler, batch_size=10)
    with pytest.raises(HandlerFailed, match=rf"batch of 5 events \(ids {ids[0]}..{ids[4]}\).*ValueError: poison"):
        consumer.run_once()
    assert count(db, "SELECT count(*) FROM public.results") == 0
    assert count(db, "SELECT event_id FROM pubsub_watermarks") == 0
    assert consumer.run_once() == 2  # in halves until the poison is alone: the first half goes through
    with pytest.raises(HandlerFailed, match=rf"batch of 2 events \(ids {ids[2]}..{ids[3]}\).*in batches of 1"):
        consumer.run_once()
    assert consumer.run_once() == 1
    with pytest.raises(HandlerFailed, match=rf"failed on event {ids[3]} \(attempt 1 of 10\): ValueError: poison"):
        consumer.run_once()
    with pytest.raises(HandlerFailed, match=rf"failed on event {ids[3]} \(attempt 2 of 10\)"):
        consumer.run_once()
    assert count(db, "SELECT count(*) FROM public.results") == 3
    assert count(db, "SELECT failing_event FROM pubsub_watermarks") == ids[3]


def test_the_watermark_lock_serialises_identical_consumers(db):
    with db.connection() as conn:
        publish(0, {}, conn=conn)
        lock_watermark(conn, "same", 0)  # created at zero, committed
    holder = db.connect()
    lock_watermark(holder, "same", 0)
    with db.connection() as conn, pytest.raises(ConsumerBusy, match="'same' of branch 0 is busy"):
        lock_watermark(conn, "same", 0, wait=False)
    waiting, seen = collect(db, "same")
    done = threading.Event()
    thread = threading.Thread(target=lambda: (waiting.run_once(), done.set()))
    thread.start()
    wait_until(  # blocked on the row lock while the other transaction holds the watermark
        lambda: count(
            db,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%%pubsub_watermarks%%' AND pid <> pg_backend_pid()",
        ),
        what="the second consumer waits for the watermark lock",
    )
    assert not done.is_set()
    holder.rollback()
    thread.join(5)
    assert done.is_set() and len(seen) == 1
    holder.close()


def test_competing_consumers_apply_each_event_once(db):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint NOT NULL)")
        conn.execute(
            "INSERT INTO pubsub_events (branch_id, topic, op, payload)"
            " SELECT 0, 't', 'publish', '{}' FROM generate_series(1, 3000)"
        )

    def handler(conn, events):
        conn.execute("INSERT INTO public.results SELECT unnest(%s::bigint[])", ([e.id for e in events],))

    consumers = [consumer_of(db, "shared", 0, handler, batch_size=50) for _ in range(3)]
    threads = [threading.Thread(target=drain, args=(c,)) for c in consumers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert count(db, "SELECT count(*) FROM public.results") == 3000
    assert count(db, "SELECT count(DISTINCT event_id) FROM public.results") == 3000


def test_events_a_handler_publishes_on_its_own_branch_come_in_a_later_batch(db):
    with db.connection() as conn:
        publish(0, {"generation": 0}, conn=conn)
        conn.execute("SELECT pg_current_xact_id()")
    seen = []

    def handler(conn, events):
        seen.extend(e.payload["generation"] for e in events)
        with db.connection() as other:  # a later txid completes, so this transaction's own txid < xmax
            other.execute("SELECT pg_current_xact_id()")
        for e in events:
            if e.payload["generation"] < 3:
                publish(0, {"generation": e.payload["generation"] + 1}, conn=conn)

    consumer = consumer_of(db, "echo", 0, handler)
    assert [consumer.run_once() for _ in range(5)] == [1, 1, 1, 1, 0]
    assert seen == [0, 1, 2, 3]


def naive_reader(db, stop, seen):
    """The broken design: remember the last id read."""
    last = 0
    with db.connect(autocommit=True) as conn:
        while not stop.is_set():
            rows = conn.execute("SELECT id FROM pubsub_events WHERE id > %s ORDER BY id", (last,)).fetchall()
            for (event_id,) in rows:
                seen.append(event_id)
                last = event_id
        rows = conn.execute("SELECT id FROM pubsub_events WHERE id > %s ORDER BY id", (last,)).fetchall()
        seen.extend(r[0] for r in rows)


def test_concurrent_producers_with_random_commit_delays_lose_nothing_while_naive_ids_skip(db):
    rng = random.Random(3)
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint NOT NULL)")

    def handler(conn, events):
        conn.execute("INSERT INTO public.results SELECT unnest(%s::bigint[])", ([e.id for e in events],))

    committed: list[int] = []
    committed_lock = threading.Lock()

    def producer(seed):
        r = random.Random(seed)
        with db.connect() as conn:
            for _ in range(25):
                ids = [publish(0, {"p": seed}, conn=conn) for _ in range(r.randint(1, 4))]
                time.sleep(r.choice([0, 0, 0.001, 0.005, 0.03]))  # long and short transactions interleave
                if r.random() < 0.1:
                    conn.rollback()
                    continue
                conn.commit()
                with committed_lock:
                    committed.extend(ids)

    stop = threading.Event()
    naive: list[int] = []
    consumer = consumer_of(db, "ordered", 0, handler, batch_size=7, idle_sleep=0.01)
    naive_thread = threading.Thread(target=naive_reader, args=(db, stop, naive))
    naive_thread.start()
    consumer_thread = threading.Thread(target=consumer.run)
    consumer_thread.start()
    # one interleaving made certain: a transaction takes an id, a later id commits first
    with db.connect() as slow, db.connect() as fast:
        held = publish(0, {"p": "slow"}, conn=slow)
        quick = publish(0, {"p": "fast"}, conn=fast)
        fast.commit()
        wait_until(lambda: quick in naive)
        producers = [threading.Thread(target=producer, args=(rng.random(),)) for _ in range(8)]
        for p in producers:
            p.start()
        for p in producers:
            p.join(60)
        slow.commit()
    committed += [held, quick]
    wait_until(lambda: count(db, "SELECT count(*) FROM public.results") >= len(committed), timeout=30)
    stop.set()
    naive_thread.join(10)
    consumer.stop()
    consumer_thread.join(10)
    with db.connection() as conn:
        results = [r[0] for r in conn.execute("SELECT event_id FROM public.results")]
    assert sorted(results) == sorted(committed)  # every committed event once, none of the rolled back
    assert held not in naive  # the naive reader passed the slow transaction's id for good
    assert set(committed) - set(naive)


def test_trim_keeps_what_a_registered_consumer_has_not_read(db):
    with db.connection() as conn:
        for n in range(10):
            publish(0, {"n": n}, conn=conn)
            publish(5, {"n": n}, conn=conn)
    fast, _ = collect(db, "fast")
    slow, _ = collect(db, "slow", batch_size=4)
    drain(fast)
    slow.run_once()
    with db.connect(autocommit=True) as conn:
        assert (
            trim(conn, retain=timedelta(0)) == 0
        )  # one transaction: slow is inside it (target snapshot), nothing below its xmin
    drain(slow)
    with db.connection() as conn:
        publish(0, {"n": "late"}, conn=conn)
    with db.connect(autocommit=True) as conn:
        assert (
            trim(conn, batch_size=3, retain=timedelta(0)) == 10
        )  # branch 0's read events; branch 5 has no consumer: kept
        assert conn.execute("SELECT branch_id, count(*) FROM cmb.pubsub_events GROUP BY 1 ORDER BY 1").fetchall() == [
            (0, 1),
            (5, 10),
        ]
        newcomer, _ = collect(db, "newcomer", 5)
        newcomer.check()  # registered: branch 5 is now held back for it
        assert trim(conn, retain=timedelta(0)) == 0
    assert drain(newcomer) == 10
    with db.connection() as conn:
        assert drop_consumer(conn, "slow", 0) and not drop_consumer(conn, "slow", 0)


def test_lag_counts_committed_undelivered_events(db):
    with db.connection() as conn:
        for n in range(5):
            publish(0, {"n": n}, conn=conn)
    consumer, _ = collect(db, "lagging", batch_size=2)
    consumer.check()
    [lag] = status(db, "lagging", 0).consumers
    assert lag.events == 5 and lag.seconds > 0
    consumer.run_once()
    assert status(db, "lagging").consumers[0].events == 3  # mid-snapshot position counts too
    drain(consumer)
    [lag] = status(db).consumers
    assert (lag.events, lag.seconds, lag.delivered) == (0, 0.0, 5)


def fake_restore(db, ahead=1_000_000):
    """What pg_restore into another, younger cluster looks like: stored txids far ahead of this one's."""
    with db.connection() as conn:
        conn.execute("UPDATE pubsub_clock SET system_identifier = 42")
        conn.execute("UPDATE pubsub_events SET txid = (txid::text::bigint + %s)::text::xid8", (ahead,))
        conn.execute(
            "UPDATE pubsub_watermarks SET snapshot = format('%%s:%%s:',"
            " pg_snapshot_xmin(snapshot)::text::bigint + %(a)s,"
            " pg_snapshot_xmax(snapshot)::text::bigint + %(a)s)::pg_snapshot",
            {"a": ahead},
        )


def test_after_a_restore_consumers_refuse_until_reset_then_resume_exactly(db):
    with db.connection() as conn:
        for n in range(3):
            publish(0, {"n": n}, conn=conn)
    consumer, seen = collect(db, "restored")
    drain(consumer)
    with db.connection() as conn:
        for n in range(3, 5):
            publish(0, {"n": n}, conn=conn)
    fake_restore(db)
    with pytest.raises(StreamRestored, match="cluster 42 .* run `cmb-dagster pubsub reset`"):
        consumer.run_once()
    with db.connection() as conn:
        conn.execute("UPDATE pubsub_clock SET system_identifier = (SELECT system_identifier FROM pg_control_system())")
    with pytest.raises(StreamRestored, match="ahead of the current txid"):
        consumer.run_once()
    with db.connect(autocommit=True) as conn:
        old, new = reset(conn)
        assert old == 0 and new > 900_000
        assert reset(conn)[1] == new  # again: nothing to do
    with db.connection() as conn:
        publish(0, {"n": 5}, conn=conn)
    drain(consumer)
    assert [e.payload["n"] for e in seen] == [0, 1, 2, 3, 4, 5]


POOLED: list = []


def remember(conn, events):
    POOLED.extend(events)


def test_a_consumer_on_a_plain_connection_pool(db):
    with db.connection() as conn:
        publish(0, {"via": "pool"}, conn=conn)
    with ConnectionPool(db.url, min_size=1, max_size=2, open=True) as pool:
        consumer = consumer_of(Database.of(pool, schema=db.schema), "pooled", 0, remember)
        assert drain(consumer) == 1 and POOLED[0].payload == {"via": "pool"}
        assert count(db, "SELECT handler FROM pubsub_watermarks") == f"{__name__}:remember"
        with pool.connection() as conn:
            assert conn.execute("SELECT current_setting('search_path')").fetchone()[0] == '"$user", public'


def test_txids_crossing_a_power_of_ten_keep_their_order(db):
    with db.connection() as conn:  # move the stream's clock to just below 10,000,000
        conn.execute("UPDATE pubsub_clock SET shift = 9999995 - pg_current_xact_id()::text::bigint")
    ids = []
    for n in range(12):
        with db.connection() as conn:
            ids.append(publish(0, {"n": n}, conn=conn))
    consumer, seen = collect(db, batch_size=3)
    assert drain(consumer) == 12
    assert [e.id for e in seen] == ids and seen[0].txid < 10_000_000 <= seen[-1].txid


@pytest.mark.parametrize("batch_size", [0, -1, True, 1.5])
def test_trim_refuses_a_batch_size_that_would_never_finish(db, batch_size):
    with db.connect(autocommit=True) as conn, pytest.raises(InvalidInput, match="batch_size"):
        trim(conn, batch_size=batch_size)
