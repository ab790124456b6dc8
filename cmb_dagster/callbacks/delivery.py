"""Calling events back: HTTP POSTs over reused connections, Dagster launches, fast retries, due-time waits.

The HTTP client is a small HTTP/1.1 one on asyncio streams, keeping idle connections per target for
reuse: CPU per call is what limits a worker (one event loop runs every call, no thread per call), and it
gives the two limits a callback needs: a deadline for the whole call (resolve, connect, send, every read: the
call is cancelled there), and a cap on the response bytes read. It connects only to addresses the settings
allow, checked on the address actually connected to (after name resolution).

The calls run on the worker's :class:`~cmb_dagster.executor.Executor`, up to ``worker_concurrency`` at once: HTTP calls
on its event loop, ``dagster://`` launches in its threads. A dispatcher on that loop takes due deliveries, highest
priority first, as many as the executor has free slots, and passes them through the worker's
*gate* first: one transaction that takes the slots of the limits their destinations need (those it cannot get
wait in the pool, not counted), re-checks, under row locks, that each event is still pending in the version
polled (cancel, update and delete wait for that lock) and counts the call in ``attempts``. Only what the gate let
through is called; every fast retry passes the gate again. So once cancel, update or delete has returned, no
call of the old version starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import json
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple, Protocol
from urllib.parse import urlsplit

from cmb_dagster.callbacks.hosts import allowed_resolutions, host_allowed
from cmb_dagster.callbacks.launches import CALLBACK_TAG, dagster_job_name
from cmb_dagster.callbacks.models import CallbackSettings, RetryPolicy
from cmb_dagster.callbacks.signing import signature_headers
from cmb_dagster.executor import Executor, Task
from cmb_dagster.isolation import TimedOut, describe_error, sanitize
from cmb_dagster.models import LAUNCHED_BY_TAG, MAX_TAG_VALUE
from cmb_dagster.run_requests import JobLauncher

log = logging.getLogger("cmb_dagster.callbacks")

REJECT_HEADERS = ("X-Ya-CallMeBack-Notify-Reject", "X-CallMeBack-Notify-Reject")
_REJECT_HEADERS_LOWER = tuple(name.lower() for name in REJECT_HEADERS)

NOTIFIED = "notified"
REJECTED = "rejected"
FAILED = "failed"  # permanent: retrying cannot help (host not allowed, unknown job)
RETRY = "retry"  # main retry: reschedule in the database
ABANDONED = "abandoned"  # not called: the lease could lapse first, or the worker is stopping
GONE = "gone"  # not called: cancelled, updated or deleted since it was polled (nothing to write)
HELD = "held"  # a failed probe: back to waiting for its endpoint (neither a retry nor a failure of its own)
MAX_HEADER_BYTES = 16 * 1024
RESPONSE_EXCERPT_BYTES = 512  # of an answer's body kept with the outcome (last_response)
_BODY_ENCODER = json.JSONEncoder(separators=(",", ":"))
INTERNAL_ERROR_DELAY = 5.0  # seconds: at least this long before an event that hit one of our bugs is retried
SLOT_RECHECK = 0.05  # seconds: calls waiting for slots other workers hold ask again after this
PARKED_RECHECK = 1.0  # seconds: calls waiting for slots in use here ask again after this at the latest
MIN_SHUTDOWN = 1.0  # seconds: the dispatcher and the gate's connection are given at least this to close
FlowKey = tuple[str, str]  # (scope, key) of the limits a call is under (cmb_dagster.flow)


class Gate(Protocol):
    """Lets due deliveries through to their calls (the worker provides it, on the pool's event loop).

    In one transaction it takes the slots of their limits, counts those still to be called and passes them to
    ``start`` before that transaction commits; it returns those that are gone, those waiting for a slot or a
    token, and the seconds after which to ask again for those (None: when a slot frees here). The rest are not
    due yet by the database's clock.
    """

    async def __call__(
        self, deliveries: list[Delivery], start: Callable[[list[Delivery]], None]
    ) -> tuple[list[Delivery], list[Delivery], float | None]: ...

    def free(self, delivery: Delivery) -> None:
        """``delivery`` holds no slot any more (its call ended, or it was not called)."""

    async def close(self) -> None: ...


@dataclass(eq=False)
class Delivery:
    """One event handed to the pool: what to call, and (once done) how it went."""

    bucket_id: int
    event_id: int
    run_at: datetime
    originally_run_at: datetime
    owner_client_id: str
    group_key: str
    event_key: str
    cb_url: str
    context_json: str | None  # the event's context as stored (JSON text)
    context_only: bool  # the request's body is the context alone, not the envelope
    retry: RetryPolicy
    attempts: int
    main_retries: int
    due: float  # time.monotonic() at which run_at arrives, by the database's clock
    lease_deadline: Callable[[], float]  # monotonic time after which this worker may no longer hold the bucket
    on_done: Callable[[Delivery], None]
    priority: int = 0
    flow: FlowKey | None = None  # the limits the call is under (None: none)
    slot: int | None = None  # the slot of those limits it holds while called
    message_id: int = 0  # its webhook-id is cb_<message_id> (0: the event id)
    endpoint: str | None = None  # its circuit breaker's endpoint (None: not an HTTP call)
    probe: int | None = None  # the id of the open endpoint it probes (no fast retry; failed, it is held again)
    secrets: tuple[str, ...] = field(default=(), repr=False)  # its owner's active signing secrets (the gate's copy)
    outcome: str | None = None
    tries: int = 0
    error: str | None = None
    status_code: int | None = None  # of the last answer (None: no HTTP answer)
    response: str | None = None  # the first bytes of the last answer's body, sanitised
    retry_delay: float = 0.0
    finished: float = 0.0
    _seq: int = field(default_factory=itertools.count().__next__)

    @property
    def position(self) -> tuple[datetime, int]:
        """The event's place in the poller's (run_at, event_id) order."""
        return (self.run_at, self.event_id)

    def body(self) -> bytes:
        """The JSON the callback receives: the envelope, or the context alone."""
        if self.context_only:
            return (self.context_json or "null").encode()
        text = _BODY_ENCODER.encode
        return (
            f'{{"event_id":{self.event_id},"owner_client_id":{text(self.owner_client_id)},'
            f'"group_key":{text(self.group_key)},"event_key":{text(self.event_key)},'
            f'"run_at":"{self.run_at.isoformat()}","originally_run_at":"{self.originally_run_at.isoformat()}",'
            f'"context":{self.context_json or "null"},"attempt":{self.attempts + self.tries}}}'  # this call, from 1
        ).encode()


class Answer(NamedTuple):
    """How a call went: the outcome, why it failed, and the answer's status code and first body bytes."""

    outcome: str
    error: str | None
    status: int | None = None
    excerpt: str | None = None


class CallError(Exception):
    """A call that failed in a way retrying may cure (its message is safe to store in last_error)."""


class RefusedTarget(Exception):
    """The target resolves to no address the settings allow."""


class _Connection:
    """One keep-alive connection to a target: its stream reader and writer."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.transport.abort()  # dropped at once: nothing more is read or sent


class HttpSender:
    """POSTs JSON over HTTP/1.1 from one event loop, keeping idle connections per (scheme, host, port) for reuse."""

    def __init__(self, settings: CallbackSettings) -> None:
        self.settings = settings
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._tls = ssl.create_default_context()

    async def post(self, url: str, body: bytes, headers: bytes = b"") -> Answer:
        """POST ``body`` with the extra ``headers`` (lines ending in CRLF): notified on 2xx, rejected on a reject
        header, retry otherwise.

        The caller bounds the whole call (resolving, connecting, sending and every read) by cancelling it: the
        pool runs it on its executor, under the deadline ``settings.timeout``.
        """
        target = _target(url)
        if isinstance(target, str):
            return Answer(FAILED, target)
        scheme, host, port, head = target
        if not host_allowed(host, self.settings.allowed_hosts):
            return Answer(FAILED, f"host {host!r} is not allowed")
        request = b"%s%d\r\n%s\r\n%s" % (head, len(body), headers, body)
        return await self._post((scheme, host, port), request)

    def close(self) -> None:
        """Drop the idle connections."""
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    async def _post(self, key: tuple[str, str, int], request: bytes) -> Answer:
        scheme, host, port = key
        for _ in range(2):
            idle = self._idle.get(key)
            conn = idle.pop() if idle else None
            reused = conn is not None
            try:
                if conn is None:
                    conn = await self._connect(scheme, host, port)
                status, reason, headers, keep, excerpt = await self._exchange(conn, request, reused)
            except _StaleConnection:
                conn.close()  # type: ignore[union-attr]
                continue  # the server closed an idle keep-alive connection: not the callback's fault
            except RefusedTarget:
                refused = f"host {host!r} resolves to no allowed address (loopback, private, link-local...)"
                return Answer(FAILED, refused)
            except CallError as exc:
                if conn is not None:
                    conn.close()
                return Answer(RETRY, str(exc))
            except (OSError, ValueError) as exc:
                if conn is not None:
                    conn.close()
                return Answer(RETRY, _general(exc))
            except BaseException:  # the deadline passed (cancelled), or the pool is closing
                if conn is not None:
                    conn.close()
                raise
            if keep:
                self._idle.setdefault(key, []).append(conn)
            else:
                conn.close()
            text = sanitize(excerpt.decode("utf-8", "replace"), RESPONSE_EXCERPT_BYTES) if excerpt else None
            if any(name in headers for name in _REJECT_HEADERS_LOWER):
                return Answer(REJECTED, f"HTTP {status} with a reject header", status, text)
            if 200 <= status < 300:
                return Answer(NOTIFIED, None, status, text)
            return Answer(RETRY, f"HTTP {status} {reason}".strip(), status, text)
        return Answer(RETRY, "connection closed by the server")

    async def _connect(self, scheme: str, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise CallError("could not resolve the host") from None
        allowed = allowed_resolutions(infos, self.settings.allowed_hosts)
        if not allowed:
            raise RefusedTarget
        for family, kind, proto, _, address in allowed:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
            except OSError:
                sock.close()
                continue
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = scheme == "https"
            try:
                reader, writer = await asyncio.open_connection(
                    sock=sock,
                    limit=MAX_HEADER_BYTES,
                    ssl=self._tls if tls else None,
                    server_hostname=host if tls else None,
                )
            except OSError:  # ssl.SSLError included
                sock.close()
                raise CallError("TLS handshake failed") from None
            except BaseException:
                sock.close()
                raise
            return _Connection(reader, writer)
        raise CallError("could not connect (refused, unreachable or timed out)")

    async def _exchange(
        self, conn: _Connection, request: bytes, reused: bool
    ) -> tuple[int, str, dict[str, str], bool, bytes]:
        """Send ``request``, read the answer: its status, reason, headers, whether the connection can be reused, and
        the first ``RESPONSE_EXCERPT_BYTES`` of its body."""
        reader, writer = conn.reader, conn.writer
        limit = self.settings.max_response_bytes
        try:
            writer.write(request)
            await writer.drain()
            data = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if reused and not exc.partial:
                raise _StaleConnection from None
            raise CallError("connection closed before a response") from None
        except asyncio.LimitOverrunError:
            raise CallError("response headers too long") from None
        except (BrokenPipeError, ConnectionResetError):
            if reused:
                raise _StaleConnection from None
            raise CallError("connection reset") from None
        head = data[:-4].decode("latin-1")
        status_line, _, header_text = head.partition("\r\n")
        fields = status_line.split(" ", 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
            raise CallError("invalid HTTP response")
        status = int(fields[1])
        reason = fields[2][:100] if len(fields) > 2 else ""
        headers: dict[str, str] = {}
        for line in header_text.split("\r\n"):
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        keep = fields[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if status < 200 or status in (204, 304):
            return status, reason, headers, keep, b""  # no body (1xx is not expected for a POST without Expect)
        excerpt = bytearray()
        try:
            if "chunked" in headers.get("transfer-encoding", "").lower():
                keep = await self._read_chunked(reader, limit, excerpt) and keep
            elif "content-length" in headers:
                length = int(headers["content-length"])
                if length < 0:
                    raise CallError("invalid HTTP response")
                if length > limit:  # not read past the limit: the connection is dropped
                    return status, reason, headers, False, b""
                excerpt += (await reader.readexactly(length))[:RESPONSE_EXCERPT_BYTES]
            else:  # read to the end of the connection, up to the limit
                total = 0
                while total <= limit:
                    chunk = await reader.read(65536)
                    if not chunk:
                        break
                    if total < RESPONSE_EXCERPT_BYTES:
                        excerpt += chunk[: RESPONSE_EXCERPT_BYTES - total]
                    total += len(chunk)
                keep = False
        except asyncio.IncompleteReadError:
            raise CallError("connection closed in the response body") from None
        except (ValueError, asyncio.LimitOverrunError):
            raise CallError("invalid HTTP response") from None
        return status, reason, headers, keep, bytes(excerpt)

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader, limit: int, excerpt: bytearray) -> bool:
        """Read a chunked body up to ``limit`` bytes, its first bytes into ``excerpt``; True if it ended cleanly
        (connection reusable)."""
        total = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line[:-2].split(b";")[0].strip() or b"x", 16)
            total += size
            if total > limit:
                return False
            data = await reader.readexactly(size + 2)
            end = data[-2:]
            if len(excerpt) < RESPONSE_EXCERPT_BYTES:
                excerpt += data[: min(size, RESPONSE_EXCERPT_BYTES - len(excerpt))]
            if size == 0:
                return end == b"\r\n"  # trailers are not expected: with them the connection is not reused
            if end != b"\r\n":
                raise CallError("invalid HTTP response")


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, str, int, bytes] | str:
    """(scheme, host, port, request head up to the Content-Length value) of a URL, or why it cannot be called."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return "invalid port"
    host = parts.hostname
    if not host or parts.scheme not in ("http", "https"):
        return f"host {host!r} is not allowed"
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host_header = host if ":" not in host else f"[{host}]"
    if parts.port is not None:
        host_header += f":{parts.port}"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: cmb-dagster-callbacks\r\n"
        "Content-Type: application/json\r\nContent-Length: "
    ).encode("latin-1", "replace")
    return parts.scheme, host, port, head


