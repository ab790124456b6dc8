"""A worker host cut off from Postgres for longer than the lease TTL, mid-batch: another host takes its partitions
over, the work goes on, the cut host notices, stops calling user code for what it lost, and rejoins by itself after
the heal (the other hosts are then stopped: the cut host, never restarted, takes every partition back and finishes
the work given after the heal).

Each host is a network namespace (tests/helpers/netns.py) running a real worker process (``cmb-dagster <engine>
worker``; the reactive scheduler, which has no worker command, a ``ReactiveWorker`` script). A trigger records every
change of ``leases`` (``lease_history``; the event queue's claims likewise), and user code records each call with its
process and time (multihost_handlers.py; callbacks: a receiver in the root namespace, reached over a link of each
host's own that the cut leaves up), so every call can be checked against the leases its host held at that moment.
A slower job: runs with ``CMB_MULTIHOST=1``, as root.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from multihost import HELD_INTERVALS, LEASE_HISTORY, CtlProducer, launched_last
from netns import Network, unavailable_reason
from processes import stop
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings
from cmb_dagster.callbacks.admin import set_bucket_count
from cmb_dagster.callbacks.sink import CallbackSink
from cmb_dagster.database import Database
from cmb_dagster.eventqueue import emit_many, register
from cmb_dagster.pubsub import publish
from cmb_dagster.stages import StageStore, shard_of
from cmb_dagster.workers import list_leases


def skip_reason() -> str | None:
    """Why this module does not run here (None: it does)."""
    if os.environ.get("CMB_MULTIHOST") != "1":
        return "multi-host tests run with CMB_MULTIHOST=1 (as root: they make network namespaces)"
    reason = unavailable_reason()
    return None if reason is None else f"no network namespaces here: {reason}"


SKIP = skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

CMB = str(Path(sys.executable).with_name("cmb-dagster"))
TTL = 3.0
HOSTS = 3
# a worker's database call failed (rather than hanging): the first such line's time (the log's local time)
NOTICED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?:WARNING|ERROR) cmb_dagster", re.MULTILINE)
CUT = 1  # the host cut off: started first, so it holds every partition when the cut comes


@dataclass(frozen=True)
class Held:
    partition: str
    host: int
    start: float
    end: float


class Cluster:
    """The network, its database and the worker processes, one per host."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self.db = Database(net.database_url())
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}

    def start(self, host: int, *args: str, log_dir: Path, program: str = CMB) -> None:
        log = self.logs[host] = log_dir / f"host{host}.log"
        environment = {
            **os.environ,
            "CMB_DATABASE_URL": self.net.database_url(host),
            "CMB_TEST_CALLS": str(log_dir / "calls.jsonl"),
            "PYTHONPATH": str(Path(__file__).parent),
        }
        with log.open("ab") as out:
            self.procs[host] = self.net.popen(host, [program, *args], environment, stdout=out, stderr=subprocess.STDOUT)

    def host_of(self, owner: str) -> int:
        pids = {str(p.pid): host for host, p in self.procs.items()}
        return pids.get(owner.split(":")[1], 0)

    def holding(self, kind: str) -> dict[str, int]:
        """partition -> host holding it now (unexpired)."""
        return {
            lease.partition: self.host_of(lease.owner)
            for lease in list_leases(self.db)
            if lease.kind == kind and lease.expires_in > 0
        }

    def held(self, kind: str) -> list[Held]:
        with self.db.connection() as conn:
            rows = conn.execute(HELD_INTERVALS, (kind,)).fetchall()
        return [
            Held(partition, self.host_of(owner), float(start), float(end)) for partition, owner, _, start, end in rows
        ]

    def calls(self, log_dir: Path) -> list[tuple[int, float, list]]:
        """(host, time, items) of each call of user code so far (see multihost_handlers.py)."""
        path = log_dir / "calls.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        pids = {p.pid: host for host, p in self.procs.items()}
        return [(pids.get(pid, 0), at, items) for pid, at, items in map(json.loads, lines)]

    def log(self, host: int) -> str:
        return self.logs[host].read_text(errors="replace") if host in self.logs else ""

    def close(self) -> None:
        stop(list(self.procs.values()))
        self.db.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Network(HOSTS) as net:
        cluster = Cluster(net)
        try:
            with cluster.db.connection() as conn:
                conn.execute(LEASE_HISTORY)
            yield cluster
        finally:
            cluster.close()


