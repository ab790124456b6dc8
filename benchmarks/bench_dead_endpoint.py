"""A dead endpoint among live ones: what a receiver that is down costs, and whether the live receivers of the same
host keep their lateness, side by side: cmb with its circuit breaker, cmb without it, and PgQueuer.

    .venv/bin/python benchmarks/bench_dead_endpoint.py [--quick] [--only breaker no-breaker pgqueuer]
        [--outage S] [--dead-events N] [--rate N] [--handler-ms MS] [--retry-delay S]
        [--worker-concurrency N] [--per-host-concurrency N] [--tail S] [--max-drain S]

Runs on CMB_DATABASE_URL (or the embedded server) in a database of its own (a random name), dropped at the end.
One local HTTP sink in a process of its own serves two paths of one host: ``/dead`` answers 503 for ``--outage``
seconds from the moment the dead events are due, then 200; ``/live`` answers 200 after ``--handler-ms`` (a real
handler's wait). Each side in turn: ``--dead-events`` events to /dead, loaded and ANALYZEd beforehand, all due at
the same moment; from that moment a steady ``--rate`` of events to /live, each due at its creation, until every
dead event has been delivered and ``--tail`` seconds more have passed (at most ``--max-drain`` seconds after the
outage). One consumer process, started before the dead events are due and warmed up by one call.

Every event follows the same retry schedule on every side: no fast retry, then a retry every ``--retry-delay``
seconds, giving up after a day (not within the run). The sides:

- breaker: ``cmb-dagster callbacks worker``; the owner's ``EndpointPolicy(failure_threshold=10,
  probe_interval=Backoff(first=1, factor=2, max=10))``: once /dead opens, its due events are held and one probe per
  interval goes out; the first good answer closes it and the held events go out, oldest first.
- no-breaker: the same worker, the owner's ``EndpointPolicy(breaker=False)``: each event retries on its own.
- pgqueuer: PgQueuer (pip install pgqueuer; skipped without it) set up as in bench_callbacks.py (asyncpg, a direct
  connection for the ``QueueManager``, batches of 50, ``dequeue_timeout`` of 1 s, one aiohttp session reading whole
  responses), the URL in each job's payload. Its retries are its documented database retry: the entrypoint's
  ``DatabaseRetryEntrypointExecutor`` with ``initial_delay = max_delay = --retry-delay`` and ``backoff_multiplier``
  1 (a constant delay), turning a non-2xx answer into a ``RetryRequested`` that re-queues the job with
  ``execute_after`` that much later; ``max_attempts`` is a day of retries, and a job past it is held as failed
  (``on_failure="hold"``).

The same worker concurrency on every side (cmb's ``--worker-concurrency``, PgQueuer's ``max_concurrent_tasks`` and
its aiohttp connector's limit) and the same per-host limit (cmb's ``--per-host-concurrency``, aiohttp's
``limit_per_host``; 0: none). Figures of each side: the requests /dead received during the outage, in all and per
second after its first 5 s; the lateness of /live (arrival at the sink minus run_at) p50/p99/max for the events due
during the outage and after it; the seconds from the outage's end until every dead event was delivered, and the
events failed for good; the CPU seconds of the consumer, of this process (the producers) and of Postgres over the
run. Run it alone on the machine. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import psycopg
from bench_callbacks import (
    BURST_LEAD_S,
    CLI,
    LOCAL,
    LOG_DIR,
    PGQUEUER_BATCH_SIZE,
    SinkProcess,
    _pgqueuer_install,
    bench_database,
    checkpoint,
    clear_events,
    clear_pgqueuer,
    errors_logged,
    percentile,
    pgqueuer_default_repoll,
    stop_process,
    vacuum,
    wait_for,
    warmed_up,
)
from proc_cpu import Meter, find_postmaster

from cmb_dagster.callbacks import CallbackClient, EndpointPolicy, RetryPolicy
from cmb_dagster.database import Database
from cmb_dagster.models import Backoff

DEAD, LIVE = "/dead", "/live"
SETTLE_S = 5.0  # the dead requests per second are counted after the outage's first seconds
STOP_AFTER_S = 86400.0  # every side gives up on an event after a day: never within a run
PRODUCERS = 4
BREAKER = EndpointPolicy(failure_threshold=10, probe_interval=Backoff(first=1, factor=2, max=10))
SIDES = ("breaker", "no-breaker", "pgqueuer")


@dataclass(frozen=True)
class Plan:
    """The scenario's sizes, the same for every side."""

    outage: float
    dead_events: int
    rate: int
    handler_ms: int
    retry_delay: float
    worker_concurrency: int
    per_host_concurrency: int
    tail: float
    max_drain: float


