"""Pub/sub handlers that consumer processes of the tests import (``--handler pubsub_handlers:...``): results go
to ``public.results``."""

import os
import signal


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
