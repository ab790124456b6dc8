"""What Postgres (or psycopg, before sending) refuses of a caller's input reaches the caller as the engine's typed
error naming the field, the database's reason chained, nothing written; in the caller's transaction the error
says whether that transaction is aborted. The refusal here: text a LATIN1 database cannot hold."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
import pytest
from psycopg import sql

from cmb_dagster import callbacks, eventqueue, pubsub, reactive, stages
from cmb_dagster.callbacks import CallbackClient, InvalidCallbackInput
from cmb_dagster.ctl import CtlStore, InvalidCtlInput
from cmb_dagster.database import Database
from cmb_dagster.eventqueue import HandlerRegistry, InvalidEventQueueInput, emit, emit_many
from cmb_dagster.pubsub import InvalidPubSubInput, publish
from cmb_dagster.reactive import InvalidReactiveInput
from cmb_dagster.stages import InvalidStageInput, StageStore

UNSTORABLE = "日本"  # no LATIN1 character for either
T0 = datetime(2024, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def latin1(latin1_db: Database) -> Database:
    """The LATIN1 database, with an event queue handler ``h``."""
    registry = HandlerRegistry()
    registry.add("h", print)
    eventqueue.register(latin1_db, registry)
    return latin1_db


def count(db: Database, table: str) -> int:
    with db.connection() as conn:
        return conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0]


def test_emit_and_emit_many_raise_the_typed_error_and_write_nothing(latin1):
    before = count(latin1, "eventqueue_events")
    with pytest.raises(InvalidEventQueueInput, match=r"^event: refused by the database \(.*nothing was written$") as e:
        emit("ns", "h", {"text": UNSTORABLE}, db=latin1)
    assert isinstance(e.value.__cause__, UnicodeEncodeError)  # psycopg could not send it in the database's encoding
    with pytest.raises(InvalidEventQueueInput, match=r"^events: refused by the database"):
        emit_many([{"namespace": "ns", "handler": "h", "value": n} for n in (1, UNSTORABLE)], db=latin1)
    assert count(latin1, "eventqueue_events") == before


def test_an_emit_refused_before_sending_leaves_the_callers_transaction_usable(latin1):
    before = count(latin1, "eventqueue_events")
    with latin1.connection() as conn:
        kept = emit("ns", "h", "kept", conn=conn)
        with pytest.raises(InvalidEventQueueInput, match="nothing was written$"):
            emit("ns", "h", UNSTORABLE, conn=conn)
        emit("ns", "h", "also kept", conn=conn)
    assert count(latin1, "eventqueue_events") == before + 2
    with latin1.connection() as conn:
        conn.execute("DELETE FROM eventqueue_events WHERE id >= %s", (kept,))


def test_an_emit_the_server_refuses_writes_nothing_and_leaves_the_callers_transaction_usable(latin1):
    before = count(latin1, "eventqueue_events")
    with latin1.connection() as conn:
        conn.execute("SET client_encoding = 'UTF8'")  # the server converts the text, and refuses it
        emit("ns", "h", "kept with the transaction", conn=conn)
        with pytest.raises(InvalidEventQueueInput, match="nothing was written$") as e:
            emit("ns", "h", UNSTORABLE, conn=conn)
        assert isinstance(e.value.__cause__, psycopg.errors.UntranslatableCharacter)
        emit("ns", "h", "kept too", conn=conn)
    assert count(latin1, "eventqueue_events") == before + 2


def test_publish_raises_the_typed_error_and_says_what_became_of_the_callers_transaction(latin1):
    before = count(latin1, "pubsub_events")
    with latin1.connection() as conn:
        with pytest.raises(InvalidPubSubInput, match=r"^event: refused by the database .*nothing was written$"):
            publish(0, {"text": UNSTORABLE}, conn=conn)
        assert conn.execute("SELECT 1").fetchone() == (1,)
        conn.execute("SET client_encoding = 'UTF8'")
        with pytest.raises(InvalidPubSubInput, match="the transaction of conn is aborted: roll it back$"):
            publish(0, {"text": UNSTORABLE}, conn=conn)
        conn.rollback()
    assert count(latin1, "pubsub_events") == before


@pytest.mark.parametrize("buffered", [False, True])
def test_create_and_create_many_raise_the_typed_error_and_write_nothing(latin1, buffered):
    with CallbackClient(latin1, buffered=buffered) as client:
        with pytest.raises(InvalidCallbackInput, match=r"^event: refused by the database"):
            client.create("o", "g", "k", T0, "https://example.com/x", context={"text": UNSTORABLE})
        with pytest.raises(InvalidCallbackInput, match=r"^events: refused by the database"):
            client.create_many(
                [
                    {"owner_client_id": "o", "group_key": "g", "event_key": f"k{n}", "run_at": T0,
                     "cb_url": "https://example.com/x", "context": context}
                    for n, context in enumerate([1, UNSTORABLE])
                ]
            )  # fmt: skip
    assert count(latin1, "callback_events") == 0


def test_put_and_patch_raise_the_typed_error_and_write_nothing(latin1):
    store = StageStore(latin1)
    with pytest.raises(InvalidStageInput, match=r"^entity: refused by the database"):
        store.put("e", {"text": UNSTORABLE})
    with pytest.raises(InvalidStageInput, match=r"^entities: refused by the database"):
        store.put_many({"e": {"text": "ok"}, "f": {"text": UNSTORABLE}})
    assert count(latin1, "stage_entities") == 0
    store.put("e", {"text": "ok"})
    with pytest.raises(InvalidStageInput, match=r"^patch: refused by the database"):
        store.patch("e", {"text": UNSTORABLE})
    assert store.get("e").payload == {"text": "ok"}


def test_a_ctl_set_raises_the_typed_error_and_leaves_the_callers_transaction_usable(latin1):
    store = CtlStore(latin1)
    with pytest.raises(InvalidCtlInput, match=r"^values: refused by the database .*nothing was written$"):
        store.set(UNSTORABLE, "loaded_until", T0)
    with latin1.connection() as conn:
        conn.execute("SET client_encoding = 'UTF8'")  # the server refuses it: CTL's savepoint is rolled back
        store.set("sales", "loaded_until", T0, conn=conn)
        with pytest.raises(InvalidCtlInput, match="nothing was written$") as e:
            store.set(UNSTORABLE, "loaded_until", T0, conn=conn)
        assert isinstance(e.value.__cause__, psycopg.errors.UntranslatableCharacter)
        store.set("sales", "checked_until", T0, conn=conn)
    assert [(c.entity, c.parameter) for c in store.history()] == [("sales", "checked_until"), ("sales", "loaded_until")]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda db: eventqueue.dead_letters(db, handler=UNSTORABLE), InvalidEventQueueInput),
        (lambda db: eventqueue.replay(db, handler=UNSTORABLE), InvalidEventQueueInput),
        (lambda db: CallbackClient(db, buffered=False).get(UNSTORABLE, "g", "k"), InvalidCallbackInput),
        (lambda db: callbacks.admin.signing_secrets(db, UNSTORABLE), InvalidCallbackInput),
        (lambda db: stages.entries(db, entity_id=UNSTORABLE), InvalidStageInput),
        (lambda db: reactive.status(db, scheduler=UNSTORABLE), InvalidReactiveInput),
        (lambda db: reactive.retry_task(db, UNSTORABLE, "t"), InvalidReactiveInput),
    ],
    ids=["eq-dead", "eq-replay", "cb-get", "cb-secrets", "st-entries", "re-status", "re-retry"],
)
def test_an_operator_function_raises_the_engines_typed_error_for_what_the_database_refuses(latin1, call, error):
    with pytest.raises(error, match=r"^arguments: refused by the database"):
        call(latin1)


NUL = "a\x00b"


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda db: eventqueue.dead_letters(db, handler=NUL), InvalidEventQueueInput, "handler"),
        (lambda db: eventqueue.dead_letters(db, limit=-1), InvalidEventQueueInput, "limit"),
        (lambda db: eventqueue.replay(db, [2**70]), InvalidEventQueueInput, "ids"),
        (lambda db: pubsub.status(db, "c", 2**70), InvalidPubSubInput, "branch_id"),
        (
            lambda db: pubsub.replay(db, "c", 0, lambda conn, events: None, event_ids=[0]),
            InvalidPubSubInput,
            "event_ids",
        ),
        (lambda db: CallbackClient(db, buffered=False).cancel("o", NUL, "k"), InvalidCallbackInput, "group_key"),
        (lambda db: CallbackClient(db, buffered=False).list(limit=-1), InvalidCallbackInput, "limit"),
        (lambda db: CallbackClient(db, buffered=False).delete("o", "g", "\udc80"), InvalidCallbackInput, "event_key"),
        (lambda db: stages.entries(db, limit=0), InvalidStageInput, "limit"),
        (lambda db: stages.retry(db, stage=NUL), InvalidStageInput, "stage"),
        (lambda db: reactive.forget_last_values(db, "s", NUL), InvalidReactiveInput, "name"),
        (lambda db: reactive.forget_last_values(db, "s", "t", ("e", NUL)), InvalidReactiveInput, "parameter"),
    ],
)
def test_an_operator_function_refuses_bad_arguments_naming_them(db, call, error, field):
    with pytest.raises(error, match=rf"^{field}: "):
        call(db)
