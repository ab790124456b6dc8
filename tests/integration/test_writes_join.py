"""Every engine's write joins an application's transaction through ``conn=``, on any connection of the
application (its own search path, autocommit or not): nothing exists unless that transaction commits, a refused
write leaves it usable, and the connection's settings are its own again after the write."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from callback_settings import FAST
from psycopg.rows import dict_row, tuple_row
from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackWorker
from cmb_dagster.ctl import CtlStore
from cmb_dagster.eventqueue import HandlerRegistry, emit, emit_many, register
from cmb_dagster.pubsub import publish
from cmb_dagster.stages import Entity, MergePatch, Stage, StageResult, StageStore

MOMENT = datetime(2026, 3, 3, 5, tzinfo=UTC)


class Count(Stage):
    name = "count"

    def process(self, entity: Entity, state) -> StageResult:
        return StageResult(update=MergePatch({"n": 1}))


@pytest.fixture
def app(database_url):
    """A connection as the application opens it: the server's default search path, no cmb schema on it, rows
    as dicts."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        conn.execute("SET lock_timeout = '7s'")
        conn.commit()
        yield conn


def settings(conn: psycopg.Connection) -> tuple[str, str]:
    query = "SELECT current_setting('search_path'), current_setting('lock_timeout')"
    return conn.cursor(row_factory=tuple_row).execute(query).fetchone()


def count(db, query: str) -> int:
    with db.connection() as conn:
        return conn.execute(query).fetchone()[0]


def callback(key: str, when: datetime) -> dict:
    return {
        "owner_client_id": "app",
        "group_key": "g",
        "event_key": key,
        "run_at": when,
        "cb_url": "http://127.0.0.1:9/x",
    }


@pytest.fixture
def writes(db):
    """Per engine: a write through ``conn=`` and how many of its rows exist."""
    registry = HandlerRegistry()
    registry.add("mail", lambda event: None)
    register(db, registry)
    client = CallbackClient(db, FAST)
    ctl, stages = CtlStore(db, actor="app"), StageStore(db, [Count()])
    when = datetime.now(UTC) + timedelta(hours=1)
    yield {
        "eventqueue": (
            lambda conn: emit("orders", "mail", {"order": 1}, conn=conn),
            lambda: count(db, "SELECT count(*) FROM eventqueue_events"),
        ),
        "eventqueue many": (
            lambda conn: emit_many([{"namespace": "orders", "handler": "mail", "value": i} for i in (1, 2)], conn=conn),
            lambda: count(db, "SELECT count(*) FROM eventqueue_events"),
        ),
        "callbacks": (
            lambda conn: client.create("app", "g", "k", when, "http://127.0.0.1:9/x", conn=conn),
            lambda: len(client.list(limit=10)),
        ),
        "callbacks many": (
            lambda conn: client.create_many([callback(f"m{i}", when) for i in range(2)], conn=conn),
            lambda: len(client.list(limit=10)),
        ),
        "stages": (
            lambda conn: stages.put("order-1", {"total": 3}, conn=conn),
            lambda: int(stages.get("order-1") is not None),
        ),
        "ctl": (
            lambda conn: ctl.set("shop/orders", "loaded_until", MOMENT, conn=conn),
            lambda: int(ctl.get("shop/orders", "loaded_until") is not None),
        ),
        "pubsub": (
            lambda conn: publish(0, {"order": 1}, schema=db.schema, conn=conn),
            lambda: count(db, "SELECT count(*) FROM pubsub_events WHERE topic = 'default'"),
        ),
    }
    client.close()


