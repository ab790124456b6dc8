import os
import signal
import threading
import time

import pytest
from stages_helpers import pipeline
from waiting import wait_until

from cmb_dagster.isolation import WorkerStuck
from cmb_dagster.stages import StageOptions, StageWorker
from cmb_dagster.stages.models import LEASE_KIND
from cmb_dagster.workers import EngineWorker, LeaseLost, Leases, Worker, list_leases, stop_workers_on_signals


def ended_within(timeout: float, call) -> list:
    """``[what call returned or raised]`` once it ended, run in a thread; ``[]`` if it still ran after ``timeout``."""
    ended: list = []

    def run() -> None:
        try:
            ended.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return ended


def lapsed(db, partition: str) -> bool:
    with db.connection() as conn:
        row = conn.execute(
            "SELECT expires_at <= now() FROM leases WHERE kind = 'test.kind' AND partition = %s", (partition,)
        ).fetchone()
    return row[0]


def waiting_for_a_lock(db) -> bool:
    """Whether another session of the test's database waits for a lock."""
    with db.connection() as conn:
        return (
            conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()[0]
            > 0
        )


def test_a_partition_has_one_owner_until_its_lease_expires(db):
    a = Leases(db, "test.kind", owner="a", ttl=0.5)
    b = Leases(db, "test.kind", owner="b", ttl=0.5)
    held_a = a.acquire(["p1", "p2"])
    assert set(held_a) == {"p1", "p2"}
    assert b.acquire(["p1", "p2", "p3"]).keys() == {"p3"}
    wait_until(lambda: "p1" in b.acquire(["p1"]), timeout=5)
    assert b.acquire(["p1"])["p1"].fence == held_a["p1"].fence + 1
    with db.connection() as conn, pytest.raises(LeaseLost):
        Leases.check(conn, held_a["p1"])


def test_check_many_refuses_when_any_lease_moved(db):
    a = Leases(db, "test.kind", owner="a", ttl=0.5)
    held = a.acquire(["p1", "p2"])
    with db.connection() as conn:
        Leases.check_many(conn, list(held.values()))()  # both held: no error
    a.ttl = 60
    a.acquire(["p1"])  # p1 renewed, p2 left to expire and taken over
    b = Leases(db, "test.kind", owner="b", ttl=60)
    wait_until(lambda: "p2" in b.acquire(["p2"]), timeout=5)
    with db.connection() as conn, pytest.raises(LeaseLost, match="p2"):
        Leases.check_many(conn, list(held.values()))()


def test_a_takeover_waits_for_a_transaction_that_checked_the_lease_while_renewals_do_not(db):
    a = Leases(db, "test.kind", owner="a", ttl=0.5)
    held = a.acquire(["p"])["p"]
    done: dict[str, float] = {}
    with db.connection() as conn:
        Leases.check(conn, held)  # a's work in progress, key-share-locking the lease row
        a.ttl = 60
        renewed = []
        threading.Thread(target=lambda: renewed.append(a.acquire(["p"])["p"]), daemon=True).start()
        # a renews in another session while its transaction is open (a renewal waiting for it would wait forever)
        wait_until(lambda: renewed, 60, "a's renewal")
        assert renewed[0].fence == held.fence
        a.ttl = 0.5
        assert a.acquire(["p"])  # and lets the lease lapse
        wait_until(lambda: lapsed(db, "p"), 10, "the lease lapsed")
        b = Leases(db, "test.kind", owner="b", ttl=60)
        taker = threading.Thread(target=lambda: done.update(b.acquire(["p"]) and {"at": time.monotonic()}))
        taker.start()
        wait_until(lambda: waiting_for_a_lock(db), 10, "b's takeover waiting for a's transaction")
        assert not done, "b took the partition while a's transaction that checked it was open"
        committed = time.monotonic()
    taker.join(5)
    assert done["at"] >= committed


def test_a_lease_taken_from_a_holder_that_neither_renewed_nor_released_it_is_inherited(db):
    a = Leases(db, "test.kind", owner="a", ttl=0.3)
    b = Leases(db, "test.kind", owner="b", ttl=0.3)
    assert not a.acquire(["died", "released"])["died"].inherited  # a new partition
    a.release(["released"])
    assert not b.acquire(["released"])["released"].inherited
    taken = wait_until(lambda: b.acquire(["died"]).get("died"), timeout=5, what="b takes the lapsed lease")
    assert taken.inherited
    assert not b.acquire(["died"])["died"].inherited  # b's own renewal


def test_joint_partitions_are_stepped_together(db):
    seen: list[list[str]] = []
    singles: list[str] = []
    worker: Worker

    def joint_step(leases):
        seen.append(sorted(lease.partition for lease in leases))
        worker.stop()
        return 0

    def step(lease):
        singles.append(lease.partition)
        return 0

    worker = Worker(
        db,
        "test.joint",
        ["s:1", "s:2", "other"],
        step,
        ttl=5,
        idle_sleep=0.01,
        joint=lambda p: p.startswith("s:"),
        joint_step=joint_step,
    )
    worker.run(5)
    assert seen == [["s:1", "s:2"]]
    assert "s:1" not in singles and "s:2" not in singles


def test_release_hands_over_at_once(db):
    a = Leases(db, "test.kind", owner="a", ttl=60)
    b = Leases(db, "test.kind", owner="b", ttl=60)
    a.acquire(["p"])
    assert b.acquire(["p"]) == {}
    a.release(["p"])
    assert set(b.acquire(["p"])) == {"p"}


