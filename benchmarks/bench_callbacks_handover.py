"""Lateness of the Dagster-hosted callbacks worker across a run handover.

    .venv/bin/python benchmarks/bench_callbacks_handover.py

The worker job (``cmb_callbacks_worker``) runs in-process in a child process for ``--run-seconds``; its
successor starts in a fresh process ``--lead`` seconds before that, as the keeper sensor launches it (the run
launcher spawns a process that loads the code location and runs the job), and waits for the buckets.
Meanwhile a producer creates events at a steady rate, due from 0 to 2 s after creation. Lateness is the
sink's arrival time minus run_at; the figures split events due during the handover from the rest.
With ``--dagster-dev`` the handover is Dagster's own: ``cmb-dagster dev`` runs a code location with the
callbacks engine, the keeper sensor launches each run's successor a minute before the run ends, the successor
waits for the buckets, and takes them when the ending run releases them; the benchmark waits for one handover
(a run works ``CMB_WORKER_RUN_SECONDS``, 120 s here).
Runs on CMB_DATABASE_URL (or the embedded server) in a database of its own, dropped at the end; run it alone
on the machine. JSON last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cmb_dagster.callbacks import CallbackClient, CallbackSettings  # noqa: E402
from cmb_dagster.callbacks.sink import CallbackSink  # noqa: E402
from cmb_dagster.database import Database  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_callbacks import bench_database, percentile, stop_process  # noqa: E402

LOCAL = CallbackSettings(allowed_hosts=["127.0.0.1"])
RUN = """
import sys, time
from dagster import DagsterInstance
from cmb_dagster.callbacks import CallbackSettings
from cmb_dagster.callbacks import CallbackOptions
from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.resources import CmbResource
url, seconds = sys.argv[1], float(sys.argv[2])
defs = cmb_definitions(resource=CmbResource(database_url=url),
                       callbacks=CallbackOptions(settings=CallbackSettings(allowed_hosts=["127.0.0.1"])))
job = defs.get_job_def("cmb_callbacks_worker")
print("working", time.time(), flush=True)
config = {"ops": {"cmb_callbacks_worker_op": {"config": {"duration_seconds": seconds}}}}
result = job.execute_in_process(instance=DagsterInstance.ephemeral(), run_config=config)
print("ended", time.time(), result.success, flush=True)
"""


def run_worker(url: str, seconds: float) -> dict[str, float]:
    started = time.time()
    out = subprocess.run([sys.executable, "-c", RUN, url, str(seconds)], capture_output=True, text=True, check=True)
    marks = {
        line.split()[0]: float(line.split()[1])
        for line in out.stdout.splitlines()
        if line.split()[0] in ("working", "ended")
    }
    return {"process_started": started, "working": marks["working"], "ended": marks["ended"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=int, default=200, help="Events created per second.")
    parser.add_argument("--run-seconds", type=float, default=20.0, help="How long each worker run works.")
    parser.add_argument("--lead", type=float, default=10.0, help="Seconds before its end the successor starts.")
    parser.add_argument("--dagster-dev", action="store_true", help="Measure a handover under `cmb-dagster dev`.")
    args = parser.parse_args()
    with bench_database() as db:
        if args.dagster_dev:
            dagster_dev_handover(db, args.rate)
        else:
            handover(db, args.rate, args.run_seconds, args.lead)


def produce(client: CallbackClient, sink: CallbackSink, rate: int, stop: threading.Event) -> None:
    """Create ``rate`` events a second, each due 0-2 s after its creation, until ``stop``."""
    rng, i, start = random.Random(7), 0, time.monotonic()
    while not stop.is_set():
        pause = start + i / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        client.create(
            "bench", "handover", str(i), datetime.now(UTC) + timedelta(seconds=rng.uniform(0.0, 2.0)), f"{sink.url}/cb"
        )
        i += 1


def handover_figures(calls: list, after: float, before: float) -> dict[str, object]:  # type: ignore[type-arg]
    """The handover as callers see it: the longest time without a call started between ``after`` and ``before``
    (the first run stops taking events before its process ends), and the lateness of the events due from 1 s
    before it to 1 s after it, apart from the others'."""
    late = [(datetime.fromisoformat(c.body["run_at"]).timestamp(), c.started) for c in calls]
    starts = sorted(s for _, s in late if after < s < before)
    gap_start, gap_end = max(itertools.pairwise(starts), key=lambda pair: pair[1] - pair[0])
    during = [s - r for r, s in late if gap_start - 1 <= r <= gap_end + 1]
    rest = [s - r for r, s in late if not gap_start - 1 <= r <= gap_end + 1]
    return {
        "handover_seconds": round(gap_end - gap_start, 2),
        "due_during_handover": {
            "events": len(during),
            "p50_s": round(percentile(during, 50), 3),
            "p99_s": round(percentile(during, 99), 3),
            "max_s": round(max(during, default=0), 3),
        },
        "rest": {"events": len(rest), "p50_s": round(percentile(rest, 50), 3), "p99_s": round(percentile(rest, 99), 3)},
    }


