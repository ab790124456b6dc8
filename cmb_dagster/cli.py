"""The ``cmb-dagster`` command line."""

from __future__ import annotations

import contextlib
import importlib
import json
import keyword
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from cmb_dagster.errors import CmbError
from cmb_dagster.isolation import escaped
from cmb_dagster.secrets import scrub, secrets_of

if TYPE_CHECKING:  # the commands that use the database import it (psycopg, pydantic): the others start faster
    from cmb_dagster.database import Database
    from cmb_dagster.settings import Settings

DEBUG_ENV = "CMB_DEBUG"
MAX_ERROR_LINE = 500
"""Most characters of an error line; a longer one (quoting a huge argument) is cut, saying how long it was."""
SECRET_ENV = ("CMB_DATABASE_URL", "CMB_DIRECT_DATABASE_URL", "CMB_DAGSTER_STORAGE_URL")
"""Variables whose secrets never appear in the CLI's output, errors or logs (nor does ``PGPASSWORD``)."""


def dagster_env(settings: Settings, db: Database) -> dict[str, str]:
    """Variables that dagster.yaml reads: storage on the cmb server, artifacts under CMB_HOME."""
    from cmb_dagster.settings import dagster_storage_url

    env = {
        "CMB_HOME": str(settings.home),
        "CMB_DAGSTER_ARTIFACTS": str(settings.home / "dagster"),
        "CMB_DAGSTER_STORAGE_URL": os.environ.get("CMB_DAGSTER_STORAGE_URL") or dagster_storage_url(db.direct_url),
    }
    if settings.database_url is None:
        env["CMB_DATABASE_URL"] = db.url  # child processes find the running embedded server directly
    return env


ENGINE_GROUPS = {
    "callbacks": "cmb_dagster.callbacks.cli:callbacks",
    "ctl": "cmb_dagster.ctl.cli:ctl",
    "events": "cmb_dagster.eventqueue.cli:events",
    "pubsub": "cmb_dagster.pubsub.cli:pubsub",
    "reactive": "cmb_dagster.reactive.cli:reactive",
    "stages": "cmb_dagster.stages.cli:stages",
}
"""The engines' command groups, each imported (with its engine) only when a command line names it."""