# -- the sink, in a process of its own ----------------------------------------------------------


class Arrival(NamedTuple):
    """One request as the sink saw it: its arrival (``time.time()``), path, the status answered, and the event's
    key and run_at (epoch seconds) from its body."""

    at: float
    path: str
    status: int
    event_key: str
    run_at: float


async def _serve_outage_sink(control: Connection, handler_s: float) -> None:
    """Serve /dead and /live on a free port of 127.0.0.1, keeping each request's Arrival, until told to stop."""
    arrivals: list[Arrival] = []
    delivered: set[str] = set()  # the dead events answered 200
    outage_end = math.inf

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                at = time.time()
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                path = request_line.split(" ")[1]
                length = 0
                for line in header_lines:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = json.loads(await reader.readexactly(length))
                if path == DEAD:
                    status = 503 if at < outage_end else 200
                    if status == 200:
                        delivered.add(body["event_key"])
                else:
                    await asyncio.sleep(handler_s)
                    status = 200
                run_at = datetime.fromisoformat(body["run_at"]).timestamp()
                arrivals.append(Arrival(at, path, status, body["event_key"], run_at))
                reason = "OK" if status == 200 else "Service Unavailable"
                writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\n\r\n".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    control.send(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    loop = asyncio.get_running_loop()
    while (command := await loop.run_in_executor(None, control.recv)) != "stop":
        if isinstance(command, tuple):  # ("outage_end", epoch seconds)
            outage_end = command[1]
            control.send(None)
        elif command == "count":
            control.send(len(arrivals))
        elif command == "live":
            control.send(sum(1 for a in arrivals if a.path == LIVE))
        elif command == "delivered":
            control.send(len(delivered))
        elif command == "calls":
            control.send(arrivals)
        elif command == "clear":
            arrivals.clear()
            delivered.clear()
            control.send(None)
    server.close()


def _run_outage_sink(control: Connection, handler_s: float) -> None:
    asyncio.run(_serve_outage_sink(control, handler_s))