def was_held(intervals: list[Held], host: int, partition: str, at: float) -> bool:
    return any(h.host == host and h.partition == partition and h.start <= at <= h.end for h in intervals)


def cut_mid_batch(cluster: Cluster, kind: str, busy, ttl: float = TTL) -> tuple[float, set[str]]:  # type: ignore[no-untyped-def]
    """Once the cut host holds partitions and ``busy()`` says it has work in flight, cut it off; wait until the other
    hosts hold every partition it held. Returns (cut time, its partitions)."""
    wait_until(lambda: set(cluster.holding(kind).values()) == {CUT}, timeout=30, what="the first host holds all")
    wait_until(busy, timeout=30, what="work in flight on the first host")
    lost = set(cluster.holding(kind))
    logged = len(cluster.log(CUT))
    cut_at = cluster.net.cut(CUT)

    def taken_over() -> bool:
        now = cluster.holding(kind)
        return all(now.get(p, CUT) != CUT for p in lost)

    wait_until(taken_over, timeout=60, what="the other hosts take the cut host's partitions over")
    assert time.time() - cut_at > ttl * 2 / 3, "taken over before the cut host's lease could have lapsed"
    assert_noticed(cluster, logged, cut_at, ttl)
    return cut_at, lost


def assert_noticed(cluster: Cluster, logged: int, cut_at: float, ttl: float) -> None:
    """The cut host's log shows, within one lease TTL of the cut, that its database calls fail."""
    found = wait_until(lambda: NOTICED.search(cluster.log(CUT)[logged:]), timeout=30, what="the cut host notices")
    noticed_at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    print(f"the cut host noticed {noticed_at - cut_at:.2f}s after the cut (lease TTL {ttl:g}s)")
    assert noticed_at - cut_at <= ttl, f"noticed {noticed_at - cut_at:.1f}s after the cut, the lease TTL is {ttl:g}s"


def heal_and_rejoin(cluster: Cluster, kind: str, lost: set[str]) -> float:
    """Heal the cut host's link, stop the other hosts (they release their partitions): the cut host, never restarted,
    takes every partition back."""
    healed_at = cluster.net.heal(CUT)
    stop([p for host, p in cluster.procs.items() if host != CUT])
    wait_until(
        lambda: set(cluster.holding(kind)) >= lost and set(cluster.holding(kind).values()) == {CUT},
        timeout=60,
        what="the healed host takes its partitions back",
    )
    assert cluster.procs[CUT].poll() is None, cluster.log(CUT)[-3000:]
    return healed_at


# -- callbacks -----------------------------------------------------------------------------------------------------

caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller")


class HostSink(CallbackSink):
    """A CallbackSink that also records which address each call came from (``calls``: (call, address))."""

    def __init__(self, host: str) -> None:
        super().__init__(host)
        self.calls: list[tuple[object, str]] = []
        self.on_call.append(lambda call: self.calls.append((call, caller.get())))

    async def _handle(self, reader, writer) -> None:  # type: ignore[no-untyped-def]
        caller.set(writer.get_extra_info("peername")[0])
        await super()._handle(reader, writer)


