"""One bad, big or slow entity affects only itself: stage workers (real processes) keep every other entity
moving past a poison result, a stage that never returns, and an entity that kills its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.stages import StageStore, entries, status

HERE = Path(__file__).parent
WORKER = [sys.executable, "-c", "from cmb_dagster.cli import run; run()", "stages", "worker", "--stages"]
OTHERS = 1000


class Workers:
    """`cmb-dagster stages worker` processes on one database, restarted when they die (as a supervisor would)."""

    def __init__(self, database_url: str, options: str, env: dict[str, str] | None = None) -> None:
        self.command = [*WORKER, f"stages_isolation_stages:{options}"]
        self.env = {
            **os.environ,
            "CMB_DATABASE_URL": database_url,
            **(env or {}),
            "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        self.processes: list[subprocess.Popen[bytes]] = []
        self.deaths = 0

    def start(self, count: int) -> None:
        self.processes += [self._spawn() for _ in range(count)]

    def restart_dead(self) -> None:
        for i, process in enumerate(self.processes):
            if process.poll() is not None:
                self.deaths += 1
                self.processes[i] = self._spawn()

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def workers(database_url: str) -> Iterator[list[Workers]]:
    started: list[Workers] = []
    yield started
    for group in started:
        group.stop()


def done(db: Database) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM stage_entities WHERE payload ? 'done'").fetchone()[0]


def load(db: Database, special: dict[str, str]) -> None:
    sys.path.insert(0, str(HERE))
    import stages_isolation_stages

    store = StageStore(db, stages_isolation_stages.poison.stages)
    store.put_many({f"k{i}": {"i": i} for i in range(OTHERS)} | {name: {"do": do} for name, do in special.items()})


def test_a_poison_result_is_parked_alone_and_every_other_entity_moves(db, database_url, workers):
    load(db, {"nul": "nul", "surrogate": "surrogate", "raise": "raise"})
    group = Workers(database_url, "poison")
    workers.append(group)
    group.start(2)
    wait_until(lambda: done(db) == OTHERS, 60, "every other entity done")
    wait_until(
        lambda: len([e for e in entries(db, stage="mark") if e.parked_at]) == 3, 30, "the three poison entries parked"
    )
    errors = {e.entity_id: e.last_error for e in entries(db, stage="mark")}
    assert "U+0000" in errors["nul"] and "surrogate" in errors["surrogate"]
    assert errors["raise"].startswith("ValueError: bad \\0 byte and \ufffd half"), errors["raise"]  # stored, sanitised
    assert all(e.attempts == 2 for e in entries(db, stage="mark"))


def test_a_stage_that_never_returns_holds_up_no_other_entity(db, database_url, workers, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    load(db, {"slow": "hold"})
    group = Workers(database_url, "slow", {"CMB_TEST_HOLD": str(hold)})
    workers.append(group)
    group.start(2)  # two workers on the same shards: one serves them, the other stands by
    wait_until(lambda: done(db) == OTHERS, 60, "every other entity done while one call does not return")
    [slow] = entries(db, stage="mark")
    assert slow.entity_id == "slow" and slow.attempts == 0, "the others finished before its first call ended"
    hold.unlink()
    wait_until(lambda: done(db) == OTHERS + 1, 60, "the slow entity done once its call returns")


@pytest.mark.slow
def test_an_entity_that_kills_its_worker_is_parked_and_the_others_move(db, database_url, workers):
    load(db, {"crash": "crash"})
    group = Workers(database_url, "crash")
    workers.append(group)
    group.start(2)

    def settled() -> bool:
        group.restart_dead()
        parked = [e for e in entries(db, stage="mark") if e.parked_at]
        return done(db) == OTHERS and [e.entity_id for e in parked] == ["crash"]

    wait_until(settled, 120, "every other entity done and the crashing one parked", interval=0.2)
    [entry] = entries(db, stage="mark")
    assert "3 runs in a row ended with the death of their worker" in entry.last_error
    assert 3 <= group.deaths <= 4, group.deaths  # each of its runs killed one worker, then it was parked
    [mark] = status(db).stages
    assert mark.parked == 1 and mark.errors == 1  # counted once, as a failure