class OutageSinkProcess(SinkProcess):
    """This benchmark's sink in a child process: SinkProcess's controls (``calls()`` gives :class:`Arrival`s), the
    outage's end, and how many /live calls and delivered dead events it has seen."""

    def __init__(self, handler_ms: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._control, child = context.Pipe()
        self._process = context.Process(target=_run_outage_sink, args=(child, handler_ms / 1000), daemon=True)

    def end_outage_at(self, at: float) -> None:
        self._ask(("outage_end", at))

    def live(self) -> int:
        return self._ask("live")

    def delivered(self) -> int:
        return self._ask("delivered")


# -- one side's run ------------------------------------------------------------------------------


def moments(rate: int, start: float, part: int) -> Iterator[tuple[int, float]]:
    """This producer's share of the steady stream: (event number, its moment on ``time.monotonic()``)."""
    for n in itertools.count(part, PRODUCERS):
        yield n, start + n / rate


def lateness(values: list[float]) -> dict[str, Any]:
    """How many, and their p50, p99 and max (seconds)."""
    return {
        "events": len(values),
        "p50_s": round(percentile(values, 50), 3),
        "p99_s": round(percentile(values, 99), 3),
        "max_s": round(max(values), 3) if values else float("nan"),
    }


def outcome(arrivals: list[Arrival], due: float, outage_end: float, plan: Plan) -> dict[str, Any]:
    """The figures the sink's arrivals give: the dead endpoint's requests and drain, the live lateness."""
    dead = [a for a in arrivals if a.path == DEAD]
    during = [a for a in dead if a.at < outage_end]
    delivered: dict[str, float] = {}
    for a in sorted(dead):
        if a.status == 200:
            delivered.setdefault(a.event_key, a.at)
    live = [a for a in arrivals if a.path == LIVE]
    return {
        "dead_requests_during_outage": len(during),
        "dead_requests_per_s_after_5s": round(
            sum(1 for a in during if a.at >= due + SETTLE_S) / (outage_end - due - SETTLE_S), 2
        ),
        "dead_requests_after_outage": len(dead) - len(during),
        "dead_delivered": len(delivered),
        "drain_s": round(max(delivered.values()) - outage_end, 2) if len(delivered) == plan.dead_events else None,
        "duplicate_deliveries": sum(1 for a in dead if a.status == 200) - len(delivered),
        "live_during_outage": lateness([a.at - a.run_at for a in live if a.run_at < outage_end]),
        "live_after_outage": lateness([a.at - a.run_at for a in live if a.run_at >= outage_end]),
    }


def watch(
    sink: OutageSinkProcess, plan: Plan, outage_end: float, health: Callable[[], dict[str, Any] | None] | None
) -> dict[str, Any] | None:
    """Wait until every dead event is delivered and ``plan.tail`` seconds more have passed (at most
    ``plan.max_drain`` seconds after the outage); return ``health()`` read in the outage's last second."""
    at_outage_end = None
    drained_at = None
    while time.time() < outage_end + plan.max_drain:
        now = time.time()
        if health is not None and at_outage_end is None and now >= outage_end - 1:
            at_outage_end = health()
        if drained_at is None and sink.delivered() >= plan.dead_events:
            drained_at = now
        if drained_at is not None and now >= drained_at + plan.tail:
            break
        time.sleep(0.1)
    return at_outage_end


def run_side(
    name: str,
    url: str,
    sink: OutageSinkProcess,
    plan: Plan,
    postmaster: int | None,
    due: datetime,
    start_consumer: Callable[[], subprocess.Popen],
    send_probe: Callable[[], None],
    produce_live: Callable[[float, threading.Event], int],
    health: Callable[[], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """With the dead events loaded (due at ``due``): start the consumer, warm it up with one call, then from
    ``due`` produce the live stream until the dead events are drained; the figures of the run."""
    outage_end = due.timestamp() + plan.outage
    vacuum(url)  # loaded: counted before the consumer starts
    checkpoint(url)
    sink.clear()
    sink.end_outage_at(outage_end)
    consumer = start_consumer()
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        try:
            send_probe()
            warmed_up(sink)
            late = time.time() > due.timestamp()
            time.sleep(max(0.0, due.timestamp() - time.time()))
            with Meter(postmaster, consumer=consumer.pid, producers=os.getpid()) as meter:
                produced = pool.submit(produce_live, time.monotonic(), stop)
                at_outage_end = watch(sink, plan, outage_end, health)
                stop.set()
                live_events = produced.result()
                live_arrived = wait_for(lambda: sink.live() >= live_events, timeout=60)
        finally:
            stop.set()
            stop_process(consumer)
    figures = {
        **outcome(sink.calls(), due.timestamp(), outage_end, plan),
        "live_events": live_events,
        "live_all_arrived": live_arrived,
        "setup_late": late,
        "run_s": round(meter.wall, 1),
        "endpoint_at_outage_end": at_outage_end,
        **meter.figures(plan.dead_events + live_events),
    }
    during, after = figures["live_during_outage"], figures["live_after_outage"]
    drain = figures["drain_s"]
    print(
        f"  {name}: /dead got {figures['dead_requests_during_outage']:,} requests during the outage "
        f"({figures['dead_requests_per_s_after_5s']:g}/s after its first {SETTLE_S:g} s); "
        + (
            f"every dead event delivered {drain:.2f} s after it"
            if drain is not None
            else f"{figures['dead_delivered']:,} of {plan.dead_events:,} dead events delivered (INCOMPLETE)"
        )
        + f"; /live lateness p50/p99/max during {during['p50_s']:.3f}/{during['p99_s']:.3f}/{during['max_s']:.3f} s, "
        f"after {after['p50_s']:.3f}/{after['p99_s']:.3f}/{after['max_s']:.3f} s ({live_events:,} live events"
        + ("" if live_arrived else ", NOT ALL ARRIVED")
        + ")"
        + (" (set up after the due time)" if late else "")
        + "; CPU s: "
        + ", ".join(f"{side} {figures[f'{side}_cpu_s']}" for side in ("consumer", "producers", "postgres"))
    )
    return figures


# -- cmb -----------------------------------------------------------------------------------------


def start_cmb_worker(url: str, plan: Plan, log_name: str) -> subprocess.Popen:
    env = {**os.environ, "CMB_DATABASE_URL": url}
    log = open(LOG_DIR / log_name, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [
            *CLI,
            "callbacks",
            "worker",
            "--no-materialize",
            "--allow-host",
            "127.0.0.1",
            "--worker-concurrency",
            str(plan.worker_concurrency),
            "--per-host-concurrency",
            str(plan.per_host_concurrency),
        ],
        env=env,
        stdout=log,
        stderr=log,
    )


def cmb_side(
    db: Database, sink: OutageSinkProcess, plan: Plan, postmaster: int | None, breaker: bool
) -> dict[str, Any]:
    """cmb's worker with the owner's breaker on (``BREAKER``) or off."""
    owner = "breaker" if breaker else "no-breaker"
    log_name = f"cmb-worker-{owner}.log"
    retry = RetryPolicy.constant(plan.retry_delay, fast_retries=0, stop_after_delay=STOP_AFTER_S)
    due = datetime.now(UTC) + timedelta(seconds=BURST_LEAD_S)
    with CallbackClient(db, LOCAL) as client:
        client.set_endpoint_policy(owner, BREAKER if breaker else EndpointPolicy(breaker=False))
        client.create_many(
            {
                "owner_client_id": owner,
                "group_key": "dead",
                "event_key": str(i),
                "run_at": due,
                "cb_url": f"{sink.url}{DEAD}",
                "retry": retry,
            }
            for i in range(plan.dead_events)
        )

        def send_probe() -> None:
            client.create(owner, "warm-up", "probe", datetime.now(UTC), f"{sink.url}{LIVE}", retry=retry)

        def produce_live(start: float, stop: threading.Event) -> int:
            def part(n: int) -> int:
                created = 0
                for i, at in moments(plan.rate, start, n):
                    time.sleep(max(0.0, at - time.monotonic()))
                    if stop.is_set():
                        break
                    client.create(owner, "live", str(i), datetime.now(UTC), f"{sink.url}{LIVE}", retry=retry)
                    created += 1
                return created

            with ThreadPoolExecutor(PRODUCERS) as pool:
                return sum(pool.map(part, range(PRODUCERS)))

        def health() -> dict[str, Any] | None:
            dead = next((e for e in client.endpoints(owner) if e.endpoint.endswith(DEAD)), None)
            return None if dead is None else {"state": dead.state, "held": dead.held, "failed_probes": dead.probes}

        figures = run_side(
            owner,
            db.url,
            sink,
            plan,
            postmaster,
            due,
            lambda: start_cmb_worker(db.url, plan, log_name),
            send_probe,
            produce_live,
            health,
        )
    with db.connection() as conn:
        figures["failed_for_good"] = conn.execute(
            "SELECT count(*) FROM callback_events WHERE owner_client_id = %s AND status = 'failed'", (owner,)
        ).fetchone()[0]
    figures["errors_logged"] = errors_logged(log_name)
    clear_events(db, peer=False)
    return figures


# -- PgQueuer ------------------------------------------------------------------------------------


def pgqueuer_payload(url: str, event_key: str, run_at: datetime) -> bytes:
    return json.dumps({"url": url, "event_key": event_key, "run_at": run_at.isoformat()}).encode()


async def _pgqueuer_consumer(url: str, plan: Plan) -> None:
    """PgQueuer as its docs set it up (see the module's docstring), retrying a failed call after a constant delay."""
    import aiohttp
    import asyncpg
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.executors import DatabaseRetryEntrypointExecutor, EntrypointExecutorParameters
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=plan.worker_concurrency, limit_per_host=plan.per_host_concurrency),
        timeout=aiohttp.ClientTimeout(total=LOCAL.timeout),
    )
    delay = timedelta(seconds=plan.retry_delay)

    def retrying(parameters: EntrypointExecutorParameters) -> DatabaseRetryEntrypointExecutor:
        return DatabaseRetryEntrypointExecutor(
            parameters=parameters,
            max_attempts=math.ceil(STOP_AFTER_S / plan.retry_delay),
            initial_delay=delay,
            max_delay=delay,
            backoff_multiplier=1.0,
        )

    @qm.entrypoint("callback", on_failure="hold", executor_factory=retrying)
    async def callback(job) -> None:  # type: ignore[no-untyped-def]
        target = json.loads(job.payload)["url"]
        async with session.post(target, data=job.payload, headers={"Content-Type": "application/json"}) as response:
            await response.read()  # the whole response, as a callback client must
            if response.status // 100 != 2:
                raise RuntimeError(f"HTTP {response.status}")

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    try:
        await qm.run(
            batch_size=min(PGQUEUER_BATCH_SIZE, plan.worker_concurrency // 2),  # it wants twice the batch in flight
            max_concurrent_tasks=plan.worker_concurrency,
            dequeue_timeout=timedelta(seconds=LOCAL.poll_interval),
        )
    finally:
        await session.close()
        await conn.close()


def start_pgqueuer_consumer(url: str, plan: Plan, log_name: str) -> subprocess.Popen:
    log = open(LOG_DIR / log_name, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, __file__, "--pgqueuer-consumer", url, json.dumps(asdict(plan))], stdout=log, stderr=log
    )


def pgqueuer_side(url: str, sink: OutageSinkProcess, plan: Plan, postmaster: int | None) -> dict[str, Any]:
    """PgQueuer's consumer; every job goes through its database retry."""
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    log_name = "pgqueuer.log"
    due = datetime.now(UTC) + timedelta(seconds=BURST_LEAD_S)

    async def enqueue(payloads: list[bytes], execute_after: timedelta) -> None:
        conn = await asyncpg.connect(url)
        try:
            count = len(payloads)
            await Queries(AsyncpgDriver(conn)).enqueue(
                ["callback"] * count, payloads, [0] * count, [execute_after] * count
            )
        finally:
            await conn.close()

    asyncio.run(
        enqueue(
            [pgqueuer_payload(f"{sink.url}{DEAD}", str(i), due) for i in range(plan.dead_events)],
            due - datetime.now(UTC),
        )
    )

    def send_probe() -> None:
        asyncio.run(enqueue([pgqueuer_payload(f"{sink.url}{LIVE}", "probe", datetime.now(UTC))], timedelta(0)))

    async def produce(start: float, stop: threading.Event) -> int:
        conns = [await asyncpg.connect(url) for _ in range(PRODUCERS)]

        async def part(n: int) -> int:
            queries = Queries(AsyncpgDriver(conns[n]))
            created = 0
            for i, at in moments(plan.rate, start, n):
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                if stop.is_set():
                    break
                await queries.enqueue("callback", pgqueuer_payload(f"{sink.url}{LIVE}", str(i), datetime.now(UTC)), 0)
                created += 1
            return created

        try:
            return sum(await asyncio.gather(*(part(n) for n in range(PRODUCERS))))
        finally:
            for conn in conns:
                await conn.close()

    figures = run_side(
        "pgqueuer",
        url,
        sink,
        plan,
        postmaster,
        due,
        lambda: start_pgqueuer_consumer(url, plan, log_name),
        send_probe,
        lambda start, stop: asyncio.run(produce(start, stop)),
    )
    with psycopg.connect(url, autocommit=True) as conn:
        figures["failed_for_good"] = conn.execute("SELECT count(*) FROM pgqueuer WHERE status = 'failed'").fetchone()[0]
    figures["errors_logged"] = errors_logged(log_name)
    clear_pgqueuer(url)
    return figures


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--quick", action="store_true", help="A short run to check it works (outage 10 s, 500 dead events, 100/s)."
    )
    parser.add_argument("--only", nargs="+", choices=SIDES, default=SIDES, help="Run only these sides.")
    parser.add_argument("--outage", type=float, help="Seconds /dead answers 503 (default 60; quick 10; over 5).")
    parser.add_argument("--dead-events", type=int, help="Events to /dead, due at once (default 2,000; quick 500).")
    parser.add_argument("--rate", type=int, help="Events per second to /live (default 200; quick 100).")
    parser.add_argument("--handler-ms", type=int, default=50, help="/live's answer time (default 50 ms).")
    parser.add_argument("--retry-delay", type=float, default=5.0, help="Seconds between retries (default 5).")
    parser.add_argument(
        "--worker-concurrency", type=int, default=128, help="Calls in flight of each side's consumer (default 128)."
    )
    parser.add_argument(
        "--per-host-concurrency", type=int, default=0, help="Calls in flight to the sink's host (default 0: no limit)."
    )
    parser.add_argument(
        "--tail", type=float, help="Seconds the live stream goes on once every dead event is delivered (5; quick 3)."
    )
    parser.add_argument(
        "--max-drain", type=float, help="Seconds after the outage the run stops at the latest (default 300; quick 60)."
    )
    parser.add_argument("--pgqueuer-consumer", nargs=2, metavar=("URL", "PLAN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pgqueuer_consumer:
        url, plan_json = args.pgqueuer_consumer
        asyncio.run(_pgqueuer_consumer(url, Plan(**json.loads(plan_json))))
        return
    plan = Plan(
        outage=args.outage or (10.0 if args.quick else 60.0),
        dead_events=args.dead_events or (500 if args.quick else 2_000),
        rate=args.rate or (100 if args.quick else 200),
        handler_ms=args.handler_ms,
        retry_delay=args.retry_delay,
        worker_concurrency=args.worker_concurrency,
        per_host_concurrency=args.per_host_concurrency,
        tail=args.tail or (3.0 if args.quick else 5.0),
        max_drain=args.max_drain or (60.0 if args.quick else 300.0),
    )
    bounds = {
        "outage": (SETTLE_S + 1, 3600),
        "dead_events": (1, 100_000),
        "rate": (1, 5_000),
        "handler_ms": (0, 10_000),
        "retry_delay": (0.1, 3600),
        "worker_concurrency": (2, 512),
        "per_host_concurrency": (0, 512),
        "tail": (0, 600),
        "max_drain": (1, 3600),
    }
    for name, (low, high) in bounds.items():
        if not low <= getattr(plan, name) <= high:
            parser.error(f"--{name.replace('_', '-')} must be in [{low:g}, {high:g}]")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    sides = [side for side in SIDES if side in args.only]
    if "pgqueuer" in sides and pgqueuer_default_repoll() is None:
        print("  PgQueuer not installed (pip install -e '.[bench]'): its side is skipped")
        sides.remove("pgqueuer")
    results: dict[str, Any] = {
        "benchmark": "dead_endpoint",
        "cpus": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "plan": asdict(plan),
        "breaker_policy": BREAKER.model_dump(),
        "sides": {},
    }
    with bench_database() as db:
        url = db.url
        postmaster = find_postmaster(url)
        with psycopg.connect(url, autocommit=True) as conn:
            results["server"] = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("server_version", "fsync", "synchronous_commit", "autovacuum")
            }
        results["postgres_cpu_measured"] = postmaster is not None
        print(
            f"dead endpoint benchmark on {db.display_url} ({os.cpu_count()} CPUs, load average "
            f"{results['load_average_start'][0]}): /dead down {plan.outage:g} s with {plan.dead_events:,} events due "
            f"at once, {plan.rate}/s to /live ({plan.handler_ms} ms each), retries every {plan.retry_delay:g} s, "
            f"worker concurrency {plan.worker_concurrency}, per-host limit {plan.per_host_concurrency or 'none'}"
        )
        if postmaster is None:
            print("  the server is not on this machine: its CPU is not measured")
        if "pgqueuer" in sides:
            asyncio.run(_pgqueuer_install(url))
        with OutageSinkProcess(plan.handler_ms) as sink:
            for side in sides:
                results["sides"][side] = (
                    pgqueuer_side(url, sink, plan, postmaster)
                    if side == "pgqueuer"
                    else cmb_side(db, sink, plan, postmaster, breaker=side == "breaker")
                )
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"  load average: start {results['load_average_start']}, end {results['load_average_end']}")
    sys.stdout.flush()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
