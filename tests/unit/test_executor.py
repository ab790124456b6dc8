"""The executor of user code: bounded concurrency, deadlines that stop a call, slots held until a call has really
ended, user code that cannot stop the worker, and child processes that fail their call alone."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import io
import itertools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from waiting import wait_until

from cmb_dagster import executor
from cmb_dagster.errors import CmbError
from cmb_dagster.executor import ChildDied, Executor, RemoteError, UserCodeExit, is_coroutine_function
from cmb_dagster.isolation import TimedOut, WorkerStuck

LONG = 60.0  # a deadline no call of these tests reaches unless it is meant to


def run_all(ex: Executor, items, function, timeout: float = LONG) -> list:
    """Start ``function`` on every item as slots free up; the tasks, each ended."""
    tasks, pending = [], list(items)
    while pending:
        while pending and ex.free:
            tasks.append(ex.start(pending.pop(0), function, timeout))
        assert ex.wait(LONG), "no call ended"
        ex.ended()
    assert ex.wait_all(LONG), "calls still running"
    return tasks


def pool_threads(ex: Executor) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"cmb-user-code:{ex.name}"]


def children() -> set[int]:
    """Pids of this process's child processes (zombies too)."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(FileNotFoundError), open(path) as file:  # its thread may have ended
            pids |= {int(pid) for pid in file.read().split()}
    return pids


@pytest.fixture
def no_child_left():
    """Fails the test if a child process it started is still there (running or not reaped) at its end."""
    before = children()
    yield
    assert children() - before == set()


@pytest.fixture
def new_executor(request):
    """An executor named after the test, closed at its end."""
    executors: list[Executor] = []

    def make(concurrency: int = 4, isolation: executor.Isolation = "thread", **kwargs) -> Executor:
        made = Executor(f"{request.node.name}-{len(executors)}", concurrency, isolation, **kwargs)
        executors.append(made)
        return made

    yield make
    for made in executors:
        made.close()


# -- concurrency --------------------------------------------------------------------------------------


def test_sync_calls_run_concurrency_at_once_and_never_more(new_executor):
    concurrency = 5
    ex = new_executor(concurrency)
    run_all(ex, [0], lambda _: None)  # leaves an idle thread, which must not take two calls
    all_in, release = threading.Barrier(concurrency, timeout=LONG), threading.Event()

    def call(item: int) -> int:
        all_in.wait()  # passes only when every call runs at the same time
        release.wait(LONG)
        return item

    tasks = [ex.start(i, call, LONG) for i in range(concurrency)]
    assert ex.free == 0
    with pytest.raises(RuntimeError, match="no free slot"):
        ex.start(99, call, LONG)
    release.set()
    assert ex.wait_all(LONG)
    assert [t.outcome for t in tasks] == list(range(concurrency))
    assert ex.free == concurrency


def test_a_slot_is_free_only_once_its_call_has_ended(new_executor):
    ex = new_executor(2)
    release = threading.Event()
    held = ex.start("held", lambda _: release.wait(LONG), LONG)
    quick = ex.start("quick", lambda _: "done", LONG)
    assert ex.wait_all(0.01) is False
    wait_until(lambda: quick.ended, LONG, "the quick call ended")
    assert ex.free == 1 and ex.running == [held]
    release.set()
    assert ex.wait_all(LONG) and ex.free == 2


def test_a_call_starts_while_another_thread_waits_for_calls_to_end(new_executor):
    wake_read, wake_write = os.pipe()
    ex = new_executor(2, on_end=lambda: os.write(wake_write, b"x"))  # as a worker loop's wake-up
    release, stop = threading.Event(), threading.Event()
    held = ex.start("held", lambda _: release.wait(LONG), LONG)

    def wait_for_the_end() -> None:
        while not stop.is_set():
            ex.wait_all(LONG)

    waiter = threading.Thread(target=wait_for_the_end, daemon=True)
    waiter.start()
    try:
        for i in range(200):
            task = ex.start(i, lambda item: item, LONG)
            wait_until(lambda task=task: task.ended, LONG / 2, f"call {i} ended")
            ex.ended()
    finally:
        stop.set()
        release.set()
        waiter.join()
        os.close(wake_read)
        os.close(wake_write)
    assert held.ended


# -- async def ----------------------------------------------------------------------------------------


