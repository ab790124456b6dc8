"""The executor of user code, shared by every engine: bounded concurrency, a deadline that stops a call, and an
item held until its call has really ended.

- ``async def`` functions run on the executor's event loop (a thread of its own) and are cancelled at their
  deadline.
- Other functions run in a bounded pool of threads (``isolation="thread"``). A thread cannot be stopped: a call
  past its deadline keeps its slot until it ends, and then fails as :class:`TimedOut` (its result is dropped).
- ``isolation="process"``: each call runs in a child process forked for it and killed at its deadline; a crash
  of the child (a signal, ``os._exit``, a hang that holds the GIL) fails that call alone.

``SystemExit`` and ``KeyboardInterrupt`` raised by user code fail its call (:class:`UserCodeExit`), never the
worker. Calls are taken in the order they were given. When every slot is held by a call past twice its deadline,
:meth:`Executor.check` raises :class:`~cmb_dagster.isolation.WorkerStuck`: the process should be restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import inspect
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from cmb_dagster.errors import CmbError
from cmb_dagster.isolation import TimedOut, WorkerStuck, describe_error, describe_traceback, sanitize

log = logging.getLogger("cmb_dagster.executor")

T = TypeVar("T")

Isolation = Literal["thread", "process"]

IDLE_THREAD_SECONDS = 60.0
"""Seconds a thread of the pool waits for a call before it exits."""
STUCK_FACTOR = 2.0
"""A call still running this many times its deadline counts as stuck (see :meth:`Executor.check`)."""
MEAN_WEIGHT = 0.1
"""Weight of the latest call in :attr:`Executor.mean_seconds` (an exponential moving average)."""
ENDS_KEPT = 10_000
"""Times of the latest calls that ended, kept for :meth:`Executor.ends_within`."""


class UserCodeExit(CmbError):
    """User code raised ``SystemExit`` or ``KeyboardInterrupt``: its call failed, the worker goes on."""


class RemoteError(CmbError):
    """User code running in a child process raised; ``traceback`` is the child's, as text."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


class ChildDied(CmbError):
    """The child process running a call ended without an answer (killed, crashed or exited)."""


