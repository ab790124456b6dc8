"""Flow control shared by the engines: a token bucket and concurrency slots per key, held in Postgres so that the
limits hold across every worker and process.

A *scope* is what an engine limits (an event queue handler, a stage, a callback destination); its *keys* come
from the work (an account, a tenant, a host). :func:`register` records each scope's :class:`FlowLimits` (a
definition of a lower ``version`` than the stored one leaves it as it is); :func:`take` grants work a token and a
slot of its key, held by the worker that took it; the commit that finishes the work frees its slot
(:func:`release`), and the slot of a holder that died frees itself when its time-to-live passes (a holder renews
it with :func:`renew` while it works). An engine's claim inlines the same statements
(:mod:`cmb_dagster.flow.sql`) in its own.

A key's rows are made when it is first taken and removed by :func:`sweep` once it is idle (its bucket full again,
no slot held): the tables hold the keys in use, not every key ever seen. An idle key is what a new one is, so its
limits are unchanged by the removal. Every worker loop calls :func:`sweep_when_due`, which walks the keys a batch at
a time, once per process.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Collection, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from pydantic import Field, model_validator

from cmb_dagster.database import Database
from cmb_dagster.errors import CmbError
from cmb_dagster.flow import sql
from cmb_dagster.models import Options

log = logging.getLogger("cmb_dagster.flow")

MAX_KEY_LENGTH = 500
"""Longest key kept: a longer one is cut to this length."""
MAX_CONCURRENCY = 10_000
MAX_VERSION = 2**31 - 1
SWEEP_BATCH = 500
"""Keys a sweep examines in one transaction."""
SWEEP_INTERVAL = 60.0
"""Seconds between two walks of a process over a database's keys (:func:`sweep_when_due`)."""
SWEEP_PAUSE = 1.0
"""Seconds between two batches of one walk; :data:`SWEEP_BURST_PAUSE` after a batch that removed half its keys or
more (a burst of keys to clear: 100,000 take about half a minute)."""
SWEEP_BURST_PAUSE = 0.1
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d*(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class RateLimit(Options):
    """At most ``rate`` starts per ``per`` seconds for each key, with bursts of up to ``burst`` (default ``rate``).

    Also written ``"10/s"``, ``"600/m"``, ``"5/2s"``."""

    rate: float = Field(gt=0, le=1_000_000, description="Starts allowed per period.")
    per: float = Field(default=1.0, gt=0, le=86_400, description="The period in seconds.")
    burst: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Starts allowed at once after a quiet time (default: rate)."
    )

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        match = _RATE.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not a rate such as '10/s', '600/m' or '5/2s'")
        count, amount, unit = match.groups()
        return {"rate": float(count), "per": float(amount or 1) * _UNIT[unit]}

    @property
    def per_second(self) -> float:
        """Tokens added per second."""
        return self.rate / self.per

    @property
    def capacity(self) -> float:
        """The bucket's size: the starts allowed at once."""
        return float(self.burst if self.burst is not None else max(1, math.floor(self.rate)))


class FlowLimits(Options):
    """The limits of one scope, applied to each of its keys: a rate limit and a concurrency limit (either may be
    None: no limit)."""

    rate_limit: RateLimit | None = Field(default=None, description="Starts per period per key.")
    concurrency: int | None = Field(
        default=None, ge=1, le=MAX_CONCURRENCY, description="Items in flight per key across all workers."
    )
    version: int = Field(
        default=0,
        ge=0,
        le=MAX_VERSION,
        description="The definition's version: workers registering a lower one leave the stored limits as they are "
        "(raise it with each change, so a worker of an older deployment cannot undo it).",
    )

    @property
    def limited(self) -> bool:
        return self.rate_limit is not None or self.concurrency is not None


@dataclass(frozen=True)
class Grant:
    """What :func:`take` granted a key: ``count`` starts, the slots taken for them (``slots``, under a concurrency
    limit: one per start not holding one already); ``retry_after``: seconds until the next token when nothing was
    granted for want of one."""

    count: int
    slots: list[int]
    retry_after: float | None


@dataclass(frozen=True)
class KeyUse:
    """One key's limits and their use now."""

    scope: str
    key: str
    rate_per_second: float | None
    burst: float | None
    concurrency: int | None
    tokens: float | None
    in_flight: int


def describe_limits(rate_per_second: float | None, burst: float | None, concurrency: int | None) -> str:
    """A scope's limits in words: ``20/s (burst 20), 2 in flight`` or ``no limits``."""
    parts = []
    if rate_per_second:
        parts.append(f"{rate_per_second:g}/s (burst {burst:g})")
    if concurrency:
        parts.append(f"{concurrency} in flight")
    return ", ".join(parts) or "no limits"


FlowKey = tuple[str, str]
"""(scope, key)."""
HeldSlot = tuple[str, str, int]
"""(scope, key, slot)."""


@dataclass(frozen=True)
class ScopeLimits:
    """A registered scope's limits as stored."""

    scope: str
    rate_per_second: float | None
    burst: float | None
    concurrency: int | None
    version: int


