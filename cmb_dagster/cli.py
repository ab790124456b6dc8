"""The ``cmb-dagster`` command line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from cmb_dagster.callbacks.cli import callbacks
from cmb_dagster.ctl.cli import ctl
from cmb_dagster.database import Database
from cmb_dagster.errors import CmbError
from cmb_dagster.eventqueue.cli import events
from cmb_dagster.pubsub.cli import pubsub
from cmb_dagster.reactive.cli import reactive
from cmb_dagster.settings import Settings
from cmb_dagster.stages.cli import stages


def open_database(schema: str | None = None) -> Database:
    """The database named by the environment (starting the embedded server if needed)."""
    return Database.from_settings(Settings.from_env(schema_name=schema))


def dagster_storage_url(url: str) -> str:
    """``url`` as a SQLAlchemy URL on psycopg2, which dagster-postgres needs for NOTIFY."""
    scheme, rest = url.split("://", 1)
    return f"postgresql+psycopg2://{rest}"


def dagster_env(settings: Settings, db: Database) -> dict[str, str]:
    """Variables that dagster.yaml reads: storage on the cmb server, artifacts under CMB_HOME."""
    env = {
        "CMB_HOME": str(settings.home),
        "CMB_DAGSTER_ARTIFACTS": str(settings.home / "dagster"),
        "CMB_DAGSTER_STORAGE_URL": os.environ.get("CMB_DAGSTER_STORAGE_URL") or dagster_storage_url(db.url),
    }
    if settings.database_url is None:
        env["CMB_DATABASE_URL"] = db.url  # child processes find the running embedded server directly
    return env


@click.group()
@click.version_option(package_name="cmb-dagster")
def main() -> None:
    """cmb_dagster: reactive, event-driven pipelines for Dagster on Postgres."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of the Dagster UI.")
@click.option("--port", default=3000, show_default=True, type=click.IntRange(1, 65535), help="Port of the Dagster UI.")
@click.option("-w", "--workspace", default="workspace.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--sink-port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="Port of the local endpoint that receives demo callbacks (0: none).")
def dev(host: str, port: int, workspace: str, sink_port: int) -> None:
    """Start Postgres if needed, migrate, then run the Dagster webserver and daemon.

    Also serves a local callback endpoint (http://127.0.0.1:8765) that prints what it receives, for the
    example location's callbacks. Ctrl-C (or SIGTERM) stops everything; worker runs end as successes.
    """
    settings = Settings.from_env()
    db = Database.from_settings(settings)
    db.ensure_ready()
    if not Path(workspace).is_file():
        raise click.ClickException(f"no {workspace} in {Path.cwd()}; run from your project's root or pass -w")
    env = {**os.environ, **dagster_env(settings, db)}
    if "DAGSTER_HOME" not in env:
        if not Path("dagster.yaml").is_file():
            raise click.ClickException(f"no dagster.yaml in {Path.cwd()}; run from your project's root or set DAGSTER_HOME")
        env["DAGSTER_HOME"] = str(Path.cwd())
    status = db.status()
    click.echo(f"cmb_dagster: Postgres {status['server_version']} at {db.display_url}, schema {db.schema} v{status['version']}")
    sink = _start_sink(sink_port) if sink_port else None
    click.echo(f"Dagster UI: http://{host}:{port}  (Ctrl-C stops everything)")
    sys.stdout.flush()
    dagster = shutil.which("dagster", path=str(Path(sys.executable).parent)) or "dagster"
    try:
        code = run_process_group([dagster, "dev", "-w", workspace, "-h", host, "-p", str(port)], env)
    finally:
        if sink is not None:
            sink.stop()
    sys.exit(code)


def _start_sink(port: int) -> object | None:
    """The local callback endpoint of the examples, printing each call; None when the port is taken."""
    from cmb_dagster.callbacks.sink import CallbackSink

    sink = CallbackSink("127.0.0.1", port, keep=False)
    sink.on_call.append(lambda call: click.echo(f"callback received: {call.path} {json.dumps(call.body)[:300]}"))
    try:
        sink.start()
    except OSError as exc:
        click.echo(f"callback sink not started: 127.0.0.1:{port} is taken ({exc.strerror}); demo callbacks go there")
        return None
    click.echo(f"callback sink: {sink.url} (demo callbacks are printed here)")
    return sink


def run_process_group(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` in a process group of its own and return its exit code.

    SIGINT and SIGTERM are passed on to the whole group as SIGINT (what Ctrl-C does in a terminal),
    so the webserver, the daemon, code servers and run workers all stop; whatever is left of the
    group 15 s after the command has exited is killed.
    """
    group: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group[0], signal.SIGINT)

    # Handlers first: a handled signal is reset to default in the child, an ignored one (a background
    # job of a non-interactive shell ignores SIGINT) would stay ignored and the group would not stop.
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    group.append(proc.pid)
    code = proc.wait()
    deadline = time.monotonic() + 15
    with contextlib.suppress(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises once no process of the group is left
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    return code


@main.command()
def env() -> None:
    """Print the exports that let `dagster dev` or `dagster-daemon` run on the cmb server directly."""
    settings = Settings.from_env()
    db = Database.from_settings(settings)
    for key, value in dagster_env(settings, db).items():
        click.echo(f"export {key}='{value}'")


@main.group()
def db() -> None:
    """The cmb database: migrations, status, URL."""


@db.command()
@click.option("--schema", default=None, help="Schema of cmb tables (default: CMB_SCHEMA or 'cmb').")
def upgrade(schema: str | None) -> None:
    """Apply pending migrations (safe to run from several processes at once)."""
    database = open_database(schema)
    applied = database.upgrade()
    for migration in applied:
        click.echo(f"applied {migration.version:04d}_{migration.name}")
    click.echo(f"schema {database.schema} is at version {database.status()['version']}")


@db.command()
@click.option("--schema", default=None, help="Schema of cmb tables (default: CMB_SCHEMA or 'cmb').")
def status(schema: str | None) -> None:
    """Show the server, the schema and its migration version."""
    database = Database.from_settings(Settings.from_env(schema_name=schema), migrate=False)
    info = database.status()
    click.echo(f"server:  {info['server']} (Postgres {info['server_version']})")
    click.echo(f"schema:  {info['schema']}")
    state = "not migrated" if info["version"] is None else f"{info['version']} (package knows {info['latest']})"
    click.echo(f"version: {state}")


@db.command()
def url() -> None:
    """Print the database URL with the password masked."""
    click.echo(open_database().display_url)


@db.command()
def stop() -> None:
    """Stop the embedded Postgres server (its data stays under CMB_HOME)."""
    from cmb_dagster.embedded import stop_embedded

    settings = Settings.from_env()
    if settings.database_url:
        raise click.ClickException("CMB_DATABASE_URL is set: there is no embedded server to stop")
    click.echo("stopped" if stop_embedded(settings.home) else "the embedded server was not running")



for engine_group in (pubsub, ctl, reactive, callbacks, stages, events):
    main.add_command(engine_group)


def run() -> None:
    """Console-script entry point: CmbErrors become one line on stderr and exit code 1."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except CmbError as exc:
        click.echo(f"cmb-dagster: error: {exc}", err=True)
        sys.exit(1)
