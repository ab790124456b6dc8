"""The calls the event queue's worker-process tests record in ``public.eq_runs`` (their handlers write it)."""

EQ_RUNS = (
    "CREATE TABLE public.eq_runs (id bigserial PRIMARY KEY, event_id bigint, key text, pid int,"
    " started_at timestamptz NOT NULL DEFAULT clock_timestamp(), ended_at timestamptz)"
)


def left(db) -> int:
    """Events still in the queue."""
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0]


def runs(db) -> list[tuple]:
    """(event id, key, pid, started, ended) of every call, in start order (epoch seconds; ended None: running)."""
    with db.connection() as conn:
        return conn.execute(
            "SELECT event_id, key, pid, extract(epoch FROM started_at)::float8, extract(epoch FROM ended_at)::float8"
            " FROM public.eq_runs ORDER BY started_at, id"
        ).fetchall()
