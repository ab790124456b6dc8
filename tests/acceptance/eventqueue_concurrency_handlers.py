"""Handlers for the event queue's concurrency tests: each call records its start (as the handler saw it) and end
(on the server) in ``public.eq_runs``; ``value["sleep"]`` seconds between (``EQ_SLEEP`` by default)."""

import os
import re
import sys
import time

from cmb_dagster.eventqueue import HandlerRegistry

registry = HandlerRegistry()
_conn = None


def _runs():
    global _conn
    if _conn is None:
        import psycopg

        _conn = psycopg.connect(os.environ["CMB_DATABASE_URL"], autocommit=True)
    return _conn


def _recorded(event) -> None:
    """Records the call's start and end, sleeping between; ``value["exit"]`` exits, ``value["gil"]`` holds the GIL
    (a regular expression that backtracks for ages in C)."""
    started = time.time()  # on entry: the call's start, whichever thread gets the connection first
    conn = _runs()
    run_id = conn.execute(
        "INSERT INTO public.eq_runs (event_id, key, pid, started_at)"
        " VALUES (%s, %s, %s, to_timestamp(%s)) RETURNING id",
        (event.id, event.key, os.getpid(), started),
    ).fetchone()[0]
    if event.value.get("exit"):
        sys.exit(3)
    if event.value.get("gil"):
        re.match(r"(a+)+$", "a" * 64 + "b")
    time.sleep(float(event.value.get("sleep", os.environ.get("EQ_SLEEP", "0"))))
    conn.execute("UPDATE public.eq_runs SET ended_at = clock_timestamp() WHERE id = %s", (run_id,))


LOCK_EXPIRY = float(os.environ.get("EQ_LOCK_EXPIRY", "300"))
registry.add("one_per_key", _recorded, key="value.tenant", concurrency=1, lock_expiry=LOCK_EXPIRY)
registry.add("two_per_key", _recorded, key="value.tenant", concurrency=2, lock_expiry=LOCK_EXPIRY)
registry.add("one_per_key_1s", _recorded, key="value.tenant", concurrency=1, timeout=1, max_retries=1)
registry.add("plain", _recorded, lock_expiry=LOCK_EXPIRY, timeout=1, max_retries=0)
registry.add("patient", _recorded, lock_expiry=LOCK_EXPIRY, timeout=900)

unlimited = HandlerRegistry()  # a worker whose handlers have no limits claims ahead of its free slots
unlimited.add("patient", _recorded, lock_expiry=LOCK_EXPIRY, timeout=900)
