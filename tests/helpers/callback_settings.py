"""Callback settings for tests: short polls, leases and timeouts, calls to 127.0.0.1 allowed; and a worker process
started with the same."""

import sys

from cmb_dagster.callbacks.models import CallbackSettings
from cmb_dagster.models import Backoff

FAST = CallbackSettings(
    poll_interval=0.2, lease_ttl=3, timeout=1, backoff=Backoff(first=0.01), lookahead=1, allowed_hosts=["127.0.0.1"]
)

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
WORKER = [
    *CLI,
    "callbacks",
    "worker",
    "--lease-ttl",
    "3",
    "--timeout",
    "1",
    "--poll-interval",
    "0.2",
    "--no-materialize",
]
"""The command of a callbacks worker process with FAST's lease, timeout and poll interval (add options at its end)."""
