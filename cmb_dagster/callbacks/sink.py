"""A local HTTP endpoint that receives callbacks: for the examples, tests and benchmarks.

Every POST is answered 200, except on these paths: ``/reject`` (200 with a reject header), ``/fail``
(500) and ``/slow?ms=N`` (200 after N milliseconds). Each call is kept in ``received``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

from cmb_dagster.callbacks.delivery import REJECT_HEADERS


@dataclass(frozen=True)
class ReceivedCall:
    """One call as the sink saw it: when it arrived and ended (``time.time()``), its path and JSON body."""

    started: float
    ended: float
    path: str
    body: dict[str, Any]


class CallbackSink:
    """An HTTP/1.1 keep-alive server on its own thread and event loop; ``url`` is its address."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, keep: bool = True) -> None:
        self.host = host
        self.port = port
        self.keep = keep
        self.received: list[ReceivedCall] = []
        self.count = 0
        self.on_call: list[Any] = []  # callables(ReceivedCall), e.g. to print
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> CallbackSink:
        """Listen (on a free port when ``port`` is 0) and serve in the background."""
        ready = threading.Event()

        failure: list[OSError] = []

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, self.host, self.port))
            except OSError as exc:  # e.g. the port is taken: reported by start()
                failure.append(exc)
                ready.set()
                return
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="cmb-callback-sink", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Close the server and its connections."""

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        if self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                started = time.time()
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                target = request_line.split(" ")[1]
                length = 0
                for line in header_lines:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                parts = urlsplit(target)
                status, extra = "200 OK", ""
                if parts.path == "/reject":
                    extra = f"{REJECT_HEADERS[0]}: 1\r\n"
                elif parts.path == "/fail":
                    status = "500 Internal Server Error"
                elif parts.path == "/slow":
                    await asyncio.sleep(int(parse_qs(parts.query).get("ms", ["100"])[0]) / 1000)
                call = ReceivedCall(started, time.time(), parts.path, json.loads(body) if body else {})
                self.count += 1
                if self.keep:
                    self.received.append(call)
                for callback in self.on_call:
                    callback(call)
                writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n{extra}\r\n".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
