"""Isolation of a bad item, a rule of the shared runtime: one bad, big or slow item affects only itself.

Every engine that calls user code or writes what user code returned follows it:

- **Text from user code is sanitised before it is stored or logged** (:func:`describe_error`,
  :func:`sanitize`): no NUL, no lone surrogate, a bounded length, so recording a failure cannot fail. A
  ``cmb-dagster`` command escapes every log line and error it writes the same way, tracebacks included.
- **A write of many items that fails on the data of one is split until that item is alone**
  (:func:`split_until_alone`); the others commit, the failing one is recorded as failed on its own.
- **User code runs in a thread of its own, under a deadline** (:class:`UserCode`): a call still running
  after ``set_aside_after`` seconds is set aside and the other items go on; past its ``timeout`` it is
  abandoned and reported as :class:`TimedOut`. No transaction is open while user code runs, except the
  pub/sub handler's, whose connection is terminated at the deadline.
- **Crashes are counted in Postgres before user code runs**: claiming an item adds one to its
  ``crashes``, any orderly end (done, failed, released) clears it. An item claimed with ``crashes > 0``
  began a run that never ended: it runs alone, and after ``max_crashes`` such runs it is parked instead.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import psycopg

from cmb_dagster.errors import CmbError

log = logging.getLogger("cmb_dagster.isolation")

T = TypeVar("T")

ERROR_TEXT_LIMIT = 2000
"""Characters of an error message kept with a failed item (tracebacks keep :data:`TRACEBACK_LIMIT`)."""
TRACEBACK_LIMIT = 20_000
DEFAULT_MAX_CRASHES = 3
"""Runs of one item that may end with its worker's death before the item is parked."""
SET_ASIDE_AFTER = 1.0
"""Seconds a call of user code may hold up the items after it before it is set aside."""
MAX_ABANDONED = 8
"""Calls past their deadline that may still be running in one process before its worker stops."""

_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
# SQLSTATE classes an item's own data can cause: data exception, integrity constraint violation,
# program limit exceeded (a value too big for an index or a field)
_ITEM_ERROR_CLASSES = ("22", "23", "54")


class TimedOut(CmbError):
    """A call of user code ran past its time limit; it was abandoned (its result, if any, is dropped)."""


class WorkerStuck(CmbError):
    """More calls of user code than :data:`MAX_ABANDONED` are running past their deadline: the worker
    stops so that its process can be restarted (Postgres keeps every item; nothing is lost)."""


def escaped(text: str) -> str:
    """``text`` as Postgres text and logs can hold it: NUL written ``\\0``, lone surrogates replaced by U+FFFD."""
    text = text.replace("\x00", "\\0")
    if _LONE_SURROGATE.search(text):
        text = _LONE_SURROGATE.sub("\ufffd", text)
    return text


def sanitize(text: str, limit: int = ERROR_TEXT_LIMIT) -> str:
    """``text`` :func:`escaped`, at most ``limit`` characters."""
    text = escaped(text)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def describe_error(exc: BaseException, limit: int = ERROR_TEXT_LIMIT) -> str:
    """``Type: message`` of an exception from user code, sanitised (see :func:`sanitize`); never raises,
    even for an exception whose ``__str__`` does."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ of a user exception
        message = "(its message could not be read)"
    return sanitize(f"{type(exc).__name__}: {message}" if message else type(exc).__name__, limit)


def describe_traceback(exc: BaseException) -> str:
    """The formatted traceback of ``exc``, sanitised and bounded."""
    import traceback

    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # noqa: BLE001 - formatting calls the exception's __str__
        text = describe_error(exc)
    return sanitize(text, TRACEBACK_LIMIT)


def is_item_error(exc: BaseException) -> bool:
    """Whether a failed write was refused for the data it carried (then splitting the write finds the
    item), not for the connection, a lock or the server (then the whole write is retried later)."""
    if isinstance(exc, UnicodeError):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    if exc.sqlstate is not None:
        return exc.sqlstate[:2] in _ITEM_ERROR_CLASSES
    # refused by psycopg before sending (a NUL in text, a value it cannot adapt), not by the connection
    return isinstance(exc, psycopg.DataError | psycopg.ProgrammingError)


def split_until_alone(
    items: Sequence[T], write: Callable[[Sequence[T]], None], alone: Callable[[T, BaseException], None]
) -> None:
    """``write(items)``; if the data of some item makes it fail (:func:`is_item_error`), write each half
    again, recursively, until the failing item is alone: ``alone(item, error)`` then records it.

    ``write`` must be one transaction that leaves nothing behind when it raises.
    """
    if not items:
        return
    try:
        write(items)
    except Exception as exc:
        if not is_item_error(exc):
            raise
        if len(items) == 1:
            alone(items[0], exc)
            return
        middle = len(items) // 2
        split_until_alone(items[:middle], write, alone)
        split_until_alone(items[middle:], write, alone)


@dataclass(eq=False)
class Call(Generic[T]):
    """One call of user code on one item, as :class:`UserCode` runs it."""

    item: T
    function: Callable[[T], Any]
    timeout: float
    started: float | None = None  # time.monotonic() when the call began
    ended: bool = False
    result: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    aside: bool = False  # set aside: it runs on in a lane of its own
    withdrawn: bool = False

    @property
    def seconds(self) -> float:
        """How long the call has run (so far)."""
        return 0.0 if self.started is None else time.monotonic() - self.started

    @property
    def outcome(self) -> Any:
        """The call's result; raises its error, or :class:`TimedOut`."""
        if self.timed_out:
            raise TimedOut(f"timed out after {self.timeout:g} s (still running, abandoned)")
        if self.error is not None:
            raise self.error
        return self.result