def target_host(url: str) -> str | None:
    """The host an HTTP(S) callback URL calls (None: another URL, e.g. ``dagster://``)."""
    target = _target(url)
    return None if isinstance(target, str) else target[1]


class _StaleConnection(Exception):
    """A kept-alive connection the server had closed: retry on a new one."""


def _general(exc: BaseException) -> str:
    """An error in general terms: last_error must not tell a reader which ports are open where."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return "TLS error"
    if isinstance(exc, ConnectionError):
        return "connection failed"
    if isinstance(exc, ValueError):
        return "invalid HTTP response"
    return "network error"


class DeliveryPool:
    """Calls due deliveries, let through the worker's gate, on an executor of user code, with fast retries.

    The calls run on a :class:`~cmb_dagster.executor.Executor` of ``worker_concurrency`` slots: HTTP calls on its event
    loop, cancelled at their deadline (``timeout``), ``dagster://`` launches in its threads. On the same loop, a
    dispatcher waits for the earliest due delivery and for the executor's free slots, passes as many due
    deliveries as there are free slots through the gate (one transaction), highest priority first, then earliest
    due, and starts the calls of those let through; while the gate waits for the database, the calls go on.
    Those waiting for a slot or a token of their limits are parked until a call under the same limits ends here,
    or until the time the gate gave (``SLOT_RECHECK`` for slots held elsewhere, the next token,
    ``PARKED_RECHECK`` at the latest). A delivery is held (its executor slot, its limits' slot, its outcome) until
    its call has really ended, a launch past its deadline too; a fast retry then goes back to the heap and
    through the gate again.
    """

    def __init__(
        self,
        settings: CallbackSettings,
        launcher: JobLauncher | None = None,
        gate: Gate | None = None,
        on_broken: Callable[[BaseException], None] | None = None,
        on_answer: Callable[[Delivery, Answer], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_answer = on_answer  # told of every answer of an endpoint (not of a call refused by the settings)
        self.sender = HttpSender(settings)
        self.launcher = launcher
        self.gate = gate
        self.on_broken = on_broken  # told if the dispatcher ends by an error: no delivery would be called after it
        self.broken: BaseException | None = None
        self._heap: list[tuple[float, int, Delivery]] = []  # by due time
        self._ready: list[tuple[int, float, int, Delivery]] = []  # due: by priority, then due time
        self._parked: dict[FlowKey, list[tuple[int, float, int, Delivery]]] = {}  # waiting for a slot or a token
        self._parked_count = 0
        self._recheck_at = math.inf  # when the parked deliveries ask the gate again
        self._cond = threading.Condition()  # guards the heap and the counters; close() waits on it
        self._gating = 0
        self._running = 0  # calls started whose end is not settled yet
        self._closed = False
        self._wake_at = -math.inf  # a submit due before this wakes the dispatcher (-inf: it is not asleep)
        self._wake = asyncio.Event()
        self._executor = Executor("callbacks", settings.worker_concurrency, on_end=self._settle_ended)
        self._loop = self._executor.loop
        self._loop_thread: int | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._loop.call_soon_threadsafe(self._start_dispatcher)

    def submit(self, delivery: Delivery) -> None:
        """Call ``delivery`` at its due time; its ``on_done`` runs when it has an outcome."""
        with self._cond:
            heapq.heappush(self._heap, (delivery.due, delivery._seq, delivery))
            wake = delivery.due < self._wake_at
            if wake:
                self._wake_at = -math.inf  # one wake-up is enough
        if wake:
            self._wake_dispatcher()

    def abandon_waiting(self) -> None:
        """Give every delivery not started yet back as abandoned (the worker is stopping)."""
        with self._cond:
            waiting = [entry[-1] for entry in (*self._heap, *self._ready)]
            waiting += [entry[-1] for parked in self._parked.values() for entry in parked]
            self._heap, self._ready, self._parked, self._parked_count = [], [], {}, 0
        for delivery in waiting:
            self._give_back(delivery)

    def _give_back(self, delivery: Delivery) -> None:
        """Not called now: abandoned if never called (polled again), else a main retry by its policy."""
        if delivery.tries == 0:
            self._finish(delivery, ABANDONED, None)
            return
        delivery.retry_delay = delivery.retry.main_retry_delay(delivery.main_retries)
        self._finish(delivery, RETRY, delivery.error)

    @property
    def busy(self) -> int:
        """Deliveries waiting, being gated or being called."""
        with self._cond:
            return len(self._heap) + len(self._ready) + self._parked_count + self._gating + self._running

    def check(self) -> None:
        """Raise :class:`~cmb_dagster.isolation.WorkerStuck` when every call slot is held by a launch running
        past twice its deadline (the process is to be restarted)."""
        self._executor.check()

    def close(self, timeout: float = 30.0) -> None:
        """Abandon waiting deliveries, let the gate and running calls end (up to ``timeout``), then stop the
        dispatcher and the executor: calls still running on its loop are cancelled and given back."""
        self.abandon_waiting()
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
        self._wake_dispatcher()
        with self._cond:
            while (self._running or self._gating) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
        try:
            stopped = asyncio.run_coroutine_threadsafe(self._stop_dispatcher(), self._loop)
            stopped.result(max(MIN_SHUTDOWN, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - the loop is stopped next anyway
            log.warning("callback dispatcher did not stop cleanly (%s)", type(exc).__name__)
        finally:
            self._executor.close()

    def _wake_dispatcher(self) -> None:
        """Wake the dispatcher, from any thread."""
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: no dispatcher to wake
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- the dispatcher, on the executor's event loop -------------------------------------------------

    def _start_dispatcher(self) -> None:
        self._loop_thread = threading.get_ident()
        self._dispatcher = self._loop.create_task(self._dispatch())
        self._dispatcher.add_done_callback(self._dispatcher_ended)

    async def _stop_dispatcher(self) -> None:
        """End the dispatcher, drop the idle connections and close the gate's connection."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        self.sender.close()
        if self.gate is not None:
            await self.gate.close()

    def _dispatcher_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.broken = task.exception()
        with self._cond:  # the deliveries it was passing through the gate are left to the buckets' next holder
            self._gating = 0
            self._cond.notify_all()
        log.error("callback dispatcher stopped by an error; no more calls start", exc_info=self.broken)
        if self.on_broken is not None:
            self.on_broken(self.broken)

    async def _dispatch(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                if now >= self._recheck_at:
                    self._recheck_at = math.inf
                    for key in list(self._parked):
                        self._unpark(key)
                while self._heap and self._heap[0][0] <= now:
                    _, seq, delivery = heapq.heappop(self._heap)
                    heapq.heappush(self._ready, (-delivery.priority, delivery.due, seq, delivery))
                free = self._executor.free  # only this dispatcher starts calls: slots only free up meanwhile
                due: list[Delivery] = []
                while self._ready and len(due) < free:
                    due.append(heapq.heappop(self._ready)[3])
                self._gating += len(due)
                if not due:  # asleep until the earliest is due, or a slot frees (a call's end wakes it)
                    self._wake.clear()
                    self._wake_at = -math.inf if free == 0 else self._heap[0][0] if self._heap else math.inf
                    wake_at = min(self._wake_at, self._recheck_at)
                    timeout = wake_at - now if wake_at < math.inf and free else None
            if not due:
                try:
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                with self._cond:
                    self._wake_at = -math.inf
                continue
            later, waiting, wait = await self._pass_gate(due)
            with self._cond:
                self._gating -= len(due)
                for delivery in later:  # not due yet by the database's clock (clocks drift a little)
                    delivery.due = time.monotonic() + 0.005
                    heapq.heappush(self._heap, (delivery.due, delivery._seq, delivery))
                for delivery in waiting:
                    parked = self._parked.setdefault(delivery.flow, [])  # type: ignore[arg-type]
                    heapq.heappush(parked, (-delivery.priority, delivery.due, delivery._seq, delivery))
                self._parked_count += len(waiting)
                if waiting:
                    recheck = PARKED_RECHECK if wait is None else max(wait, 0.001)
                    self._recheck_at = min(self._recheck_at, time.monotonic() + recheck)
                if self._closed:
                    self._cond.notify_all()

    def _unpark(self, key: FlowKey | None, count: float = math.inf) -> None:
        """The first ``count`` deliveries waiting for a slot of ``key``, ready again (under ``_cond``)."""
        parked = self._parked.get(key)  # type: ignore[arg-type]
        while parked and count > 0:
            heapq.heappush(self._ready, heapq.heappop(parked))
            self._parked_count -= 1
            count -= 1
        if not parked:
            self._parked.pop(key, None)  # type: ignore[arg-type]

    def _free_slot(self, delivery: Delivery) -> None:
        """``delivery``'s slot back to the worker; the deliveries waiting for one of its key ready again."""
        if delivery.slot is None or self.gate is None:
            return
        self.gate.free(delivery)
        delivery.slot = None
        with self._cond:
            self._unpark(delivery.flow, 1)

    def _start(self, go: list[Delivery]) -> None:
        """Start the calls of ``go`` on the executor (each in a slot the dispatcher counted as free)."""
        with self._cond:
            self._running += len(go)
        for delivery in go:
            launch = self.launcher is not None and dagster_job_name(delivery.cb_url) is not None
            self._executor.start(delivery, self._launch if launch else self._post, self.settings.timeout)

    async def _pass_gate(self, due: list[Delivery]) -> tuple[list[Delivery], list[Delivery], float | None]:
        """Start what the gate lets through; return those not due yet, those waiting for a slot or a token, and
        the seconds after which to ask again for those (None: when a slot frees here).

        The others are finished here: gone, or given back.
        """
        now = time.monotonic()
        ready = []
        for delivery in due:
            if now + self.settings.timeout >= delivery.lease_deadline():
                self._give_back(delivery)  # the lease could lapse during the call: leave it to the next holder
            else:
                ready.append(delivery)
        if not ready:
            return [], [], None
        if self.gate is None:
            self._start(ready)
            return [], [], None
        started: list[Delivery] = []

        def start(go: list[Delivery]) -> None:
            started.extend(go)
            self._start(go)

        try:
            gone, waiting, wait = await self.gate(ready, start)
        except Exception as exc:  # noqa: BLE001 - the database or the lease is gone: give the others back
            log.warning("callback gate failed (%s); calls given back", type(exc).__name__)
            begun = {id(d) for d in started}
            for delivery in ready:
                if id(delivery) not in begun:
                    self._free_slot(delivery)
                    self._give_back(delivery)
            return [], [], None
        for delivery in gone:
            self._free_slot(delivery)
            self._finish(delivery, GONE, None)
        settled = {id(d) for d in (*started, *gone, *waiting)}
        later = [d for d in ready if id(d) not in settled]
        for delivery in later:
            self._free_slot(delivery)
        return later, waiting, wait

    # -- the calls, on the executor -------------------------------------------------------------------

    async def _post(self, delivery: Delivery) -> Answer | None:
        """The HTTP call of ``delivery``, on the executor's loop (None: not called; a ``dagster://`` event here has
        no launcher, and is retried)."""
        if time.monotonic() >= delivery.lease_deadline():  # stopped or stalled since the gate: not called
            return None
        delivery.tries += 1
        if dagster_job_name(delivery.cb_url) is not None:
            return Answer(RETRY, "dagster:// callbacks need a worker with a Dagster launcher (the Dagster worker job)")
        body = delivery.body()
        message_id = delivery.message_id or delivery.event_id
        headers = signature_headers(message_id, int(time.time()), body, delivery.secrets)
        return await self.sender.post(delivery.cb_url, body, headers)

    def _launch(self, delivery: Delivery) -> Answer | None:
        """Start the Dagster run of a ``dagster://`` event, in a thread of the executor (None: not called)."""
        job_name = dagster_job_name(delivery.cb_url)
        assert self.launcher is not None and job_name is not None
        if time.monotonic() >= delivery.lease_deadline():  # stopped or stalled since the gate: not launched
            return None
        delivery.tries += 1
        context = json.loads(delivery.context_json or "null")
        context = context if isinstance(context, dict) else {}
        tags = {str(k): str(v) for k, v in (context.get("tags") or {}).items()}
        key = f"{delivery.owner_client_id}/{delivery.group_key}/{delivery.event_key}"
        tags.update({CALLBACK_TAG: key, LAUNCHED_BY_TAG: f"cmb callback {key}"[:MAX_TAG_VALUE]})
        try:
            self.launcher.launch(
                job_name,
                run_key=f"cmb-callback-{delivery.event_id}",
                run_config=context.get("run_config") or {},
                tags=tags,
            )
        except (LookupError, ValueError) as exc:
            return Answer(FAILED, f"no run of Dagster job {job_name!r}: {describe_error(exc)}")
        except Exception as exc:  # noqa: BLE001 - any launch failure is retried by the policy
            return Answer(RETRY, f"Dagster launch failed: {describe_error(exc)}")
        return Answer(NOTIFIED, None)

    def _settle_ended(self) -> None:
        """Settle the calls that ended (the executor's ``on_end``, on the thread or loop where a call ended)."""
        for task in self._executor.ended():
            self._settle(task)

    def _settle(self, task: Task[Delivery]) -> None:
        """The outcome of a call that has ended: finished, a fast retry (back to the heap), or given back."""
        delivery = task.item
        try:
            try:
                answer = task.outcome
            except TimedOut:  # cancelled at its deadline, or a launch that ended past it
                answer = Answer(RETRY, "timed out")
            if answer is None:
                self._give_back(delivery)
                return
            outcome, error, delivery.status_code, delivery.response = answer
            if delivery.endpoint is not None and outcome in (NOTIFIED, REJECTED, RETRY) and self.on_answer is not None:
                self.on_answer(delivery, answer)  # every call counts for its endpoint's circuit breaker
            if outcome != RETRY:
                self._finish(delivery, outcome, error)
                return
            delivery.error = error
            if delivery.probe is not None:
                self._finish(delivery, HELD, error)
                return
            if delivery.tries <= delivery.retry.fast_retries and not self._closed:
                # a fast retry: back to the heap, and through the gate again
                delivery.due = time.monotonic() + self.settings.backoff.delay(delivery.tries - 1)
                with self._cond:
                    heapq.heappush(self._heap, (delivery.due, delivery._seq, delivery))
                return
            delivery.retry_delay = delivery.retry.main_retry_delay(delivery.main_retries)
            self._finish(delivery, RETRY, error)
        except asyncio.CancelledError:  # the pool closed before the call ended
            self._give_back(delivery)
        except Exception as exc:  # our own bug: this event backs off, the others go on
            log.exception("callback %s crashed", delivery.event_id)
            try:
                delay = max(INTERNAL_ERROR_DELAY, delivery.retry.main_retry_delay(delivery.main_retries))
            except Exception:  # noqa: BLE001
                delay = INTERNAL_ERROR_DELAY
            delivery.retry_delay = delay
            self._finish(delivery, RETRY, f"internal error: {type(exc).__name__}")
        finally:
            self._free_slot(delivery)
            with self._cond:
                self._running -= 1
                if self._closed:
                    self._cond.notify_all()
            self._wake_dispatcher()  # a free slot (and maybe a fast retry) for the dispatcher

    def _finish(self, delivery: Delivery, outcome: str, error: str | None) -> None:
        """Record ``outcome`` and hand ``delivery`` back; ``error`` may quote the target or the launcher, so it
        is sanitised before it is stored or logged."""
        self._free_slot(delivery)  # before the outcome is handed back: the write of the outcome releases it
        delivery.outcome = outcome
        delivery.error = None if error is None else sanitize(error)
        delivery.finished = time.monotonic()
        delivery.on_done(delivery)
