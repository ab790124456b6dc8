"""Stopping the worker processes a test started."""

from __future__ import annotations

import signal
import subprocess


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each live process, wait for it (20 s at most), then kill what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
