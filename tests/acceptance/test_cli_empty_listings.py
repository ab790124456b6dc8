"""Issue 31: a listing command with nothing to list says so in one line ("no <things>") instead of printing nothing;
with --json, stdout stays JSON lines (none) and the line goes to stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from cmb_dagster import health
from cmb_dagster.callbacks import CallbackClient, CallbackSettings
from cmb_dagster.ctl.store import CtlStore
from cmb_dagster.eventqueue import HandlerRegistry, admin
from cmb_dagster.health import Verdict
from cmb_dagster.stages.admin import shard_count

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]

# every listing command of the callbacks, events, pubsub, stages and ctl groups, and what it says when empty
EMPTY: dict[tuple[str, ...], str] = {
    ("callbacks", "list"): "no events",
    ("callbacks", "list", "--status", "failed", "--owner", "nobody"): "no events",
    ("events", "status"): "no handlers registered",
    ("events", "rules"): "no rules",
    ("events", "dead"): "no dead-lettered events",
    ("events", "dead", "--handler", "nobody", "--traceback"): "no dead-lettered events",
    ("pubsub", "status"): "no consumers registered",
    ("pubsub", "dead"): "no parked events",
    ("pubsub", "dead", "nobody", "--all"): "no parked events",
    ("stages", "queue"): "no entries",
    ("stages", "queue", "--stage", "nothing", "--problems"): "no entries",
    ("ctl", "get"): "no values",
    ("ctl", "get", "nobody"): "no values",
    ("ctl", "history"): "no changes",
    ("ctl", "history", "shop/orders", "loaded_until", "--backwards"): "no changes",
    ("checks",): "no check evaluated yet (the engines' status sensors do it)",
    ("checks", "--failing"): "no failing check",
}
EMPTY_JSON: dict[tuple[str, ...], str] = {
    ("events", "status", "--json"): "no handlers registered",
    ("stages", "status", "--json"): "no stages",
}


def run_cli(args: tuple[str, ...], database_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        env={**os.environ, "CMB_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def run_all(commands: list[tuple[str, ...]], database_url: str) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    with ThreadPoolExecutor(4) as pool:  # a process each (the CLI as it is run), a few at a time
        return dict(zip(commands, pool.map(lambda args: run_cli(args, database_url), commands), strict=True))


def test_listings_with_nothing_to_list_say_so(db, database_url):
    expected = {**EMPTY, ("stages", "status"): f"no stages\nshards: {shard_count(db)}"}
    results = run_all([*expected, *EMPTY_JSON], database_url)
    wrong = [
        (" ".join(args), r.returncode, r.stdout, r.stderr)
        for args, says in expected.items()
        if ((r := results[args]).returncode, r.stdout) != (0, f"{says}\n")
    ]
    wrong += [
        (" ".join(args), r.returncode, r.stdout, r.stderr)
        for args, says in EMPTY_JSON.items()
        if ((r := results[args]).returncode, r.stdout, r.stderr) != (0, "", f"{says}\n")
    ]
    assert wrong == []


registry = HandlerRegistry()


@registry.handler("record")
def record(event) -> None:  # registered only: no worker runs it
    pass


def test_listings_with_something_to_list_show_it_and_not_the_none_line(db, database_url):
    with CallbackClient(db, CallbackSettings(allowed_hosts=["127.0.0.1"]), buffered=False) as client:
        client.create("shop", "orders", "o-1", datetime.now(UTC) + timedelta(hours=1), "http://127.0.0.1:9/cb")
    CtlStore(db, actor="tester").set("shop/orders", "loaded_until", datetime(2030, 1, 1, tzinfo=UTC))
    admin.register(db, registry)
    assert admin.pause(db, "ns", "record")
    health.record(db, [Verdict(("stages", "price"), "parked", "error", "2 parked entries (error at 1)")])
    shown = {
        ("checks",): ("no check evaluated yet", "ERROR  stages/price parked  since "),
        ("checks", "--failing"): ("no failing check", ": 2 parked entries (error at 1)"),
        ("callbacks", "list"): ("no events", "shop/orders/o-1"),
        ("events", "status"): ("no handlers registered", "record"),
        ("events", "status", "--json"): ("no handlers registered", '"handler": "record"'),
        ("events", "rules"): ("no rules", "pause  ns/record"),
        ("ctl", "get"): ("no values", "shop/orders/loaded_until = 2030-01-01T00:00:00+00:00"),
        ("ctl", "history"): ("no changes", "shop/orders/loaded_until: None -> 2030-01-01"),
    }
    results = run_all(list(shown), database_url)
    for args, (none, item) in shown.items():
        result = results[args]
        assert result.returncode == 0, (args, result.stderr)
        assert item in result.stdout and none not in result.stdout + result.stderr, (args, result.stdout)