def test_callbacks_partition(cluster: Cluster, tmp_path: Path) -> None:
    net, db, kind = cluster.net, cluster.db, "callbacks.bucket"
    set_bucket_count(db, 6)
    side_address = {f"10.{net.octet}.{100 + host}.1": host for host in net.hosts}
    concurrency = 16
    settings = CallbackSettings(lease_ttl=TTL, timeout=1, poll_interval=0.2, allowed_hosts=[net.receiver_address])
    with HostSink(net.receiver_address) as sink, CallbackClient(db, settings) as client:
        start = datetime.now(UTC)
        events = 600
        client.create_many(
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"k{i}",
                "run_at": start + timedelta(milliseconds=5 * i),
                "cb_url": f"{sink.url}/slow?ms=300",
            }
            for i in range(events)
        )
        args = ["callbacks", "worker", "--lease-ttl", str(TTL), "--timeout", "1", "--poll-interval", "0.2",
                "--worker-concurrency", str(concurrency), "--no-materialize",
                "--allow-host", net.receiver_address]  # fmt: skip
        for host in net.hosts:
            cluster.start(host, *args, log_dir=tmp_path)
            if host == CUT:
                wait_until(lambda: len(cluster.holding(kind)) == 6, timeout=30, what="the first host holds all")

        def by(host: int) -> int:
            return sum(side_address.get(address) == host for _, address in list(sink.calls))

        cut_at, lost = cut_mid_batch(cluster, kind, lambda: by(CUT) >= 100)
        others_then = sum(by(h) for h in net.hosts if h != CUT)
        wait_until(lambda: sum(by(h) for h in net.hosts if h != CUT) >= others_then + 100, timeout=60,
                   what="the work goes on on the other hosts")  # fmt: skip
        heal_and_rejoin(cluster, kind, lost)
        late = start + timedelta(milliseconds=5 * events)
        client.create_many(  # work after the heal: only the rejoined host is left to do it
            {"owner_client_id": "a", "group_key": "g", "event_key": f"after{i}", "run_at": late, "cb_url": sink.url}
            for i in range(200)
        )
        with db.connection() as conn:
            wait_until(
                lambda: (
                    conn.execute("SELECT count(*) FROM callback_events WHERE status <> 'notified'").fetchone()[0] == 0
                ),
                timeout=120,
                what="every event notified",
            )
            bucket_of = dict(conn.execute("SELECT event_key, bucket_id::text FROM callback_events").fetchall())
            attempts = dict(conn.execute("SELECT event_key, attempts FROM callback_events").fetchall())
        calls = list(sink.calls)

    keys = Counter(call.body["event_key"] for call, _ in calls)
    assert set(keys) == set(bucket_of), "an event was never called"
    intervals = cluster.held(kind)
    outside = [
        (call.body["event_key"], side_address.get(address), call.started - cut_at)
        for call, address in calls
        if not was_held(intervals, side_address.get(address, 0), bucket_of[call.body["event_key"]], call.started)
    ]
    assert not outside, f"calls by a host not holding the event's bucket (key, host, seconds after the cut): {outside}"
    # at most one call per gate pass (``attempts`` counts them); a gate pass whose commit the cut lost is not counted,
    # but its calls started: one more call than counted, for events the cut host called at most
    twice = {key for key, n in keys.items() if n > 1}
    uncounted = {key for key, n in keys.items() if n > attempts[key]}
    first_caller = {}
    for call, address in calls:
        first_caller.setdefault(call.body["event_key"], side_address.get(address))
    assert max(keys.values()) <= 2, keys.most_common(3)
    assert all(first_caller[key] == CUT for key in twice | uncounted), twice | uncounted
    assert all(keys[key] <= attempts[key] + 1 for key in uncounted) and len(uncounted) <= concurrency, uncounted
    print(f"callbacks: {len(calls)} calls of {len(keys)} events; called twice (in flight at the cut): {len(twice)}")


# -- pub/sub -------------------------------------------------------------------------------------------------------


