"""Calling targets: private addresses closed by default, the address connected to checked, and the HTTP client's
deadline, response limit and connection reuse."""

import asyncio
import socket
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from running import Running
from test_callbacks_guarantees import LOCAL
from test_callbacks_guarantees import worker as worker  # a fixture
from waiting import wait_until

from cmb_dagster.callbacks import (
    CallbackClient,
    CallbackSettings,
    CallbackWorker,
    InvalidCallbackInput,
    RetryPolicy,
)
from cmb_dagster.callbacks.delivery import HttpSender

# -- private addresses closed by default --------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/cb",
        "http://[::1]/cb",
        "http://169.254.169.254/latest/meta-data",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://localhost:8080/cb",
        "http://10.0.0.5/cb",
        "http://192.168.1.1/cb",
        "http://172.16.0.1/cb",
        "http://[fe80::1]/cb",
        "http://0.0.0.0/cb",
        "http://224.0.0.1/cb",
        "http://[::ffff:127.0.0.1]/cb",
    ],
)
def test_private_targets_are_closed_by_default(db, url, monkeypatch):
    monkeypatch.delenv("CMB_CALLBACK_ALLOWED_HOSTS", raising=False)
    with CallbackClient(db) as client, pytest.raises(InvalidCallbackInput, match="cb_url: host .* is not allowed"):
        client.create("a", "g", "k", datetime.now(UTC), url)


def test_public_targets_are_open_by_default(db, monkeypatch):
    monkeypatch.delenv("CMB_CALLBACK_ALLOWED_HOSTS", raising=False)
    with CallbackClient(db) as client:
        assert client.create("a", "g", "k", datetime.now(UTC) + timedelta(hours=1), "https://api.example.com/cb")
        assert client.create("a", "g", "k2", datetime.now(UTC) + timedelta(hours=1), "http://8.8.8.8/cb")


def test_the_environment_opens_hosts_for_clients_and_workers(db, sink, monkeypatch):
    monkeypatch.setenv("CMB_CALLBACK_ALLOWED_HOSTS", "*, 127.0.0.0/8")
    settings = CallbackSettings(poll_interval=0.2, lease_ttl=3, timeout=1)
    assert settings.allowed_hosts == ("*", "127.0.0.0/8")
    with CallbackClient(db, settings) as client:
        client.create("a", "g", "k", datetime.now(UTC), f"{sink.url}/cb")
        running = Running(CallbackWorker(db, settings))
        try:
            wait_until(lambda: client.get("a", "g", "k").status == "notified")
        finally:
            running.stop()


def test_the_address_connected_to_is_checked_not_the_name(db, sink, worker):
    # 'localhost' is opened by name, its address is not: as a name rebound to 127.0.0.1 would be
    settings = LOCAL.model_copy(update={"allowed_hosts": ("localhost",)})
    with CallbackClient(db, settings) as client:
        client.create("a", "g", "k", datetime.now(UTC), f"http://localhost:{sink.port}/cb")
        worker(settings)
        wait_until(lambda: client.get("a", "g", "k").status == "failed")
        assert "resolves to no allowed address" in client.get("a", "g", "k").last_error
    assert sink.received == []


class RawServer:
    """A TCP server answering every connection with ``respond(server, socket)`` on a thread of its own;
    ``connections`` counts the connections accepted."""

    def __init__(self, respond):
        self.respond = respond
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.sent = 0
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            conn.recv(65536)
            self.respond(self, conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.sock.close()


def drip(server, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(100):
        conn.sendall(b"x")
        time.sleep(0.2)


def flood(server, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")  # no length: to the end of the connection
    chunk = b"x" * 65536
    for _ in range(300 * 16):  # 300 MB
        conn.sendall(chunk)
        server.sent += len(chunk)


def test_the_timeout_is_a_deadline_for_the_whole_call(db, worker):
    dropped = []  # seconds after which the client dropped the dripping answer

    def drip_until_dropped(server, conn):
        started = time.monotonic()
        try:
            drip(server, conn)  # 20 s to send the whole answer
        except OSError:
            dropped.append(time.monotonic() - started)

    server = RawServer(drip_until_dropped)
    try:
        with CallbackClient(db, LOCAL) as client:
            url = f"http://127.0.0.1:{server.port}/cb"
            client.create("a", "g", "k", datetime.now(UTC), url, retry=RetryPolicy.constant(3600, fast_retries=0))
            worker()
            event = wait_until(lambda: (e := client.get("a", "g", "k")).main_retries and e, what="a main retry")
            assert (event.attempts, event.last_error) == (1, "timed out")
            wait_until(lambda: dropped, what="the client dropped the connection")
    finally:
        server.close()


def test_a_response_body_is_not_read_past_the_limit():
    server = RawServer(flood)
    try:
        outcome, *_ = asyncio.run(HttpSender(LOCAL).post(f"http://127.0.0.1:{server.port}/cb", b"{}"))
        assert outcome == "notified"
        time.sleep(0.2)
        assert server.sent < 50 * 2**20  # the client stopped reading: the rest was never sent (socket buffers aside)
    finally:
        server.close()


def keep_alive(response: bytes, per_connection: int | None = None):
    """A RawServer answer: ``response`` to each request on the connection, closed after ``per_connection``
    answers (None: when the client closes it)."""

    def respond(server, conn):
        answered = 0
        while True:
            conn.sendall(response)
            answered += 1
            if answered == per_connection or not conn.recv(65536):  # the next request, head and body in one send
                return

    return respond


def post_twice(port: int, pause: float = 0.0) -> list[tuple[str, str | None]]:
    async def go():
        sender = HttpSender(LOCAL)
        first = await sender.post(f"http://127.0.0.1:{port}/cb", b"{}")
        await asyncio.sleep(pause)
        second = await sender.post(f"http://127.0.0.1:{port}/cb", b"{}")
        sender.close()
        return [first[:2], second[:2]]  # (outcome, error)

    return asyncio.run(go())


def test_a_chunked_response_is_read_whole_and_its_connection_reused():
    server = RawServer(keep_alive(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"))
    try:
        assert post_twice(server.port) == [("notified", None), ("notified", None)]
        assert server.connections == 1
    finally:
        server.close()


def test_a_kept_alive_connection_the_server_closed_is_replaced_and_the_call_succeeds():
    server = RawServer(keep_alive(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", per_connection=1))
    try:
        assert post_twice(server.port, pause=0.1) == [("notified", None), ("notified", None)]
        assert server.connections == 2
    finally:
        server.close()
