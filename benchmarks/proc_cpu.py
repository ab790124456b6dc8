"""CPU seconds of processes and of a local Postgres server, read from Linux /proc (the benchmarks' meters)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal, Self

import psycopg

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[str, list[str]]:
    """The command name and the fields after it of /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 1 :].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = _stat(pid)[1]
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def find_postmaster(url: str) -> int | None:
    """The pid of the server's postmaster (the parent of a backend), or None if it is not on this machine."""
    with psycopg.connect(url, autocommit=True) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        try:
            name, fields = _stat(backend)
        except OSError:
            return None
    return int(fields[1]) if name == "postgres" else None


def postgres_cpu_seconds(postmaster: int | None) -> float | None:
    """User + system CPU seconds of the server's processes named postgres (the postmaster and its children), with
    those of its children that have ended (the postmaster's cutime + cstime)."""
    if postmaster is None:
        return None
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name, fields = _stat(entry.name)
        except OSError:
            continue  # ended meanwhile
        if name != "postgres":
            continue
        if int(entry.name) == postmaster:
            ticks += sum(int(f) for f in fields[11:15])
        elif int(fields[1]) == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


class Meter:
    """Wall time and CPU seconds, between entry and exit, of named processes and of the Postgres server."""

    def __init__(self, postmaster: int | None, **pids: int) -> None:
        self.postmaster, self.pids = postmaster, pids

    def _read(self) -> dict[str, float | None]:
        return {
            **{name: cpu_seconds(pid) for name, pid in self.pids.items()},
            "postgres": postgres_cpu_seconds(self.postmaster),
        }

    def __enter__(self) -> Self:
        self.before, self.started = self._read(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.monotonic() - self.started
        after = self._read()
        self.cpu = {
            name: None if after[name] is None else after[name] - self.before[name]  # type: ignore[operator]
            for name in after
        }

    def figures(self, items: int, *, unit: Literal["ms", "us"] = "ms", **others: float) -> dict[str, Any]:
        """Per side, and per one of ``others`` (CPU seconds measured elsewhere): CPU seconds, CPU per item in
        ``unit`` and cores (CPU over the wall time)."""
        scale, digits = {"ms": (1e3, 3), "us": (1e6, 1)}[unit]
        out: dict[str, Any] = {}
        for name, cpu in {**self.cpu, **others}.items():
            out[f"{name}_cpu_s"] = None if cpu is None else round(cpu, 2)
            out[f"{name}_cpu_{unit}_per_event"] = None if cpu is None else round(scale * cpu / max(items, 1), digits)
            out[f"{name}_cores"] = None if cpu is None else round(cpu / self.wall, 2)
        return out