def test_async_calls_run_on_the_executors_loop_many_at_once(new_executor):
    calls = 100
    ex = new_executor(calls)
    seen: list[tuple[str, asyncio.AbstractEventLoop]] = []

    async def call(item: int) -> int:  # returns once every call has started: all of them run at once, or none ends
        seen.append((threading.current_thread().name, asyncio.get_running_loop()))
        while len(seen) < calls:
            await asyncio.sleep(0.01)
        return item

    tasks = [ex.start(i, call, LONG) for i in range(calls)]
    assert ex.wait_all(2 * LONG)
    assert [t.outcome for t in tasks] == list(range(calls))
    assert {name for name, _ in seen} == {f"cmb-user-code-loop:{ex.name}"}
    assert len({id(loop) for _, loop in seen}) == 1


def test_an_async_call_is_cancelled_at_its_deadline(new_executor):
    ex = new_executor(1)
    cancelled = threading.Event()

    async def hang(_) -> None:
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = ex.start("hang", hang, 0.3)
    assert ex.wait(LONG / 2), "the call was not cancelled at its deadline"
    assert cancelled.is_set()
    assert isinstance(task.error, TimedOut) and task.timed_out
    assert ex.free == 1


def test_a_timeout_error_of_the_call_itself_is_its_error_not_a_deadline(new_executor):
    ex = new_executor(1)

    async def fails(_) -> None:
        raise TimeoutError("the API did not answer")

    (task,) = run_all(ex, ["x"], fails)
    assert type(task.error) is TimeoutError and not task.timed_out


def test_a_callable_object_with_an_async_call_is_async(new_executor):
    @dataclass
    class Fetch:
        prefix: str

        async def __call__(self, item: str) -> tuple[str, str]:
            await asyncio.sleep(0)
            return self.prefix + item, threading.current_thread().name

    class Sync:
        def __call__(self, item: str) -> str:
            return item

    async def plain(item: str) -> str:
        return item

    assert is_coroutine_function(Fetch("a"))
    assert is_coroutine_function(plain) and is_coroutine_function(functools.partial(plain))
    assert not is_coroutine_function(Sync()) and not is_coroutine_function(len)
    ex = new_executor(1)
    (task,) = run_all(ex, ["b"], Fetch("a"))
    assert task.outcome == ("ab", f"cmb-user-code-loop:{ex.name}")


# -- deadlines of threads -----------------------------------------------------------------------------


def test_a_thread_past_its_deadline_holds_its_slot_until_it_ends_then_fails(new_executor):
    ex = new_executor(1)
    release = threading.Event()

    def late(_) -> str:
        release.wait(LONG)
        return "too late"

    task = ex.start("late", late, 0.2)
    wait_until(lambda: task.seconds > 0.5, LONG, "the deadline passed")
    assert not task.ended and ex.free == 0 and ex.running == [task]
    with pytest.raises(RuntimeError, match="no free slot"):
        ex.start("next", lambda _: None, LONG)
    assert not ex.wait(0)
    release.set()
    assert ex.wait(LONG)
    assert isinstance(task.error, TimedOut) and task.result is None
    assert ex.free == 1
    (after,) = run_all(ex, ["next"], lambda item: item)
    assert after.outcome == "next"


# -- user code that exits -----------------------------------------------------------------------------


def raise_exit(_) -> None:
    sys.exit(3)


def raise_interrupt(_) -> None:
    raise KeyboardInterrupt


async def raise_exit_async(_) -> None:
    await asyncio.sleep(0)
    raise SystemExit("bye")


@pytest.mark.parametrize("function", [raise_exit, raise_interrupt, raise_exit_async])
def test_system_exit_and_keyboard_interrupt_fail_their_call_and_the_executor_goes_on(new_executor, function):
    ex = new_executor(1)
    for _ in range(3):
        (failed,) = run_all(ex, ["exits"], function)
        assert isinstance(failed.error, UserCodeExit)
        (ok,) = run_all(ex, ["next"], lambda item: item)
        assert ok.outcome == "next"


# -- order --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_calls_start_in_the_order_given(new_executor, concurrency, kind):
    ex = new_executor(concurrency)
    started: list[int] = []

    def call(item: int) -> None:
        started.append(item)

    async def call_async(item: int) -> None:
        started.append(item)

    run_all(ex, range(300), call if kind == "sync" else call_async)
    assert started == list(range(300))


# -- isolation="process" ------------------------------------------------------------------------------


def test_a_child_in_an_endless_loop_is_killed_at_its_deadline(new_executor, no_child_left):
    def spin(_) -> None:
        while True:
            pass

    ex = new_executor(2, "process")
    spinning = ex.start("spin", spin, 1.0)
    fine = ex.start("fine", lambda item: item, LONG)
    assert ex.wait_all(LONG), "the child was not killed"
    assert isinstance(spinning.error, TimedOut) and "killed" in str(spinning.error)
    assert fine.outcome == "fine"