def handover(db: Database, rate: int, run_seconds: float, lead: float) -> None:
    url = db.url
    results: dict[str, object] = {
        "benchmark": "callbacks_handover",
        "rate": rate,
        "run_seconds": run_seconds,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    with CallbackSink() as sink, CallbackClient(db, LOCAL) as client:
        stop = threading.Event()
        runs: list[dict[str, float]] = []
        producer = threading.Thread(target=produce, args=(client, sink, rate, stop))
        first = threading.Thread(target=lambda: runs.append(run_worker(url, run_seconds)))
        first.start()
        launched = time.monotonic()
        time.sleep(8)  # the first run is up (process start and code load) before events flow
        producer.start()
        time.sleep(max(0.0, launched + run_seconds - lead - time.monotonic()))
        # the successor: waits for the buckets until the first run releases them, then works past the producer
        second = threading.Thread(target=lambda: runs.append(run_worker(url, run_seconds + lead)))
        second.start()
        first.join()
        ended = runs[0]["ended"]
        while not any(c.started > ended for c in list(sink.received)) and second.is_alive():
            time.sleep(0.05)
        time.sleep(run_seconds / 2)  # events keep flowing after the handover, all due before the end
        stop.set()
        producer.join()
        second.join()
        with db.connection() as conn:
            pending = conn.execute("SELECT count(*) FROM callback_events WHERE status = 'pending'").fetchone()[0]
        calls = list(sink.received)
    results.update(
        {
            "events_called": len(calls),
            "events_left_pending": pending,
            **handover_figures(calls, runs[0]["working"], runs[1]["ended"]),
            "successor_working_before_the_end_s": round(runs[0]["ended"] - runs[1]["working"], 2),
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
        }
    )
    print(f"callbacks handover on {db.display_url}: {rate} events/s, runs of {run_seconds:g}s")
    print(
        f"  handover (the longest time without a call): {results['handover_seconds']}s; the successor was working "
        f"{results['successor_working_before_the_end_s']}s before the first run ended"
    )
    print(f"  events due around the handover: {results['due_during_handover']}")
    print(f"  other events: {results['rest']}; {pending} left pending")
    print(json.dumps(results))


DEV_RUN_SECONDS = 120

DEFINITIONS = """
from cmb_dagster import CallbackOptions, cmb_definitions
from cmb_dagster.callbacks import CallbackSettings

defs = cmb_definitions(callbacks=CallbackOptions(settings=CallbackSettings(allowed_hosts=["127.0.0.1"])))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_runs(db: Database) -> list[tuple[str, float | None, float | None]]:
    """(status, start, end) of the callbacks worker's runs, from Dagster's run storage, oldest first."""
    with db.connection() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                "SELECT status, start_time, end_time FROM public.runs WHERE pipeline_name = 'cmb_callbacks_worker' "
                "ORDER BY create_timestamp"
            ).fetchall()
        ]


def dagster_dev_handover(db: Database, rate: int) -> None:
    """One handover of the worker job under ``cmb-dagster dev``: the keeper, the queue and the run launcher."""
    results: dict[str, object] = {
        "benchmark": "callbacks_handover_dagster_dev",
        "rate": rate,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    project = Path(tempfile.mkdtemp(prefix="cmb-handover-"))
    (project / "definitions.py").write_text(DEFINITIONS)
    (project / "workspace.yaml").write_text("load_from:\n  - python_file: definitions.py\n")
    shutil.copy(ROOT / "dagster.yaml", project / "dagster.yaml")
    log = open(project / "dev.log", "wb")  # noqa: SIM115 - the child owns it
    env = {**os.environ, "CMB_DATABASE_URL": db.url, "CMB_WORKER_RUN_SECONDS": str(DEV_RUN_SECONDS)}
    env.pop("DAGSTER_HOME", None)
    env.pop("CMB_DAGSTER_STORAGE_URL", None)
    dev = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from cmb_dagster.cli import run; run()",
            "dev",
            "--port",
            str(free_port()),
            "--sink-port",
            "0",
        ],
        cwd=project,
        env=env,
        stdout=log,
        stderr=log,
    )
    try:
        with CallbackSink() as sink, CallbackClient(db, LOCAL) as client:
            client.create("bench", "warm-up", "probe", datetime.now(UTC), f"{sink.url}/cb")
            deadline = time.monotonic() + 180
            while not sink.received:  # the first run is working
                if time.monotonic() > deadline or dev.poll() is not None:
                    raise RuntimeError(f"no worker run called the probe; see {project / 'dev.log'}")
                time.sleep(0.2)
            sink.received.clear()
            stop = threading.Event()
            producer = threading.Thread(target=produce, args=(client, sink, rate, stop))
            producer.start()
            deadline = time.monotonic() + 420
            while time.monotonic() < deadline:  # until the first run has ended 20 s ago
                runs = worker_runs(db)
                if len(runs) >= 2 and runs[0][2] is not None and time.time() - runs[0][2] > 20:
                    break
                time.sleep(1)
            else:
                raise RuntimeError(f"no handover within 7 minutes; see {project / 'dev.log'}")
            stop.set()
            producer.join()
            quiet = time.monotonic() + 15  # every event is due within 2 s of the last create
            with db.connection() as conn:
                while (
                    pending := conn.execute("SELECT count(*) FROM callback_events WHERE status = 'pending'").fetchone()[
                        0
                    ]
                ) and time.monotonic() < quiet:
                    time.sleep(0.2)
            calls = list(sink.received)
            runs = worker_runs(db)
    finally:
        stop_process(dev)
    first_end, second_start = runs[0][2], runs[1][1]
    results.update(
        {
            "events_called": len(calls),
            "events_left_pending": pending,
            **handover_figures(calls, -math.inf, math.inf),
            "successor_started_before_the_end_s": round(first_end - second_start, 2)
            if first_end and second_start
            else None,
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
        }
    )
    shutil.rmtree(project, ignore_errors=True)
    print(f"callbacks handover under cmb-dagster dev on {db.display_url}: {rate} events/s, runs of {DEV_RUN_SECONDS}s")
    print(
        f"  handover (the longest time without a call): {results['handover_seconds']}s; the successor started "
        f"{results['successor_started_before_the_end_s']}s before the first run ended (Dagster's run records)"
    )
    print(f"  events due around the handover: {results['due_during_handover']}")
    print(f"  other events: {results['rest']}; {pending} left pending")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