def test_pubsub_partition(cluster: Cluster, tmp_path: Path) -> None:
    db, kind, partition = cluster.db, "pubsub.consumer", "results@0"
    events = 2000
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (item int NOT NULL, pid int NOT NULL)")
        for n in range(events):
            publish(0, {"n": n}, topic="work", conn=conn)
    args = ["pubsub", "consume", "results", "--handler", "multihost_handlers:pubsub_record", "--batch-size", "20",
            "--lease-ttl", str(TTL)]  # fmt: skip
    for host in cluster.net.hosts:
        cluster.start(host, *args, log_dir=tmp_path)
        if host == CUT:
            wait_until(lambda: cluster.holding(kind), timeout=30, what="the first host holds the consumer")

    def calls_by(host: int) -> int:
        return sum(h == host for h, _, _ in cluster.calls(tmp_path))

    cut_at, lost = cut_mid_batch(cluster, kind, lambda: calls_by(CUT) >= 5)
    others_then = sum(calls_by(h) for h in cluster.net.hosts if h != CUT)
    wait_until(lambda: sum(calls_by(h) for h in cluster.net.hosts if h != CUT) >= others_then + 5, timeout=60,
               what="the work goes on on the other hosts")  # fmt: skip
    heal_and_rejoin(cluster, kind, lost)
    with db.connection() as conn:
        for n in range(events, events + 100):  # published after the heal: only the rejoined host is left
            publish(0, {"n": n}, topic="work", conn=conn)

    def results() -> list[tuple[int, int]]:
        with db.connection() as conn:
            return conn.execute("SELECT item, pid FROM public.results").fetchall()

    wait_until(lambda: len(results()) >= events + 100, timeout=120, what="every event handled")
    check_same_database_results(cluster, tmp_path, kind, {partition}, results(), range(events + 100), cut_at)


def check_same_database_results(cluster, log_dir, kind, partitions, rows, expected, cut_at) -> None:  # type: ignore[no-untyped-def]
    """Exactly once for what committed, every call of user code inside a lease its host held, for each partition."""
    items = Counter(item for item, _ in rows)
    assert set(items) == set(expected), f"lost: {sorted(set(expected) - set(items))[:20]}"
    assert max(items.values()) == 1, f"applied twice: {[i for i, n in items.items() if n > 1][:20]}"
    intervals = cluster.held(kind)
    calls = cluster.calls(log_dir)
    outside = [
        (host, round(at - cut_at, 2), batch[:3])
        for host, at, batch in calls
        if not any(was_held(intervals, host, partition, at) for partition in partitions)
    ]
    assert not outside, (
        f"user code called by a host not holding the partition (host, s after the cut, items): {outside}"
    )
    cut_host_calls = [round(at - cut_at, 2) for host, at, _ in calls if host == CUT and at > cut_at - 1]
    print(f"{kind}: {len(calls)} calls; the cut host's calls from 1 s before the cut (s after it): {cut_host_calls}")


# -- event queue ---------------------------------------------------------------------------------------------------

# Every claim of an event (and renewal of it), with the address of the host that made it.
CLAIM_HISTORY = """
CREATE TABLE public.claim_history (
    id bigint, visible_at timestamptz, client inet, at timestamptz DEFAULT clock_timestamp()
);
CREATE FUNCTION public.record_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.claim_history (id, visible_at, client) VALUES (NEW.id, NEW.visible_at, inet_client_addr());
    RETURN NULL;
END $$;
CREATE TRIGGER claim_history AFTER UPDATE ON cmb.eventqueue_events FOR EACH ROW WHEN (NEW.locked_at IS NOT NULL)
EXECUTE FUNCTION public.record_claim();
"""


