"""The worker runtime shared by every engine: partitions owned through leases, a loop bounded in time.

A loop (:class:`Worker`) of some ``kind`` (``"callbacks.bucket"``, ``"pubsub.consumer"``, ...) is given the
partitions it may serve. It holds a partition by a row in ``leases`` that it renews every ``ttl / 3``
seconds; a worker that dies stops renewing and loses the partition after ``ttl`` seconds, and whoever asks
next takes it over with a higher fence. It listens for the NOTIFY hints that wake it, backs a failing
partition off, and reports its progress. Every engine's worker is an :class:`EngineWorker`:
``XWorker(db, options, *, owner=None)`` with ``run(duration=None, *, on_progress=None)`` and ``stop()``.
The same loop runs inside a Dagster op (relaunched by a sensor) and inside a long-running
``cmb-dagster ... worker`` process.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import psycopg

from cmb_dagster import flow, sql
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.errors import CmbError, DatabaseUnavailable
from cmb_dagster.isolation import WorkerStuck
from cmb_dagster.models import Backoff
from cmb_dagster.notifications import Listener, OnNotify, channel_name

log = logging.getLogger("cmb_dagster.workers")

LEASES_CHANNEL = "leases"
"""Where released leases are announced (payload: their kind)."""


class LeaseLost(CmbError):
    """A worker found that a partition it worked on is no longer its own."""


def default_owner() -> str:
    """A worker name unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class LeaseTerm:
    """Until when (``time.monotonic()``) this process may count a lease of one fence as its own: the time its
    last successful renewal was sent plus the TTL; ``-inf`` once a renewal found it lost or it was released."""

    ttl: float
    valid_until: float = -math.inf


@dataclass(frozen=True)
class Lease:
    """A held partition: the fence proves ownership inside a transaction (see :meth:`Leases.check`).

    ``inherited``: taken over from a holder that neither renewed nor released it (it died or stalled), so
    work of its may have been cut off mid-item. ``term``: the lease's validity by this process's own clock,
    shared by every :class:`Lease` of the same fence (a renewal extends it for all of them)."""

    kind: str
    partition: str
    owner: str
    fence: int
    inherited: bool = field(default=False, compare=False)
    term: LeaseTerm = field(default_factory=lambda: LeaseTerm(0.0, math.inf), compare=False, repr=False)

    def valid_for(self, seconds: float) -> bool:
        """Whether, by this process's clock, the lease is still held ``seconds`` from now."""
        return time.monotonic() + seconds < self.term.valid_until

    def require(self) -> None:
        """Raise LeaseLost unless, by this process's clock, the lease is still held for a third of its TTL.

        Called before items of the partition are handed to user code: a process that was stopped (SIGSTOP,
        a long pause) or cut off from the database past its lease calls no user code for a partition
        another worker may hold by now (the fence would refuse its commit anyway)."""
        if not self.valid_for(self.term.ttl / 3):
            raise LeaseLost(
                f"{self.kind} partition {self.partition!r}: the lease of {self.owner} has expired by its own "
                "clock (not renewed in time); its items are left to the next holder"
            )


