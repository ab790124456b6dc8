"""A health check: a job that records that this code location reached the cmb database."""

from dagster import OpExecutionContext, job, op

from cmb_dagster import migrations
from cmb_dagster.resources import CmbResource


@op(description="Record that this code location reached the cmb database, with server and schema versions.")
def record_health_check(context: OpExecutionContext, cmb: CmbResource) -> None:
    with cmb.connection() as conn:
        server = conn.execute("SHOW server_version").fetchone()[0]
        version = migrations.current_version(conn, cmb.database.schema)
        row = conn.execute(
            "INSERT INTO health_checks (source, server_version, schema_version) VALUES (%s, %s, %s) RETURNING id",
            (f"dagster run {context.run_id}", server, version),
        ).fetchone()
    context.log.info(f"health check {row[0]}: Postgres {server}, schema {cmb.database.schema} v{version}")


@job(description="Checks the cmb database answers and records it in cmb.health_checks.")
def health_check() -> None:
    record_health_check()
