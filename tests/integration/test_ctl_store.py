import itertools
import threading
from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest

from cmb_dagster.ctl import CTL_BRANCH_ID, CtlStore, InvalidCtlInput

T0 = datetime(2024, 5, 1, tzinfo=UTC)


def events(db):
    with db.connection() as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT payload FROM pubsub_events WHERE branch_id = %s ORDER BY id", (CTL_BRANCH_ID,)
            ).fetchall()
        ]


def test_set_get_and_get_many(db):
    store = CtlStore(db, actor="tester")
    change = store.set("sales", "loaded_until", T0)
    assert change.old_value is None and change.new_value == T0 and change.changed_by == "tester"
    store.set_many({("sales", "checked_at"): T0 + timedelta(hours=1), ("prices", "loaded_until"): T0})
    assert store.get("sales", "loaded_until") == T0
    assert store.get("nobody", "nothing") is None
    assert store.get_many([("sales", "loaded_until"), ("prices", "loaded_until"), ("x", "y")]) == {
        ("sales", "loaded_until"): T0,
        ("prices", "loaded_until"): T0,
    }


def test_setting_the_same_value_records_and_publishes_nothing(db):
    store = CtlStore(db)
    assert store.set("sales", "loaded_until", T0) is not None
    assert store.set("sales", "loaded_until", T0.astimezone(timezone(timedelta(hours=3)))) is None  # same instant
    assert len(store.history("sales", "loaded_until")) == 1
    assert len(events(db)) == 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (("sales", "loaded_until"), datetime(2024, 5, 1), "timezone"),
        (("", "loaded_until"), T0, "entity"),
        (("sales", ""), T0, "parameter"),
        (("sales", "loaded_until"), "yesterday", "value"),
        (("sales",), T0, "pair"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(db, key, value, message):
    store = CtlStore(db)
    with pytest.raises(InvalidCtlInput, match=message):
        store.set_many({("prices", "loaded_until"): T0, key: value})
    assert store.get("prices", "loaded_until") is None
    assert store.history() == [] and events(db) == []


def test_history_records_every_change_and_flags_backwards_moves(db):
    store = CtlStore(db)
    store.set("sales", "loaded_until", T0, by="loader")
    store.set("sales", "loaded_until", T0 + timedelta(days=1), by="loader")
    back = store.set("sales", "loaded_until", T0 + timedelta(hours=5), by="an operator")
    assert back.backwards and back.old_value == T0 + timedelta(days=1)
    history = store.history("sales", "loaded_until")
    assert [(c.old_value, c.new_value, c.backwards, c.changed_by) for c in history] == [
        (T0 + timedelta(days=1), T0 + timedelta(hours=5), True, "an operator"),
        (T0, T0 + timedelta(days=1), False, "loader"),
        (None, T0, False, "loader"),
    ]
    assert [c.id for c in store.history(backwards_only=True)] == [back.id]
    published = [change for event in events(db) for change in event["changes"]]
    assert [c["backwards"] for c in published] == [False, False, True]


def test_changes_commit_or_roll_back_with_the_callers_transaction(db):
    store = CtlStore(db)
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.orders (id int)")
    with pytest.raises(RuntimeError), db.connection() as conn:
        conn.execute("INSERT INTO public.orders VALUES (1)")
        store.set("orders", "loaded_until", T0, conn=conn)
        raise RuntimeError("the load failed")
    assert store.get("orders", "loaded_until") is None and events(db) == [] and store.history() == []
    with db.connection() as conn:
        conn.execute("INSERT INTO public.orders VALUES (1)")
        store.set("orders", "loaded_until", T0, conn=conn)
    assert store.get("orders", "loaded_until") == T0
    assert [e["changes"][0]["new"] for e in events(db)] == [T0.isoformat()]


def test_concurrent_writers_leave_an_exact_history_chain(db):
    store = CtlStore(db)
    barrier = threading.Barrier(6)
    errors = []

    def writer(offset: int) -> None:
        barrier.wait()
        try:
            for i in range(40):
                store.set("sales", "loaded_until", T0 + timedelta(minutes=i * 6 + offset))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    chain = list(reversed(store.history("sales", "loaded_until", limit=1000)))
    assert chain[0].old_value is None
    for before, after in itertools.pairwise(chain):
        assert after.old_value == before.new_value  # every change saw exactly the value it replaced
    assert chain[-1].new_value == store.get("sales", "loaded_until")
    assert len(events(db)) == len(chain)


def test_the_change_stream_delivers_every_change(db):
    from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker

    store = CtlStore(db)
    for i in range(5):
        store.set("sales", "loaded_until", T0 + timedelta(hours=i))
    seen = []

    def handler(conn, batch) -> None:
        seen.extend(c["new"] for e in batch for c in e.payload["changes"])

    consumer = ConsumerWorker(db, ConsumerSpec(consumer_id="test.ctl", branch_id=CTL_BRANCH_ID, handler=handler))
    while consumer.run_once():
        pass
    assert seen == [(T0 + timedelta(hours=i)).isoformat() for i in range(5)]


def test_a_connection_without_the_cmb_schema_on_its_search_path_writes_in_its_transaction(db):
    store = CtlStore(db)
    with psycopg.connect(db.url) as conn:
        store.set("sales", "loaded_until", T0, conn=conn)
        assert store.get("sales", "loaded_until") is None  # not committed yet
    assert store.get("sales", "loaded_until") == T0


@pytest.mark.parametrize(
    ("values", "by", "field"),
    [
        ({("sa\x00les", "loaded_until"): T0}, None, "entity"),
        ({("sales", "loaded\x00"): T0}, None, "parameter"),
        ({("sales", "loaded_until"): T0}, "ops\x00", "by"),
        ({("sales", "loaded_until"): datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))}, None, "value"),
        ({("sales", "loaded_until"): datetime(9999, 12, 31, 12, tzinfo=UTC)}, None, "value"),
        ({("sales", "loaded_until"): datetime(1, 1, 1, 1, tzinfo=timezone(timedelta(hours=5)))}, None, "value"),
    ],
)
def test_nul_bytes_and_years_out_of_range_are_typed_errors_naming_the_field(db, values, by, field):
    store = CtlStore(db)
    with pytest.raises(InvalidCtlInput, match=rf"\b{field}: "):
        store.set_many({("prices", "loaded_until"): T0, **values}, by=by)
    assert store.history() == [] and events(db) == []
    with pytest.raises(InvalidCtlInput, match=r"entity: .*U\+0000"):
        store.history("sa\x00les")
    with pytest.raises(InvalidCtlInput, match="limit"):
        store.history(limit=-1)
    edge = datetime(9999, 12, 30, tzinfo=UTC)  # the last day stays readable in any session time zone
    assert store.set("sales", "loaded_until", edge).new_value == edge