class Leases:
    """Acquire, renew, check and release partition leases of one kind for one owner.

    Renewals and releases go to the server itself (:meth:`Database.direct_connection`), not through a pooler
    whose server connections may all be busy with work; a renewal waits a third of the TTL at most for a
    connection, so a worker cut off from the database finds out well within one TTL."""

    def __init__(self, db: Database, kind: str, owner: str | None = None, ttl: float = 10.0) -> None:
        self.db = db
        self.kind = kind
        self.owner = owner or default_owner()
        self.ttl = ttl
        self._terms: dict[str, tuple[int, LeaseTerm]] = {}  # partition -> (fence, its term), while held

    def acquire(self, partitions: Iterable[str]) -> dict[str, Lease]:
        """Take (or renew) every partition that is free, expired or already ours; return those held.

        Each lease returned is valid by this process's clock until ``ttl`` seconds after the statement was
        sent; a partition asked for and not returned is lost, also for the :class:`Lease` objects still
        around."""
        wanted = list(partitions)
        params = {"kind": self.kind, "owner": self.owner, "ttl": self.ttl, "partitions": wanted}
        with self.db.direct_connection(timeout=self.ttl / 3) as conn:
            sent_at = time.monotonic()  # before the database reads now(): the local expiry errs early
            rows = conn.execute(sql.ACQUIRE_LEASES, params).fetchall()
        held = {}
        for p, fence, inherited in rows:
            known_fence, term = self._terms.get(p, (None, None))
            if term is None or known_fence != fence:
                self._forget([p])
                term = LeaseTerm(self.ttl)
                self._terms[p] = (fence, term)
            term.valid_until = sent_at + self.ttl
            held[p] = Lease(self.kind, p, self.owner, fence, inherited, term)
        self._forget(p for p in wanted if p not in held)
        return held

    def _forget(self, partitions: Iterable[str]) -> None:
        """The leases of ``partitions`` are no longer this process's, by its own clock too."""
        for p in partitions:
            if (known := self._terms.pop(p, None)) is not None:
                known[1].valid_until = -math.inf

    def release(self, partitions: Iterable[str]) -> None:
        """Give partitions up at once and announce it, so another worker takes them without waiting."""
        params = {
            "kind": self.kind,
            "owner": self.owner,
            "partitions": list(partitions),
            "channel": channel_name(self.db, LEASES_CHANNEL),
        }
        self._forget(params["partitions"])
        with self.db.direct_connection(timeout=self.ttl / 3) as conn:
            conn.execute(sql.RELEASE_LEASES, params)

    @staticmethod
    def check(conn: psycopg.Connection, lease: Lease) -> None:
        """Inside ``conn``'s transaction: raise LeaseLost unless ``lease`` is still held and unexpired.

        The row stays key-share-locked until the transaction ends, so no one can take the partition over
        between this check and the commit of the work it guards (a takeover changes the fence, a column of the
        unique index leases_fence, so it waits for key-share locks; the holder's renewals go on). A process
        stopped inside such a transaction would hold the partition: connections that run them end a transaction
        left idle (``idle_in_transaction_session_timeout``).
        """
        params = {"kind": lease.kind, "partition": lease.partition, "owner": lease.owner, "fence": lease.fence}
        if conn.execute(sql.CHECK_LEASE, params).fetchone() is None:
            raise LeaseLost(f"{lease.kind} partition {lease.partition!r} is no longer held by {lease.owner}")

    @staticmethod
    def check_many(conn: psycopg.Connection, leases: Sequence[Lease]) -> Callable[[], None]:
        """:meth:`check` for leases of one kind and owner in one statement.

        Sends the check and returns a function that raises LeaseLost unless every lease is held; in
        pipeline mode, other statements of the transaction can be sent before it is called.
        """
        if not leases:
            return lambda: None
        if len({(lease.kind, lease.owner) for lease in leases}) != 1:
            raise ValueError("check_many takes leases of one kind and one owner")
        cursor = conn.execute(
            sql.CHECK_LEASES,
            {
                "kind": leases[0].kind,
                "owner": leases[0].owner,
                "partitions": [lease.partition for lease in leases],
                "fences": [lease.fence for lease in leases],
            },
        )

        def confirm() -> None:
            held = {row[0] for row in cursor.fetchall()}
            lost = sorted(lease.partition for lease in leases if lease.partition not in held)
            if lost:
                raise LeaseLost(f"{leases[0].kind} partitions {lost} are no longer held by {leases[0].owner}")

        return confirm


@dataclass(frozen=True)
class LeaseState:
    """A lease as stored: who holds the partition and for how many more seconds (negative once expired,
    ``-inf`` once released)."""

    kind: str
    partition: str
    owner: str
    fence: int
    acquired_at: datetime
    expires_in: float


