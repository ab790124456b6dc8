import os
import random
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.pubsub import install_capture, publish

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
HERE = Path(__file__).parent


def env_for(database_url):
    return {**os.environ, "CMB_DATABASE_URL": database_url, "PYTHONPATH": str(HERE)}  # for pubsub_handlers


def cli(database_url, *args):
    return subprocess.run(
        [*CLI, "pubsub", *args], check=False, env=env_for(database_url), capture_output=True, text=True, timeout=120
    )


def results(database_url):
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT count(*), count(DISTINCT event_id) FROM public.results").fetchone()


def held(database_url) -> bool:
    """Whether a consumer holds its lease."""
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT count(*) FROM cmb.leases WHERE expires_at > now()").fetchone() == (1,)


def consuming(database_url, before, running):
    """Wait until a consumer adds results; if none does within 30 s, fail saying what the database and the
    consumers were doing."""
    try:
        wait_until(lambda: results(database_url)[0] > before, timeout=30, what="a consumer adding results")
    except AssertionError as exc:
        with psycopg.connect(database_url, autocommit=True) as conn:
            activity = conn.execute(
                "SELECT pid, application_name, state, wait_event_type, wait_event, now() - xact_start, "
                "left(query, 120) "
                "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
            waiting = conn.execute(
                "SELECT pid, locktype, mode, relation::regclass FROM pg_locks WHERE NOT granted"
            ).fetchall()
            leases = conn.execute("SELECT partition, owner, fence, expires_at - now() FROM cmb.leases").fetchall()
            events = conn.execute("SELECT count(*) FROM cmb.pubsub_events").fetchone()
        logs = "\n".join(f"{proc.log.name} (exit {proc.poll()}): {proc.log.read_text()[-1500:]}" for proc in running)
        raise AssertionError(
            f"{exc}: {before} results, {events[0]} events\nbackends: {activity}\nwaiting: {waiting}\n"
            f"leases: {leases}\n{logs}"
        ) from None


def test_kill_9_at_random_points_over_100k_events_leaves_each_result_exactly_once(database_url, tmp_path):
    db = Database(database_url)
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint NOT NULL)")  # no unique key: duplicates would show
        conn.execute("CREATE TABLE public.orders (id bigint PRIMARY KEY, amount int NOT NULL)")
        install_capture(conn, "public.orders")
        conn.execute("INSERT INTO public.orders SELECT g, g % 100 FROM generate_series(1, 50000) g")

    def produce():  # the second half arrives while the consumer crashes and restarts
        with db.connect() as conn:
            for start in range(50001, 100001, 1000):
                conn.execute(
                    "INSERT INTO public.orders SELECT g, 1 FROM generate_series(%s, %s) g", (start, start + 999)
                )
                conn.commit()

    producer = threading.Thread(target=produce)
    producer.start()
    command = [
        *CLI,
        "pubsub",
        "consume",
        "crash",
        "--handler",
        "pubsub_handlers:record",
        "--batch-size",
        "500",
        "--lease-ttl",
        "1",
    ]
    rng = random.Random(9)
    logs = iter(tmp_path / f"consumer{n}.log" for n in range(100))

    def start():
        log = next(logs)
        proc = subprocess.Popen(command, env=env_for(database_url), stdout=subprocess.DEVNULL, stderr=log.open("w"))
        proc.log = log
        return proc

    running = [start(), start()]  # identical consumers: one works, the other stands by
    kills = 0
    try:
        while results(database_url)[0] < 100_000 and kills < 8:
            before = results(database_url)[0]
            consuming(database_url, before, running)
            time.sleep(rng.uniform(0, 0.5))  # a random point of its work
            victim = running.pop(rng.randrange(len(running)))
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            kills += 1
            running.append(start())
        producer.join(60)
        wait_until(lambda: results(database_url)[0] >= 100_000, timeout=90)
    except BaseException:
        for proc in running:
            proc.kill()
        raise
    for proc in running:
        wait_until(lambda proc=proc: "started" in proc.log.read_text(), timeout=30)  # its SIGTERM handler is set
        proc.send_signal(signal.SIGTERM)
    codes = [proc.wait(30) for proc in running]
    assert codes == [0, 0], [proc.log.read_text() for proc in running]
    assert kills >= 3
    assert results(database_url) == (100_000, 100_000)
    with psycopg.connect(database_url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM public.orders o"
            " JOIN cmb.pubsub_events e ON (e.key->>'id')::bigint = o.id"
            " JOIN public.results r ON r.event_id = e.id"
        ).fetchone() == (100_000,)
    db.close()


def test_sigterm_at_any_moment_of_a_consumers_start_or_while_its_database_is_away_stops_it(database_url, server_url):
    """The signal lands before, while and after the consumer registers and takes its lease, and once while its
    database refuses connections (each lease renewal fails); each time the process ends by itself."""
    with psycopg.connect(database_url) as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint PRIMARY KEY)")
        for n in range(200):
            publish(0, {"n": n}, conn=conn)
    command = [*CLI, "pubsub", "consume", "sig", "--handler", "pubsub_handlers:record", "--lease-ttl", "1"]
    name = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]
    rng = random.Random(11)
    for moment in [*(rng.uniform(0, 2) for _ in range(6)), None]:
        proc = subprocess.Popen(command, env=env_for(database_url), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            if moment is None:
                wait_until(lambda: held(database_url), timeout=60, what="the consumer holding its lease")
                with psycopg.connect(server_url, autocommit=True) as conn:
                    conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
                    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name])
                time.sleep(2)  # renewals fail meanwhile
            else:
                time.sleep(moment)
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"SIGTERM did not stop the consumer (at {moment or 'the database away'})") from None
        finally:
            proc.kill()
            proc.stderr.close()
            if moment is None:
                with psycopg.connect(server_url, autocommit=True) as conn:
                    conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')