@dataclass(eq=False)
class _Lane:
    thread: threading.Thread | None = None
    current: Call[Any] | None = None
    detached: bool = False


@dataclass
class UserCode:
    """Runs calls of user code one after another in a thread of its own (a lane), each under a deadline.

    :meth:`run` hands a list of calls to the lane and waits for them; a call still running after
    ``set_aside_after`` seconds (None: never) is set aside: it keeps its thread, and a new lane takes
    the calls after it. :meth:`collect` returns set-aside calls once they ended or passed their timeout
    (``timed_out``: abandoned, still running; its result will be dropped). When a call is not set aside,
    ``run`` waits for it until its timeout. Used by one worker thread; the lanes are daemon threads.
    """

    name: str
    set_aside_after: float | None = SET_ASIDE_AFTER
    max_set_aside: int = 8
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _todo: deque[Call[Any]] = field(default_factory=deque, repr=False)
    _lane: _Lane | None = field(default=None, repr=False)
    _set_aside: list[Call[Any]] = field(default_factory=list, repr=False)
    _abandoned: list[Call[Any]] = field(default_factory=list, repr=False)
    _interrupted: bool = field(default=False, repr=False)

    # -- running ---------------------------------------------------------------------------------

    def run(
        self,
        items: Sequence[T],
        function: Callable[[T], Any],
        timeout: Callable[[T], float] | float,
        *,
        on_wait: Callable[[], None] | None = None,
        wait_step: float = 1.0,
        stop_starting_after: float | None = None,
    ) -> list[Call[T]]:
        """Call ``function(item)`` for each item in order; return the calls that ended or timed out, in order.

        Calls set aside are left to :meth:`collect`; calls not started when ``stop_starting_after``
        seconds have passed, or :meth:`withdraw`-n, are neither returned nor run. ``on_wait`` runs in
        this thread at least every ``wait_step`` seconds while the calls run, and at once after
        :meth:`interrupt`.
        """
        self._check_abandoned()
        calls = [Call(item, function, timeout(item) if callable(timeout) else timeout) for item in items]
        if not calls:
            return []
        began = time.monotonic()
        with self._cond:
            self._todo.extend(calls)
            lane = self._lane if self._lane is not None else self._start_lane()
            self._cond.notify_all()
        pending = calls
        while True:
            with self._cond:
                pending = [c for c in pending if not self._settled(c)]
                if not pending:
                    break
                now = time.monotonic()
                if stop_starting_after is not None and now - began >= stop_starting_after and self._todo:
                    self._withdraw_locked(list(self._todo))
                    continue
                current = lane.current
                if current is not None and current.started is not None:
                    running = now - current.started
                    if self._may_set_aside() and running >= self.set_aside_after:  # type: ignore[operator]
                        current.aside = True
                        self._set_aside.append(current)
                        lane = self._replace_lane(lane)
                        log.warning(
                            "%s: a call on %s has run %.1f s; set aside, the items after it go on",
                            self.name,
                            _label(current.item),
                            running,
                        )
                        continue
                    if running >= current.timeout:
                        current.timed_out = True
                        self._abandoned.append(current)
                        lane = self._replace_lane(lane)
                        log.error(
                            "%s: a call on %s ran past its %g s limit; abandoned",
                            self.name,
                            _label(current.item),
                            current.timeout,
                        )
                        continue
                    limit = self.set_aside_after if self._may_set_aside() else current.timeout
                    wait = min(wait_step, max(0.001, limit - running))  # type: ignore[operator]
                else:  # the lane is between calls: look again soon (it only signals when its calls end)
                    wait = min(wait_step, self.set_aside_after or wait_step, *(c.timeout for c in pending[:1])) / 4
                if not self._interrupted:
                    self._cond.wait(wait)
                interrupted, self._interrupted = self._interrupted, False
            if on_wait is not None and (interrupted or time.monotonic() - began >= wait_step):
                on_wait()
        return [c for c in calls if (c.ended or c.timed_out) and not c.aside]

    def collect(self) -> list[Call[Any]]:
        """Set-aside calls that ended since (``timed_out`` for those past their timeout, abandoned)."""
        done = []
        with self._cond:
            for call in list(self._set_aside):
                if call.ended:
                    done.append(call)
                elif call.seconds >= call.timeout:
                    call.timed_out = True
                    self._abandoned.append(call)
                    done.append(call)
                    log.error(
                        "%s: a call on %s ran past its %g s limit; abandoned",
                        self.name,
                        _label(call.item),
                        call.timeout,
                    )
            for call in done:
                self._set_aside.remove(call)
                call.aside = False
        self._check_abandoned()
        return done

    @property
    def set_aside(self) -> list[Call[Any]]:
        """Calls set aside and still within their timeout."""
        with self._cond:
            return list(self._set_aside)

    def wait_set_aside(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the set-aside calls to end (e.g. on shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(not c.ended for c in self._set_aside) and time.monotonic() < deadline:
                self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    # -- controlling what starts -------------------------------------------------------------------

    @contextmanager
    def holding(self) -> Iterator[list[Call[Any]]]:
        """Within the block no call starts; yields the calls not started yet (see :meth:`withdraw`)."""
        with self._cond:
            yield list(self._todo)

    def withdraw(self, calls: Sequence[Call[Any]]) -> None:
        """Take calls that have not started out of the lane (inside :meth:`holding`); run() drops them."""
        with self._cond:
            self._withdraw_locked(calls)

    def interrupt(self) -> None:
        """Make :meth:`run` call its ``on_wait`` now (safe from any thread)."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    # -- lanes ---------------------------------------------------------------------------------------

    def _may_set_aside(self) -> bool:
        return self.set_aside_after is not None and len(self._set_aside) < self.max_set_aside

    @staticmethod
    def _settled(call: Call[Any]) -> bool:
        return call.ended or call.timed_out or call.aside or call.withdrawn

    def _withdraw_locked(self, calls: Sequence[Call[Any]]) -> None:
        for call in calls:
            try:
                self._todo.remove(call)
            except ValueError:
                continue
            call.withdrawn = True

    def _start_lane(self) -> _Lane:
        lane = _Lane()
        lane.thread = threading.Thread(target=self._serve, args=(lane,), name=f"cmb-user-code:{self.name}", daemon=True)
        self._lane = lane
        lane.thread.start()
        return lane

    def _replace_lane(self, lane: _Lane) -> _Lane:
        """Leave ``lane`` to finish its current call and take nothing more; a new lane takes the rest."""
        lane.detached = True
        return self._start_lane()

    def _serve(self, lane: _Lane) -> None:
        while True:
            with self._cond:
                while not self._todo and not lane.detached:
                    self._cond.wait(60.0)
                if lane.detached:
                    return
                call = self._todo.popleft()
                call.started = time.monotonic()
                lane.current = call
            try:
                call.result = call.function(call.item)
            except BaseException as exc:  # noqa: BLE001 - SystemExit or KeyboardInterrupt of user code too
                call.error = exc
            with self._cond:
                call.ended = True
                lane.current = None
                if not self._todo or lane.detached:
                    self._cond.notify_all()

    def _check_abandoned(self) -> None:
        with self._cond:
            self._abandoned = [c for c in self._abandoned if not c.ended]
            if len(self._abandoned) > MAX_ABANDONED:
                raise WorkerStuck(
                    f"{self.name}: {len(self._abandoned)} calls of user code are still running past their time limit "
                    f"(on {', '.join(_label(c.item) for c in self._abandoned[:3])}, ...); the worker stops"
                )


def _label(item: Any) -> str:
    return sanitize(str(getattr(item, "label", item)), 200)
