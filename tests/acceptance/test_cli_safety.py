"""Issue 15: the command line shows no secret, quotes what `env` prints, and ends every error in one line."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import click
import pytest
from click.testing import CliRunner

from cmb_dagster.cli import main
from cmb_dagster.cli_common import FloatRange

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
SECRET = "pw4SAFETYtest"  # appears in the password as written and as decoded (%21 -> !)
PASSWORD = f"{SECRET}%21"
BAD = "bad"
GOOD = "good"

# Every command with values that work and values that must be refused, in the order they run. Commands
# added later (new engine groups) are still run with a bogus option by test_no_password_in_any_refusal.
COMMANDS: list[tuple[str, list[str]]] = [
    (GOOD, ["db", "upgrade"]),
    (GOOD, ["db", "status"]),
    (GOOD, ["db", "url"]),
    (GOOD, ["env"]),
    (GOOD, ["ctl", "set", "shop/orders", "loaded_until", "2024-05-01T00:00:00+00:00", "--by", "tester"]),
    (GOOD, ["ctl", "get"]),
    (GOOD, ["ctl", "history", "--limit", "5"]),
    (GOOD, ["reactive", "status"]),
    (GOOD, ["reactive", "status", "--json"]),
    (GOOD, ["pubsub", "status"]),
    (GOOD, ["pubsub", "trim"]),
    (GOOD, ["pubsub", "reset"]),
    (GOOD, ["pubsub", "drop", "nobody"]),
    (
        GOOD,
        ["pubsub", "consume", "quiet", "--handler", "cmb_dagster.examples.pubsub:add_to_totals", "--duration", "0.3"],
    ),
    (GOOD, ["pubsub", "dead"]),
    (GOOD, ["pubsub", "backfills"]),
    (GOOD, ["callbacks", "buckets", "5"]),
    (GOOD, ["callbacks", "buckets", "3"]),
    (GOOD, ["callbacks", "create", "me", "g", "k", "--in", "3600", "--url", "http://127.0.0.1:9/x"]),
    (GOOD, ["callbacks", "show", "me", "g", "k"]),
    (GOOD, ["callbacks", "list", "--limit", "10"]),
    (GOOD, ["callbacks", "cancel", "me", "g", "k"]),
    (GOOD, ["callbacks", "delete", "me", "g", "k", "--force"]),
    (GOOD, ["callbacks", "clean"]),
    (GOOD, ["callbacks", "status"]),
    (GOOD, ["callbacks", "failed"]),
    (GOOD, ["callbacks", "failed", "--json", "--owner", "me", "--since", "2024-01-01T00:00:00Z"]),
    (GOOD, ["callbacks", "replay", "--owner", "me", "--group", "g"]),
    (GOOD, ["callbacks", "on-failure", "me", "http://127.0.0.1:9/hook"]),
    (GOOD, ["callbacks", "on-failure", "me"]),
    (GOOD, ["callbacks", "secret", "rotate", "--owner", "me"]),
    (GOOD, ["callbacks", "secret", "list", "--owner", "me"]),
    (GOOD, ["callbacks", "secret", "retire", "--owner", "me", "--all"]),
    (
        GOOD,
        ["callbacks", "create", "me", "g", "k3", "--in", "3600", "--url", "http://127.0.0.1:9/x", "--endpoint", "bill"],
    ),
    (GOOD, ["callbacks", "endpoint", "disable", "--owner", "me", "http://127.0.0.1:9/down"]),
    (GOOD, ["callbacks", "endpoints", "--owner", "me", "--json"]),
    (GOOD, ["callbacks", "endpoint", "enable", "--owner", "me", "http://127.0.0.1:9/down?any=query"]),
    (GOOD, ["callbacks", "endpoint", "policy", "--owner", "me", "--disable-after", "86400", "--probe-interval", "5"]),
    (GOOD, ["callbacks", "endpoint", "policy", "--owner", "me", "--clear"]),
    (GOOD, ["callbacks", "worker", "--duration", "0.5", "--no-materialize"]),
    (BAD, ["--bogus"]),
    (BAD, ["nosuch"]),
    (BAD, ["dev", "--port", "0"]),
    (BAD, ["dev", "-w", "/nonexistent/workspace.yaml"]),
    (BAD, ["db", "status", "--schema", "pg_x"]),
    (BAD, ["db", "upgrade", "--schema", "public"]),
    (BAD, ["db", "url", "--bogus"]),
    (BAD, ["db", "start"]),  # CMB_DATABASE_URL is set: no embedded server to start
    (BAD, ["db", "stop"]),  # CMB_DATABASE_URL is set: no embedded server to stop
    (BAD, ["env", "--bogus"]),
    (BAD, ["ctl", "set", "shop/orders", "loaded_until", "yesterday"]),
    (BAD, ["ctl", "set", "shop/orders", "loaded_until", "9999-12-31T23:00:00-05:00"]),
    (BAD, ["ctl", "history", "--limit", "-1"]),
    (BAD, ["ctl", "get", "a", "b"]),
    (BAD, ["reactive", "forget", "nobody", "nothing"]),
    (BAD, ["reactive", "forget", "s", "t", "--parameter", "only-one"]),
    (BAD, ["reactive", "retry", "nobody", "nothing"]),
    (BAD, ["reactive", "status", "--bogus"]),
    (
        BAD,
        [
            "reactive",
            "set-last",
            "nobody",
            "nothing",
            "--parameter",
            "a/b",
            "p",
            "--value",
            "2024-01-01T00:00:00+00:00",
        ],
    ),
    (BAD, ["reactive", "set-last", "s", "t", "--parameter", "a/b", "p", "--value", "yesterday"]),
    (BAD, ["pubsub", "consume", "unregistered", "--duration", "0.3"]),
    (BAD, ["pubsub", "consume", "c", "--handler", "no_such_module_x:f", "--duration", "0.3"]),
    (BAD, ["pubsub", "drop", "x", "--branch", "abc"]),
    (BAD, ["pubsub", "trim", "--batch-size", "many"]),
    (BAD, ["pubsub", "trim", "--batch-size", "0"]),
    (BAD, ["pubsub", "reset", "--bogus"]),
    (BAD, ["pubsub", "status", "--bogus"]),
    (BAD, ["pubsub", "replay", "nobody", "--bogus"]),
    (BAD, ["pubsub", "rewind", "nobody", "--to", "1"]),
    (BAD, ["pubsub", "backfill", "--table", "no_such_table"]),
    (BAD, ["pubsub", "backfill", "--table", "cmb.callback_signing_secrets"]),
    (BAD, ["pubsub", "backfill", "--table", "pg_authid"]),
    (BAD, ["pubsub", "backfill", "--table", "cmb.leases", "--where", "TRUE) LIMIT 1), x AS (DELETE FROM cmb.leases"]),
    (BAD, ["callbacks", "create", "me", "g", "k2", "--in", "1e30", "--url", "http://127.0.0.1:9/x"]),
    (BAD, ["callbacks", "create", "me", "g", "k2", "--at", "tomorrow", "--url", "http://127.0.0.1:9/x"]),
    (BAD, ["callbacks", "create", "me", "g", "k2", "--in", "5", "--url", "http://127.0.0.1:9/x", "--context", "{"]),
    (BAD, ["callbacks", "show", "me", "g", "nothing"]),
    (BAD, ["callbacks", "list", "--limit", "-5"]),
    (BAD, ["callbacks", "cancel", "me", "g", "nothing"]),
    (BAD, ["callbacks", "delete", "me", "g"]),
    (BAD, ["callbacks", "clean", "--ttl-days", "soon"]),
    (BAD, ["callbacks", "buckets", "abc"]),
    (BAD, ["callbacks", "buckets", "100000000"]),
    (BAD, ["callbacks", "worker", "--buckets", "a,b", "--duration", "0.3"]),
    (BAD, ["callbacks", "worker", "--worker-concurrency", "0", "--duration", "0.3"]),
    (BAD, ["callbacks", "sink", "--port", "70000"]),
    (BAD, ["callbacks", "failed", "--since", "yesterday"]),
    (BAD, ["callbacks", "replay", "--group", "g"]),
    (BAD, ["callbacks", "on-failure", "me", "http://10.0.0.1/hook"]),
    (BAD, ["callbacks", "secret", "rotate", "--owner", "me", "--previous-valid-for", "-1"]),
    (BAD, ["callbacks", "endpoint", "enable", "--owner", "me", "http://127.0.0.1:9/never-seen"]),
    (BAD, ["callbacks", "endpoint", "disable", "--owner", "me", "ftp://127.0.0.1/x"]),
    (
        BAD,
        ["callbacks", "endpoint", "disable", "--owner", "me'); DELETE FROM cmb.callback_events; --" * 10, "http://x/"],
    ),
    (BAD, ["callbacks", "endpoints", "--state", "half-open"]),
    (BAD, ["callbacks", "create", "me", "g", "k4", "--in", "5", "--url", "http://127.0.0.1:9/x", "--endpoint", "a b"]),
    (BAD, ["callbacks", "endpoint", "policy", "--owner", "me", "--failure-threshold", "0"]),
]


def all_commands(group: click.Group = main, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command of the CLI, as the words that name it, groups added later included."""
    found = []
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            found.extend(all_commands(command, (*path, name)))
        else:
            found.append((*path, name))
    return found


