"""Backfills (issue 34): a table's rows as snapshot events whose id is the row's version, in batches, resumable."""

import json
import re
import threading

import pytest
from waiting import wait_until

from cmb_dagster.pubsub import (
    ConsumerSpec,
    ConsumerWorker,
    InvalidPubSubInput,
    backfill,
    backfills,
    install_capture,
    status,
)


@pytest.fixture
def items(db):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.items (id int PRIMARY KEY, v int NOT NULL, kind text NOT NULL)")
        conn.execute(
            "INSERT INTO public.items SELECT g, 1, CASE WHEN g % 2 = 0 THEN 'even' ELSE 'odd' END"
            " FROM generate_series(1, 10) g"
        )
        install_capture(conn, "public.items", ops=("insert", "update", "delete"))
    return db


def events_of(db, key):
    with db.connection() as conn:
        return conn.execute(
            "SELECT id, op, (payload->>'v')::int FROM pubsub_events WHERE key = %s::jsonb ORDER BY id",
            (f'{{"id": {key}}}',),
        ).fetchall()


def backend_waits_on_a_lock(db, pattern):
    with db.connection() as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s", (pattern,)
        ).fetchone()[0]


def test_a_snapshot_waits_for_a_writer_of_its_row_so_its_id_orders_it_after_that_change(items):
    db = items
    writer = db.connect()
    writer.execute("UPDATE public.items SET v = 2 WHERE id = 5")  # captured (event id taken), not committed
    done = []
    run = threading.Thread(target=lambda: done.append(backfill(db, "public.items", lock_timeout=30)))
    run.start()
    wait_until(
        lambda: done or backend_waits_on_a_lock(db, "%FOR SHARE%"), timeout=10, what="the backfill waiting on row 5"
    )
    writer.commit()
    writer.close()
    run.join(30)
    assert done[0].rows_done == 10 and done[0].state == "done"
    update, snapshot = events_of(db, 5)
    assert update[1:] == ("update", 2) and snapshot[1:] == ("snapshot", 2)  # the newest committed version
    assert snapshot[0] > update[0]  # ... with the higher version: applied by version, it wins; the old one never


def test_a_where_and_batches_publish_the_matching_rows_once_and_progress_shows(items):
    db = items
    progress = []
    done = backfill(db, "items", 3, where="kind = 'even'", batch_size=2, on_progress=progress.append)
    assert (done.rows_done, done.batches, done.state, done.last_key) == (5, 3, "done", {"id": 10})
    assert [p.rows_done for p in progress] == [2, 4, 5]
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT key->>'id', topic, op, payload->>'kind' FROM pubsub_events WHERE branch_id = 3 ORDER BY id"
        ).fetchall()
    assert rows == [(str(i), "public.items", "snapshot", "even") for i in (2, 4, 6, 8, 10)]
    listed = status(db).backfills
    assert [(b.id, b.table, b.where, b.state) for b in listed] == [(done.id, "public.items", "kind = 'even'", "done")]
    assert backfills(db) == listed
    again = backfill(db, "items", 3, where="kind = 'even'", batch_size=2)  # a done backfill: a new one
    assert again.id != done.id and again.rows_done == 5


