"""Isolation of a bad item, a rule of the shared runtime: one bad, big or slow item affects only itself.

Every engine that calls user code or writes what user code returned follows it:

- **Text from user code is sanitised before it is stored or logged** (:func:`describe_error`,
  :func:`sanitize`): no NUL, no lone surrogate, a bounded length, so recording a failure cannot fail. A
  ``cmb-dagster`` command escapes every log line and error it writes the same way, tracebacks included.
- **A write of many items that fails on the data of one is split until that item is alone**
  (:func:`split_until_alone`); the others commit, the failing one is recorded as failed on its own.
- **User code runs on the executor every engine shares** (:mod:`cmb_dagster.executor`): bounded concurrency, a
  deadline that stops it (cancellation, or a child process killed), its item held until the call has ended
  (:class:`TimedOut` past its deadline, :class:`WorkerStuck` when every slot is stuck). No transaction is open
  while user code runs, except the pub/sub handler's, whose connection is terminated at the deadline.
- **Crashes are counted in Postgres before user code runs**: claiming an item (which starts its call) adds one
  to its ``crashes``, any orderly end (done, failed, released) clears it. An item claimed with ``crashes > 0``
  began a run that never ended: it runs alone, and after ``max_crashes`` such runs it is parked instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

import psycopg

from cmb_dagster.errors import CmbError

T = TypeVar("T")

ERROR_TEXT_LIMIT = 2000
"""Characters of an error message kept with a failed item (tracebacks keep :data:`TRACEBACK_LIMIT`)."""
TRACEBACK_LIMIT = 20_000
DEFAULT_MAX_CRASHES = 3
"""Runs of one item that may end with its worker's death before the item is parked."""

_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
# SQLSTATE classes an item's own data can cause: data exception, integrity constraint violation,
# program limit exceeded (a value too big for an index or a field)
_ITEM_ERROR_CLASSES = ("22", "23", "54")


class TimedOut(CmbError):
    """A call of user code ran past its time limit; it was abandoned (its result, if any, is dropped)."""


class WorkerStuck(CmbError):
    """Every slot of a worker is held by a call of user code running far past its deadline: the worker stops so
    that its process can be restarted (Postgres keeps every item; nothing is lost)."""


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
