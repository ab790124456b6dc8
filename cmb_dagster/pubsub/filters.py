"""Filters of consumers and backfills: SQL/JSON path predicates, a language that can read the document it is given
and nothing else (no function call, no other table, no change). The text travels as a parameter of a fixed
statement and Postgres evaluates it with ``jsonb_path_match_tz``; it never becomes part of a statement.

A consumer's filter reads the event's payload as ``$`` and its topic, op and key as ``$topic``, ``$op`` and
``$key``; a backfill's filter reads the row (as the snapshot event will carry it) as ``$``.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import psycopg
from psycopg.types.json import Jsonb

from cmb_dagster.inputs import shorten
from cmb_dagster.pubsub.errors import InvalidPubSubInput

MAX_FILTER_LENGTH = 2000
EVENT_VARIABLES = ("topic", "op", "key")
"""The variables a consumer's filter may name besides ``$``, the payload."""
ROW_VARIABLES: tuple[str, ...] = ()
"""A backfill's filter names none: ``$`` is the row."""

FILTER_ERRORS = (psycopg.DataError, psycopg.errors.ProgramLimitExceeded, psycopg.errors.InsufficientResources)
"""What evaluating a filter can raise that its silent mode does not suppress (a datetime template it cannot apply, a
regular expression or a document too deep for the server's limits): a batch that met one judges its events apart."""

_SAMPLE_VARIABLES = {"topic": "", "op": "publish", "key": None}
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
# Characters that end a jsonpath variable's name (the "special" class of Postgres's jsonpath scanner).
_SPECIAL = set('?%$.[]{}()|&!=<>@#,*:-+/\\" \t\n\r\f')
_EXAMPLE = "e.g. '$.kind == \"refund\" && $.amount > 100'"


def filter_problem(text: str, variables: Collection[str] = EVENT_VARIABLES) -> str | None:
    """Why ``text`` cannot be a filter naming only ``variables``, or None; Postgres then parses it
    (:func:`check_filter`)."""
    if not text.strip():
        return f"must be an SQL/JSON path predicate, {_EXAMPLE}, not empty"
    if len(text) > MAX_FILTER_LENGTH:
        return f"{len(text)} characters, at most {MAX_FILTER_LENGTH} allowed"
    if "\x00" in text:
        return "the character U+0000 is not allowed"
    if _LONE_SURROGATE.search(text):
        return "lone surrogate characters are not valid Unicode"
    unknown = sorted(set(named_variables(text)) - set(variables))
    if unknown:
        allowed = ", ".join(f"${v}" for v in variables) or "none"
        return f"${unknown[0]} is not a variable here (variables: {allowed}; $ is the document)"
    return None


def named_variables(text: str) -> list[str]:
    """The variables (``$name`` or ``$"name"``) that the jsonpath ``text`` names, outside its strings and comments.

    Postgres raises when a path names a variable it was not given, and only when it evaluates that part, so a
    filter naming one could pass a check and raise on some event later: the names are read here, before, by
    the scanner's own rules (Postgres has no function listing them)."""
    found, i, n = [], 0, len(text)
    while i < n:
        char = text[i]
        if char == '"':
            i = _string_end(text, i)
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif char == "$" and i + 1 < n and text[i + 1] == '"':
            end = _string_end(text, i + 1)
            found.append(text[i + 2 : end - 1])
            i = end
        elif char == "$":
            start = i = i + 1
            while i < n and text[i] not in _SPECIAL:
                i += 1
            if i > start:
                found.append(text[start:i])
        else:
            i += 1
    return found


def _string_end(text: str, start: int) -> int:
    """The index after the double-quoted string that starts at ``start`` (backslash escapes inside)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return len(text)


def check_filter(conn: psycopg.Connection, text: str | None, *, field: str, variables: Collection[str]) -> None:
    """Raise :class:`InvalidPubSubInput` naming ``field`` unless ``text`` (None: no filter) is a predicate Postgres
    parses, naming only ``variables``. Runs in a savepoint of ``conn``'s transaction; nothing is written."""
    if text is None:
        return
    problem = filter_problem(text, variables)
    if problem is None:
        sample = {name: _SAMPLE_VARIABLES[name] for name in variables}
        try:
            with conn.transaction():
                conn.execute("SELECT jsonb_path_match_tz('{}', %s::jsonpath, %s)", (text, Jsonb(sample)))
        except (psycopg.errors.SyntaxError, psycopg.DataError) as exc:  # not jsonpath; a path that is no predicate
            reason = (exc.diag.message_primary or str(exc)).strip()
            if reason == "single boolean result is expected":
                reason = "it selects values; a filter must be true or false (compare them: '$.active == true')"
            problem = f"{shorten(text)} is not an SQL/JSON path predicate ({reason}); {_EXAMPLE}"
    if problem:
        raise InvalidPubSubInput(f"{field}: {problem}")