class LazyGroup(click.Group):
    """A group whose ``lazy_commands`` (name -> "module:attribute") are imported when first asked for, so that a
    command line pays only for the commands it names (``--help`` imports them all, for their short help)."""

    def __init__(self, *args: Any, lazy_commands: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            module, _, attribute = self.lazy_commands[cmd_name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.list_commands(ctx):  # mistyped: click suggests the closest of all commands
            for name in self.lazy_commands:
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


class CmbGroup(LazyGroup):
    """The root ``cmb-dagster`` group: whatever goes wrong in any command of any group added to it
    (engine groups included) ends as one line on stderr and a non-zero exit code, with every secret of
    the configured database URLs masked, in that line, in the traceback ``--debug`` adds and in logs.

    Exit codes: 1 for an error, 2 for a bad command line (click's usage errors), 130 when interrupted.
    """

    debug = False

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        self.debug = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
        clean = output_scrubber()
        with scrubbed_logs(clean):
            try:
                result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            except SystemExit:
                raise
            except BaseException as exc:  # every error ends as one line, KeyboardInterrupt too
                code = report_error(exc, clean, debug=self.debug, command=self.command_path_of(args))
                if standalone_mode:
                    sys.exit(code)
                raise
        if standalone_mode:
            sys.exit(result if isinstance(result, int) else 0)
        return result

    def command_path_of(self, args: Sequence[str] | None) -> str:
        """``cmb-dagster group command``: the command that ``args`` name, as far as they name one loaded
        (reporting an error imports nothing)."""
        words, group = ["cmb-dagster"], self
        for arg in sys.argv[1:] if args is None else args:
            if arg.startswith("-"):
                continue
            command = group.commands.get(arg) if isinstance(group, click.Group) else None
            if command is None:
                break
            words.append(arg)
            group = command
        return " ".join(words)


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        root = ctx.find_root().command
        if isinstance(root, CmbGroup):
            root.debug = True


@click.group(cls=CmbGroup, lazy_commands=ENGINE_GROUPS)
@click.version_option(package_name="cmb-dagster")
@click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_set_debug,
    help=f"On an error, print the traceback (passwords masked) before the one-line message; or set {DEBUG_ENV}=1.",
)
def main() -> None:
    """cmb_dagster: reactive, event-driven pipelines for Dagster on Postgres."""


# -- errors: one line, no secret -------------------------------------------------------------------


def output_scrubber() -> Callable[[str], str]:
    """A function that removes from a text the secrets of CMB_DATABASE_URL, CMB_DIRECT_DATABASE_URL,
    CMB_DAGSTER_STORAGE_URL, PGPASSWORD and of any URL or ``password=`` the text quotes itself, and writes a NUL
    as ``\\0`` (:func:`~cmb_dagster.isolation.escaped`: text from user code, e.g. an exception's message, may
    hold one, and a terminal or a log collector would be handed the raw byte)."""
    sources = [os.environ.get(name) for name in SECRET_ENV]
    hidden = set().union(*(secrets_of(source) for source in sources))
    if os.environ.get("PGPASSWORD"):
        hidden.add(os.environ["PGPASSWORD"])
    return lambda text: escaped(scrub(text, *sources, secrets=hidden))


@contextlib.contextmanager
def scrubbed_logs(clean: Callable[[str], str]) -> Iterator[None]:
    """Log records made meanwhile (messages, tracebacks, stacks), cmb's and user code's, are ``clean``-ed
    (:func:`output_scrubber`: no secret, no NUL), whatever their handler."""
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string is logging's own error to report
            return record
        cleaned = clean(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = clean("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        if record.stack_info:
            record.stack_info = clean(record.stack_info)
        return record

    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        logging.setLogRecordFactory(previous)


def report_error(exc: BaseException, clean: Callable[[str], str], *, debug: bool, command: str = "cmb-dagster") -> int:
    """Write ``exc`` as one line on stderr (after its traceback when ``debug``); return the exit code."""
    if debug:
        click.echo(clean("".join(traceback.format_exception(exc)).rstrip("\n")), err=True)
    message, code = describe_error(exc, command)
    if code == 1 and not debug and not isinstance(exc, CmbError | click.ClickException):
        message += f" (--debug or {DEBUG_ENV}=1 shows the traceback)"
    click.echo(bounded(clean(f"{command}: error: {message}")), err=True)
    return code


def bounded(line: str) -> str:
    """``line`` if it has at most MAX_ERROR_LINE characters, else its start and its length."""
    if len(line) <= MAX_ERROR_LINE:
        return line
    tail = f"... ({len(line)} characters in all)"
    return line[: MAX_ERROR_LINE - len(tail)] + tail


def describe_error(exc: BaseException, command: str = "cmb-dagster") -> tuple[str, int]:
    """One line naming what was wrong and what to check, and the exit code."""
    if isinstance(exc, KeyboardInterrupt | click.exceptions.Abort):
        return "aborted", 130
    if isinstance(exc, click.UsageError):
        where = f" (see '{exc.ctx.command_path if exc.ctx else command} --help')"
        return _one_line(exc.format_message()) + where, exc.exit_code
    if isinstance(exc, click.ClickException):
        return _one_line(exc.format_message()), exc.exit_code
    if isinstance(exc, CmbError):
        return _one_line(str(exc)), 1
    import psycopg
    import psycopg_pool
    import pydantic

    if isinstance(exc, pydantic.ValidationError):
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
        )
        return f"invalid {exc.title}: {_one_line(problems)}; check the command's arguments", 1
    if isinstance(exc, psycopg_pool.PoolTimeout):
        return (
            f"no database connection available ({_one_line(str(exc))}); check that the server runs and accepts "
            "connections and that CMB_DATABASE_URL is right"
        ), 1
    if isinstance(exc, psycopg.OperationalError) and not exc.sqlstate:
        return (
            f"database connection failed ({_one_line(str(exc))}); check that the server runs and that "
            "CMB_DATABASE_URL is right"
        ), 1
    if isinstance(exc, psycopg.Error):
        return f"the database refused the command: {_psycopg_line(exc)}; {_psycopg_hint(exc)}", 1
    if isinstance(exc, ValueError | OverflowError | TypeError):
        return f"invalid value: {_one_line(str(exc)) or type(exc).__name__}; check the command's arguments", 1
    if isinstance(exc, ImportError):
        return f"cannot import {exc.name or 'a module'} ({_one_line(str(exc))}); check the module:function given", 1
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {_one_line(str(exc))}", 1
    return f"unexpected {type(exc).__name__}: {_one_line(str(exc))}; please report it with the --debug output", 1


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _psycopg_line(exc: Any) -> str:
    diag = exc.diag
    message = diag.message_primary or str(exc).strip().splitlines()[0]
    detail = f" ({diag.message_detail})" if diag.message_detail else ""
    return _one_line(f"{message}{detail}") + (f" [SQLSTATE {exc.sqlstate}]" if exc.sqlstate else "")


def _psycopg_hint(exc: Any) -> str:
    state = exc.sqlstate or ""
    if state in ("42P01", "3F000", "42883"):  # undefined table, schema, function
        return "check CMB_SCHEMA and that the schema is migrated (cmb-dagster db upgrade)"
    if state.startswith("28") or state == "42501":
        return "check the user and password of CMB_DATABASE_URL and the user's privileges"
    if state.startswith(("08", "53", "57")):
        return "check that the server runs and has room for connections"
    return "check the command's arguments"


STOP_GRACE_S = 15  # from the stop signal to killing what is left of `cmb-dagster dev`'s session
REAP_WAIT_S = 5  # then, at most, for the killed processes to be reaped


EXAMPLES_MODULE = "cmb_dagster.examples"
"""A workspace naming this module loads the examples, whose callbacks go to the sink of `cmb-dagster dev`."""
DEFAULT_SINK_PORT = 8765


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of the Dagster UI.")
@click.option("--port", default=3000, show_default=True, type=click.IntRange(1, 65535), help="Port of the Dagster UI.")
@click.option(
    "-w",
    "--workspace",
    default=None,
    type=click.Path(dir_okay=False),
    help="A workspace file to load (default: workspace.yaml when there is one, else this dg project).",
)
@click.option(
    "--sink-port",
    default=None,
    type=click.IntRange(0, 65535),
    help=f"Port of the local endpoint that prints the callbacks it receives (0: none). Default: "
    f"{DEFAULT_SINK_PORT} when the workspace file names {EXAMPLES_MODULE} (the examples' callbacks go there), "
    "else none.",
)
@click.option(
    "--verbose",
    is_flag=True,
    help="Pass on all that Dagster prints: its webserver's and daemon's INFO logs, run and sensor logs "
    "(default: warnings and errors only).",
)
def dev(host: str, port: int, workspace: str | None, sink_port: int | None, verbose: bool) -> None:
    """Start Postgres if needed, migrate, then run `dg dev` (the Dagster webserver and daemon).

    Run it in a dg project's folder (`cmb-dagster init` writes one) or a folder holding workspace.yaml; Dagster's
    storage is the cmb server when the folder (or DAGSTER_HOME) holds a dagster.yaml. Of Dagster's output it shows
    warnings and errors (--verbose: all); the UI shows the rest.

    For the examples' workspace (the file names cmb_dagster.examples), it also serves a local callback
    endpoint (http://127.0.0.1:8765) that prints what it receives; --sink-port N serves it for any
    workspace, --sink-port 0 never. Ctrl-C (or SIGTERM) stops everything; worker runs end as successes.
    The embedded Postgres keeps running afterwards (`cmb-dagster db stop` stops it).
    """
    if workspace is None and Path("workspace.yaml").is_file():
        workspace = "workspace.yaml"
    if workspace is not None and not Path(workspace).is_file():
        raise click.ClickException(f"no {workspace} in {Path.cwd()}")
    if workspace is None and not _is_dg_project(Path.cwd()):
        raise click.ClickException(
            f"{Path.cwd()} is no dg project (pyproject.toml with [tool.dg]) and holds no workspace.yaml; run from "
            "your project's folder, pass -w, or run `cmb-dagster init`"
        )
    from cmb_dagster.settings import Settings

    settings = Settings.from_env()
    db = open_dagster_database(settings)
    db.ensure_ready()
    env = {**os.environ, **dagster_env(settings, db)}
    home = instance_home(Path.cwd())
    if "DAGSTER_HOME" not in env and home is not None:
        env["DAGSTER_HOME"] = str(home)
    status = db.status()
    click.echo(
        f"cmb_dagster: Postgres {status['server_version']} at {db.display_url}, schema {db.schema} v{status['version']}"
    )
    if sink_port is None:
        examples = workspace is not None and EXAMPLES_MODULE in Path(workspace).read_text(errors="replace")
        sink_port = DEFAULT_SINK_PORT if examples else 0
    sink = _start_sink(sink_port) if sink_port else None
    click.echo(f"Dagster UI: http://{host}:{port}  (Ctrl-C stops everything)")
    sys.stdout.flush()
    dg = shutil.which("dg", path=str(Path(sys.executable).parent)) or "dg"
    command = [dg, "dev", *(["-w", workspace] if workspace else []), "-h", host, "-p", str(port)]
    if not verbose:
        command += ["--log-level", "warning"]
        env["PYTHONUNBUFFERED"] = "1"  # the filter passes each line on as it comes
    _announce_when_up(host, port)
    try:
        code = run_process_group(command, env, keep=None if verbose else QuietFilter)
    finally:
        if sink is not None:
            sink.stop()
        if settings.database_url is None:
            click.echo(f"the embedded Postgres keeps running; `cmb-dagster db stop` stops it ({settings.home})")
    sys.exit(code)


def _is_dg_project(folder: Path) -> bool:
    """Whether ``folder`` holds a dg project: a pyproject.toml with a ``[tool.dg]`` table."""
    try:
        return "dg" in tomllib.loads((folder / "pyproject.toml").read_text()).get("tool", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_QUIET_LEVELS = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} - [\w.-]+ - (DEBUG|INFO) - ")
"""A log line of a Dagster process below WARNING (run workers and sensors print theirs whatever --log-level says)."""
_BETA_NOTICE = re.compile(r"^(.* - WARNING - )?\S+:\d+: BetaWarning: ")
"""Dagster's notice of a beta API: a log record, or Python's own warning line."""
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} - [\w.-]+ - [A-Z]+ - ")


class QuietFilter:
    """What `cmb-dagster dev` passes on of a stream of its Dagster processes (without --verbose): every line but

    - Dagster's DEBUG and INFO log records (run workers and sensors print theirs whatever --log-level says;
      the UI shows them with each run and sensor tick), their indented continuation lines included;
    - Dagster's notices of its beta APIs (``BetaWarning`` records), which it also gives for its own calls
      (turning a component's asset checks into checks definitions); every other warning is passed on;
    - tracebacks that end in ``KeyboardInterrupt``: processes stopping on the Ctrl-C that dev passed on to
      them (Dagster's and cmb_dagster's alike), which is no error. Any other traceback is passed on whole.
    """

    MAX_HELD = 400  # lines of tracebacks held back at most, before they are passed on anyway

    def __init__(self) -> None:
        self.held: list[str] = []
        self.open = 0  # tracebacks begun in ``held`` whose exception line has not come yet
        self.interrupts_only = True
        self.dropping = False  # the last record was dropped: so are its continuation lines

    def __call__(self, line: str) -> list[str]:
        """The lines to pass on now, given the next ``line`` (with its end of line)."""
        if line.startswith("Traceback (most recent call last)"):
            self.held.append(line)
            self.open += 1
            self.dropping = False
            return []
        record = _LOG_LINE.match(_ANSI.sub("", line)) is not None
        if self.held and not record:  # a line of a traceback (another process's log lines may come between)
            self.held.append(line)
            if line.strip() and not line[:1].isspace() and not line.startswith(("During handling", "The above")):
                self.open -= 1  # the exception line ends a traceback
                # two processes' writes may meet within a line: "KeyboardInterrupt    time.sleep(1)"
                self.interrupts_only &= line.startswith("KeyboardInterrupt")
                if self.open <= 0:
                    interrupted = self.interrupts_only
                    block = self.flush()
                    return [] if interrupted else block
            return self.flush() if len(self.held) > self.MAX_HELD else []
        if self.dropping and line[:1].isspace() and line.strip():
            return []
        plain = _ANSI.sub("", line)
        self.dropping = _QUIET_LEVELS.match(plain) is not None or _BETA_NOTICE.match(plain) is not None
        return [] if self.dropping else [line]

    def flush(self) -> list[str]:
        """The lines held back (at the end of the output, or when too many)."""
        block, self.held, self.open, self.interrupts_only = self.held, [], 0, True
        return block


def _announce_when_up(host: str, port: int, within_s: float = 600) -> None:
    """Say once the UI answers (Dagster's own "Serving" line is an INFO line)."""
    import threading
    import urllib.request

    def wait() -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/server_info", timeout=2):
                    click.echo(f"Dagster UI is up: http://{host}:{port}")
                    return
            except OSError:
                time.sleep(0.5)

    threading.Thread(target=wait, name="cmb-dev-ui-up", daemon=True).start()


def open_dagster_database(settings: Settings) -> Database:
    """The database of ``settings``; says on stderr when it has to start the embedded server (it keeps running)."""
    from cmb_dagster.database import Database
    from cmb_dagster.embedded import data_dir, embedded_running

    if settings.database_url is None and not embedded_running(settings.home):
        click.echo(
            f"cmb-dagster: starting the embedded Postgres under {data_dir(settings.home)} "
            "(it keeps running until `cmb-dagster db stop`)",
            err=True,
        )
    return Database.from_settings(settings)


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


def run_process_group(
    command: list[str], env: dict[str, str], keep: Callable[[], Callable[[str], list[str]]] | None = None
) -> int:
    """Run ``command`` in a session and process group of its own and return its exit code.

    With ``keep`` (a factory of filters, one per stream), the group's stdout and stderr are read line by line
    and what the stream's ``filter(line)`` returns is written to ours (its ``flush()``, if it has one, gives
    what it held back at the end); without it, the group writes to ours directly.

    SIGINT and SIGTERM are passed on to the whole group as SIGINT (what Ctrl-C does in a terminal),
    so the webserver, the daemon, code servers and run workers all stop. When the command has exited,
    each process of its session that has not had SIGINT yet gets it (`dagster dev` restarts a code server
    that stopped before it did, after the signal). Whatever is left 15 s after the first signal (or after
    the command exited on its own) is killed; it returns once the session's processes are gone.
    """
    group: list[int] = []
    interrupted: set[int] = set()  # processes of the session that had SIGINT
    kill_at: list[float] = []  # when whatever is left of the session is killed

    def forward(signum: int, frame: object) -> None:
        if group:
            interrupted.update(_session_members(group[0]))
            kill_at.append(time.monotonic() + STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group[0], signal.SIGINT)

    # Handlers first: a handled signal is reset to default in the child, an ignored one (a background
    # job of a non-interactive shell ignores SIGINT) would stay ignored and the group would not stop.
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    piped = subprocess.PIPE if keep is not None else None
    proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=piped, stderr=piped)
    group.append(proc.pid)
    readers = [] if keep is None else _pass_on(proc, keep)
    code = proc.wait()
    kill_at.append(time.monotonic() + STOP_GRACE_S)
    while (members := _session_members(proc.pid)) and time.monotonic() < kill_at[0] + REAP_WAIT_S:
        late = time.monotonic() > kill_at[0]
        for pid in members if late else members - interrupted:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if late else signal.SIGINT)
        interrupted.update(members)
        time.sleep(0.2)
    for reader in readers:
        reader.join(REAP_WAIT_S)  # a process of another session may hold the pipe open
    return code


