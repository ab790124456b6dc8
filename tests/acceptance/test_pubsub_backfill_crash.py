"""Issue 34: a backfill of 100,000 rows while about 1,000 changes a second flow, killed -9 midway and resumed; a
consumer applying by version ends equal to the table, and no row's events go back to an older version."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, install_capture, status

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
ROWS = 100_000
BACKFILL = [*CLI, "pubsub", "backfill", "--table", "public.source", "--batch-size", "2000"]


def apply_by_version(conn, events):
    """Keep each row's newest version (``event.version``); count the events older than what is applied."""
    conn.execute(
        "INSERT INTO public.copy (id, v, version)"
        " SELECT DISTINCT ON (id) * FROM ("
        "  SELECT (e->>'id')::int AS id, (e->>'v')::int AS v, (e->>'version')::bigint AS version"
        "  FROM jsonb_array_elements(%s::jsonb) AS e) AS batch"
        " ORDER BY id, version DESC"
        " ON CONFLICT (id) DO UPDATE SET v = excluded.v, version = excluded.version"
        " WHERE copy.version < excluded.version",
        (json.dumps([{"id": e.key["id"], "v": e.payload["v"], "version": e.version} for e in events]),),
    )


def rows_done(database_url):
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT rows_done, state FROM cmb.pubsub_backfills").fetchone()
        return row or (0, None)


def test_a_backfill_killed_midway_resumes_and_a_consumer_by_version_ends_equal_to_the_table(database_url, tmp_path):
    db = Database(database_url)
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.source (id int PRIMARY KEY, v int NOT NULL)")
        conn.execute("CREATE TABLE public.copy (id int PRIMARY KEY, v int NOT NULL, version bigint NOT NULL)")
        conn.execute("INSERT INTO public.source SELECT g, 0 FROM generate_series(1, %s) g", (ROWS,))
        install_capture(conn, "public.source")  # the rows exist already: only their changes are captured
    stop = threading.Event()
    changes = [0]

    def write():  # about 1,000 changes a second: 100 transactions of 10 rows, each row's v counting up
        rng = random.Random(34)
        with db.connect() as conn:
            while not stop.is_set():
                started = time.monotonic()
                for _ in range(10):
                    ids = sorted(rng.sample(range(1, ROWS + 1), 10))
                    try:
                        conn.execute("UPDATE public.source SET v = v + 1 WHERE id = ANY(%s)", (ids,))
                        conn.commit()
                        changes[0] += 10
                    except psycopg.errors.DeadlockDetected:  # with the backfill's row locks: the writer retries
                        conn.rollback()
                time.sleep(max(0.0, 0.1 - (time.monotonic() - started)))

    worker = ConsumerWorker(db, ConsumerSpec(consumer_id="copy", handler=apply_by_version, idle_sleep=0.1))
    threads = [threading.Thread(target=write), threading.Thread(target=worker.run, args=(300,))]
    for thread in threads:
        thread.start()
    env = {**os.environ, "CMB_DATABASE_URL": database_url}
    log = Path(tmp_path / "backfill.log")
    try:
        killed = subprocess.Popen(BACKFILL, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        wait_until(lambda: rows_done(database_url)[0] >= 20_000, timeout=60, what="20,000 rows backfilled")
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        done_before, state = rows_done(database_url)
        with psycopg.connect(database_url) as conn:
            written = conn.execute("SELECT count(*) FROM cmb.pubsub_events WHERE op = 'snapshot'").fetchone()[0]
        assert state == "running" and written == done_before < ROWS  # nothing of the batch it was killed in
        resumed = subprocess.run(BACKFILL, env=env, capture_output=True, text=True, timeout=120)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert f"{ROWS} rows in" in resumed.stdout and "done" in resumed.stdout
        time.sleep(1)  # changes keep flowing after the backfill
        stop.set()
        threads[0].join(30)
        wait_until(lambda: status(db, "copy", 0).consumers[0].events == 0, timeout=120, what="the consumer caught up")
    finally:
        stop.set()
        worker.stop()
        for thread in threads:
            thread.join(30)
    assert changes[0] >= 1_000
    with psycopg.connect(database_url) as conn:
        snapshots = conn.execute(
            "SELECT count(*), count(DISTINCT key) FROM cmb.pubsub_events WHERE op = 'snapshot'"
        ).fetchone()
        assert snapshots == (ROWS, ROWS)  # each row once: no duplicate across the kill
        assert (
            conn.execute(  # a row's events by id (version) never go back to an older v
                "SELECT count(*) FROM (SELECT (payload->>'v')::int AS v,"
                " lag((payload->>'v')::int) OVER (PARTITION BY key ORDER BY id) AS before"
                " FROM cmb.pubsub_events) AS e WHERE v < before"
            ).fetchone()[0]
            == 0
        )
        assert conn.execute("SELECT count(*) FROM public.copy").fetchone()[0] == ROWS
        assert (
            conn.execute(
                "SELECT count(*) FROM public.source s JOIN public.copy c USING (id) WHERE s.v <> c.v"
            ).fetchone()[0]
            == 0
        )
    listed = subprocess.run(
        [*CLI, "pubsub", "backfills", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    [progress] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (progress["table"], progress["rows_done"], progress["state"]) == ("public.source", ROWS, "done")
    rewind = subprocess.run(
        [*CLI, "pubsub", "rewind", "copy", "--to", "2000-01-01T00:00+00:00"], env=env, capture_output=True, text=True
    )
    assert rewind.returncode == 0 and "rewound consumer copy (branch 0)" in rewind.stdout, rewind.stderr
    shown = json.loads(
        subprocess.run([*CLI, "pubsub", "status", "--json"], env=env, capture_output=True, text=True).stdout
    )
    assert "to event 1 " in shown["consumers"][0]["last_rewind"] and shown["backfills"][0]["state"] == "done"
    assert shown["consumers"][0]["events"] > ROWS  # everything again
    db.close()
