"""Handlers for the event queue's process tests: each run appends ``<event id> <unix time>`` to a file per process."""

import os
import time

from cmb_dagster.eventqueue import Backoff, HandlerRegistry

registry = HandlerRegistry()
_fd = None


def _out() -> int:
    global _fd
    if _fd is None:
        path = os.path.join(os.environ["EQ_OUT"], f"{os.getpid()}.log")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    return _fd


@registry.handler("record", lock_expiry=float(os.environ.get("EQ_LOCK_EXPIRY", "300")))
def record(event) -> None:
    pause = float(os.environ.get("EQ_SLEEP", "0"))
    if pause:
        time.sleep(pause)
    os.write(_out(), f"{event.id} {time.time():.6f}\n".encode())  # unbuffered: survives kill -9


@registry.handler("always_fails", max_retries=1, backoff=Backoff(first=0.1))
def always_fails(event) -> None:
    raise ValueError(f"cannot handle {event.value}")


@registry.handler("mixed", lock_expiry=float(os.environ.get("EQ_MIXED_LOCK_EXPIRY", "1")), max_crashes=3)
def mixed(event) -> None:
    """Records the run, then sleeps ``value["sleep"]`` seconds; ``value["crash"]`` kills the process first."""
    if event.value.get("crash"):
        os.kill(os.getpid(), 9)  # as a segfaulting library or the OOM killer would
    os.write(_out(), f"{event.id} {time.time():.6f}\n".encode())
    time.sleep(event.value.get("sleep", 0))


def _runs_table():
    """A connection of this process recording runs in ``public.eq_runs`` (the flow tests make the table)."""
    global _runs
    if _runs is None:
        import psycopg

        _runs = psycopg.connect(os.environ["CMB_DATABASE_URL"], autocommit=True)
    return _runs


_runs = None


def _recorded(event) -> None:
    """Records the run's start and end in ``eq_runs`` (time on the server), sleeping ``EQ_SLEEP`` seconds between."""
    conn = _runs_table()
    run_id = conn.execute(
        "INSERT INTO public.eq_runs (event_id, key, pid) VALUES (%s, %s, %s) RETURNING id",
        (event.id, event.key, os.getpid()),
    ).fetchone()[0]
    time.sleep(float(os.environ.get("EQ_SLEEP", "0")))
    conn.execute("UPDATE public.eq_runs SET ended_at = clock_timestamp() WHERE id = %s", (run_id,))


registry.add(
    "two_per_tenant",
    _recorded,
    key="value.tenant",
    concurrency=2,
    lock_expiry=float(os.environ.get("EQ_LOCK_EXPIRY", "300")),
)
registry.add("twenty_a_second", _recorded, key="value.tenant", rate_limit="20/s")


@registry.handler("digest", key="value.user", debounce=0.3, lock_expiry=float(os.environ.get("EQ_LOCK_EXPIRY", "300")))
def digest(events) -> None:
    """Records one run per call (the first event's id, the ids as the key), sleeping ``EQ_SLEEP`` seconds."""
    conn = _runs_table()
    ids = ",".join(str(e.id) for e in events)
    run_id = conn.execute(
        "INSERT INTO public.eq_runs (event_id, key, pid) VALUES (%s, %s, %s) RETURNING id",
        (events[0].id, ids, os.getpid()),
    ).fetchone()[0]
    time.sleep(float(os.environ.get("EQ_SLEEP", "0")))
    conn.execute("UPDATE public.eq_runs SET ended_at = clock_timestamp() WHERE id = %s", (run_id,))
