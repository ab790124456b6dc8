"""Calling events back: HTTP POSTs over reused connections, Dagster launches, fast retries, due-time waits.

The HTTP client is a small HTTP/1.1 one on plain sockets, one keep-alive connection per thread and
target: CPU per call is what limits a worker, and it gives the two limits a callback needs: a deadline
for the whole call (connect, send, every read), and a cap on the response bytes read. It connects only to
addresses the settings allow, checked on the address actually connected to (after name resolution).

Calls run on a fixed pool of threads. A dispatcher takes due deliveries in due order, as many as there
are idle threads, and passes them through the worker's *gate* first: one transaction that re-checks,
under row locks, that each event is still pending in the version polled (cancel, update and delete wait
for that lock) and counts the call in ``attempts``. Only what the gate let through is called; every
fast retry passes the gate again. So once cancel, update or delete has returned, no call of the old
version starts.
"""

from __future__ import annotations

import functools
import heapq
import ipaddress
import itertools
import json
import logging
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import urlsplit

from cmb_dagster.callbacks.models import CallbackSettings, RetryPolicy, dagster_job_name

log = logging.getLogger("cmb_dagster.callbacks")

REJECT_HEADERS = ("X-Ya-CallMeBack-Notify-Reject", "X-CallMeBack-Notify-Reject")

NOTIFIED = "notified"
REJECTED = "rejected"
FAILED = "failed"  # permanent: retrying cannot help (host not allowed, unknown job)
RETRY = "retry"  # main retry: reschedule in the database
ABANDONED = "abandoned"  # not called: the lease could lapse first, or the worker is stopping
GONE = "gone"  # not called: cancelled, updated or deleted since it was polled (nothing to write)
MAX_HEADER_BYTES = 16 * 1024
INTERNAL_ERROR_DELAY = 5.0  # seconds: at least this long before an event that hit one of our bugs is retried

# A gate: given due deliveries and ``start``, count in one transaction those still to be called, pass them
# to ``start`` before that transaction commits, and return those that are gone; the rest are not due yet by
# the database's clock.
Gate = Callable[[list["Delivery"], Callable[[list["Delivery"]], None]], list["Delivery"]]


class JobLauncher(Protocol):
    """Starts a Dagster run for a ``dagster://<job>`` event; the Dagster shell provides it.

    ``run_key`` identifies the event: launching twice with one key must start one run only.
    Raise ``LookupError`` for a job that does not exist (the event fails without retries).
    """

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str: ...


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
    context: Any
    retry: RetryPolicy
    attempts: int
    main_retries: int
    due: float  # time.monotonic() at which run_at arrives, by the database's clock
    lease_deadline: Callable[[], float]  # monotonic time after which this worker may no longer hold the bucket
    on_done: Callable[[Delivery], None]
    outcome: str | None = None
    tries: int = 0
    error: str | None = None
    retry_delay: float = 0.0
    finished: float = 0.0
    _seq: int = field(default_factory=itertools.count().__next__)

    @property
    def position(self) -> tuple[datetime, int]:
        """The event's place in the poller's (run_at, event_id) order."""
        return (self.run_at, self.event_id)

    def body(self) -> bytes:
        """The JSON the callback receives."""
        return json.dumps(
            {
                "event_id": self.event_id,
                "owner_client_id": self.owner_client_id,
                "group_key": self.group_key,
                "event_key": self.event_key,
                "run_at": self.run_at.isoformat(),
                "originally_run_at": self.originally_run_at.isoformat(),
                "context": self.context,
                "attempt": self.attempts + self.tries,  # this call, counted from 1
            },
            separators=(",", ":"),
        ).encode()


class CallError(Exception):
    """A call that failed in a way retrying may cure (its message is safe to store in last_error)."""


class RefusedTarget(Exception):
    """The target resolves to no address the settings allow."""


