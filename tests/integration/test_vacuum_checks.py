"""The database checks turn red while another session holds a snapshot that keeps vacuum from cleaning the engines'
tables, naming that session, and green once it ends and vacuum has run; the metrics say the same."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from checks_helpers import StatusTicks, notes, transitions_of
from dagster import AssetCheckSeverity
from scrapes import parse, scrape
from waiting import wait_until

from cmb_dagster import cmb_definitions
from cmb_dagster.eventqueue import EventQueueOptions
from cmb_dagster.metrics import serve
from cmb_dagster.resources import CmbResource
from cmb_dagster.vacuum import MIN_DEAD_ROWS, DatabaseOptions

HORIZON = "database/vacuum:vacuum_horizon_seconds"
DEAD = "database/vacuum:dead_rows_share"
REPORT = "nightly report'); DROP TABLE cmb.leases; --<b>"  # what an application calls itself, shown as text


@contextmanager
def held_snapshot(database_url: str) -> Iterator[int]:
    """Another application's session in a REPEATABLE READ transaction that has read once and stays open: its pid."""
    with psycopg.connect(database_url, application_name=REPORT) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT count(*) FROM pg_class").fetchone()
        yield conn.info.backend_pid
        conn.rollback()


def leave_dead_rows(database_url: str, count: int) -> None:
    """Rows written and deleted in a cmb table by a session that then ends (its statistics reach the server)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO cmb.leases (kind, partition, owner, expires_at) "
            "SELECT 'dead', g::text, 'nobody', now() FROM generate_series(1, %s) AS g",
            (count,),
        )
        conn.execute("DELETE FROM cmb.leases WHERE kind = 'dead'")


def definitions(database_url: str):
    checks = {"vacuum_horizon_seconds": {"error_at": 1}}
    return cmb_definitions(
        resource=CmbResource(database_url=database_url),
        events=EventQueueOptions(handlers=notes),
        database=DatabaseOptions(checks=checks),
    )


def test_a_held_snapshot_turns_the_checks_red_naming_its_session_and_green_after(db, database_url):
    ticks = StatusTicks(definitions(database_url), "cmb_database_status", database_url)
    ticks.tick()
    assert ticks.seen[HORIZON].passed and ticks.seen[DEAD].passed
    with held_snapshot(database_url) as pid:
        leave_dead_rows(database_url, MIN_DEAD_ROWS + 2_000)
        red = ticks.until(HORIZON, passed=False)
        assert red.severity == AssetCheckSeverity.ERROR
        assert f"session {pid} (application {REPORT!r}" in red.description, red.description
        assert "state idle in transaction" in red.description
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("VACUUM cmb.leases")  # the held snapshot keeps every deleted row
        dead = ticks.until(DEAD, passed=False)
        assert dead.severity == AssetCheckSeverity.WARN and dead.description.startswith("leases is 100% dead rows")
    green = ticks.until(HORIZON, passed=True)
    assert "no snapshot held" in green.description
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("VACUUM cmb.leases")  # what autovacuum does once nothing holds the rows back
    assert ticks.until(DEAD, passed=True).description.startswith("no cmb table has")
    assert transitions_of(db, HORIZON) == [("ok", "error"), ("error", "ok")]
    assert transitions_of(db, DEAD) == [("ok", "warn"), ("warn", "ok")]


def horizons(url: str) -> dict[frozenset, float]:
    """The scraped ages of held snapshots by their labels."""
    return {labels: v for (name, labels), v in parse(scrape(url)).items() if name == "cmb_vacuum_horizon_age_seconds"}


def dead_rows(url: str, table: str) -> float:
    return parse(scrape(url))[("cmb_table_dead_rows", frozenset({("table", table)}))]


def test_the_metrics_name_the_holder_and_count_the_dead_rows(db, database_url):
    server = serve(db, host="127.0.0.1", port=0)
    try:
        with held_snapshot(database_url) as pid:
            leave_dead_rows(database_url, 500)
            holder = {"kind": "session", "pid": str(pid), "name": REPORT}
            wait_until(
                lambda: any(dict(k) == holder and v >= 1 for k, v in horizons(server.url).items()),
                20,
                "the held snapshot's age in the metrics",
                interval=0.2,
            )
            assert dead_rows(server.url, "leases") >= 500
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("VACUUM cmb.leases")
        wait_until(
            lambda: not any(v >= 1 for v in horizons(server.url).values()) and dead_rows(server.url, "leases") == 0,
            20,
            "no snapshot held and no dead row left",
            interval=0.2,
        )
    finally:
        server.stop()