def list_leases(db: DatabaseSource) -> list[LeaseState]:
    """Every lease of every kind, by kind and partition (read only: nothing is taken or renewed)."""
    with Database.of(db).connection() as conn:
        return [LeaseState(*row) for row in conn.execute(sql.LIST_LEASES)]


Step = Callable[[Lease], int]
JointStep = Callable[[list[Lease]], int]


@dataclass
class WorkerReport:
    """What a worker run did."""

    owner: str
    steps: int = 0
    items: int = 0
    errors: int = 0
    held: set[str] = field(default_factory=set)
    seconds: float = 0.0


PARTITION_BACKOFF = Backoff(first=0.5, factor=2, max=30)
"""How long a partition whose step raised waits before it is stepped again."""


class Worker:
    """Runs ``step(lease)`` for each partition it holds, again and again, until its time is up.

    ``step`` does one bounded batch for one partition and returns how many items it handled; when
    no partition had work, the worker sleeps ``idle_sleep`` seconds (or until :meth:`wake`: on every
    NOTIFY on ``channels``, unless ``on_notify`` handles them; the listener checks its connection after
    ``heartbeat`` seconds of silence). A listening worker also hears leases of its kind being released
    (a worker run handing over to its successor) and asks for them at once. A step that raises is logged and its
    partition is retried after ``backoff``. ``partitions`` may be a function, asked again at every lease
    renewal, for partitions that can be added while it runs. Partitions for which ``joint`` is true are
    served together: one call ``joint_step(leases)`` with all of them held (one backoff for the group). When the
    loop ends, ``drain`` (if any) runs before the leases are released; it returns False to keep them (work of theirs
    still runs: they lapse after ``ttl`` instead).
    """

    def __init__(
        self,
        db: Database,
        kind: str,
        partitions: Sequence[str] | Callable[[], Sequence[str]],
        step: Step,
        *,
        owner: str | None = None,
        ttl: float = 10.0,
        idle_sleep: float = 1.0,
        backoff: Backoff = PARTITION_BACKOFF,
        channels: Sequence[str] = (),
        on_notify: OnNotify | None = None,
        heartbeat: float = 5.0,
        on_progress: Callable[[WorkerReport], None] | None = None,
        on_shutdown: Callable[[], None] | None = None,
        joint: Callable[[str], bool] | None = None,
        joint_step: JointStep | None = None,
        drain: Callable[[], bool] | None = None,
    ) -> None:
        if (joint is None) != (joint_step is None):
            raise ValueError("joint and joint_step go together")
        if not callable(partitions) and not partitions:
            raise ValueError("a worker needs at least one partition")
        self.leases = Leases(db, kind, owner, ttl)
        self.partitions = partitions if callable(partitions) else list(partitions)
        self.step = step
        self.joint = joint
        self.joint_step = joint_step
        self.drain = drain
        self.idle_sleep = idle_sleep
        self.backoff = backoff
        self.channels = list(channels)
        self.on_notify = on_notify
        self.heartbeat = heartbeat
        self.listener: Listener | None = None
        self.on_progress = on_progress
        self.on_shutdown = on_shutdown or self.stop
        self._stop = threading.Event()
        self._signal_passed = False  # a shutdown signal was passed to on_shutdown
        self._wake = threading.Event()
        self._held: dict[str, Lease] = {}
        self._next_renew = 0.0
        self._leases_channel = channel_name(db, LEASES_CHANNEL)
        self.turned_at = time.monotonic()

    @property
    def owner(self) -> str:
        return self.leases.owner

    def stop(self) -> None:
        """Ask the loop to finish its current step and return."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        """Whether the loop was asked to stop. A shutdown signal is passed to ``on_shutdown`` (the engine's stop,
        which may first let calls in flight end) from here too, not only by the helper thread that passes it at
        once: a loop turning without that thread still stops by its engine's rules."""
        if not self._stop.is_set() and not self._signal_passed and shutdown_signalled():
            self._signal_passed = True
            self.on_shutdown()
        return self._stop.is_set()

    def wake(self) -> None:
        """Cut the current idle sleep short (e.g. on a NOTIFY hint)."""
        self._wake.set()

    def run(self, duration: float | None = None) -> WorkerReport:
        """Loop for ``duration`` seconds (None: until :meth:`stop`); release the leases on the way out.

        Raises :class:`~cmb_dagster.isolation.WorkerStuck` (after releasing) when user code it abandoned
        piles up: the process should then be restarted."""
        started = time.monotonic()
        deadline = None if duration is None else started + duration
        report = WorkerReport(owner=self.owner)
        self._held = {}
        self._next_renew = 0.0
        retry_at: dict[str, float] = {}
        failures: dict[str, int] = {}
        _running.add(self.on_shutdown)
        self.turned_at = time.monotonic()
        _turning.add(self)
        if not _first_loop_at:
            _first_loop_at.append(self.turned_at)
        if self.channels:
            self.listener = Listener(
                self.leases.db,
                [*self.channels, self._leases_channel],
                self._notified,
                heartbeat=self.heartbeat,
            ).start()
        try:
            while not self.stopping and (deadline is None or time.monotonic() < deadline):
                self.turned_at = time.monotonic()
                if time.monotonic() >= self._next_renew:
                    self._renew(self.partitions)
                    report.held = set(self._held)
                handled = 0
                for partition, run_step in self._steps(self._held):
                    if self.stopping or retry_at.get(partition, 0) > time.monotonic():
                        continue
                    try:
                        count = run_step()
                    except LeaseLost as exc:
                        log.warning("%s", exc)
                        self._next_renew = 0.0
                        continue
                    except WorkerStuck:
                        raise
                    except Exception:  # one failing partition must not stop the others
                        delay = self.backoff.delay(failures.get(partition, 0))
                        failures[partition] = failures.get(partition, 0) + 1
                        retry_at[partition] = time.monotonic() + delay
                        report.errors += 1
                        log.exception("%s partition %r failed; retrying in %.1fs", self.leases.kind, partition, delay)
                        continue
                    failures.pop(partition, None)
                    report.steps += 1
                    report.items += count
                    handled += count
                sweep_in = flow.sweep_when_due(self.leases.db)  # housekeeping shared by the engines: one walk
                if self.on_progress is not None:
                    report.seconds = time.monotonic() - started
                    self.on_progress(report)
                if handled == 0:
                    wait = min(self.idle_sleep if self._held else self.leases.ttl / 3, sweep_in)
                    if deadline is not None:
                        wait = max(0.0, min(wait, deadline - time.monotonic()))
                    self._wake.wait(wait)
                    self._wake.clear()
        finally:
            _running.discard(self.on_shutdown)
            _turning.discard(self)
            if self.listener is not None:
                self.listener.stop()
                self.listener = None
            if self.drain is not None and not self.drain():
                self._held = {}
            if self._held:
                try:
                    self.leases.release(self._held)
                except (psycopg.Error, CmbError) as exc:
                    log.warning("could not release leases (%s); they expire in %.0fs", exc, self.leases.ttl)
            report.seconds = time.monotonic() - started
        return report

    def _notified(self, channel: str, payload: str | None) -> None:
        if channel == self._leases_channel:
            if payload == self.leases.kind:  # a handover: ask for the released partitions now
                self._next_renew = 0.0
                self.wake()
        elif self.on_notify is not None:
            self.on_notify(channel, payload)
        else:
            self.wake()

    @property
    def listening(self) -> bool:
        """Whether the loop's LISTEN connection is up (notifications reach it)."""
        return self.listener is not None and self.listener.connected.is_set()

    def keep_alive(self) -> None:
        """Renew the held leases if they are due (from a step that waits on user code, so a slow but live
        call does not cost the worker its partitions)."""
        self.turned_at = time.monotonic()
        if self._held and time.monotonic() >= self._next_renew:
            self._renew(list(self._held))

    def _renew(self, partitions: Iterable[str] | Callable[[], Sequence[str]]) -> None:
        """Hold ``partitions`` (asked first, if a function); on a database error, hold none until the next try."""
        try:
            self._held = dict(self.leases.acquire(partitions() if callable(partitions) else partitions))
        except (psycopg.Error, CmbError) as exc:
            log.warning("lease renewal failed (%s); retrying", exc)
            self._held = {}
        self._next_renew = time.monotonic() + self.leases.ttl / 3

    def _steps(self, held: dict[str, Lease]) -> list[tuple[str, Callable[[], int]]]:
        """(partition or joint group name, step) for one round over the held partitions whose leases are valid by
        this process's clock (see :meth:`Lease.require`)."""
        steps: list[tuple[str, Callable[[], int]]] = []
        together: list[Lease] = []
        for partition, lease in sorted(held.items()):
            if not lease.valid_for(self.leases.ttl / 3):  # not renewed in time (a stop, a stall): renew first
                self._next_renew = 0.0
                continue
            if self.joint is not None and self.joint(partition):
                together.append(lease)
            else:
                steps.append((partition, functools.partial(self.step, lease)))
        if together:
            steps.insert(0, ("(joint)", functools.partial(self.joint_step, together)))  # type: ignore[arg-type]
        return steps