class _Connection:
    """One keep-alive connection to a target, its socket and what is left unread in its buffer."""

    __slots__ = ("sock", "calls")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls = 0

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class HttpSender:
    """POSTs JSON over HTTP/1.1, keeping one connection per (thread, scheme, host, port) alive between calls."""

    def __init__(self, settings: CallbackSettings) -> None:
        self.settings = settings
        self._local = threading.local()
        self._tls = ssl.create_default_context()

    def post(self, url: str, body: bytes) -> tuple[str, str | None]:
        """Return (outcome, error): notified on 2xx, rejected on a reject header, retry otherwise."""
        deadline = time.monotonic() + self.settings.timeout
        target = _target(url)
        if isinstance(target, str):
            return FAILED, target
        scheme, host, port, head = target
        if not self.settings.host_allowed(host):
            return FAILED, f"host {host!r} is not allowed"
        request = b"%s%d\r\n\r\n%s" % (head, len(body), body)
        key = (scheme, host, port)
        conns = self._local.__dict__.setdefault("conns", {})
        for _ in range(2):
            conn = conns.pop(key, None)
            reused = conn is not None
            try:
                if conn is None:
                    conn = self._connect(scheme, host, port, deadline)
                status, reason, headers, keep = self._exchange(conn, request, deadline, reused)
            except _StaleConnection:
                conn.close()  # type: ignore[union-attr]
                continue  # the server closed an idle keep-alive connection: not the callback's fault
            except RefusedTarget:
                return FAILED, f"host {host!r} resolves to no allowed address (loopback, private, link-local...)"
            except CallError as exc:
                if conn is not None:
                    conn.close()
                return RETRY, str(exc)
            except (OSError, ValueError) as exc:
                if conn is not None:
                    conn.close()
                return RETRY, _general(exc)
            if keep:
                conns[key] = conn
            else:
                conn.close()
            if any(h.lower() in headers for h in REJECT_HEADERS):
                return REJECTED, f"HTTP {status} with a reject header"
            if 200 <= status < 300:
                return NOTIFIED, None
            return RETRY, f"HTTP {status} {reason}".strip()
        return RETRY, "connection closed by the server"

    def close(self) -> None:
        """Close this thread's connections."""
        for conn in self._local.__dict__.pop("conns", {}).values():
            conn.close()

    def _connect(self, scheme: str, host: str, port: int, deadline: float) -> _Connection:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise CallError("could not resolve the host") from None
        allowed = [i for i in infos if self.settings.address_allowed(ipaddress.ip_address(i[4][0].split("%")[0]))]
        if not allowed:
            raise RefusedTarget
        sock = None
        for family, kind, proto, _, address in allowed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(remaining)
                sock.connect(address)
                break
            except OSError:
                sock.close()
                sock = None
        if sock is None:
            raise CallError("could not connect (refused, unreachable or timed out)")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock = self._tls.wrap_socket(sock, server_hostname=host)
            except (OSError, ssl.SSLError):
                sock.close()
                raise CallError("TLS handshake failed") from None
        return _Connection(sock)

    def _exchange(
        self, conn: _Connection, request: bytes, deadline: float, reused: bool
    ) -> tuple[int, str, dict[str, str], bool]:
        sock = conn.sock
        limit = self.settings.max_response_bytes

        def timeout() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CallError("timed out")
            return remaining

        try:
            sock.settimeout(timeout())
            sock.sendall(request)
            data = bytearray()
            while True:
                end = data.find(b"\r\n\r\n")
                if end >= 0:
                    break
                if len(data) > MAX_HEADER_BYTES:
                    raise CallError("response headers too long")
                sock.settimeout(timeout())
                chunk = sock.recv(65536)
                if not chunk:
                    if reused and not data:
                        raise _StaleConnection
                    raise CallError("connection closed before a response")
                data += chunk
        except (BrokenPipeError, ConnectionResetError):
            if reused and not conn.calls:
                raise _StaleConnection from None
            if reused:
                raise _StaleConnection from None
            raise CallError("connection reset") from None
        except TimeoutError:
            raise CallError("timed out") from None
        conn.calls += 1
        head = bytes(data[:end]).decode("latin-1")
        rest = data[end + 4 :]
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
            return status, reason, headers, keep  # no body (1xx is not expected for a POST without Expect)
        try:
            if "chunked" in headers.get("transfer-encoding", "").lower():
                keep = self._read_chunked(sock, rest, limit, timeout) and keep
            elif "content-length" in headers:
                length = int(headers["content-length"])
                if length < 0:
                    raise CallError("invalid HTTP response")
                if length > limit:
                    return status, reason, headers, False  # not read past the limit: the connection is dropped
                while len(rest) < length:
                    sock.settimeout(timeout())
                    chunk = sock.recv(min(65536, length - len(rest)))
                    if not chunk:
                        raise CallError("connection closed in the response body")
                    rest += chunk
                keep = keep and len(rest) == length
            else:  # read to the end of the connection, up to the limit
                while len(rest) <= limit:
                    sock.settimeout(timeout())
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    rest += chunk
                keep = False
        except TimeoutError:
            raise CallError("timed out") from None
        except ValueError:
            raise CallError("invalid HTTP response") from None
        return status, reason, headers, keep

    @staticmethod
    def _read_chunked(sock: socket.socket, data: bytearray, limit: int, timeout: Callable[[], float]) -> bool:
        """Read a chunked body up to ``limit`` bytes; True if it ended cleanly (connection reusable)."""
        total = 0
        while True:
            while b"\r\n" not in data:
                if len(data) > 1024:
                    raise CallError("invalid HTTP response")
                sock.settimeout(timeout())
                chunk = sock.recv(65536)
                if not chunk:
                    raise CallError("connection closed in the response body")
                data += chunk
            line, _, rest = bytes(data).partition(b"\r\n")
            size = int(line.split(b";")[0].strip() or b"x", 16)
            total += size
            if total > limit:
                return False
            need = size + 2
            data = bytearray(rest)
            while len(data) < need:
                sock.settimeout(timeout())
                chunk = sock.recv(65536)
                if not chunk:
                    raise CallError("connection closed in the response body")
                data += chunk
            data = data[need:]
            if size == 0:
                return not data  # trailers are not expected; anything left makes the connection unusable


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
    head = (f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: cmb-dagster-callbacks\r\n"
            "Content-Type: application/json\r\nContent-Length: ").encode("latin-1", "replace")
    return parts.scheme, host, port, head


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
    """Threads that call due deliveries, let through the worker's gate in due order, with fast retries.

    One dispatcher thread waits for the earliest due delivery and for idle threads, passes as many due
    deliveries as there are idle threads through the gate (one transaction), and hands the ones let
    through to the threads. A fast retry goes back to the heap and through the gate again.
    """

    def __init__(self, settings: CallbackSettings, launcher: JobLauncher | None = None, gate: Gate | None = None) -> None:
        self.settings = settings
        self.sender = HttpSender(settings)
        self.launcher = launcher
        self.gate = gate
        self._launch_lock = threading.Lock()
        self._heap: list[tuple[float, int, Delivery]] = []
        self._ready: deque[Delivery] = deque()
        self._cond = threading.Condition()  # guards the heap, the dispatcher's state and the counters
        self._work = threading.Condition()  # guards the ready queue
        self._idle = settings.concurrency
        self._gating = 0
        self._running = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._loop, name=f"cmb-callback-{i}", daemon=True) for i in range(settings.concurrency)
        ]
        self._dispatcher = threading.Thread(target=self._dispatch, name="cmb-callback-dispatch", daemon=True)
        for thread in (*self._threads, self._dispatcher):
            thread.start()

    def submit(self, delivery: Delivery) -> None:
        """Call ``delivery`` at its due time; its ``on_done`` runs when it has an outcome."""
        with self._cond:
            heapq.heappush(self._heap, (delivery.due, delivery._seq, delivery))
            self._cond.notify_all()

    def abandon_waiting(self) -> None:
        """Give every delivery not started yet back as abandoned (the worker is stopping)."""
        with self._cond:
            waiting, self._heap = self._heap, []
        for _, _, delivery in waiting:
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
            return len(self._heap) + self._gating + self._running

    def close(self, timeout: float = 30.0) -> None:
        """Abandon waiting deliveries, let running calls end, stop the threads."""
        self.abandon_waiting()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with self._work:
            self._work.notify_all()
        deadline = time.monotonic() + timeout
        for thread in (self._dispatcher, *self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the dispatcher ------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._heap and self._idle > 0:
                        wait = self._heap[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                now = time.monotonic()
                due: list[Delivery] = []
                while self._heap and self._heap[0][0] <= now and len(due) < self._idle:
                    due.append(heapq.heappop(self._heap)[2])
                self._gating += len(due)
                self._idle -= len(due)
            started, later = self._pass_gate(due)
            with self._cond:
                self._gating -= len(due)
                self._idle += len(due) - started
                for delivery in later:  # not due yet by the database's clock (clocks drift a little)
                    delivery.due = time.monotonic() + 0.005
                    heapq.heappush(self._heap, (delivery.due, delivery._seq, delivery))

    def _start(self, go: list[Delivery]) -> None:
        with self._cond:
            self._running += len(go)
        with self._work:
            self._ready.extend(go)
            self._work.notify(len(go))

    def _pass_gate(self, due: list[Delivery]) -> tuple[int, list[Delivery]]:
        """Start what the gate lets through; return (how many started, those not due yet).

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
            return 0, []
        if self.gate is None:
            self._start(ready)
            return len(ready), []
        started: list[Delivery] = []

        def start(go: list[Delivery]) -> None:
            started.extend(go)
            self._start(go)

        try:
            gone = self.gate(ready, start)
        except Exception as exc:  # noqa: BLE001 - the database or the lease is gone: give the others back
            log.warning("callback gate failed (%s); calls given back", type(exc).__name__)
            begun = {id(d) for d in started}
            for delivery in ready:
                if id(delivery) not in begun:
                    self._give_back(delivery)
            return len(started), []
        for delivery in gone:
            self._finish(delivery, GONE, None)
        settled = {id(d) for d in started} | {id(d) for d in gone}
        return len(started), [d for d in ready if id(d) not in settled]

    # -- the callers ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._work:
                while not self._ready:
                    if self._closed:
                        self.sender.close()
                        return
                    self._work.wait(1.0)
                delivery = self._ready.popleft()
            try:
                self._call(delivery)
            except Exception as exc:  # noqa: BLE001 - our own bug: this event backs off, the others go on
                log.exception("callback %s crashed", delivery.event_id)
                try:
                    delay = max(INTERNAL_ERROR_DELAY, delivery.retry.main_retry_delay(delivery.main_retries))
                except Exception:  # noqa: BLE001
                    delay = INTERNAL_ERROR_DELAY
                delivery.retry_delay = delay
                self._finish(delivery, RETRY, f"internal error: {type(exc).__name__}")
            finally:
                with self._cond:
                    self._running -= 1
                    self._idle += 1
                    self._cond.notify_all()

    def _call(self, delivery: Delivery) -> None:
        delivery.tries += 1
        outcome, error = self._attempt(delivery)
        if outcome != RETRY:
            self._finish(delivery, outcome, error)
            return
        delivery.error = error
        if delivery.tries <= delivery.retry.fast_retries and not self._closed:
            # a fast retry: back to the heap, and through the gate again
            delivery.due = time.monotonic() + self.settings.fast_retry_pause * 2 ** (delivery.tries - 1)
            with self._cond:
                heapq.heappush(self._heap, (delivery.due, delivery._seq, delivery))
                self._cond.notify_all()
            return
        delivery.retry_delay = delivery.retry.main_retry_delay(delivery.main_retries)
        self._finish(delivery, RETRY, error)

    def _attempt(self, delivery: Delivery) -> tuple[str, str | None]:
        job_name = dagster_job_name(delivery.cb_url)
        if job_name is None:
            return self.sender.post(delivery.cb_url, delivery.body())
        if self.launcher is None:
            return RETRY, "dagster:// callbacks need a worker with a Dagster launcher (the Dagster worker job)"
        context = delivery.context if isinstance(delivery.context, dict) else {}
        tags = {str(k): str(v) for k, v in (context.get("tags") or {}).items()}
        tags.update({"cmb/callback": f"{delivery.owner_client_id}/{delivery.group_key}/{delivery.event_key}"})
        try:
            with self._launch_lock:
                self.launcher.launch(
                    job_name,
                    run_key=f"cmb-callback-{delivery.event_id}",
                    run_config=context.get("run_config") or {},
                    tags=tags,
                )
        except LookupError as exc:
            return FAILED, f"no Dagster job {job_name!r}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any launch failure is retried by the policy
            return RETRY, f"Dagster launch failed: {type(exc).__name__}: {exc}"
        return NOTIFIED, None

    def _finish(self, delivery: Delivery, outcome: str, error: str | None) -> None:
        delivery.outcome = outcome
        delivery.error = error
        delivery.finished = time.monotonic()
        delivery.on_done(delivery)
