import os
import subprocess
import sys

import psycopg
import pytest

from cmb_dagster import migrations
from cmb_dagster.database import Database
from cmb_dagster.embedded import embedded_url
from cmb_dagster.errors import DatabaseUnavailable, EmbeddedServerError, SchemaTooNew
from cmb_dagster.eventqueue import HandlerRegistry, emit, register
from cmb_dagster.eventqueue import admin as eventqueue_admin

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120)


def applied(url: str, schema: str = "cmb") -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute(f"SELECT version, name FROM {schema}.schema_migrations ORDER BY version").fetchall()


def test_first_use_migrates_and_second_is_a_no_op(empty_database_url):
    db = Database(empty_database_url)
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM leases").fetchone() == (0,)
    assert db.upgrade() == []
    assert applied(empty_database_url) == [(m.version, m.name) for m in migrations.available()]


def test_two_schemas_share_one_database(empty_database_url):
    Database(empty_database_url, schema="cmb_a").upgrade()
    Database(empty_database_url, schema="cmb_b").upgrade()
    assert applied(empty_database_url, "cmb_a") == applied(empty_database_url, "cmb_b")


def test_four_parallel_upgrades_apply_each_migration_once(empty_database_url):
    procs = [
        subprocess.Popen(
            [*CLI, "db", "upgrade"],
            env={**os.environ, "CMB_DATABASE_URL": empty_database_url},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outputs
    assert applied(empty_database_url) == [(m.version, m.name) for m in migrations.available()]
    # exactly one process applied the migrations; the others found nothing to do
    assert sum("applied 0001_foundation" in out for out, _ in outputs) == 1


def test_a_newer_schema_is_refused(database_url):
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO cmb.schema_migrations (version, name) VALUES (9999, 'from_the_future')")
    with pytest.raises(SchemaTooNew, match="9999"):
        Database(database_url).ensure_ready()
    result = cli("db", "upgrade", env={"CMB_DATABASE_URL": database_url})
    assert result.returncode == 1
    assert "refusing to run" in result.stderr


def test_unreachable_database_is_one_clear_line_without_password():
    url = "postgresql://someone:hunter2@127.0.0.1:1/nowhere"
    with pytest.raises(DatabaseUnavailable, match="127.0.0.1:1"):
        Database(url).ensure_ready()
    result = cli("db", "status", env={"CMB_DATABASE_URL": url})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "127.0.0.1:1" in result.stderr and "hunter2" not in result.stderr
    assert "Traceback" not in result.stderr


def test_db_status_and_url(database_url):
    status = cli("db", "status", env={"CMB_DATABASE_URL": database_url})
    assert status.returncode == 0, status.stderr
    assert f"version: {migrations.latest_version()}" in status.stdout
    url = cli("db", "url", env={"CMB_DATABASE_URL": "postgresql://u:s3cret@127.0.0.1:1/x"})
    assert url.returncode == 0 and url.stdout.strip() == "postgresql://u:***@127.0.0.1:1/x"


def test_embedded_server_failure_names_its_log(tmp_path):
    pgdata = tmp_path / "postgres"
    pgdata.mkdir()
    (pgdata / "PG_VERSION").write_text("9\n")  # a data directory this server can't run
    with pytest.raises(EmbeddedServerError, match=str(pgdata / "log")):
        embedded_url(tmp_path)


def test_embedded_server_is_shared_between_processes():
    if os.environ.get("CMB_DATABASE_URL"):
        pytest.skip("CMB_DATABASE_URL set: no embedded server in use")
    from cmb_dagster.settings import Settings

    here = embedded_url(Settings.from_env().home)
    code = (
        "from cmb_dagster.embedded import embedded_url; from cmb_dagster.settings import Settings; "
        "print(embedded_url(Settings.from_env().home))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    assert other == here
    with psycopg.connect(here) as a, psycopg.connect(other) as b:
        assert (
            a.execute("SELECT pg_postmaster_start_time()").fetchone()
            == b.execute("SELECT pg_postmaster_start_time()").fetchone()
        )


def test_a_migration_missing_below_the_newest_is_applied(database_url):
    with psycopg.connect(database_url) as conn:
        conn.execute("DELETE FROM cmb.schema_migrations WHERE version = 1")
        conn.execute("DROP TABLE cmb.health_checks")
        conn.execute("DROP TABLE cmb.leases")
    Database(database_url).ensure_ready()
    assert applied(database_url) == [(m.version, m.name) for m in migrations.available()]
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM cmb.leases").fetchone() == (0,)


def test_a_url_given_for_a_database_is_one_pool_for_the_process(db, database_url):
    registry = HandlerRegistry()
    registry.add("h", lambda event: None)
    register(db, registry)
    shared = Database.of(database_url, schema=db.schema)
    try:
        for i in range(40):
            emit("ns", "h", i, db=database_url)
        with psycopg.connect(database_url, autocommit=True) as conn:
            connections = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()[0]
        assert connections <= shared.max_pool_size  # the shared pool's and the fixture's, not one pool per emit
        assert [h.queued for h in eventqueue_admin.status(database_url).handlers] == [40]
        assert Database.of(database_url, schema=db.schema) is shared
    finally:
        shared.close()
