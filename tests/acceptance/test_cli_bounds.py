"""Issue 29 item 13: the command line refuses shard ids out of range and handlers of the standard library, and
an error line quoting a huge argument stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from cmb_dagster.examples.pubsub import add_to_totals, consumer
from cmb_dagster.pubsub.models import load_handler

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
HUGE = "x" * 100_000
MAX_LINE = 1_000


def run_cli(args: list[str], database_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CMB_DATABASE_URL": database_url}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60)


def run_all(cases: list[list[str]], database_url: str) -> list[tuple[list[str], subprocess.CompletedProcess[str]]]:
    with ThreadPoolExecutor(4) as pool:
        return list(zip(cases, pool.map(lambda args: run_cli(args, database_url), cases), strict=True))


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], result.stderr[:2000]
    return lines[0]


def test_an_error_quoting_a_huge_argument_is_one_short_line(database_url):
    usage_error, error = 2, 1
    cases = {
        ("stages", "get", HUGE): error,
        ("stages", "worker", "--stages", HUGE, "--duration", "0.3"): error,
        ("events", "emit", HUGE, "handler", "{}"): error,
        ("pubsub", "consume", HUGE, "--duration", "0.3"): error,
        ("ctl", "history", "--limit", HUGE): usage_error,
    }
    lines = {}
    for args, result in run_all([list(args) for args in cases], database_url):
        lines[args[0]] = line = error_line(result)
        assert result.returncode == cases[tuple(args)], (args[:2], result.returncode, line[:300])
        assert len(line) < MAX_LINE, (args[:2], len(line), line[:300])
    assert lines["ctl"].startswith("cmb-dagster ctl history: error: Invalid value for '--limit': 'xxx")
    assert re.search(r"\.\.\. \(100\d{3} characters in all\)$", lines["ctl"])  # click quotes all of it; the line is cut


def test_worker_shards_must_be_ids_within_range(database_url):
    worker = ["stages", "worker", "--stages", "cmb_dagster.examples.stages:options", "--duration", "0.3"]
    refused = [[*worker, "--shards", shards] for shards in ["-5", "5000", ",", "1,a", ""]]
    for args, result in run_all(refused, database_url):
        line = error_line(result)
        assert result.returncode == 2 and "'--shards'" in line, (args, line)


def test_consume_refuses_a_handler_of_the_standard_library_or_of_another_shape(database_url):
    refused = [
        ["pubsub", "consume", "c", "--handler", handler, "--duration", "0.3"]
        for handler in ["os:system", "subprocess:call", "builtins:eval", "cmb_dagster.inputs:max_payload_bytes"]
    ]
    for args, result in run_all(refused, database_url):
        line = error_line(result)
        assert result.returncode == 1 and "handler: " in line, (args, line)


def test_a_handler_of_its_own_still_loads():
    assert load_handler(consumer.handler) is add_to_totals