def _pass_on(proc: subprocess.Popen[bytes], keep: Callable[[], Callable[[str], list[str]]]) -> list[Any]:
    """Threads writing what a filter of ``keep`` keeps of ``proc``'s stdout and stderr to ours, line by line."""
    import threading

    def read(source: Any, target: Any) -> None:
        kept = keep()
        with source:
            for raw in source:
                _write(target, kept(raw.decode(errors="replace")))
        flush = getattr(kept, "flush", None)
        _write(target, flush() if flush is not None else [])

    readers = [
        threading.Thread(target=read, args=(proc.stdout, sys.stdout), name="cmb-dev-stdout", daemon=True),
        threading.Thread(target=read, args=(proc.stderr, sys.stderr), name="cmb-dev-stderr", daemon=True),
    ]
    for reader in readers:
        reader.start()
    return readers


def _write(target: Any, lines: list[str]) -> None:
    if lines:
        with contextlib.suppress(OSError, ValueError):  # our own output closed: the lines have nowhere to go
            target.write("".join(lines))
            target.flush()


def _session_members(session: int) -> set[int]:
    """The processes of session ``session``, zombies not yet reaped included."""
    import psutil

    members = set()
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):  # gone meanwhile, or not ours to see
            if os.getsid(process.pid) == session:
                members.add(process.pid)
    return members


