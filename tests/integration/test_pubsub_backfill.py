"""Backfills (issue 34): a table's rows as snapshot events whose id is the row's version, in batches, resumable."""

import json
import re
import threading

import pytest
from psycopg.conninfo import make_conninfo
from waiting import wait_until

from cmb_dagster.database import Database
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
    done = backfill(db, "items", 3, where='$.kind == "even"', batch_size=2, on_progress=progress.append)
    assert (done.rows_done, done.batches, done.state, done.last_key) == (5, 3, "done", {"id": 10})
    assert [p.rows_done for p in progress] == [2, 4, 5]
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT key->>'id', topic, op, payload->>'kind' FROM pubsub_events WHERE branch_id = 3 ORDER BY id"
        ).fetchall()
    assert rows == [(str(i), "public.items", "snapshot", "even") for i in (2, 4, 6, 8, 10)]
    listed = status(db).backfills
    assert [(b.id, b.table, b.where, b.state) for b in listed] == [
        (done.id, "public.items", '$.kind == "even"', "done")
    ]
    assert backfills(db) == listed


def snapshot_count(db, branch_id):
    with db.connection() as conn:
        return conn.execute(
            "SELECT count(*) FROM pubsub_events WHERE branch_id = %s AND op = 'snapshot'", (branch_id,)
        ).fetchone()[0]


def test_a_done_backfill_is_not_run_again_unless_asked(items):
    db = items
    done = backfill(db, "items", 3, where='$.kind == "even"')
    same = backfill(db, "public.items", 3, where='$.kind == "even"')
    assert (same.id, same.state, same.rows_done, snapshot_count(db, 3)) == (done.id, "done", 5, 5)
    again = backfill(db, "items", 3, where='$.kind == "even"', again=True)
    assert (again.id, again.state, again.rows_done, snapshot_count(db, 3)) == (done.id, "done", 5, 10)
    assert again.started_at > done.started_at and len(backfills(db, include_done=True)) == 1  # one row per backfill


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
        "table: no table named 'a b'": dict(table="a b"),
        "table: no table named 'items; DROP TABLE items'": dict(table="items; DROP TABLE items"),
        "where: 'true; DROP TABLE items' is not an SQL/JSON path predicate": dict(
            table="items", where="true; DROP TABLE items"
        ),
        "where: \"kind = 'even'\" is not an SQL/JSON path predicate": dict(table="items", where="kind = 'even'"),
        "where: $op is not a variable here (variables: none": dict(table="items", where='$op == "insert"'),
        "where: '$.v + 1' is not an SQL/JSON path predicate": dict(table="items", where="$.v + 1"),
        "batch_size": dict(table="items", batch_size=0),
    }
    for message, kwargs in cases.items():
        with pytest.raises(InvalidPubSubInput, match=re.escape(message)):
            backfill(db, **kwargs)
    assert backfills(db, include_done=True) == []
    assert snapshot_count(db, 0) == 0


def test_an_injected_filter_runs_nothing_and_writes_nothing(items):
    """The issue's string passed every check of the SQL filter and emptied a table through the batch's WITH."""
    db = items
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.victim (v int)")
        conn.execute("INSERT INTO public.victim VALUES (1), (2)")
    injected = (
        'TRUE) ORDER BY "id" LIMIT 1000 FOR SHARE OF r), x AS (DELETE FROM public.victim RETURNING 1), '
        "y AS (SELECT 1 FROM public.victim WHERE (TRUE"
    )
    for where in (injected, "(SELECT count(*) FROM public.victim) > 0", "pg_sleep(5) IS NOT NULL"):
        with pytest.raises(InvalidPubSubInput, match="where: .* is not an SQL/JSON path predicate"):
            backfill(db, "public.items", where=where)
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM public.victim").fetchone()[0] == 2
    assert backfills(db, include_done=True) == [] and snapshot_count(db, 0) == 0


