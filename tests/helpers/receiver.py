"""A webhook receiver on 127.0.0.1 for tests: records each request (path, headers, exact body) and answers as told."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


@dataclass(frozen=True)
class Request:
    """One request as received."""

    at: float
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes


class Receiver:
    """HTTP/1.1 (keep-alive) on a free port; ``answer(request)`` gives (status, body), 200 by default."""

    def __init__(self, answer: Callable[[Request], tuple[int, bytes]] | None = None) -> None:
        self.answer = answer or (lambda request: (200, b"ok"))
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # the name http.server calls
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = Request(time.time(), self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                status, text = receiver.answer(request)
                with receiver._lock:
                    receiver.requests.append(request)
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # a burst of new connections is queued, not refused
            daemon_threads = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def received(self, path: str | None = None) -> list[Request]:
        """The requests so far (to ``path`` only, if given)."""
        with self._lock:
            return [r for r in self.requests if path is None or r.path == path]

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