INSTANCE_HOME = "dagster_home"
"""The folder of a project holding the Dagster instance's dagster.yaml (DAGSTER_HOME), apart from the project's
root so that `dg` commands run without the variables it reads."""


def instance_home(folder: Path) -> Path | None:
    """The folder holding a project's dagster.yaml: its ``dagster_home/`` (`cmb-dagster init`), or itself."""
    for home in (folder / INSTANCE_HOME, folder):
        if (home / "dagster.yaml").is_file():
            return home
    return None


def project_files(package: str) -> dict[str, str]:
    """What `cmb-dagster init` writes (a path in the project -> its template in cmb_dagster/templates)."""
    return {
        "pyproject.toml": "pyproject.toml.tmpl",
        f"{INSTANCE_HOME}/dagster.yaml": "dagster.yaml",
        ".gitignore": "gitignore",
        f"src/{package}/__init__.py": "",
        f"src/{package}/definitions.py": "definitions.py",
        f"src/{package}/defs/__init__.py": "",
        f"src/{package}/defs/shop/assets.py": "assets.py",
        f"src/{package}/defs/reactive/defs.yaml": "reactive.defs.yaml",
    }


def package_name(folder: Path) -> str:
    """The Python package of a project in ``folder``: its name in lower case ASCII, other characters as ``_``."""
    name = re.sub(r"[^a-z0-9]+", "_", folder.resolve().name.lower()).strip("_") or "pipelines"
    return f"p_{name}" if name[0].isdigit() or keyword.iskeyword(name) else name