def test_cmbs_own_tables_the_systems_and_unreadable_ones_are_never_a_source(items, database_url):
    db = items
    with db.connection() as conn:
        conn.execute("CREATE SCHEMA other_tenant")
    Database(database_url, schema="other_tenant").upgrade()  # a second cmb deployment in the same database
    with db.connection() as conn:
        conn.execute("DROP ROLE IF EXISTS cmb_test_reader")
        conn.execute("CREATE ROLE cmb_test_reader LOGIN")
        conn.execute("GRANT USAGE ON SCHEMA cmb TO cmb_test_reader")
        conn.execute("GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA cmb TO cmb_test_reader")
        conn.execute("GRANT USAGE ON ALL SEQUENCES IN SCHEMA cmb TO cmb_test_reader")
        conn.execute("CREATE TABLE public.private (id int PRIMARY KEY)")
    refused = {
        "cmb.callback_signing_secrets": "belongs to cmb or the system",
        "callback_signing_secrets": "belongs to cmb or the system",  # found on cmb's search_path
        "other_tenant.pubsub_events": "belongs to cmb or the system",
        "pg_authid": "belongs to cmb or the system",
        "information_schema.sql_features": "belongs to cmb or the system",
    }
    for table, message in refused.items():
        with pytest.raises(InvalidPubSubInput, match=f"table: .* {message}"):
            backfill(db, table)
    reader = Database(make_conninfo(database_url, user="cmb_test_reader"))
    try:
        with pytest.raises(InvalidPubSubInput, match=r"table: the role may not read public.private \(SELECT\)"):
            backfill(reader, "public.private")
    finally:
        reader.close()
        with db.connection() as conn:
            conn.execute("DROP OWNED BY cmb_test_reader")
            conn.execute("DROP ROLE cmb_test_reader")
    assert backfills(db, include_done=True) == [] and snapshot_count(db, 0) == 0


def test_a_row_the_filter_raises_on_is_passed_over_named_and_the_rest_is_published(items):
    db = items
    with db.connection() as conn:
        conn.execute("ALTER TABLE public.items ADD COLUMN due text")
        conn.execute("UPDATE public.items SET due = 'soon' WHERE id = 7")
    where = '$.due.datetime("TH") < "2020-01-01".datetime() || $.v == 1'
    done = backfill(db, "items", 2, where=where, batch_size=4)
    assert (done.state, done.rows_done, done.rows_skipped) == ("done", 9, 1)
    assert done.last_skip.startswith('key {"id": 7}: invalid datetime format separator')
    with db.connection() as conn:
        keys = conn.execute("SELECT (key->>'id')::int FROM pubsub_events WHERE branch_id = 2 ORDER BY 1").fetchall()
    assert [k for (k,) in keys] == [1, 2, 3, 4, 5, 6, 8, 9, 10]


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


def test_the_backfill_job_reports_its_progress_in_the_ui_and_reads_only_the_tables_its_options_name(items, resource):
    from dagster import DagsterInvalidConfigError

    from cmb_dagster.pubsub import PubSubOptions
    from cmb_dagster.pubsub.dagster_defs import pubsub_definitions

    assert pubsub_definitions(PubSubOptions()).jobs == [] or all(
        j.name != "cmb_pubsub_backfill" for j in pubsub_definitions(PubSubOptions()).jobs
    )
    definitions = pubsub_definitions(PubSubOptions(backfill_tables=["public.items"]), resource=resource)
    job = definitions.resolve_job_def("cmb_pubsub_backfill")
    with pytest.raises(DagsterInvalidConfigError, match="cmb.callback_signing_secrets"):
        job.execute_in_process(
            run_config={"ops": {"cmb_pubsub_backfill_op": {"config": {"table": "cmb.callback_signing_secrets"}}}}
        )
    result = job.execute_in_process(
        run_config={"ops": {"cmb_pubsub_backfill_op": {"config": {"table": "public.items", "batch_size": 4}}}}
    )
    assert result.success
    [materialization] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    metadata = materialization.event_specific_data.metadata
    assert metadata["rows_done"].value == 10 and metadata["batches"].value == 3 and metadata["state"].value == "done"