def with_password(url: str, form: str) -> str:
    """``url`` carrying PASSWORD in its user-info or as ``?password=`` (the test servers trust local users)."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0].partition(":")[0] if "@" in parts.netloc else "postgres"
    host = parts.netloc.rpartition("@")[2]
    if form == "user-info":
        return parts._replace(netloc=f"{user}:{PASSWORD}@{host}").geturl()
    query = f"{parts.query}&password={PASSWORD}" if parts.query else f"password={PASSWORD}"
    return parts._replace(netloc=f"{user}@{host}", query=query).geturl()


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def check_one_line_error(result: subprocess.CompletedProcess[str], args: list[str]) -> None:
    assert result.returncode not in (0, None), (args, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, (args, result.stderr)
    assert lines[0].startswith("cmb-dagster") and ": error: " in lines[0], (args, lines)


def with_passwords(database_url: str, tmp_path) -> Iterator[dict[str, str]]:
    """The environment of each command: the URL carries the password in its user-info or as ?password=, the two
    forms alternating from command to command (both go through the same masking; one pass over the commands keeps
    this short)."""
    env = {"CMB_HOME": str(tmp_path / "home"), "CMB_CALLBACK_ALLOWED_HOSTS": "127.0.0.1"}
    for form in itertools.cycle(["user-info", "query"]):
        yield env | {"CMB_DATABASE_URL": with_password(database_url, form)}


def check_no_password(results: list[tuple[list[str], subprocess.CompletedProcess[str]]], tmp_path) -> None:
    for args, result in results:
        for stream in (result.stdout, result.stderr):
            assert SECRET not in stream, (args, stream)
    logs = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(SECRET not in p.read_text(errors="replace") for p in logs)


def test_no_password_anywhere(database_url, tmp_path):
    envs = with_passwords(database_url, tmp_path)
    # in order: they build on each other
    results = [(args, run_cli(args, next(envs))) for kind, args in COMMANDS if kind == GOOD]
    for args, result in results:
        assert result.returncode == 0, (args, result.stderr)
    check_no_password(results, tmp_path)
    status = next(result for args, result in results if args == ["db", "status"])
    assert "password=***" in status.stdout or ":***@" in status.stdout


def test_no_password_in_any_refusal(database_url, tmp_path):
    covered = {tuple(a[: len(c)]) for _, a in COMMANDS for c in all_commands() if tuple(a[: len(c)]) == c}
    bad = [args for kind, args in COMMANDS if kind == BAD]
    bad += [[*command, "--no-such-option"] for command in all_commands() if command not in covered]
    bad += [["--debug", "ctl", "history", "--limit", "-1"], ["--debug", "db", "status", "--schema", "pg_x"]]
    envs = with_passwords(database_url, tmp_path)
    bad_envs = [next(envs) for _ in bad]
    with ThreadPoolExecutor(4) as pool:
        refused = list(zip(bad, pool.map(run_cli, bad, bad_envs), strict=True))
    for args, result in refused:
        if "--debug" not in args:
            check_one_line_error(result, args)
    check_no_password(refused, tmp_path)


def test_item1_db_url_and_status_mask_a_query_password(database_url):
    env = {"CMB_DATABASE_URL": with_password(database_url, "query").replace("password=", "sslmode=prefer&password=")}
    for args in (["db", "url"], ["db", "status"]):
        result = run_cli(args, env)
        assert result.returncode == 0, result.stderr
        assert SECRET not in result.stdout and "password=***" in result.stdout


@pytest.mark.parametrize("command", [["db", "url"], ["db", "status"], ["ctl", "get"]])
def test_item2_a_malformed_url_is_one_line_without_its_secret(command):
    env = {"CMB_DATABASE_URL": f"postgresql://u:{SECRET}%zz@127.0.0.1:1/d"}
    result = run_cli(command, env)
    check_one_line_error(result, command)
    assert SECRET not in result.stdout + result.stderr and "cannot be read" in result.stderr


HOSTILE = "a'b\"c$(touch%20PWNED)`touch%20PWNED2`;touch%20PWNED3\\%41"


@pytest.mark.parametrize("show_secrets", [False, True])
def test_item3_env_quotes_hostile_values(tmp_path, show_secrets):
    home = tmp_path / "home a'b\"c$(touch PWNED4)`touch PWNED5`; x"
    url = f"postgresql://u:{HOSTILE}@127.0.0.1:1/d"  # libpq reads raw quotes, $ and ` in a password
    env = {"CMB_DATABASE_URL": url, "CMB_HOME": str(home)}
    printed = run_cli(["env", *(["--show-secrets"] if show_secrets else [])], env)
    assert printed.returncode == 0, printed.stderr
    assert ("PWNED2" in printed.stdout) == show_secrets  # the password is printed only when asked for
    script = 'eval "$1" && printf "%s\\n%s\\n" "$CMB_DAGSTER_STORAGE_URL" "$CMB_HOME"'
    shell = subprocess.run(
        ["sh", "-c", script, "sh", printed.stdout],
        cwd=tmp_path,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shell.returncode == 0, shell.stderr
    assert not list(tmp_path.glob("PWNED*")), "eval ran code from a value"
    assert shell.stdout.splitlines() == [f"postgresql+psycopg2://u:{HOSTILE}@127.0.0.1:1/d", str(home)]


def test_item4_every_group_ends_a_bad_value_in_one_line(database_url):
    """Each group's typical failures (a psycopg error, a pydantic error, a bad option value, an overflow, a
    ValueError); test_no_password_in_any_refusal checks every bad value of COMMANDS the same way."""
    env = {"CMB_DATABASE_URL": database_url}
    bad = [
        ["db", "status", "--schema", "pg_x"],
        ["dev", "--port", "0"],
        ["ctl", "set", "shop/orders", "loaded_until", "9999-12-31T23:00:00-05:00"],
        ["ctl", "history", "--limit", "-1"],
        ["reactive", "forget", "s", "t", "--parameter", "only-one"],
        ["pubsub", "consume", "c", "--handler", "no_such_module_x:f", "--duration", "0.3"],
        ["callbacks", "create", "me", "g", "k2", "--in", "1e30", "--url", "http://127.0.0.1:9/x"],
        ["callbacks", "list", "--limit", "-5"],
        ["callbacks", "worker", "--buckets", "a,b", "--duration", "0.3"],
        ["callbacks", "worker", "--worker-concurrency", "0", "--duration", "0.3"],
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda args: run_cli(args, env), bad))
    for args, result in zip(bad, results, strict=True):
        check_one_line_error(result, args)
        assert result.returncode == (2 if "--help')" in result.stderr else 1), (args, result.stderr)
    debug = run_cli(["ctl", "history", "--limit", "-1"], {**env, "CMB_DEBUG": "1"})
    assert "Traceback" in debug.stderr and debug.stderr.strip().splitlines()[-1].startswith(
        "cmb-dagster ctl history: error:"
    )
    flag = run_cli(["--debug", "callbacks", "show", "me", "g", "nothing"], env)
    assert "Traceback" in flag.stderr and flag.returncode == 1


def test_cli_errors_name_the_command_and_what_to_check(database_url):
    result = run_cli(["callbacks", "list", "--limit", "-5"], {"CMB_DATABASE_URL": database_url})
    assert "cmb-dagster callbacks list: error: Invalid value for '--limit'" in result.stderr
    refused = run_cli(["ctl", "history", "--limit", "abc"], {"CMB_DATABASE_URL": database_url})
    assert "'--limit'" in refused.stderr and "--help" in refused.stderr


def test_the_commands_table_is_complete_for_the_groups_it_knows():
    named = {tuple(args[:n]) for _, args in COMMANDS for n in (1, 2, 3)}  # commands of subgroups have 3 words
    known = [c for c in all_commands() if c[0] in {"db", "ctl", "reactive", "pubsub", "callbacks", "env", "dev"}]
    assert [c for c in known if c not in named] == []


def numeric_parameters() -> list[tuple[tuple[str, ...], click.Parameter]]:
    """Every option and argument of every command that takes a number."""
    found = []
    for path in all_commands():
        command = main
        for word in path:
            command = command.get_command(click.Context(command), word)
        for param in command.params:
            if isinstance(param.type, click.types.IntParamType | click.types.FloatParamType):
                found.append((path, param))
    return found


def test_item7_every_numeric_option_and_argument_has_a_range():
    params = numeric_parameters()
    assert len(params) >= 30
    unbounded = [
        (path, p.name)
        for path, p in params
        if not isinstance(p.type, click.types._NumberRangeBase) or p.type.min is None or p.type.max is None
    ]
    assert unbounded == []
    nan_passes = [
        (path, p.name)
        for path, p in params
        if isinstance(p.type, click.FloatRange) and not isinstance(p.type, FloatRange)
    ]
    assert nan_passes == []  # click's FloatRange lets NaN through every comparison


def test_item7_out_of_range_values_end_in_one_line_naming_the_parameter(database_url):
    cases = []
    for path, param in numeric_parameters():
        if getattr(param, "deprecated", False):  # a line saying so comes first: the name of this release is tried
            continue
        bounds = param.type
        values = [str(bounds.max + 1), str(bounds.min - 1)]
        if isinstance(bounds, click.FloatRange):
            values = [str(bounds.max * 2 + 1), str(bounds.min - 1), "nan"]
        for value in values:
            if isinstance(param, click.Option):
                cases.append(([*path, param.opts[0], value], f"'{param.opts[0]}"))
            else:  # the required arguments before it get placeholders
                arguments = (
                    [
                        p
                        for p in main.get_command(None, path[0]).commands[path[1]].params
                        if isinstance(p, click.Argument)
                    ]
                    if len(path) == 2
                    else []
                )
                before = ["x" for p in arguments[: arguments.index(param)]]
                cases.append(([*path, *before, value], param.human_readable_name))
    # refused while the command line is parsed, before any command runs: in-process (a process per case took a
    # minute on a shared machine); the entry point in a process of its own is test_no_password_in_any_refusal's
    runner = CliRunner()
    for args, named in cases:
        invoked = runner.invoke(main, args, prog_name="cmb-dagster", env={"CMB_DATABASE_URL": database_url})
        result = subprocess.CompletedProcess(args, invoked.exit_code, invoked.stdout, invoked.stderr)
        check_one_line_error(result, args)
        assert named in result.stderr, (args, result.stderr)


NUL_HANDLERS = """
import logging