def register(conn: psycopg.Connection, limits: Mapping[str, FlowLimits | None]) -> None:
    """Record each scope's limits (None or no limit: the scope is not limited), except where the stored definition
    has a higher version: those are kept, with a warning."""
    if not limits:
        return
    scopes = list(limits)
    given = [limits[s] or FlowLimits() for s in scopes]
    newer = conn.execute(
        sql.REGISTER,
        {
            "scopes": scopes,
            "rates": [g.rate_limit.per_second if g.rate_limit else None for g in given],
            "bursts": [g.rate_limit.capacity if g.rate_limit else None for g in given],
            "concurrency": [g.concurrency for g in given],
            "versions": [g.version for g in given],
        },
    ).fetchall()
    for scope, version in newer:
        log.warning(
            "flow limits of %s: version %d is registered, newer than this worker's %d; the registered ones apply",
            scope,
            version,
            (limits[scope] or FlowLimits()).version,
        )


def scopes(conn: psycopg.Connection, prefix: str) -> list[ScopeLimits]:
    """The registered scopes starting with ``prefix`` that have a limit, and their limits."""
    rows = conn.execute(sql.SCOPES, {"prefix": prefix}).fetchall()
    return [ScopeLimits(*row) for row in rows if row[1] is not None or row[3] is not None]


def ensure(conn: psycopg.Connection, keys: Iterable[FlowKey]) -> None:
    """Make the bucket of limited (scope, key) pairs (full) where missing, and more slot rows (free) up to the
    concurrency limit: 64 at first, then twice as many each time."""
    pairs = sorted(set(keys))  # in one order, so two workers making the same rows never deadlock
    if pairs:
        conn.execute(sql.ENSURE, {"scopes": [p[0] for p in pairs], "keys": [p[1] for p in pairs]})


_Step = tuple[str, dict[str, Any]]


def _take_steps(
    wants: Mapping[FlowKey, int], holding: Mapping[FlowKey, int], holder: str, ttl: float
) -> Generator[_Step, list[tuple[Any, ...]], dict[FlowKey, Grant]]:
    """The statements of a take, for a sync or an async connection to run (one logic, two drivers): each yields
    (statement, parameters) and is sent the rows."""
    wanted = {(scope, key[:MAX_KEY_LENGTH]): (n, holding.get((scope, key), 0)) for (scope, key), n in wants.items()}
    wanted = {key: (n, min(held, n)) for key, (n, held) in sorted(wanted.items()) if n > 0}
    grants: dict[FlowKey, Grant] = {}  # the keys of scopes with limits (those without are granted all)
    for attempt in (1, 2):  # a second time for the keys that lacked rows, once they are made
        if not wanted:
            break
        rows = yield sql.TAKE, _take_params(wanted, holder, ttl)
        lacking = []
        for scope, key, count, slots, wait, missing in rows:
            before = grants.get((scope, key), Grant(0, [], None))
            grants[(scope, key)] = Grant(before.count + count, [*before.slots, *slots], wait)
            n, held = wanted[(scope, key)]
            if missing and count < n and attempt == 1:
                lacking.append((scope, key))
                wanted[(scope, key)] = (n - count, max(0, held - count))
        if not lacking:
            break
        yield sql.ENSURE, {"scopes": [k[0] for k in lacking], "keys": [k[1] for k in lacking]}
        wanted = {key: wanted[key] for key in lacking}
    return grants


def _take_params(wanted: Mapping[FlowKey, tuple[int, int]], holder: str, ttl: float) -> dict[str, Any]:
    keys = list(wanted)
    return {
        "scopes": [k[0] for k in keys],
        "keys": [k[1] for k in keys],
        "want": [wanted[k][0] for k in keys],
        "slots": [wanted[k][0] - wanted[k][1] for k in keys],
        "holder": holder,
        "ttl": ttl,
    }


def take(
    conn: psycopg.Connection,
    wants: Mapping[FlowKey, int],
    *,
    holder: str,
    ttl: float,
    holding: Mapping[FlowKey, int] | None = None,
) -> dict[FlowKey, Grant]:
    """Grant up to ``wants[(scope, key)]`` starts of each key a token and a slot, the slots held by ``holder`` for
    ``ttl`` seconds unless renewed (``holding``: of the starts, how many hold a slot already and need a token
    alone); run it in the transaction that records the starts. Keys of scopes without limits are granted all."""
    steps = _take_steps(wants, holding or {}, holder, ttl)
    try:
        statement, params = next(steps)
        while True:
            cursor = conn.execute(statement, params)
            statement, params = steps.send(cursor.fetchall() if cursor.description else [])
    except StopIteration as done:
        return _granted_all(wants, done.value)


async def take_async(
    conn: psycopg.AsyncConnection,
    wants: Mapping[FlowKey, int],
    *,
    holder: str,
    ttl: float,
    holding: Mapping[FlowKey, int] | None = None,
) -> dict[FlowKey, Grant]:
    """:func:`take` on an async connection."""
    steps = _take_steps(wants, holding or {}, holder, ttl)
    try:
        statement, params = next(steps)
        while True:
            cursor = await conn.execute(statement, params)
            statement, params = steps.send(await cursor.fetchall() if cursor.description else [])
    except StopIteration as done:
        return _granted_all(wants, done.value)