def test_a_child_holding_the_gil_is_killed_at_its_deadline_while_the_worker_goes_on(new_executor, no_child_left):
    ex = new_executor(1, "process")
    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.005)

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    try:
        # one C call that keeps the GIL for minutes (in a thread of this process, every other thread would stop)
        task = ex.start("spin", lambda _: sum(itertools.repeat(1, 10**10)), 3.0)
        before = ticks[0]
        wait_until(lambda: ticks[0] >= before + 5, LONG, "the counter advanced")
        assert not task.ended
        assert ex.wait(LONG), "the child was not killed"
    finally:
        stop.set()
        counter.join()
    assert isinstance(task.error, TimedOut)


def test_a_child_that_exits_or_is_killed_fails_its_call_only(new_executor, no_child_left, tmp_path):
    ex = new_executor(3, "process")
    pid_file = tmp_path / "pid"

    def wait_to_be_killed(_) -> None:
        pid_file.write_text(str(os.getpid()))
        time.sleep(LONG)

    exits = ex.start("exits", lambda _: os._exit(3), LONG)
    killed = ex.start("killed", wait_to_be_killed, LONG)
    fine = ex.start("fine", lambda item: item, LONG)
    pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), LONG, "the child wrote its pid"))
    os.kill(pid, signal.SIGKILL)
    assert ex.wait_all(LONG / 2)
    assert isinstance(exits.error, ChildDied) and "exit code 3" in str(exits.error)
    assert isinstance(killed.error, ChildDied) and "SIGKILL" in str(killed.error)
    assert fine.outcome == "fine"


def failing_in_child(item: int) -> None:
    raise ValueError(f"bad item {item}")


def test_an_error_in_a_child_comes_back_with_its_traceback(new_executor, no_child_left):
    (task,) = run_all(new_executor(1, "process"), [5], failing_in_child)
    assert isinstance(task.error, RemoteError) and str(task.error) == "ValueError: bad item 5"
    assert "in failing_in_child" in task.error.traceback and "ValueError: bad item 5" in task.error.traceback


def test_a_childs_exit_is_a_user_code_exit(new_executor, no_child_left):
    (task,) = run_all(new_executor(1, "process"), ["x"], raise_exit)
    assert isinstance(task.error, UserCodeExit) and "SystemExit: 3" in str(task.error)


@dataclass
class Answer:
    pid: int
    values: list[int]


def test_the_result_comes_back_pickled_from_the_child(new_executor, no_child_left):
    ex = new_executor(2, "process")
    done = ex.start(3, lambda n: Answer(os.getpid(), list(range(n))), LONG)
    unpicklable = ex.start("lock", lambda _: threading.Lock(), LONG)
    assert ex.wait_all(LONG)
    assert done.outcome == Answer(done.outcome.pid, [0, 1, 2]) and done.outcome.pid != os.getpid()
    assert isinstance(unpicklable.error, RemoteError) and "could not be sent back" in str(unpicklable.error)


def test_async_calls_run_in_a_child_too(new_executor, no_child_left):
    async def answer(item: int) -> tuple[int, int]:
        await asyncio.sleep(0)
        return item * 2, os.getpid()

    async def hang(_) -> None:
        await asyncio.sleep(LONG)

    ex = new_executor(2, "process")
    done = ex.start(21, answer, LONG)
    hung = ex.start(0, hang, 0.5)
    assert ex.wait_all(LONG / 2)
    value, pid = done.outcome
    assert value == 42 and pid != os.getpid()
    assert isinstance(hung.error, TimedOut)