from cmb_dagster.eventqueue import HandlerRegistry

handlers = HandlerRegistry()


@handlers.handler("nul", max_retries=0)
def nul(event):
    try:
        raise ValueError("a NUL\\x00from the handler")
    except ValueError:
        logging.getLogger("shop.handlers").exception("event %s failed on %s", event.id, "its NUL\\x00key")
        raise
"""


def test_no_raw_nul_reaches_a_worker_process_stderr(database_url, tmp_path):
    (tmp_path / "nul_handlers.py").write_text(NUL_HANDLERS)
    (tmp_path / "nul_at_import.py").write_text('raise ValueError("a NUL\\x00at import")\n')
    env = {**os.environ, "CMB_DATABASE_URL": database_url, "PYTHONPATH": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*CLI, *args], env=env, capture_output=True, timeout=120)

    assert run("events", "register", "--handlers", "nul_handlers:handlers").returncode == 0
    assert run("events", "emit", "ns", "nul", "1").returncode == 0
    worker = run("events", "worker", "--handlers", "nul_handlers:handlers", "--duration", "3")
    assert worker.returncode == 0, worker.stderr
    assert b"\x00" not in worker.stderr
    # the handler's own log line and its traceback, the worker's line about the event: each escaped
    assert worker.stderr.count(b"a NUL\\0from the handler") >= 2 and b"its NUL\\0key" in worker.stderr
    for debug in ([], ["--debug"]):  # the error that ends the command, then with its traceback
        failed = run(*debug, "events", "worker", "--handlers", "nul_at_import:handlers")
        assert failed.returncode == 1
        assert b"\x00" not in failed.stderr and b"a NUL\\0at import" in failed.stderr
