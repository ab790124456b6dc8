"""What the multi-host tests check worker processes against: the leases they held (a trigger records every change
of ``leases``), the calls of user code they made (tests/acceptance/multihost_handlers.py records each with its
process and time), and a gate the test closes on those calls to stop a process inside user code."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
from processes import stop

from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
HANDLERS_DIR = Path(__file__).parents[1] / "acceptance"  # multihost_handlers.py, importable by the workers

LEASE_HISTORY = """
CREATE TABLE public.lease_history (
    kind text, partition text, owner text, fence bigint, expires_at timestamptz,
    at timestamptz DEFAULT clock_timestamp()
);
CREATE FUNCTION public.record_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.lease_history (kind, partition, owner, fence, expires_at)
    VALUES (NEW.kind, NEW.partition, NEW.owner, NEW.fence, NEW.expires_at);
    RETURN NULL;
END $$;
CREATE TRIGGER lease_history AFTER INSERT OR UPDATE ON cmb.leases FOR EACH ROW EXECUTE FUNCTION public.record_lease();
"""

# Per lease (kind, partition, owner, fence): from its acquisition until it was released or its last expiry.
HELD_INTERVALS = """
SELECT partition, owner, fence, extract(epoch FROM min(at)),
       extract(epoch FROM coalesce(min(at) FILTER (WHERE expires_at = '-infinity'), max(expires_at)))
FROM public.lease_history WHERE kind = %s GROUP BY partition, owner, fence
"""


def held_intervals(db: Database, kind: str) -> list[tuple[str, str, float, float]]:
    """(partition, owner, start, end) of every lease of ``kind`` the history recorded (see HELD_INTERVALS)."""
    with db.connection() as conn:
        rows = conn.execute(HELD_INTERVALS, (kind,)).fetchall()
    return [(partition, owner, float(start), float(end)) for partition, owner, _, start, end in rows]


def read_calls(path: Path) -> list[tuple[int, float, list]]:
    """(pid, time, items) of each call of user code recorded in ``path`` so far (see multihost_handlers.py)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(pid, at, items) for pid, at, items in map(json.loads, lines)]


class Gate:
    """Holds calls of user code (multihost_handlers.wait_at_gate): every call of a process, or its calls on one
    item, wait while the test holds them (a file in ``path`` named ``<pid>`` or ``<pid>.<item>``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(exist_ok=True)

    def hold(self, pid: int, item: object = None) -> None:
        self._file(pid, item).touch()

    def open(self, pid: int, item: object = None) -> None:
        self._file(pid, item).unlink(missing_ok=True)

    def stop_after_call(self, pid: int) -> None:
        """The next call of process ``pid`` stops the process (SIGSTOP) as it ends."""
        (self.path / f"stop.{pid}").touch()

    def _file(self, pid: int, item: object) -> Path:
        return self.path / (str(pid) if item is None else f"{pid}.{item}")


class WorkerProcess:
    """A worker process whose log goes to a file (read after the test's checks)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, program: list[str] = CLI) -> None:
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen([*program, *args], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def owns(self, owner: str) -> bool:
        return owner.split(":")[1] == str(self.pid)  # default owner names: host:pid:suffix

    @property
    def stopped(self) -> bool:
        return psutil.Process(self.pid).status() == psutil.STATUS_STOPPED

    def signal(self, signum: int) -> float:
        self.proc.send_signal(signum)
        return time.time()

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        stop([self.proc])
        self._log.close()


def leases(db: Database, kind: str) -> dict[str, tuple[str, int, float]]:
    """partition -> (owner, fence, seconds left) of every lease of ``kind``."""
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT partition, owner, fence, extract(epoch FROM expires_at - now())::float8 FROM leases "
            "WHERE kind = %s",
            (kind,),
        ).fetchall()
    return {p: (owner, fence, left) for p, owner, fence, left in rows}


def held_by(db: Database, kind: str, worker: WorkerProcess) -> dict[str, int]:
    """partition -> fence of the unexpired leases ``worker`` holds."""
    return {p: fence for p, (owner, fence, left) in leases(db, kind).items() if worker.owns(owner) and left > 0}


def take_over(db: Database, kind: str, lost: dict[str, int], taker: WorkerProcess) -> bool:
    """Whether ``taker`` holds every partition of ``lost`` with a higher fence."""
    now = held_by(db, kind, taker)
    return all(now.get(p, 0) > fence for p, fence in lost.items())


class CtlProducer:
    """Changes CTL values all along, in a thread, until :meth:`stop`: each entity's moment (``e<i>.p``, the
    parameters of multihost_handlers.reactive_worker's tasks) moves forward by whole seconds."""

    def __init__(self, db: Database, entities: int) -> None:
        base = datetime(2024, 5, 1, tzinfo=UTC)
        self.store = CtlStore(db, actor="producer")
        self.moments = {f"e{i}": base for i in range(entities)}
        self._producing = threading.Event()
        self._producing.set()
        self._thread = threading.Thread(target=self._produce, daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        step = 0
        while self._producing.is_set():
            entity = f"e{step % len(self.moments)}"
            self.moments[entity] += timedelta(seconds=1 + step % 3)
            self.store.set(entity, "p", self.moments[entity])
            step += 1
            time.sleep(0.01)  # a pace of changes, not a wait

    def stop(self) -> dict[str, str]:
        """Stop; the last value of each parameter."""
        self._producing.clear()
        self._thread.join()
        return {f"{entity}.p": moment.isoformat() for entity, moment in self.moments.items()}


def launched_last(calls: list[tuple[int, float, list]]) -> dict[str, str]:
    """The newest value of each parameter among the launches of the reactive launcher's calls."""
    latest: dict[str, str] = {}
    for _, _, launches in calls:
        for _, _, values in launches:
            for key, value in values.items():
                latest[key] = max(latest.get(key, value), value)
    return latest
