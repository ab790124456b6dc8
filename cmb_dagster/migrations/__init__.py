"""Versioned schema migrations: numbered SQL files in this folder, applied in one locked transaction.

Authoring rules for a migration file ``NNNN_name.sql``:
- it runs with ``search_path`` set to the cmb schema, so it names tables without a schema;
- functions it creates say ``SET search_path FROM CURRENT`` so they find cmb tables from any session;
- it never edits an earlier file: a change is a new file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import psycopg
from psycopg import sql

from cmb_dagster.errors import SchemaTooNew

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """Every migration shipped with the package, in version order."""
    found = []
    for entry in resources.files(__package__).iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions in cmb_dagster.migrations: {versions}")
    return found


def latest_version() -> int:
    """The schema version this package expects."""
    return max((m.version for m in available()), default=0)


def applied_versions(conn: psycopg.Connection, schema: str) -> set[int] | None:
    """Versions applied to ``schema``, or None when the schema has never been migrated."""
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.schema_migrations",)).fetchone()[0]
    if not exists:
        return None
    query = sql.SQL("SELECT version FROM {}.schema_migrations").format(sql.Identifier(schema))
    return {row[0] for row in conn.execute(query)}


def current_version(conn: psycopg.Connection, schema: str) -> int | None:
    """The highest version applied to ``schema``, or None when it has never been migrated."""
    versions = applied_versions(conn, schema)
    return None if versions is None else max(versions, default=0)


def is_up_to_date(versions: set[int] | None) -> bool:
    """Whether every shipped migration is among ``versions``."""
    return versions is not None and {m.version for m in available()} <= versions


def check_not_newer(version: int | None, schema: str) -> None:
    """Refuse to run against a schema migrated by a newer cmb_dagster."""
    latest = latest_version()
    if version is not None and version > latest:
        raise SchemaTooNew(
            f"schema {schema!r} is at version {version} but this cmb_dagster knows only up to {latest}; "
            "upgrade the cmb-dagster package (refusing to run)"
        )


def upgrade(conn: psycopg.Connection, schema: str) -> list[Migration]:
    """Apply every pending migration to ``schema``; return those applied.

    Safe when several processes run it at once: a transaction-level advisory lock serialises them,
    and everything (schema, version rows, migrations) commits together or not at all.
    """
    ident = sql.Identifier(schema)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"cmb_dagster.migrate:{schema}",))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        done = applied_versions(conn, schema) or set()
        check_not_newer(max(done, default=0), schema)
        pending = [m for m in available() if m.version not in done]  # also fills a gap left by a late file
        conn.execute(sql.SQL("SET LOCAL search_path TO {}, public").format(ident))
        for migration in pending:
            conn.execute(migration.sql)
            conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                (migration.version, migration.name),
            )
    return pending
