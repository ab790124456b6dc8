"""``cmb_dagster/migrations/schema.sql`` is exactly the schema the migrations leave.

Both are loaded into fresh databases of the same server and dumped with the same ``pg_dump``, so the
comparison holds on any server version. After a new migration, regenerate the file with
``python tests/migration/test_schema.py`` (it migrates a scratch database and dumps it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg

from cmb_dagster.database import Database
from cmb_dagster.embedded import client_tool

SCHEMA_SQL = Path(__file__).parents[2] / "cmb_dagster" / "migrations" / "schema.sql"
HEADER = """-- The whole cmb schema as the migrations in this folder leave it (generated; do not edit by hand:
-- add a migration, then run `python tests/migration/test_schema.py`). Read it to see every table.
"""


def dump_schema(url: str) -> str:
    """The cmb schema of ``url`` as SQL, without pg_dump's session settings and comments."""
    out = subprocess.run(
        [str(client_tool("pg_dump")), "--schema-only", "--no-owner", "--no-privileges", "--schema=cmb", "-d", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [
        line
        for line in out.splitlines()
        if line.strip()
        and not line.startswith(("--", "SET ", "SELECT pg_catalog.set_config", "\\restrict", "\\unrestrict"))
        and "SET (pg_attver=" not in line  # a per-server column option some builds add; not part of the schema
    ]
    text = "\n".join(lines)
    return re.sub(r";\n(?=CREATE|ALTER|COMMENT)", ";\n\n", text) + "\n"


def load_schema_sql(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET check_function_bodies = false")  # functions may name tables created further down
        conn.execute(SCHEMA_SQL.read_text())


def test_schema_sql_is_what_the_migrations_leave(database_url, empty_database_url):
    load_schema_sql(empty_database_url)
    assert dump_schema(empty_database_url) == dump_schema(database_url), (
        "cmb_dagster/migrations/schema.sql is out of date: run `python tests/migration/test_schema.py`"
    )


def test_a_changed_migration_shows_in_the_comparison(database_url, empty_database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE cmb.leases ADD COLUMN extra int")
    load_schema_sql(empty_database_url)
    assert dump_schema(empty_database_url) != dump_schema(database_url)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import _create_database, _drop_database

    from cmb_dagster.embedded import embedded_url
    from cmb_dagster.settings import Settings

    server = embedded_url(Settings.from_env().home)
    name, url = _create_database(server, None)
    try:
        Database(url).upgrade()
        SCHEMA_SQL.write_text(HEADER + "\n" + dump_schema(url))
    finally:
        _drop_database(server, name)
    print(f"wrote {SCHEMA_SQL}")