class StuckWriter(io.RawIOBase):
    """A file whose writes block until released, on a real file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd, self.entered, self.release = fd, threading.Event(), threading.Event()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        self.entered.set()
        self.release.wait(LONG)
        return len(data)


def test_a_child_prints_while_another_thread_held_stdouts_lock_at_the_fork(new_executor, no_child_left, monkeypatch):
    with open(os.devnull, "w") as devnull:
        stuck = StuckWriter(devnull.fileno())
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(stuck), write_through=True))
        writer = threading.Thread(target=lambda: print("held", flush=True), daemon=True)
        writer.start()
        try:
            stuck.entered.wait(LONG)  # the writer thread holds stdout's lock, inside write()

            def prints(item: str) -> str:
                print(item, flush=True)
                return item

            (task,) = run_all(new_executor(1, "process"), ["printed"], prints, timeout=10)
            assert task.outcome == "printed"
        finally:
            stuck.release.set()
            writer.join()


# -- stuck workers, idle threads, on_end, close ------------------------------------------------------


def test_the_worker_is_stuck_only_when_every_slot_is_held_past_twice_its_deadline(new_executor):
    ex = new_executor(2)
    release = threading.Event()
    try:
        first = ex.start("first", lambda _: release.wait(LONG), 1.0)
        wait_until(lambda: first.seconds > 2.2, LONG, "first past twice its deadline")
        ex.check()  # one slot free
        second = ex.start("second", lambda _: release.wait(LONG), 2.0)
        wait_until(lambda: second.seconds > 2.2, LONG, "second past its deadline")
        if second.seconds < 4.0:
            ex.check()  # the second is late, but not twice
        wait_until(lambda: second.seconds > 4.2, LONG, "second past twice its deadline")
        with pytest.raises(WorkerStuck, match="first"):
            ex.check()
    finally:
        release.set()
    assert ex.wait_all(LONG)
    ex.check()


def test_idle_threads_exit_so_a_burst_leaves_none_behind(new_executor, monkeypatch):
    monkeypatch.setattr(executor, "IDLE_THREAD_SECONDS", 0.2)
    concurrency = 20
    ex = new_executor(concurrency)
    all_in = threading.Barrier(concurrency, timeout=LONG)
    run_all(ex, range(concurrency), lambda _: all_in.wait())
    assert len(pool_threads(ex)) <= concurrency
    wait_until(lambda: not pool_threads(ex), LONG, "the idle threads exited")
    (task,) = run_all(ex, ["again"], lambda item: item)  # a new thread serves the next call
    assert task.outcome == "again"


def test_on_end_is_called_once_per_ended_call(new_executor):
    ends: list[int] = []
    ex = new_executor(5, on_end=lambda: ends.append(1))

    async def hang(_) -> None:
        await asyncio.sleep(LONG)

    slow = lambda _: time.sleep(0.3)  # noqa: E731
    calls = [(lambda item: item, LONG), (failing_in_child, LONG), (raise_exit, LONG), (slow, 0.1), (hang, 0.1)]
    for item, (function, timeout) in enumerate(calls):
        ex.start(item, function, timeout)
    wait_until(lambda: len(ends) >= len(calls), LONG, "every call ended")
    assert len(ex.ended()) == len(calls) and ex.ended() == []
    run_all(ex, ["last"], lambda item: item)
    wait_until(lambda: len(ends) >= len(calls) + 1, LONG, "the last call ended")
    assert len(ends) == len(calls) + 1


def test_on_end_that_raises_does_not_stop_the_executor(new_executor):
    def broken() -> None:
        raise RuntimeError("broken on_end")

    ex = new_executor(1, on_end=broken)
    tasks = run_all(ex, range(3), lambda item: item)
    assert [t.outcome for t in tasks] == [0, 1, 2]


def test_close_cancels_the_calls_on_the_loop_and_refuses_new_ones(new_executor):
    ex = new_executor(3)

    async def hang(_) -> None:
        await asyncio.sleep(LONG)

    tasks = [ex.start(i, hang, LONG) for i in range(3)]
    ex.close()  # at once: some calls may not have begun yet
    assert ex.wait_all(LONG / 2)
    assert all(isinstance(t.error, CmbError) and "closed" in str(t.error) for t in tasks)
    with pytest.raises(RuntimeError, match="closed"):
        ex.start("late", hang, LONG)
    wait_until(
        lambda: not any(t.name == f"cmb-user-code-loop:{ex.name}" for t in threading.enumerate()),
        LONG,
        "the loop's thread ended",
    )


def test_a_child_that_dies_is_seen_at_once_while_its_siblings_run(new_executor, no_child_left):
    gate_read, gate_write = os.pipe()
    ex = new_executor(24, "process")
    try:
        sleepers = [ex.start(i, lambda _: os.read(gate_read, 1), LONG) for i in range(12)]
        dying = [ex.start(i, lambda _: os._exit(1), LONG) for i in range(12)]
        wait_until(lambda: all(t.ended for t in dying), LONG / 2, "the dead children were seen")
        assert not any(t.ended for t in sleepers)
        assert all(isinstance(t.error, ChildDied) for t in dying)
    finally:
        os.write(gate_write, b"x" * 12)
        assert ex.wait_all(LONG)
        os.close(gate_read)
        os.close(gate_write)
