"""The shared isolation rules without a database: sanitised text, splitting a failing write, user code
under a deadline."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from cmb_dagster import isolation
from cmb_dagster.isolation import (
    TimedOut,
    UserCode,
    WorkerStuck,
    describe_error,
    is_item_error,
    sanitize,
    split_until_alone,
)


def test_sanitize_writes_nul_escaped_replaces_lone_surrogates_and_bounds_the_length():
    assert sanitize("a\x00b \udc80 c") == "a\\0b \ufffd c"
    assert sanitize("x" * 50, limit=10) == "x" * 9 + "…"
    assert sanitize("é ok") == "é ok"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_describe_error_never_raises():
    assert describe_error(ValueError("bad\x00")) == "ValueError: bad\\0"
    assert describe_error(Unprintable()) == "Unprintable: (its message could not be read)"
    assert describe_error(KeyError()) == "KeyError"


def test_item_errors_are_those_the_data_causes():
    assert is_item_error(psycopg.errors.UntranslatableCharacter())  # 22P05
    assert is_item_error(psycopg.errors.CheckViolation())  # 23514
    assert is_item_error(psycopg.errors.ProgramLimitExceeded())  # 54000
    assert is_item_error(psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"))
    assert is_item_error(UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed"))
    assert not is_item_error(psycopg.OperationalError("server closed the connection"))
    assert not is_item_error(psycopg.errors.SerializationFailure())
    assert not is_item_error(psycopg.errors.DeadlockDetected())
    assert not is_item_error(ValueError("a bug"))


def test_a_failing_write_is_split_until_the_failing_items_are_alone():
    written: list[list[int]] = []

    def write(items):
        if any(i in (3, 11) for i in items):
            raise psycopg.DataError("refused")
        written.append(list(items))

    alone: list[int] = []
    split_until_alone(list(range(16)), write, lambda item, exc: alone.append(item))
    assert alone == [3, 11]
    assert sorted(i for part in written for i in part) == [i for i in range(16) if i not in (3, 11)]
    assert len(written) <= 8  # halves, not one write per item


def test_an_error_that_is_not_the_datas_is_raised_at_once():
    calls = []

    def write(items):
        calls.append(items)
        raise psycopg.OperationalError("server closed the connection")

    with pytest.raises(psycopg.OperationalError):
        split_until_alone([1, 2, 3, 4], write, lambda item, exc: None)
    assert len(calls) == 1


def test_a_slow_call_is_set_aside_and_the_calls_after_it_go_on():
    release = threading.Event()
    code = UserCode("test", set_aside_after=0.2)

    def work(item: int) -> int:
        if item == 2:
            release.wait(10)
        return item * 10

    started = time.monotonic()
    ended = code.run([1, 2, 3, 4], work, 5.0)
    assert [c.result for c in ended] == [10, 30, 40]
    assert time.monotonic() - started < 5.0
    [aside] = code.set_aside
    assert aside.item == 2 and code.collect() == []
    release.set()
    [done] = _collect_until(code)
    assert done.item == 2 and done.outcome == 20


def test_a_call_past_its_timeout_is_abandoned_and_reported():
    release = threading.Event()
    code = UserCode("test", set_aside_after=None)
    [call] = code.run([1], lambda item: release.wait(10), 0.2)
    release.set()
    assert call.timed_out
    with pytest.raises(TimedOut, match=r"timed out after 0.2 s"):
        call.outcome  # noqa: B018 - reading it raises


def test_errors_of_user_code_are_returned_not_raised():
    code = UserCode("test")
    [call] = code.run([1], lambda item: 1 / 0, 5.0)
    with pytest.raises(ZeroDivisionError):
        call.outcome  # noqa: B018 - reading it raises


def test_withdrawn_calls_never_start():
    gate, started = threading.Event(), []
    code = UserCode("test", set_aside_after=None)

    def work(item: int) -> None:
        started.append(item)
        gate.wait(10)

    def withdraw_the_rest() -> None:
        with code.holding() as pending:
            code.withdraw(pending)
        gate.set()

    ended = code.run([1, 2, 3], work, 5.0, on_wait=withdraw_the_rest, wait_step=0.05)
    assert started == [1] and [c.item for c in ended] == [1]


def test_a_worker_whose_abandoned_calls_pile_up_stops(monkeypatch):
    monkeypatch.setattr(isolation, "MAX_ABANDONED", 2)
    release = threading.Event()
    code = UserCode("test", set_aside_after=None)
    for _ in range(3):
        code.run([1], lambda item: release.wait(10), 0.05)
    with pytest.raises(WorkerStuck, match="3 calls of user code are still running past their time limit"):
        code.run([1], lambda item: None, 1.0)
    release.set()


def _collect_until(code: UserCode, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = code.collect()
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError("no set-aside call ended")