def test_sigterm_stops_a_consumer_whose_parent_ignored_it_before_its_handler_is_set():
    """Started with SIGTERM ignored (inherited from a shell's background job, or from a process where Dagster mapped
    SIGTERM to an ignored SIGINT), while it waits for a database that does not answer: SIGTERM still ends it."""
    with socket.socket() as mute:  # accepts connections (the kernel's backlog) and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        url = f"postgresql://postgres@127.0.0.1:{mute.getsockname()[1]}/postgres"
        command = shlex.join([*CLI, "pubsub", "consume", "mute", "--handler", "pubsub_handlers:record"])
        proc = subprocess.Popen(
            ["sh", "-c", f"trap '' TERM; exec {command}"], env=env_for(url), stderr=subprocess.DEVNULL
        )
        try:
            assert select.select([mute], [], [], 60)[0], "the consumer never connected"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == -signal.SIGTERM
        finally:
            proc.kill()
            proc.wait()


def test_cli_status_trim_drop_and_reset_after_a_restore(database_url):
    db = Database(database_url)
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint NOT NULL)")
        for n in range(3):
            publish(0, {"n": n}, conn=conn)
    first = cli(database_url, "consume", "reporter", "--handler", "pubsub_handlers:record", "--duration", "1")
    assert first.returncode == 0, first.stderr
    assert "consumer reporter (branch 0): 3 events" in first.stdout
    again = cli(database_url, "consume", "reporter", "--duration", "0.5")  # the registered handler
    assert again.returncode == 0 and "0 events" in again.stdout, again.stderr
    status = cli(database_url, "status")
    assert "reporter  branch 0  delivered 3  behind 0 (0.0s)  handler pubsub_handlers:record" in status.stdout
    assert cli(database_url, "trim", "--retain-days", "0").stdout.strip() == "deleted 3 delivered events"
    assert "nothing to re-base" in cli(database_url, "reset").stdout
    with db.connection() as conn:  # what a pg_restore into a younger cluster looks like
        conn.execute("UPDATE pubsub_clock SET system_identifier = 42")
        conn.execute("UPDATE pubsub_watermarks SET snapshot = '5000000:5000000:'")
    refused = cli(database_url, "consume", "reporter", "--duration", "1")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "cluster 42" in refused.stderr and "cmb-dagster pubsub reset" in refused.stderr
    assert "re-based the stream's txids" in cli(database_url, "reset").stdout
    with db.connection() as conn:
        publish(0, {"n": "after"}, conn=conn)
    resumed = cli(database_url, "consume", "reporter", "--duration", "1")
    assert "1 events" in resumed.stdout, resumed.stderr
    assert "dropped consumer reporter" in cli(database_url, "drop", "reporter").stdout
    unknown = cli(database_url, "consume", "nobody", "--duration", "1")
    assert unknown.returncode == 1 and "has no registered handler" in unknown.stderr
    db.close()


def test_cli_status_names_a_stuck_or_parked_event_and_dead_and_replay_handle_it(database_url):
    db = Database(database_url)
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (event_id bigint NOT NULL)")
        conn.execute("CREATE TABLE public.fixed (ok boolean)")
        ids = [publish(0, {"n": n}, conn=conn) for n in range(3)]
    stuck = cli(
        database_url,
        "consume",
        "stubborn",
        "--handler",
        "pubsub_handlers:fragile",
        "--on-poison",
        "stop",
        "--max-attempts",
        "1",
        "--duration",
        "2",
    )
    assert stuck.returncode == 0, stuck.stderr
    assert "stuck on event" in stuck.stderr
    status = cli(database_url, "status").stdout
    assert f"! stuck on event {ids[1]} after" in status and "ValueError: cannot handle n=1" in status
    parking = cli(
        database_url,
        "consume",
        "tolerant",
        "--handler",
        "pubsub_handlers:fragile",
        "--max-attempts",
        "1",
        "--duration",
        "2",
    )
    assert "parked event" in parking.stderr, parking.stderr
    assert "1 parked event(s)" in cli(database_url, "status").stdout
    dead = cli(database_url, "dead", "tolerant").stdout
    assert f"tolerant  branch 0  event {ids[1]} (default publish)  1 attempts" in dead and "parked: ValueError" in dead
    failing = cli(database_url, "replay", "tolerant")
    assert failing.returncode == 1 and "replayed 0 parked events; 1 failed again" in failing.stdout
    with db.connection() as conn:
        conn.execute("INSERT INTO public.fixed VALUES (true)")
    assert "replayed 1 parked events; 0 failed" in cli(database_url, "replay", "tolerant").stdout
    assert cli(database_url, "dead").stdout.strip() == "no parked events"
    assert "replayed" in cli(database_url, "dead", "--all").stdout
    with psycopg.connect(database_url) as conn:  # tolerant: 0 and 2 by the consumer, 1 by the replay
        assert conn.execute("SELECT count(*) FROM public.results").fetchone()[0] == 4
    db.close()
