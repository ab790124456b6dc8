"""A worker process's liveness, for an orchestrator's probe: ``GET /healthz`` answers 200 while every worker loop of
the process turns (``ok``; ``starting`` before the first loop runs), and 503 naming the loops that stalled (a
Kubernetes liveness probe then restarts the process).

The answer does not depend on the database: a worker waiting for Postgres to come back keeps turning and is alive,
so a database outage never makes an orchestrator restart every worker at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# One fixed answer on one path: the standard library's server is enough (prometheus_client's serves only metrics).
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from cmb_dagster.errors import ConfigError

if TYPE_CHECKING:
    from cmb_dagster.metrics import MetricsServer

PATH = "/healthz"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_STALL_AFTER = 600.0
MAX_STALL_AFTER = 86_400.0


def check_stall_after(seconds: float) -> float:
    """``seconds`` if it is a bound a loop may go without turning (1 s to a day), else ConfigError."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 1 <= seconds <= MAX_STALL_AFTER:
        raise ConfigError(f"stall_after: expected 1 to {MAX_STALL_AFTER:.0f} seconds, not {seconds!r}")
    return float(seconds)


def serve_liveness(
    *, host: str = DEFAULT_HOST, port: int = 0, stall_after: float = DEFAULT_STALL_AFTER
) -> MetricsServer:
    """Serve this process's liveness on http://host:port/healthz in a background thread (port 0: any free one).

    A loop is stalled when it has not turned for ``stall_after`` seconds; so is a process in which no worker loop
    has started ``stall_after`` seconds after this call.
    """
    from cmb_dagster.metrics import MetricsServer, check_host, check_port  # every engine: imported once served
    from cmb_dagster.workers import loops_started, stalled_loops

    host, port, stall_after = check_host(host), check_port(port), check_stall_after(stall_after)
    started = time.monotonic()

    def verdict() -> tuple[int, str]:
        stalled = stalled_loops(stall_after, since=started)
        if stalled:
            return 503, "stalled: " + ", ".join(stalled) + "\n"
        return 200, "ok\n" if loops_started() else "starting\n"

    server = ThreadingHTTPServer((host, port), _handler(verdict))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="cmb-liveness", daemon=True)
    thread.start()
    return MetricsServer(host=host, port=server.server_port, server=server, thread=thread, path=PATH)


@contextmanager
def serving_liveness(
    port: int | None, *, host: str = DEFAULT_HOST, stall_after: float = DEFAULT_STALL_AFTER
) -> Iterator[MetricsServer | None]:
    """While the block runs, serve liveness on ``port`` (None: no endpoint)."""
    if port is None:
        yield None
        return
    served = serve_liveness(host=host, port=port, stall_after=stall_after)
    try:
        yield served
    finally:
        served.stop()


def _handler(verdict: Callable[[], tuple[int, str]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, text = verdict() if self.path.split("?")[0] == PATH else (404, f"try {PATH}\n")
            body = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no log line each
            pass

    return Handler
