"""The shared isolation rules without a database: sanitised text, splitting a failing write (user code under a
deadline: test_executor.py)."""

from __future__ import annotations

import psycopg
import pytest

from cmb_dagster.isolation import (
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