def test_eventqueue_partition(cluster: Cluster, tmp_path: Path) -> None:
    import multihost_handlers

    net, db = cluster.net, cluster.db
    client_host = {net.host_address(host): host for host in net.hosts}
    register(db, multihost_handlers.eventqueue)
    with db.connection() as conn:
        conn.execute(CLAIM_HISTORY)
    events = 500
    ids = emit_many([{"namespace": "ns", "handler": "record", "value": i} for i in range(events)], db=db)
    args = ["events", "worker", "--handlers", "multihost_handlers:eventqueue", "--batch-size", "100",
            "--sweep-interval", "0.5"]  # fmt: skip
    for host in net.hosts:
        cluster.start(host, *args, log_dir=tmp_path)

    def claims() -> list[tuple[int, int, float, float]]:
        """(event id, host, claimed or renewed at, until) of every claim so far."""
        with db.connection() as conn:
            rows = conn.execute(
                "SELECT id, host(client), extract(epoch FROM at), extract(epoch FROM visible_at)"
                " FROM public.claim_history"
            ).fetchall()
        return [(i, client_host.get(c, 0), float(at), float(until)) for i, c, at, until in rows]

    def calls_by(host: int) -> list[float]:
        return [at for h, at, _ in cluster.calls(tmp_path) if h == host]

    wait_until(lambda: len(calls_by(CUT)) >= 30 and time.time() - max(calls_by(CUT)) < 0.1, timeout=60,
               what="the first host runs handlers")  # fmt: skip
    logged = len(cluster.log(CUT))
    cut_at = net.cut(CUT)

    def cut_host_claims_lapsed() -> bool:
        with db.connection() as conn:
            now = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0]
        return all(until < float(now) for _, host, _, until in claims() if host == CUT)

    wait_until(cut_host_claims_lapsed, timeout=60, what="the cut host's claims lapse")
    others_then = sum(len(calls_by(h)) for h in net.hosts if h != CUT)
    wait_until(lambda: sum(len(calls_by(h)) for h in net.hosts if h != CUT) >= others_then + 50, timeout=60,
               what="the work goes on on the other hosts")  # fmt: skip
    assert_noticed(cluster, logged, cut_at, 3.0)  # the handler's lock expiry
    net.heal(CUT)
    stop([p for host, p in cluster.procs.items() if host != CUT])
    ids += emit_many([{"namespace": "ns", "handler": "record", "value": i} for i in range(events, events + 50)], db=db)
    with db.connection() as conn:
        wait_until(
            lambda: conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0] == 0,
            timeout=120,
            what="every event handled and deleted (the rejoined host alone for the last ones)",
        )
    assert cluster.procs[CUT].poll() is None, cluster.log(CUT)[-3000:]
    calls = cluster.calls(tmp_path)
    runs = Counter(items[0] for _, _, items in calls)
    assert set(runs) == set(ids), f"never run: {sorted(set(ids) - set(runs))[:20]}"
    assert any(host == CUT and at > cut_at + TTL for host, at, _ in calls), "the healed host ran nothing again"
    history = claims()
    outside = [
        (host, items[0], round(at - cut_at, 2))
        for host, at, items in calls
        if not any(i == items[0] and h == host and start <= at <= until for i, h, start, until in history)
    ]
    assert not outside, f"handlers run by a host whose claim had lapsed (host, event, s after the cut): {outside}"
    # at least once: a second run only for events the cut host had run, and not deleted, when it was cut off
    first_runner: dict[int, int] = {}
    for host, _, items in calls:
        first_runner.setdefault(items[0], host)
    twice = {i for i, n in runs.items() if n > 1}
    assert max(runs.values()) <= 2 and all(first_runner[i] == CUT for i in twice), twice
    print(f"eventqueue: {len(calls)} runs of {len(runs)} events; run twice (in flight at the cut): {len(twice)}")


# -- stages --------------------------------------------------------------------------------------------------------


def test_stages_partition(cluster: Cluster, tmp_path: Path) -> None:
    import multihost_handlers

    db, kind, options = cluster.db, "stages.shard", multihost_handlers.stages
    store = StageStore(db, options.stages)
    entities = 1500
    store.put_many({f"e{i}": {"n": i} for i in range(entities)})
    args = ["stages", "worker", "--stages", "multihost_handlers:stages"]
    for host in cluster.net.hosts:
        cluster.start(host, *args, log_dir=tmp_path)
        if host == CUT:
            wait_until(lambda: len(cluster.holding(kind)) >= options.shard_count, timeout=30,
                       what="the first host holds every shard")  # fmt: skip

    def calls_by(host: int) -> int:
        return sum(h == host for h, _, _ in cluster.calls(tmp_path))

    cut_at, lost = cut_mid_batch(cluster, kind, lambda: calls_by(CUT) >= 100)
    others_then = sum(calls_by(h) for h in cluster.net.hosts if h != CUT)
    wait_until(lambda: sum(calls_by(h) for h in cluster.net.hosts if h != CUT) >= others_then + 100, timeout=60,
               what="the work goes on on the other hosts")  # fmt: skip
    heal_and_rejoin(cluster, kind, lost)
    store.put_many({f"e{i}": {"n": i} for i in range(entities, entities + 100)})  # only the rejoined host is left

    def rows() -> list[tuple[str, int, int]]:
        with db.connection() as conn:
            return conn.execute(
                "SELECT e.entity_id, e.version, (s.state->>'runs')::int FROM stage_entities e"
                " LEFT JOIN stage_states s ON s.entity_id = e.entity_id AND s.stage = 'mark'"
            ).fetchall()

    wait_until(lambda: all(runs == 1 for _, _, runs in rows()) and len(rows()) == entities + 100, timeout=120,
               what="every entity through the stage")  # fmt: skip
    found = rows()
    assert all(version == 2 for _, version, _ in found), "an entity changed more than once (put, then the stage)"
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM stage_queue").fetchone()[0] == 0
    intervals, count = cluster.held(kind), options.shard_count
    calls = cluster.calls(tmp_path)
    outside = [
        (host, batch[0], round(at - cut_at, 2))
        for host, at, batch in calls
        if not was_held(intervals, host, f"shard:{shard_of(batch[0], count)}/{count}", at)
    ]
    assert not outside, f"stage run by a host not holding the entity's shard (host, entity, s after the cut): {outside}"
    runs = Counter(batch[0] for _, _, batch in calls)
    print(f"stages: {len(calls)} calls of {len(runs)} entities; called again after a lost commit: "
          f"{sum(n > 1 for n in runs.values())}")  # fmt: skip