class EngineWorker:
    """What every engine's worker is: built as ``XWorker(db, options, *, owner=None)``, it works with
    :meth:`run` until its time is up or :meth:`stop` is called.

    A subclass returns its loops from :meth:`loops` (the first runs in the calling thread, any other in a
    thread of its own, all for the same duration) and may clean up in :meth:`finish`. A stop asked while
    before or while the worker starts (its loops are being built) is kept: :meth:`run` then returns at once.
    An error that ends any loop ends the worker: the others stop, and :meth:`run` raises it.
    """

    def __init__(self, db: DatabaseSource, *, owner: str | None = None) -> None:
        self.db = Database.of(db)
        self.owner = owner or default_owner()
        self._stopping = threading.Event()
        self._loops: list[Worker] = []

    def loops(self) -> list[Worker]:  # pragma: no cover - every engine implements it
        """The loops of one run, built anew for each :meth:`run`."""
        raise NotImplementedError

    def finish(self) -> None:
        """After the loops ended and released their leases."""

    def run(
        self, duration: float | None = None, *, on_progress: Callable[[WorkerReport], None] | None = None
    ) -> WorkerReport:
        """Work for ``duration`` seconds (None: until :meth:`stop`); report what the main loop did.

        Raises what ended a loop (e.g. :class:`~cmb_dagster.isolation.WorkerStuck`) once every loop has stopped
        and released its leases, so that the process ends and is restarted; a loop of its own thread that
        failed is logged with its traceback at once."""
        try:
            started = time.monotonic()
            loops = self._loops = self._start(duration)
            if not loops:  # stopped, or the time was up, while the database was away
                return WorkerReport(owner=self.owner, seconds=time.monotonic() - started)
            main, *others = loops
            main.on_progress = on_progress
            for loop in loops:
                loop.on_shutdown = self.stop
            if self._stopping.is_set():
                for loop in loops:
                    loop.stop()
            failed: list[BaseException] = []
            threads = [
                threading.Thread(
                    target=self._run_other, args=(loop, duration, failed), name=f"cmb-{loop.leases.kind}", daemon=True
                )
                for loop in others
            ]
            for thread in threads:
                thread.start()
            try:
                report = main.run(duration)
            finally:
                for loop in others:
                    loop.stop()
                for thread in threads:
                    thread.join()
            if failed:
                raise failed[0]
            return report
        finally:
            self._loops = []
            self._stopping.clear()
            self.finish()

    def _start(self, duration: float | None) -> list[Worker]:
        """The loops of this run (:meth:`loops`), built once the database answers: a worker started while it is
        away (a restart, a failover) waits for it, backing off, until it is stopped or ``duration`` has passed."""
        deadline = None if duration is None else time.monotonic() + duration
        attempt = 0
        while True:
            try:
                return self.loops()
            except (psycopg.OperationalError, DatabaseUnavailable) as exc:
                log.warning("the database does not answer (%s); the worker starts once it does", exc)
                delay = PARTITION_BACKOFF.delay(attempt)
                if deadline is not None:
                    delay = min(delay, deadline - time.monotonic())
                if delay <= 0 or self._stopping.wait(delay):
                    return []
                attempt += 1

    def _run_other(self, loop: Worker, duration: float | None, failed: list[BaseException]) -> None:
        """Run a loop of its own thread; an error that ends it stops the worker, whose :meth:`run` raises it."""
        try:
            loop.run(duration)
        except BaseException as exc:  # raised again by run(), in its caller's thread
            log.exception("the %s loop stopped on an error; the worker stops", loop.leases.kind)
            failed.append(exc)
            self.stop()

    def stop(self) -> None:
        """Ask :meth:`run` to finish the current step and return (safe from a signal handler and any thread)."""
        self._stopping.set()
        for loop in list(self._loops):
            loop.stop()

    @property
    def listening(self) -> bool:
        """Whether the main loop's LISTEN connection is up."""
        return bool(self._loops) and self._loops[0].listening


