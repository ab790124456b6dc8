"""Pub/sub handlers that consumer processes of the tests import (``--handler pubsub_handlers:...``): results go
to ``public.results``."""

import json
import os
import signal
import sys
import time


def record(conn, events) -> None:
    """One result row per event, written in the consumer's transaction; an event whose payload says ``crash``
    kills the process delivering it (as a segfaulting library or the OOM killer would)."""
    for event in events:
        if isinstance(event.payload, dict) and event.payload.get("crash"):
            os.kill(os.getpid(), signal.SIGKILL)
    conn.execute("INSERT INTO public.results (event_id) SELECT unnest(%s::bigint[])", ([e.id for e in events],))


def fragile(conn, events) -> None:
    """Raises on payload n == 1 (unless a row in ``public.fixed`` says the bug is fixed)."""
    fixed = conn.execute("SELECT count(*) FROM public.fixed").fetchone()[0]
    conn.execute("INSERT INTO public.results (event_id) SELECT unnest(%s::bigint[])", ([e.id for e in events],))
    if not fixed and any(e.payload["n"] == 1 for e in events):
        raise ValueError("cannot handle n=1")


def record_calls(conn, events) -> None:
    """One result row per event; each call appends ``[pid, start, end, event ids]`` (``time.time()``) to the file
    ``CMB_TEST_CALLS`` as it ends. The first call on an event whose payload says ``slow`` sleeps that many seconds
    first (past the consumer's handler timeout: its transaction is ended meanwhile, so its insert fails)."""
    started, ids = time.time(), [e.id for e in events]
    path = os.environ["CMB_TEST_CALLS"]
    try:
        slow = [e for e in events if isinstance(e.payload, dict) and e.payload.get("slow")]
        if slow and not any(slow[0].id in call[3] for call in _calls(path)):
            time.sleep(slow[0].payload["slow"])
        conn.execute("INSERT INTO public.results (event_id) SELECT unnest(%s::bigint[])", (ids,))
    finally:
        with open(path, "a") as calls:
            calls.write(json.dumps([os.getpid(), started, time.time(), ids]) + "\n")


def _calls(path: str) -> list[list]:
    return [json.loads(line) for line in open(path).read().splitlines()] if os.path.exists(path) else []


def exits(conn, events) -> None:
    """One result row per event; ``sys.exit(3)`` on a batch with an event whose payload says ``exit``."""
    if any(isinstance(e.payload, dict) and e.payload.get("exit") for e in events):
        sys.exit(3)
    conn.execute("INSERT INTO public.results (event_id) SELECT unnest(%s::bigint[])", ([e.id for e in events],))