def test_an_interrupted_backfill_resumes_after_its_last_batch_and_concurrent_calls_take_turns(items):
    db = items
    with db.connection() as conn:
        conn.execute("INSERT INTO public.items SELECT g, 1, 'many' FROM generate_series(11, 2000) g")
        conn.execute(  # a run that stopped after two batches of 100
            "INSERT INTO pubsub_backfills (table_name, branch_id, topic, batch_size, key_columns, last_key,"
            " rows_done, batches, state, error) VALUES ('public.items', 1, 'public.items', 100, '{id}',"
            " '{\"id\": 200}', 200, 2, 'failed', 'killed')"
        )
    runs = [
        threading.Thread(target=backfill, args=(db, "public.items", 1), kwargs={"batch_size": 50}) for _ in range(3)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join(60)
    [done] = backfills(db)
    assert (done.state, done.rows_done, done.error) == ("done", 2000, None)
    with db.connection() as conn:
        keys = conn.execute(
            "SELECT (key->>'id')::int, count(*) FROM pubsub_events WHERE branch_id = 1 GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert keys == [(i, 1) for i in range(201, 2001)]  # after the last batch, each row once


def test_bad_backfills_are_refused_naming_the_field_and_write_nothing(items):
    db = items
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.loose (v int)")
    cases = {
        "table: no table named 'nothing'": dict(table="nothing"),
        "table: public.loose has no primary key": dict(table="public.loose"),
        "where: must be one SQL expression, without a ';'": dict(table="items", where="true; DROP TABLE items"),
        "where: must be one SQL expression, without a '--' comment": dict(table="items", where="true --"),
        "where: 'v + 1' is not a valid filter here": dict(table="items", where="v + 1"),
        "where: 'nope = 1' is not a valid filter here": dict(table="items", where="nope = 1"),
        "batch_size": dict(table="items", batch_size=0),
    }
    for message, kwargs in cases.items():
        with pytest.raises(InvalidPubSubInput, match=re.escape(message)):
            backfill(db, **kwargs)
    assert backfills(db, include_done=True) == []


def apply_by_version(conn, events):
    """Keep each row's newest version: a row's events carry their version (``event.version``)."""
    conn.execute(
        "INSERT INTO public.copy (id, v, version, deleted)"
        " SELECT DISTINCT ON (id) * FROM ("
        "  SELECT (e->'key'->>'id')::int AS id, (e->'payload'->>'v')::int AS v, (e->>'version')::bigint AS version,"
        "         e->>'op' = 'delete' AS deleted"
        "  FROM jsonb_array_elements(%s::jsonb) AS e) AS batch"
        " ORDER BY id, version DESC"
        " ON CONFLICT (id) DO UPDATE SET v = excluded.v, version = excluded.version, deleted = excluded.deleted"
        " WHERE copy.version < excluded.version",
        (json.dumps([{"key": e.key, "payload": e.payload, "version": e.version, "op": e.op} for e in events]),),
    )


def test_a_consumer_applying_by_version_ends_equal_to_the_table(items):
    db = items
    with db.connection() as conn:
        conn.execute(
            "CREATE TABLE public.copy (id int PRIMARY KEY, v int, version bigint NOT NULL, deleted boolean NOT NULL)"
        )
        conn.execute("UPDATE public.items SET v = v + 1 WHERE id <= 3")
        conn.execute("DELETE FROM public.items WHERE id = 4")
    backfill(db, "items")
    with db.connection() as conn:
        conn.execute("UPDATE public.items SET v = v + 10 WHERE id >= 8")
    worker = ConsumerWorker(db, ConsumerSpec(consumer_id="copy", handler=apply_by_version))
    while worker.run_once():
        pass
    with db.connection() as conn:
        assert (
            conn.execute(
                "SELECT id, v FROM public.copy WHERE NOT deleted EXCEPT SELECT id, v FROM public.items"
            ).fetchall()
            == []
        )
        assert conn.execute("SELECT count(*) FROM public.copy WHERE NOT deleted").fetchone()[0] == 9


def test_the_backfill_job_reports_its_progress_in_the_ui(items, resource):
    from cmb_dagster.pubsub.dagster_defs import backfill_job

    result = backfill_job().execute_in_process(
        run_config={"ops": {"cmb_pubsub_backfill_op": {"config": {"table": "public.items", "batch_size": 4}}}},
        resources={"cmb": resource},
    )
    assert result.success
    [materialization] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    metadata = materialization.event_specific_data.metadata
    assert metadata["rows_done"].value == 10 and metadata["batches"].value == 3 and metadata["state"].value == "done"
