"""Callback settings for tests: short polls, leases and timeouts, calls to 127.0.0.1 allowed."""

from cmb_dagster.callbacks.models import CallbackSettings
from cmb_dagster.models import Backoff

FAST = CallbackSettings(
    poll_interval=0.2, lease_ttl=3, timeout=1, backoff=Backoff(first=0.01), lookahead=1, allowed_hosts=["127.0.0.1"]
)