ENGINES = ["eventqueue", "eventqueue many", "callbacks", "callbacks many", "stages", "ctl", "pubsub"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rolled_back_transaction_leaves_nothing_and_a_committed_one_the_write(engine, writes, app):
    write, written = writes[engine]
    before = settings(app)
    assert before[0] == '"$user", public' and written() == 0
    app.commit()  # the write begins the transaction
    write(app)
    assert settings(app) == before  # the application's next statements see its own search path and timeouts
    app.rollback()
    assert written() == 0
    write(app)
    app.commit()
    assert written() >= 1


@pytest.mark.parametrize("engine", ["eventqueue", "callbacks", "stages", "ctl"])
def test_on_an_autocommit_connection_a_write_is_a_transaction_of_its_own(engine, writes, database_url):
    write, written = writes[engine]
    with psycopg.connect(database_url, autocommit=True) as conn:
        write(conn)
        assert written() >= 1 and settings(conn)[0] == '"$user", public'


def test_a_write_postgres_refuses_leaves_the_callers_transaction_usable_with_its_own_settings(db, app, database_url):
    stages = StageStore(db, [Count()])
    stages.put("order-1", {"total": 1})
    app.execute("CREATE TABLE public.orders (id int)")
    app.execute("INSERT INTO public.orders VALUES (1)")
    app.execute("SET LOCAL lock_timeout = '100ms'")
    with psycopg.connect(database_url) as other:
        stages.put("order-1", {"total": 2}, conn=other)  # holds the entity's row until its transaction ends
        with pytest.raises(psycopg.errors.LockNotAvailable):
            stages.put("order-1", {"total": 3}, conn=app)
        other.rollback()
    assert settings(app) == ('"$user", public', "100ms")
    stages.put("order-2", {"total": 4}, conn=app)
    app.commit()
    assert count(db, "SELECT count(*) FROM public.orders") == 1
    assert stages.get("order-1").payload == {"total": 1} and stages.get("order-2").payload == {"total": 4}


def test_a_callback_created_in_the_callers_transaction_is_called_once_after_the_commit(db, app, sink):
    with CallbackClient(db, FAST) as client, Running(CallbackWorker(db, FAST)):
        due = datetime.now(UTC) - timedelta(seconds=1)
        client.create("app", "g", "in-transaction", due, f"{sink.url}/cb", conn=app)
        client.create("app", "g", "marker", due + timedelta(milliseconds=1), f"{sink.url}/cb")  # committed at once
        wait_until(lambda: [c.body["event_key"] for c in sink.received] == ["marker"], 30, "the marker's call")
        app.commit()
        wait_until(lambda: len(sink.received) == 2, 30, "the call after the commit")
        assert sorted(c.body["event_key"] for c in sink.received) == ["in-transaction", "marker"]
        wait_until(
            lambda: client.get("app", "g", "in-transaction").status.value == "notified", 30, "the call's outcome"
        )


def test_changes_of_existing_items_roll_back_with_the_callers_transaction(db, app):
    later = datetime.now(UTC) + timedelta(hours=1)
    stages = StageStore(db, [Count()])
    stages.put("order-1", {"total": 1})
    stages.put("order-2", {"total": 2})
    with CallbackClient(db, FAST) as client:
        client.create("app", "g", "k", later, "http://127.0.0.1:9/x")
        client.create("app", "g", "j", later, "http://127.0.0.1:9/x")
        client.update("app", "g", "k", run_at=later + timedelta(hours=1), conn=app)
        client.cancel("app", "g", "j", conn=app)
        stages.patch("order-1", {"total": 5}, conn=app)
        stages.delete("order-2", conn=app)
        app.rollback()
        assert client.get("app", "g", "k").run_at == later and client.get("app", "g", "j").status.value == "pending"
        assert stages.get("order-1").payload == {"total": 1} and stages.get("order-2") is not None
        client.cancel("app", "g", "j", conn=app)
        stages.patch("order-1", {"total": 5}, conn=app)
        app.commit()
        assert client.get("app", "g", "j").status.value == "cancelled" and stages.get("order-1").payload == {"total": 5}


def test_publish_takes_conn_or_db_as_keywords_and_its_old_form_warns(db, app):
    publish(0, {"order": 1}, topic="orders", db=db)  # committed at once
    with pytest.warns(DeprecationWarning, match=r"publish\(branch_id, payload, conn=conn\)"):
        publish(app, 0, {"order": 2}, topic="orders", schema=db.schema)
    app.commit()
    assert count(db, "SELECT count(*) FROM pubsub_events WHERE topic = 'orders'") == 2
