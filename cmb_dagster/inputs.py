"""Checks of what users hand the API, the same in every engine: text Postgres can store, JSON within the
payload size limit, numbers within range. Each raises :class:`InvalidInput` (or the engine's subclass)
naming the field, before anything is written.

The payload limit (``CMB_MAX_PAYLOAD_BYTES``, 4 MiB by default) bounds every JSON value an engine
accepts: an entity's payload and a stage's state, an event's value, a published payload, a
callback's context.

What Postgres still refuses of the input (text the database's encoding cannot hold, a key past what an
index holds, a value past what a jsonb holds) reaches the caller the same way: :func:`refused_input`.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from cmb_dagster.errors import ConfigError, InvalidInput
from cmb_dagster.isolation import is_item_error

MAX_PAYLOAD_ENV = "CMB_MAX_PAYLOAD_BYTES"
DEFAULT_MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
PAYLOAD_LIMIT_RANGE = (1024, 256 * 1024 * 1024)
MAX_DELAY_SECONDS = 100 * 365.25 * 86400
"""Longest delay or timer the API accepts (a century; Postgres and Python both hold the moment)."""
BIGINT = (-(2**63), 2**63 - 1)

_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")  # a JSON \u0000 escape, not an escaped backslash before 'u0000'
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def max_payload_bytes() -> int:
    """The payload size limit of this process (``CMB_MAX_PAYLOAD_BYTES``)."""
    return _payload_limit(os.environ.get(MAX_PAYLOAD_ENV, ""))


@functools.lru_cache(maxsize=8)
def _payload_limit(raw: str) -> int:
    if not raw.strip():
        return DEFAULT_MAX_PAYLOAD_BYTES
    low, high = PAYLOAD_LIMIT_RANGE
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{MAX_PAYLOAD_ENV}: {shorten(raw)} is not a number of bytes") from None
    if not low <= value <= high:
        raise ConfigError(f"{MAX_PAYLOAD_ENV}: {value} is outside {low}..{high} bytes")
    return value


def shorten(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for error messages that quote bad input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 12]}... ({len(text)} chars)"


def check_text(
    value: Any, field: str, *, max_length: int, error: type[InvalidInput] = InvalidInput, allow_empty: bool = False
) -> str:
    """``value`` if it is a string Postgres can store (no NUL, no lone surrogate) of at most ``max_length``
    characters (and not empty, unless ``allow_empty``)."""
    if not isinstance(value, str):
        raise error(f"{field}: expected a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise error(f"{field}: must not be empty")
    if len(value) > max_length:
        raise error(f"{field}: {len(value)} characters, at most {max_length} allowed")
    if "\x00" in value:
        raise error(f"{field}: the character U+0000 cannot be stored")
    if _LONE_SURROGATE.search(value):
        raise error(f"{field}: lone surrogate characters are not valid Unicode")
    return value


def to_json(value: Any, field: str, *, error: type[InvalidInput] = InvalidInput, limit: int | None = None) -> str:
    """``value`` as compact JSON text that Postgres jsonb accepts, at most ``limit`` bytes (default: the
    payload limit); NaN, Infinity, U+0000, lone surrogates and what is not JSON are refused."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise error(f"{field}: not JSON-serializable ({exc})") from None
    except (TypeError, RecursionError) as exc:
        raise error(f"{field}: not JSON-serializable ({exc})") from None
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise error(f"{field}: the character U+0000 cannot be stored (Postgres jsonb refuses it)")
    try:
        size = len(text) if text.isascii() else len(text.encode())  # isascii is a flag: no copy for plain text
    except UnicodeEncodeError:
        raise error(f"{field}: lone surrogate characters are not valid Unicode") from None
    limit = max_payload_bytes() if limit is None else limit
    if size > limit:
        raise error(f"{field}: {size} bytes as JSON, at most {limit} allowed ({MAX_PAYLOAD_ENV})")
    return text


def load_reference(path: str, field: str, *, error: type[InvalidInput] = InvalidInput) -> Any:
    """The object a ``'module:attribute'`` path names (``attribute`` may be dotted)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise error(f"{field}: {shorten(path)} is not 'module:attribute'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise error(f"{field}: cannot load {shorten(path)} ({exc})") from None
    return target


def check_int(
    value: Any, field: str, *, low: int = BIGINT[0], high: int = BIGINT[1], error: type[InvalidInput] = InvalidInput
) -> int:
    """``value`` if it is an integer (not a bool) within ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{field}: expected an integer, got {shorten(value)}")
    if not low <= value <= high:
        raise error(f"{field}: {shorten(value)} is outside {low}..{high}")
    return value


def check_seconds(
    value: Any, field: str, *, high: float = MAX_DELAY_SECONDS, error: type[InvalidInput] = InvalidInput
) -> float:
    """``value`` (seconds or a ``timedelta``; None is 0) as finite seconds within ``0..high``."""
    if value is None:
        return 0.0
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise error(f"{field}: expected seconds or a timedelta, got {shorten(value)}")
    if seconds < 0:
        raise error(f"{field}: must not be negative, got {shorten(value)}")
    if seconds > high:
        raise error(f"{field}: {seconds:g} s is more than the {high:g} s allowed")
    return float(seconds)


@contextmanager
def refused_input(error: type[InvalidInput], field: str, *, conn: psycopg.Connection | None = None) -> Iterator[None]:
    """Raise ``error`` naming ``field``, the original chained, when Postgres (or psycopg, before sending) refuses
    the data of the block (:func:`~cmb_dagster.isolation.is_item_error`); other errors pass unchanged. ``conn``:
    the caller's connection, whose transaction the refusal may have aborted (the message then says so). Also a
    decorator."""
    try:
        yield
    except Exception as exc:
        if not is_item_error(exc):
            raise
        raise error(_refusal(field, exc, conn)) from exc


def _refusal(field: str, exc: BaseException, conn: psycopg.Connection | None) -> str:
    reason = (exc.diag.message_primary if isinstance(exc, psycopg.Error) else None) or str(exc) or type(exc).__name__
    reason = " ".join(reason.split())
    if len(reason) > 300:
        reason = f"{reason[:299]}…"
    if conn is not None and conn.info.transaction_status == TransactionStatus.INERROR:
        return f"{field}: refused by the database ({reason}); the transaction of conn is aborted: roll it back"
    return f"{field}: refused by the database ({reason}); nothing was written"