def is_coroutine_function(function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` returns a coroutine (an ``async def`` function or a callable object whose
    ``__call__`` is one)."""
    call = type(function).__call__ if not inspect.isroutine(function) else None
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


@dataclass(eq=False)
class Task(Generic[T]):
    """One call of user code on one item; its deadline is ``timeout`` seconds after ``started``."""

    item: T
    function: Callable[[T], Any]
    timeout: float
    started: float = field(default_factory=time.monotonic)  # time.monotonic() when it was given to the executor
    ended: bool = False
    result: Any = None
    error: BaseException | None = None
    timed_out: bool = False  # it ended as TimedOut

    @property
    def seconds(self) -> float:
        """Seconds since the call was given to the executor."""
        return time.monotonic() - self.started

    @property
    def outcome(self) -> Any:
        """The call's result; raises its error (:class:`TimedOut` past its deadline)."""
        if self.error is not None:
            raise self.error
        return self.result


class Executor:
    """Runs calls of user code, at most ``concurrency`` at once, each under its deadline.

    :meth:`start` begins a call in a free slot; :meth:`ended` returns the calls that ended since it was last
    asked (each exactly once), :meth:`wait` waits for the next one. A slot is free again only once its call has
    ended. ``on_end`` is called (from the executor's threads) once for each call that ends, e.g. to wake a
    worker loop.
    """

    def __init__(
        self,
        name: str,
        concurrency: int = 10,
        isolation: Isolation = "thread",
        *,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', not {isolation!r}")
        self.name = name
        self.concurrency = concurrency
        self.isolation = isolation
        self.on_end = on_end
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a call ended: for wait() and wait_all()
        self._work = threading.Condition(self._lock)  # a sync call was queued: for the pool's idle threads
        self._running: list[Task[Any]] = []
        self._ended: deque[Task[Any]] = deque()
        self._end_times: deque[float] = deque(maxlen=ENDS_KEPT)  # time.monotonic() of the latest ends, in order
        self.mean_seconds = 0.0  # how long calls run, lately (a moving average)
        self._queue: deque[Task[Any]] = deque()  # sync calls not yet taken by a thread, in order
        self._threads = 0  # threads of the pool alive
        self._busy = 0  # threads of the pool running a call
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- the slots ---------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Slots free now."""
        with self._lock:
            return self.concurrency - len(self._running)

    @property
    def running(self) -> list[Task[Any]]:
        """The calls that have not ended (past their deadline too), in the order they were given."""
        with self._lock:
            return list(self._running)

    def start(self, item: T, function: Callable[[T], Any], timeout: float) -> Task[T]:
        """Begin ``function(item)`` in a free slot, with a deadline ``timeout`` seconds from now."""
        task = Task(item, function, timeout)
        on_loop = self.isolation == "thread" and is_coroutine_function(function)
        spawn = False
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the executor is closed")
            if len(self._running) >= self.concurrency:
                raise RuntimeError(f"{self.name}: no free slot (concurrency {self.concurrency})")
            self._running.append(task)
            if on_loop:
                self._event_loop().call_soon_threadsafe(self._begin_async, task)
            else:
                self._queue.append(task)
                spawn = len(self._queue) > self._threads - self._busy  # each thread not busy takes one
                if spawn:
                    self._threads += 1
                self._work.notify()
        if spawn:
            threading.Thread(target=self._serve, name=f"cmb-user-code:{self.name}", daemon=True).start()
        return task

    def ended(self) -> list[Task[Any]]:
        """The calls that ended since the last call of this method, in the order they ended."""
        with self._lock:
            done = list(self._ended)
            self._ended.clear()
            return done

    def ends_within(self, seconds: float) -> int:
        """How many calls ended in the last ``seconds`` (at most :data:`ENDS_KEPT`): about how many will end in the
        next ``seconds`` while the calls stay alike."""
        since = time.monotonic() - seconds
        with self._lock:
            while self._end_times and self._end_times[0] < since:
                self._end_times.popleft()
            return len(self._end_times)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until some call has ended and is not yet collected by :meth:`ended`."""
        with self._lock:
            return bool(self._changed.wait_for(lambda: self._ended, timeout))

    def wait_all(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no call runs; whether none does."""
        with self._lock:
            return self._changed.wait_for(lambda: not self._running, timeout)

    def check(self) -> None:
        """Raise WorkerStuck when every slot is held by a call running past twice its deadline."""
        with self._lock:
            stuck = [t for t in self._running if t.seconds > STUCK_FACTOR * t.timeout]
        if stuck and len(stuck) >= self.concurrency:
            labels = ", ".join(_label(t.item) for t in stuck[:3])
            raise WorkerStuck(
                f"{self.name}: {len(stuck)} calls of user code are still running past their time limit "
                f"(on {labels}, ...); the worker stops"
            )

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The executor's event loop, started if need be: coroutines that drive calls (a dispatcher) run on it
        beside them; :meth:`close` stops it."""
        with self._lock:
            return self._event_loop()

    def close(self) -> None:
        """Refuse new calls and stop the event loop: the calls on it are cancelled (they end with an error)."""
        with self._lock:
            self._closed = True
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    # -- running calls -------------------------------------------------------------------------------

    def _finish(self, task: Task[Any], result: Any, error: BaseException | None, *, pooled: bool = False) -> None:
        if isinstance(error, SystemExit | KeyboardInterrupt):
            error = UserCodeExit(f"user code raised {describe_error(error)}")
        task.result, task.error = (None, error) if error is not None else (result, None)
        task.timed_out = isinstance(error, TimedOut)
        with self._lock:
            task.ended = True
            self._running.remove(task)
            self._ended.append(task)
            self._end_times.append(time.monotonic())
            self.mean_seconds += MEAN_WEIGHT * (task.seconds - self.mean_seconds)
            if pooled:
                self._busy -= 1
            self._changed.notify_all()
        if self.on_end is not None:
            try:
                self.on_end()
            except Exception:
                log.exception("%s: on_end failed", self.name)

    def _serve(self) -> None:
        """A thread of the pool: runs queued sync calls one after another; exits once idle for a while."""
        while True:
            with self._lock:
                if not self._work.wait_for(lambda: self._queue, IDLE_THREAD_SECONDS):
                    self._threads -= 1
                    return
                task = self._queue.popleft()
                self._busy += 1
            result, error = None, None
            try:
                result = _call_in_child(task) if self.isolation == "process" else task.function(task.item)
            except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt of user code too
                error = exc
            if task.seconds > task.timeout and not isinstance(error, TimedOut):
                error = TimedOut(f"ran {task.seconds:.1f} s, past its {task.timeout:g} s limit (result dropped)")
            self._finish(task, result, error, pooled=True)

    def _begin_async(self, task: Task[Any]) -> None:
        """On the loop: run the task's coroutine; a call cancelled before it began (the loop stopped) ends too."""

        def cancelled_early(future: asyncio.Task[None]) -> None:
            if future.cancelled():
                self._finish(task, None, CmbError(f"{self.name}: cancelled, the executor closed"))

        asyncio.get_running_loop().create_task(self._run_async(task)).add_done_callback(cancelled_early)

    async def _run_async(self, task: Task[Any]) -> None:
        result, error = None, None
        deadline = asyncio.timeout_at(asyncio.get_running_loop().time() + task.timeout - task.seconds)
        try:
            async with deadline:
                result = await task.function(task.item)
        except TimeoutError as exc:
            error = TimedOut(f"cancelled at its {task.timeout:g} s limit") if deadline.expired() else exc
        except asyncio.CancelledError:
            error = CmbError(f"{self.name}: cancelled, the executor closed")
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt of user code too
            error = exc
        if error is None and task.seconds > task.timeout:  # it went on after its cancellation
            error = TimedOut(f"ran {task.seconds:.1f} s, past its {task.timeout:g} s limit (result dropped)")
        self._finish(task, result, error)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The executor's event loop, started on first use (called with the lock held)."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(
                target=_serve_loop, args=(loop,), name=f"cmb-user-code-loop:{self.name}", daemon=True
            ).start()
            self._loop = loop
        return self._loop


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Run ``loop`` until it is stopped, then cancel its calls and wait until each has ended."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


# -- isolation="process" --------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
# Held from a pipe's creation until the parent has closed its end for writing: a child forked meanwhile would
# keep that end open, and the parent would not see the other child die.
_fork_lock = threading.Lock()


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """Linux's ``prctl``, looked up in the parent (a child must not load libraries: another thread may have
    held the loader's lock when it forked)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _call_in_child(task: Task[Any]) -> Any:
    """Run the task's call in a forked child: its result, or what it raised as :class:`RemoteError`; killed at
    the deadline (:class:`TimedOut`). The thread that forks waits for the child, so it outlives it."""
    prctl, parent = _prctl(), os.getpid()
    with _fork_lock:
        reader, writer = multiprocessing.Pipe(duplex=False)
        try:
            pid = os.fork()
        except OSError:
            reader.close()
            writer.close()
            raise
        if pid == 0:
            _serve_in_child(task, reader, writer, prctl, parent)
        writer.close()
    try:
        remaining = task.timeout - task.seconds
        if remaining > 0 and reader.poll(remaining):
            try:
                answer = reader.recv()
            except (EOFError, OSError):
                answer = ("died",)
        else:
            os.kill(pid, signal.SIGKILL)
            answer = ("killed",)
    finally:
        reader.close()
        _, status = os.waitpid(pid, 0)
    if answer[0] == "ok":
        return answer[1]
    if answer[0] == "error":
        raise RemoteError(answer[1], answer[2])
    if answer[0] == "exit":
        raise UserCodeExit(f"user code raised {answer[1]}")
    if answer[0] == "killed":
        raise TimedOut(f"killed at its {task.timeout:g} s limit")
    raise ChildDied(f"its process ended without an answer ({_status_text(status)})")


def _serve_in_child(task: Task[Any], reader: Any, writer: Any, prctl: Callable[..., int] | None, parent: int) -> None:
    """In the child: run the call, send its answer, exit (never returns)."""
    try:
        reader.close()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # killed when the thread that forked it ends
        if os.getppid() != parent:
            return
        _fresh_standard_streams()
        try:
            if is_coroutine_function(task.function):
                answer: tuple[Any, ...] = ("ok", asyncio.run(task.function(task.item)))
            else:
                answer = ("ok", task.function(task.item))
        except (SystemExit, KeyboardInterrupt) as exc:
            answer = ("exit", describe_error(exc))
        except BaseException as exc:  # noqa: BLE001 - everything user code raises goes back to the parent
            answer = ("error", describe_error(exc), describe_traceback(exc))
        try:
            writer.send(answer)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled
            writer.send(("error", f"its result could not be sent back: {describe_error(exc)}", ""))
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)


_replaced_streams: list[Any] = []


def _fresh_standard_streams() -> None:
    """In a child: new ``sys.stdout`` and ``sys.stderr`` on the same files, also for the logging handlers that
    wrote to them (another thread may have held the old ones' lock when the child was forked)."""
    loggers = [
        logging.getLogger(),
        *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)),
    ]
    handlers = [h for logger in loggers for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        try:
            fd = old.fileno()
            new = open(  # noqa: SIM115 - it replaces sys.stdout or sys.stderr
                fd, "w", buffering=1, encoding=old.encoding, errors=old.errors, closefd=False
            )
        except Exception:  # noqa: BLE001 - not a stream on a file descriptor (it may be any object)
            continue
        _replaced_streams.append(old)  # never closed: closing it would flush it, taking its lock
        setattr(sys, name, new)
        for handler in handlers:
            if handler.stream is old:
                handler.stream = new  # not setStream(): it would flush the old stream


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _label(item: Any) -> str:
    return sanitize(str(getattr(item, "label", item)), 200)