def test_worker_steps_held_partitions_and_backs_off_a_failing_one(db):
    calls: dict[str, int] = {"good": 0, "bad": 0}

    def step(lease):
        calls[lease.partition] += 1
        if lease.partition == "bad":
            raise RuntimeError("boom")
        return 1 if calls["good"] <= 5 else 0

    worker = Worker(db, "test.kind", ["good", "bad"], step, idle_sleep=0.05)
    report = worker.run(duration=1.5)
    assert calls["good"] > 5 and report.items == 5
    assert 1 <= calls["bad"] <= 3  # 0.5 s, then 1 s of backoff: not hammered
    assert report.errors == calls["bad"] and report.held == {"good", "bad"}
    assert set(Leases(db, "test.kind", owner="other").acquire(["good", "bad"])) == {"good", "bad"}  # released


def test_two_workers_split_nothing_and_a_stopped_one_hands_over(db):
    seen: list[tuple[str, str]] = []

    def step_for(name):
        def step(lease):
            seen.append((name, lease.partition))
            return 0

        return step

    first = Worker(db, "test.kind", ["p"], step_for("first"), idle_sleep=0.02)
    second = Worker(db, "test.kind", ["p"], step_for("second"), ttl=0.6, idle_sleep=0.02)
    thread = threading.Thread(target=first.run)
    thread.start()
    wait_until(lambda: ("first", "p") in seen)
    rounds = []
    second.on_progress = rounds.append
    second_thread = threading.Thread(target=second.run, kwargs={"duration": 5})
    second_thread.start()
    wait_until(lambda: len(rounds) >= 3, 10, "rounds of the second worker")
    assert ("second", "p") not in seen  # it stays idle while the first holds the lease
    first.stop()
    thread.join()
    wait_until(lambda: ("second", "p") in seen, timeout=5)
    second.stop()
    second_thread.join()


def test_a_shutdown_signal_also_stops_a_worker_that_starts_after_it(db):
    """A worker run handed a signal while it is still starting (before its loop registers) ends anyway."""
    with stop_workers_on_signals() as signalled:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(signalled.is_set, 5, "the signal")
        time.sleep(1)  # the shutdown helper has handled the signal (with no worker registered yet)
        worker = Worker(db, "test.late", ["p"], lambda lease: 0, idle_sleep=0.05)
        assert ended_within(60, lambda: worker.run(duration=3600)), "the worker ran on after the signal"


class Counting(EngineWorker):
    """An engine worker with a main loop and a second loop, each counting its steps."""

    def __init__(self, db, *, stop_while_starting: bool = False) -> None:
        super().__init__(db)
        self.stop_while_starting = stop_while_starting
        self.steps = {"main": 0, "side": 0}

    def loops(self) -> list[Worker]:
        if self.stop_while_starting:
            self.stop()  # as a signal arriving while the worker is still being set up
        return [
            Worker(
                self.db, "test.main", ["m"], self._step("main"), owner=self.owner, idle_sleep=5, channels=["test_wake"]
            ),
            Worker(self.db, "test.side", ["s"], self._step("side"), owner=self.owner, idle_sleep=0.01),
        ]

    def _step(self, name: str):
        def step(lease) -> int:
            self.steps[name] += 1
            return 0

        return step


def test_an_engine_worker_runs_its_loops_wakes_on_notify_and_stops_all_of_them(db):
    worker = Counting(db)
    progress = []
    thread = threading.Thread(target=lambda: progress.append(worker.run(on_progress=progress.append)))
    thread.start()
    wait_until(lambda: worker.listening and worker.steps["side"] > 2, 10, "both loops running, the main one listening")
    before = worker.steps["main"]
    with db.connection() as conn:
        conn.execute("SELECT pg_notify('test_wake', '')")
    wait_until(lambda: worker.steps["main"] > before, 3, "the NOTIFY woke the main loop out of its 5 s sleep")
    worker.stop()
    thread.join(10)
    assert not thread.is_alive() and progress[-1].owner == worker.owner


def test_a_stop_asked_while_an_engine_worker_starts_is_kept(db):
    worker = Counting(db, stop_while_starting=True)
    report = ended_within(60, lambda: worker.run(3600))
    assert report and report[0].steps == 0


def test_a_loop_of_its_own_thread_that_fails_stops_its_worker_which_raises_the_error(db, caplog):
    worker = StageWorker(db, StageOptions(stages=pipeline(), shard_count=2, idle_sleep=0.05))

    def stuck(lease):  # as the consumers' user code piling up past its time limit ends their loop
        raise WorkerStuck(f"{lease.partition}: calls of user code still running past their time limit")

    worker.consumer_step = stuck  # the loop of its own thread: the pub/sub consumers of worker 0
    raised = ended_within(60, lambda: worker.run(duration=3600))  # at once, not when its time is up
    assert raised and isinstance(raised[0], WorkerStuck) and "past their time limit" in str(raised[0])
    (failure,) = [r for r in caplog.records if "loop stopped on an error" in r.getMessage()]
    assert failure.exc_info is not None and failure.exc_info[0] is WorkerStuck  # logged with its traceback
    leases = [lease for lease in list_leases(db) if lease.kind == LEASE_KIND]
    assert {lease.partition for lease in leases} >= {"capture", *worker.shard_partitions()}
    assert {lease.expires_in for lease in leases} == {float("-inf")}  # every loop released its partitions