@main.command()
@click.argument("folder", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite those of the files that exist.")
def init(folder: Path, force: bool) -> None:
    """Start a dg project in FOLDER (default: here): pyproject.toml, dagster.yaml (Dagster's storage on the cmb
    server), src/<package>/definitions.py loading the defs folder, an asset advancing a CTL value
    (defs/shop/assets.py) and a reactive task written in defs/reactive/defs.yaml, to edit.

    Refuses, writing nothing, when one of them exists, unless --force. Then, in FOLDER: `cmb-dagster dev` runs
    Dagster on it, and after eval "$(cmb-dagster env)" `dg` commands work there too.
    """
    from importlib.resources import files

    package = package_name(folder)
    targets = {folder / path: template for path, template in project_files(package).items()}
    existing = [target for target in targets if target.exists()]
    if existing and not force:
        names = ", ".join(str(target) for target in existing)
        raise click.ClickException(f"{names}: already there, nothing written (--force overwrites)")
    templates = files("cmb_dagster") / "templates"
    for target, template in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        text = (templates / template).read_text(encoding="utf-8") if template else ""
        if template.endswith(".tmpl"):
            text = text.format(name=package.replace("_", "-"), package=package)
        target.write_text(text, encoding="utf-8")
        click.echo(f"wrote {target}" + (" (overwritten)" if target in existing else ""))
    where = "" if folder.resolve() == Path.cwd() else f"cd {shlex.quote(str(folder))} && "
    click.echo(f"next: {where}cmb-dagster dev  (the Dagster UI; edit src/{package}/defs to make it yours)")
    click.echo(
        "Postgres: CMB_DATABASE_URL if set, else an embedded server with its data under .cmb/ "
        "(`cmb-dagster db start` starts it for `dg dev`; .cmb/ is in .gitignore)"
    )


@main.command()
@click.option(
    "--show-secrets",
    is_flag=True,
    help="Print passwords literally (e.g. for a .env file) instead of reading them from the variables "
    "of the shell that evaluates the exports.",
)
def env(show_secrets: bool) -> None:
    """Print the exports that let `dg` and `dagster` commands (dev, launch, daemon, ...) run on the cmb server
    directly, in the current folder: a project of `cmb-dagster init` (its dagster_home/dagster.yaml), or a folder
    holding dagster.yaml.

    Use as eval "$(cmb-dagster env)". Exports DAGSTER_HOME (the folder of dagster.yaml), PYTHONPATH (a dg
    project's src/ first), CMB_HOME, the Dagster storage URL
    and, for the embedded Postgres (started if needed, said on stderr), CMB_DATABASE_URL. Every value is
    shell-quoted. A password is not printed: the exports read it from CMB_DATABASE_URL (or
    CMB_DAGSTER_STORAGE_URL) of the evaluating shell, unless --show-secrets.
    """
    home = instance_home(Path.cwd())
    if home is None:
        raise click.ClickException(
            f"no dagster.yaml in {Path.cwd()} or its {INSTANCE_HOME}/; run `cmb-dagster init` here first, or cd to "
            "your project's folder"
        )
    from cmb_dagster.settings import Settings

    settings = Settings.from_env()
    db = open_dagster_database(settings)
    values = {"DAGSTER_HOME": str(home), **dagster_env(settings, db)}
    source = Path.cwd() / "src"
    if _is_dg_project(Path.cwd()) and source.is_dir():  # `dg launch` imports the project without an install
        values["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))
    for line in env_lines(values, settings, show_secrets=show_secrets):
        click.echo(line)


def storage_source(settings: Settings) -> tuple[str, str] | None:
    """The variable and URL Dagster's storage is on: the server itself (LISTEN), so the direct URL if any."""
    if settings.direct_database_url:
        return "CMB_DIRECT_DATABASE_URL", settings.direct_database_url
    if settings.database_url:
        return "CMB_DATABASE_URL", settings.database_url
    return None


def env_lines(values: dict[str, str], settings: Settings, *, show_secrets: bool) -> list[str]:
    """``export`` lines for ``values``, each value quoted; values with a secret refer to the environment."""
    from cmb_dagster.settings import dagster_storage_url

    lines = []
    for key, value in values.items():
        if show_secrets or not secrets_of(value):
            lines.append(f"export {key}={shlex.quote(value)}")
        elif os.environ.get(key) == value:
            lines.append(f"export {key}")  # already in the environment: export it as it is, unprinted
        elif (
            key == "CMB_DAGSTER_STORAGE_URL"
            and (source := storage_source(settings))
            and value == dagster_storage_url(source[1])
            and value == f"postgresql+psycopg2://{source[1].split('://', 1)[1]}"  # one host: the prefix
        ):
            name = source[0]
            lines.append(
                f': "${{{name}:?is not set in this shell; cmb-dagster env refers to it for the password '
                '(or use --show-secrets)}"'
            )
            lines.append(f'export CMB_DAGSTER_STORAGE_URL="postgresql+psycopg2://${{{name}#*://}}"')
        else:
            raise click.ClickException(
                f"{key} holds a password that cmb-dagster env does not print; use --show-secrets"
            )
    return lines


@main.group()
def db() -> None:
    """The cmb database: migrations, status, URL."""


@db.command()
@click.option("--schema", default=None, help="Schema of cmb tables (default: CMB_SCHEMA or 'cmb').")
def upgrade(schema: str | None) -> None:
    """Apply pending migrations (safe to run from several processes at once)."""
    from cmb_dagster.cli_common import open_database

    database = open_database(schema)
    applied = database.upgrade()
    for migration in applied:
        click.echo(f"applied {migration.version:04d}_{migration.name}")
    click.echo(f"schema {database.schema} is at version {database.status()['version']}")


@db.command()
@click.option("--schema", default=None, help="Schema of cmb tables (default: CMB_SCHEMA or 'cmb').")
def status(schema: str | None) -> None:
    """Show the server, the schema and its migration version, and what keeps vacuum from cleaning its tables."""
    from cmb_dagster import vacuum
    from cmb_dagster.database import Database
    from cmb_dagster.settings import Settings

    database = Database.from_settings(Settings.from_env(schema_name=schema), migrate=False)
    info = database.status()
    click.echo(f"server:  {info['server']} (Postgres {info['server_version']})")
    click.echo(f"schema:  {info['schema']}")
    state = "not migrated" if info["version"] is None else f"{info['version']} (package knows {info['latest']})"
    click.echo(f"version: {state}")
    found = vacuum.status(database)
    click.echo(f"vacuum:  oldest snapshot {f'held by {found.holder}' if found.holder else 'none held'}")
    dead = sorted((t for t in found.tables if t.dead), key=lambda t: t.dead, reverse=True)[:3]
    click.echo(f"dead rows: {', '.join(f'{t.table} {t.dead:,}' for t in dead) or 'none'}")


@db.command()
def url() -> None:
    """Print the database URL with the password masked."""
    from cmb_dagster.cli_common import open_database

    click.echo(open_database().display_url)


@db.command()
def start() -> None:
    """Start the embedded Postgres server under CMB_HOME (the Dagster processes of `dg dev` use it, never start it)
    and migrate it."""
    from cmb_dagster.database import Database
    from cmb_dagster.settings import Settings

    settings = Settings.from_env()
    if settings.database_url:
        raise click.ClickException("CMB_DATABASE_URL is set: there is no embedded server to start")
    database = Database.from_settings(settings)
    database.ensure_ready()
    click.echo(f"the embedded Postgres runs under {settings.home.resolve()}; `cmb-dagster db stop` stops it")


@db.command()
def stop() -> None:
    """Stop the embedded Postgres server (its data stays under CMB_HOME).

    Also in a shell that ran eval "$(cmb-dagster env)", whose CMB_DATABASE_URL names the embedded server.
    """
    from cmb_dagster.embedded import data_dir, running_embedded_url, stop_embedded
    from cmb_dagster.settings import Settings

    settings = Settings.from_env()
    url = settings.database_url
    if url and url != running_embedded_url(settings.home) and f"host={data_dir(settings.home)}" not in url:
        raise click.ClickException("CMB_DATABASE_URL is set: there is no embedded server to stop")
    click.echo("stopped" if stop_embedded(settings.home) else "the embedded server was not running")


@main.command()
@click.option("--failing", is_flag=True, help="Only the checks that warn or fail.")
def checks(failing: bool) -> None:
    """The engines' asset checks as last evaluated (by the status sensors): severity, since when, why."""
    from cmb_dagster.cli_common import open_database
    from cmb_dagster.health import check_label, states

    found = states(open_database(), failing=failing)
    if not found:
        click.echo("no failing check" if failing else "no check evaluated yet (the engines' status sensors do it)")
    for state in found:
        since = state.since.astimezone().strftime("%Y-%m-%d %H:%M:%S")
        check = check_label(state.check, state.scope)
        click.echo(f"{state.severity.upper():<5}  {'/'.join(state.asset)} {check}  since {since}: {state.text}")


def _host(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from cmb_dagster.metrics import check_host

    try:
        return check_host(value)
    except CmbError as exc:
        raise click.BadParameter(str(exc).removeprefix("host: ")) from None


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, callback=_host, help="Address to listen on.")
@click.option("--port", default=9464, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option(
    "--bucket-sets",
    default=1,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Callbacks figures per this many bucket sets (set i: buckets with id % N == i), e.g. CallbackOptions.workers.",
)
def metrics(host: str, port: int, bucket_sets: int) -> None:
    """Serve the status of every engine as Prometheus metrics on http://HOST:PORT/metrics until stopped.

    Each scrape reads the engines' status from the database (docs/operations.md, "Metrics", lists the
    metrics). Ctrl-C or SIGTERM stops it.
    """
    from cmb_dagster.cli_common import open_database
    from cmb_dagster.metrics import serve
    from cmb_dagster.workers import stop_workers_on_signals

    database = open_database()
    with stop_workers_on_signals() as signalled:
        server = serve(database, host=host, port=port, bucket_sets=bucket_sets)
        click.echo(f"serving metrics of {database.display_url} on {server.url}", err=True)
        try:
            while not signalled.wait(0.5):
                pass
        finally:
            server.stop()


def run() -> None:
    """Console-script entry point: any error becomes one line on stderr and a non-zero exit code (see CmbGroup).

    SIGTERM stops every command, also when the parent ignored it (a shell's background job ignores SIGINT, and
    Dagster maps SIGTERM to SIGINT's handler): an ignored signal is inherited, and one that arrived before a worker
    set its handler would be lost."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    main()