_running: set[Callable[[], None]] = set()  # how to stop each worker running in this process
_turning: set[Worker] = set()  # the worker loops running in this process
_first_loop_at: list[float] = []  # when a worker loop first ran in this process
_signals: list[threading.Event] = []  # one per open stop_workers_on_signals block: set once a signal arrived


def loops_started() -> bool:
    """Whether a worker loop has run in this process."""
    return bool(_first_loop_at)


def stalled_loops(after: float, *, since: float) -> list[str]:
    """The worker loops of this process that have not turned for ``after`` seconds (a loop turns at each round
    and while it waits on user code it keeps alive); ``["no worker loop"]`` when none has run ``after``
    seconds past ``since`` (a monotonic time)."""
    now = time.monotonic()
    loops = list(_turning)
    if not loops and not _first_loop_at:
        return ["no worker loop"] if now - since > after else []
    return sorted(f"{loop.leases.kind} ({now - loop.turned_at:.0f}s)" for loop in loops if now - loop.turned_at > after)


def stop_running_workers(already: set[Callable[[], None]] | None = None) -> int:
    """Ask every worker running in this process (except those ``already`` asked, then added to it) to finish its
    current step and return; how many were asked."""
    stops = [stop for stop in list(_running) if already is None or stop not in already]
    for stop in stops:
        stop()
    if already is not None:
        already.update(stops)
    return len(stops)


