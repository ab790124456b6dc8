"""Runs the engines ask Dagster for, kept in Postgres until the launch sensor of their job has turned them into runs.

A worker stores a request (:func:`store`); the sensor takes the requests of its code location and job
(:func:`take`), hands them to Dagster as ``RunRequest``s with their run keys (Dagster starts one run per key and
sensor), and deletes them on its next tick, once Dagster has recorded its cursor. The table holds only requests
not yet launched.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from psycopg.types.json import Jsonb

from cmb_dagster.database import Database

MAX_TAKEN = 100
"""Requests one sensor tick turns into runs."""

STORE = """
INSERT INTO run_requests (location, sensor, run_key, run_config, tags)
VALUES (%(location)s, %(sensor)s, %(run_key)s, %(run_config)s, %(tags)s)
ON CONFLICT (location, sensor, run_key) DO NOTHING
"""

# Delete the requests the previous tick launched, then read the next ones, oldest first.
FORGET = "DELETE FROM run_requests WHERE location = %(location)s AND sensor = %(sensor)s AND id = ANY(%(done)s)"
TAKE = """
SELECT id, run_key, run_config, tags FROM run_requests
WHERE location = %(location)s AND sensor = %(sensor)s
ORDER BY id
LIMIT %(limit)s
"""


class JobLauncher(Protocol):
    """Asks Dagster for a run of a job of the worker's code location; the Dagster shell provides it.

    ``run_key`` names the item: launching twice with one key starts one run only. Raises ``LookupError`` for a job
    the engine does not launch and ``ValueError`` for a run config the job refuses (the item fails, not retried).
    """

    def launch(
        self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """A run request waiting for its sensor."""

    id: int
    run_key: str
    run_config: Mapping[str, Any]
    tags: Mapping[str, str]


def store(
    database: Database,
    *,
    location: str,
    sensor: str,
    run_key: str,
    run_config: Mapping[str, Any],
    tags: Mapping[str, str],
) -> None:
    """Ask ``sensor`` of code location ``location`` for a run (a key already waiting is kept as it is)."""
    params = {
        "location": location,
        "sensor": sensor,
        "run_key": run_key,
        "run_config": Jsonb(dict(run_config)),
        "tags": Jsonb(dict(tags)),
    }
    with database.connection() as conn:
        conn.execute(STORE, params)


def take(
    database: Database, *, location: str, sensor: str, done: Sequence[int], limit: int = MAX_TAKEN
) -> list[StoredRequest]:
    """Delete the requests ``done`` (launched by the previous tick) and return the next ones, oldest first."""
    params = {"location": location, "sensor": sensor, "done": list(done), "limit": limit}
    with database.connection() as conn:
        if done:
            conn.execute(FORGET, params)
        rows = conn.execute(TAKE, params).fetchall()
    return [StoredRequest(*row) for row in rows]