# -- reactive scheduler --------------------------------------------------------------------------------------------


def test_reactive_partition(cluster: Cluster, tmp_path: Path) -> None:
    import multihost_handlers

    db, kind, partition = cluster.db, "reactive.scheduler", "multihost"
    producer = CtlProducer(db, multihost_handlers.REACTIVE_TASKS)
    try:
        for host in cluster.net.hosts:
            script = f"import multihost_handlers as m; m.reactive_worker({cluster.net.database_url(host)!r})"
            cluster.start(host, "-c", script, log_dir=tmp_path, program=sys.executable)
            if host == CUT:
                wait_until(lambda: cluster.holding(kind), timeout=30, what="the first host holds the scheduler")

        def calls_by(host: int) -> int:
            return sum(h == host for h, _, _ in cluster.calls(tmp_path))

        ttl = 1 + 10  # the scheduler's lease: tick_seconds + 10
        cut_at, lost = cut_mid_batch(cluster, kind, lambda: calls_by(CUT) >= 5, ttl=ttl)
        others_then = sum(calls_by(h) for h in cluster.net.hosts if h != CUT)
        wait_until(lambda: sum(calls_by(h) for h in cluster.net.hosts if h != CUT) >= others_then + 3, timeout=60,
                   what="the work goes on on the other hosts")  # fmt: skip
        healed_at = heal_and_rejoin(cluster, kind, lost)
        wait_until(lambda: any(h == CUT and at > healed_at for h, at, _ in cluster.calls(tmp_path)), timeout=60,
                   what="the rejoined host launches again")  # fmt: skip
    finally:
        final = producer.stop()
    wait_until(lambda: launched_last(cluster.calls(tmp_path)) == final, timeout=60,
               what="every last CTL change launched (nothing lost)")  # fmt: skip
    with db.connection() as conn:
        rows = conn.execute("SELECT task, values_hash, attempt FROM reactive_launches").fetchall()
    assert len({(task, digest) for task, digest, _ in rows}) == len(rows), "a set of values launched twice"
    calls = cluster.calls(tmp_path)
    run_keys = Counter(run_key for _, _, launches in calls for _, run_key, _ in launches)
    assert max(run_keys.values()) == 1, [k for k, n in run_keys.items() if n > 1][:10]
    intervals = cluster.held(kind)
    outside = [(host, round(at - cut_at, 2)) for host, at, _ in calls if not was_held(intervals, host, partition, at)]
    assert not outside, f"launches by a host not holding the scheduler (host, s after the cut): {outside}"
    print(f"reactive: {len(calls)} launch calls, {sum(run_keys.values())} runs; cut host's calls after the cut: "
          f"{[round(at - cut_at, 2) for h, at, _ in calls if h == CUT and at > cut_at]}")  # fmt: skip