def _granted_all(wants: Mapping[FlowKey, int], grants: dict[FlowKey, Grant]) -> dict[FlowKey, Grant]:
    """``grants`` by the keys asked for; a key of a scope without limits (no row came back) is granted all."""
    return {
        (scope, key): grants.get((scope, key[:MAX_KEY_LENGTH]), Grant(n, [], None)) for (scope, key), n in wants.items()
    }


def _held_params(held: Iterable[HeldSlot], holder: str, ttl: float | None = None) -> dict[str, Any]:
    slots = sorted(set(held))
    return {
        "scopes": [s[0] for s in slots],
        "keys": [s[1][:MAX_KEY_LENGTH] for s in slots],
        "slots": [s[2] for s in slots],
        "holder": holder,
        "ttl": ttl,
    }


def renew(conn: psycopg.Connection, held: Collection[HeldSlot], *, holder: str, ttl: float) -> set[HeldSlot]:
    """The slots ``held`` by ``holder`` last another ``ttl`` seconds; returns those renewed (the others expired
    first: no longer held)."""
    if not held:
        return set()
    rows = conn.execute(sql.RENEW, _held_params(held, holder, ttl)).fetchall()
    return {(scope, key, slot) for scope, key, slot in rows}


def release(conn: psycopg.Connection, held: Collection[HeldSlot], *, holder: str) -> None:
    """Free the slots ``held`` by ``holder``; run it in the transaction that finishes their work."""
    if held:
        conn.execute(sql.RELEASE, _held_params(held, holder))


def usage(conn: psycopg.Connection, scopes: Sequence[str], *, limit: int = 1000) -> list[KeyUse]:
    """The keys of ``scopes`` with a bucket or slots, their limits and use now (at most ``limit`` keys)."""
    rows = conn.execute(sql.USAGE, {"scopes": list(scopes), "limit": limit}).fetchall()
    return [KeyUse(*row) for row in rows]


@dataclass(frozen=True)
class Swept:
    """What one batch of :func:`sweep` did: the keys whose rows it removed, and the key the next batch starts at
    (None: the batch reached the last key)."""

    removed: int
    next: tuple[str, str] | None


def sweep(conn: psycopg.Connection, *, start: tuple[str, str] = ("", ""), limit: int = SWEEP_BATCH) -> Swept:
    """Remove the rows of the idle keys (bucket full, no slot held) among the ``limit`` keys from ``start`` on in
    (scope, key) order, in one transaction of its own. A removed key is made again, full and free, when next taken;
    a key taken, made or locked by another transaction meanwhile is left as it is, and nobody waits for the sweep
    longer than this transaction."""
    with conn.transaction():
        rows = conn.execute(sql.SWEEP_LOCK, {"scope": start[0], "key": start[1], "limit": limit}).fetchall()
        idle = [row for row in rows if row[0] == "idle"]
        removed = 0
        if idle:
            params = {
                name: [row[i] for row in idle] for i, name in enumerate(("scopes", "keys", "buckets", "slots"), 1)
            }
            removed = conn.execute(sql.SWEEP_DELETE, params).fetchone()[0]
    return Swept(removed, next(((row[1], row[2]) for row in rows if row[0] == "next"), None))


@dataclass
class _Walk:
    """A process's walk over the keys of one database: when its next batch is due, and where it starts."""

    due: float
    start: tuple[str, str] = ("", "")
    running: threading.Lock = field(default_factory=threading.Lock)


_walks: weakref.WeakKeyDictionary[Database, _Walk] = weakref.WeakKeyDictionary()
_walks_lock = threading.Lock()


def sweep_when_due(db: Database) -> float:
    """Sweep the next batch of ``db``'s keys if it is due, and return the seconds until the next one is: the worker
    loops of a process share one walk over every key, its batches :data:`SWEEP_PAUSE` (or
    :data:`SWEEP_BURST_PAUSE`) apart, a walk every :data:`SWEEP_INTERVAL` seconds (the first that long after the
    first call). A failure is logged; the next walk tries again."""
    now = time.monotonic()
    with _walks_lock:
        walk = _walks.setdefault(db, _Walk(due=now + SWEEP_INTERVAL))
    if now < walk.due:
        return walk.due - now
    if not walk.running.acquire(blocking=False):  # another loop of this process sweeps now
        return SWEEP_BURST_PAUSE
    try:
        swept = Swept(0, None)
        try:
            with db.connection(timeout=1.0, autocommit=True) as conn:  # a worker loop's wait for it, at most
                swept = sweep(conn, start=walk.start)
        except (psycopg.Error, CmbError) as exc:
            log.warning("flow control: could not remove idle keys (%s); trying again in %.0fs", exc, SWEEP_INTERVAL)
        walk.start = swept.next or ("", "")
        pause = SWEEP_BURST_PAUSE if swept.removed * 2 >= SWEEP_BATCH else SWEEP_PAUSE
        walk.due = time.monotonic() + (SWEEP_INTERVAL if swept.next is None else pause)
        return walk.due - time.monotonic()
    finally:
        walk.running.release()
