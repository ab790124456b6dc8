"""The failure hook of each event that fails for good is called across a kill -9 of the worker: no event without
its hook, and one hook call per failed event counted by webhook-id (a call in flight at the kill may repeat with
its id)."""

import json
import os
import signal
import subprocess
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta

from processes import stop
from receiver import Receiver
from test_callbacks_crash import WORKER
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, EndpointPolicy, RetryPolicy

EVENTS = 300


def answer(request):
    if request.path == "/hook":
        time.sleep(0.2)  # hooks take a while: some are in flight at the kill
        return 200, b"ok"
    return 500, b"broken"


def count(db, where: str) -> int:
    with db.connection() as conn:
        return conn.execute(f"SELECT count(*) FROM callback_events WHERE {where}").fetchone()[0]


def test_each_failed_event_calls_its_hook_across_a_kill_9(db, database_url):
    settings = CallbackSettings(allowed_hosts=["127.0.0.1"])
    with Receiver(answer) as receiver, CallbackClient(db, settings) as client:
        client.set_endpoint_policy("shop", EndpointPolicy(breaker=False))  # each event fails on its own
        start = datetime.now(UTC)
        client.create_many(
            {
                "owner_client_id": "shop",
                "group_key": "orders",
                "event_key": f"o-{i}",
                "run_at": start + timedelta(milliseconds=10 * i),
                "cb_url": f"{receiver.url}/fail",
                "retry": RetryPolicy(stop_after_delay=0.3, fast_retries=0, delay=0.1),
                "on_failure": f"{receiver.url}/hook",
            }
            for i in range(EVENTS)
        )
        env = {**os.environ, "CMB_DATABASE_URL": database_url, "CMB_CALLBACK_ALLOWED_HOSTS": "127.0.0.1"}
        first = subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: len(receiver.received("/hook")) >= 50, timeout=60)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        finally:
            stop([first])
        assert count(db, "group_key = 'cmb.failure' AND status = 'notified'") < EVENTS, "the kill came too late"
        second = subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: count(db, "group_key = 'cmb.failure' AND status = 'notified'") == EVENTS, timeout=60)
        finally:
            stop([second])
        assert count(db, "group_key = 'orders' AND status = 'failed'") == EVENTS
        hook_ids = defaultdict(set)
        for request in receiver.received("/hook"):
            hook_ids[json.loads(request.body)["event_key"]].add(request.headers["webhook-id"])
    assert set(hook_ids) == {f"o-{i}" for i in range(EVENTS)}  # no failed event without its hook
    assert all(len(ids) == 1 for ids in hook_ids.values())  # one hook per failed event, by webhook-id