@contextmanager
def stop_workers_on_signals() -> Iterator[threading.Event]:
    """While the block runs, SIGINT and SIGTERM stop the running workers gracefully instead of raising.

    Yields an event set when a signal arrived. The handler only sets it; a helper thread does the
    stopping, so the handler needs no lock the interrupted code may hold.
    """
    signalled, done = threading.Event(), threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield signalled
        return

    def stop_when_signalled() -> None:  # also stops a worker that registers after the signal (still starting)
        asked: set[Callable[[], None]] = set()
        while not done.wait(0.2):
            try:
                if signalled.is_set() and (count := stop_running_workers(asked)):
                    log.warning("shutdown signal: stopping %d worker(s) after their current step", count)
            except Exception:  # the helper must outlive any one stop
                log.exception("shutdown signal: stopping a worker failed")

    helper = threading.Thread(target=stop_when_signalled, name="cmb-worker-shutdown", daemon=True)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    _signals.append(signalled)
    for signum in previous:
        signal.signal(signum, lambda *_: signalled.set())
    try:
        helper.start()
        yield signalled
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        done.set()
        _signals.remove(signalled)


def shutdown_signalled() -> bool:
    """Whether a shutdown signal arrived in a :func:`stop_workers_on_signals` block that is still open (every worker
    loop in the process then ends after its current turn, also without the helper thread that stops them at once)."""
    return any(signalled.is_set() for signalled in _signals)
