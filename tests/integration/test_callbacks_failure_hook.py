"""Failure hooks: an event that fails for good calls its on_failure target (or its owner's) once, with what failed;
a hook is an event itself (retried, signed, listed), and a failing hook has no hook."""

import json
from datetime import UTC, datetime

import pytest
from receiver import Receiver
from running import Running
from standardwebhooks import Webhook
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, CallbackWorker, InvalidCallbackInput, RetryPolicy
from cmb_dagster.models import Backoff

FAST = CallbackSettings(
    poll_interval=0.2, lease_ttl=3, timeout=1, backoff=Backoff(first=0.01), lookahead=1, allowed_hosts=["127.0.0.1"]
)
SHORT = RetryPolicy(stop_after_delay=0.3, fast_retries=0, delay=0.1)


def answer(request):
    return (500, b"broken") if request.path.startswith("/fail") else (200, b"ok")


@pytest.fixture
def client(db):
    with CallbackClient(db, FAST) as c:
        yield c


def rows(db, where: str) -> list[tuple]:
    with db.connection() as conn:
        return conn.execute(f"SELECT status, event_key, failure_of FROM callback_events WHERE {where}").fetchall()


def test_an_event_that_fails_for_good_calls_its_hook_once(db, client):
    secret = client.rotate_secret("shop")
    with Receiver(answer) as receiver, Running(CallbackWorker(db, FAST)):
        client.create(
            "shop",
            "orders",
            "o-1",
            datetime.now(UTC),
            f"{receiver.url}/fail",
            retry=SHORT,
            on_failure=f"{receiver.url}/hook",
        )
        client.create(
            "shop", "orders", "fine", datetime.now(UTC), f"{receiver.url}/cb", on_failure=f"{receiver.url}/hook"
        )
        (hook,) = wait_until(lambda: receiver.received("/hook"))
        wait_until(lambda: rows(db, "group_key = 'cmb.failure' AND status = 'notified'"))
    failed = client.get("shop", "orders", "o-1")
    body = Webhook(secret).verify(hook.body, hook.headers)  # signed as the owner's calls are
    assert body == {
        "owner_client_id": "shop",
        "group_key": "orders",
        "event_key": "o-1",
        "webhook_id": failed.webhook_id,
        "url": f"{receiver.url}/fail",
        "attempts": failed.attempts,
        "replays": 0,
        "last_error": "HTTP 500 Internal Server Error",
        "status_code": 500,
        "response": "broken",
        "failed_at": body["failed_at"],
    }
    assert datetime.fromisoformat(body["failed_at"]) == failed.finished_at
    (hook_event,) = client.list("shop", "cmb.failure")
    assert hook.headers["webhook-id"] == hook_event.webhook_id != failed.webhook_id
    assert (hook_event.status, hook_event.failure_of) == ("notified", failed.message_id)
    assert len(receiver.received("/hook")) == 1  # none for the event that succeeded


def test_the_owners_hook_serves_events_without_their_own_and_a_failing_hook_has_none(db, client):
    with Receiver(answer) as receiver:
        client.set_failure_hook("shop", f"{receiver.url}/fail-hook")  # a hook that fails too
        with pytest.raises(InvalidCallbackInput, match="on_failure"):
            client.set_failure_hook("shop", "http://10.0.0.1/hook")  # closed, as any target
        with pytest.raises(InvalidCallbackInput, match="group_key"):
            client.create("shop", "cmb.failure", "x", datetime.now(UTC), f"{receiver.url}/cb")
        now = datetime.now(UTC)
        client.create("shop", "orders", "o-1", now, f"{receiver.url}/fail", retry=SHORT)
        client.create(
            "shop", "orders", "o-2", now, f"{receiver.url}/fail", retry=SHORT, on_failure=f"{receiver.url}/own"
        )
        client.create("other", "orders", "o-3", now, f"{receiver.url}/fail", retry=SHORT)  # no hook at all
        with Running(CallbackWorker(db, FAST)):
            wait_until(lambda: receiver.received("/own") and receiver.received("/fail-hook"))
            hook_key = rows(db, "group_key = 'cmb.failure' AND cb_url LIKE '%fail-hook'")[0][1]
            with db.connection() as conn:  # the failing hook (retried for a day by default) gives up soon
                conn.execute(
                    "UPDATE callback_events SET retry = %s WHERE event_key = %s",
                    (SHORT.model_dump_json(), hook_key),
                )
            client.update("shop", "cmb.failure", hook_key, run_at=datetime.now(UTC))
            wait_until(lambda: rows(db, "group_key = 'cmb.failure' AND status = 'failed'"), timeout=20)
            wait_until(lambda: rows(db, "group_key = 'cmb.failure' AND status = 'notified'"))
    own = json.loads(receiver.received("/own")[0].body)
    assert own["event_key"] == "o-2"
    assert json.loads(receiver.received("/fail-hook")[0].body)["event_key"] == "o-1"
    assert len(rows(db, "group_key = 'cmb.failure'")) == 2  # none for o-3, none for the failed hook
    assert rows(db, "owner_client_id = 'other'") == [("failed", "o-3", None)]


def test_a_replayed_event_that_fails_again_calls_its_hook_again(db, client):
    with Receiver(answer) as receiver, Running(CallbackWorker(db, FAST)):
        client.create(
            "shop",
            "orders",
            "o-1",
            datetime.now(UTC),
            f"{receiver.url}/fail",
            retry=SHORT,
            on_failure=f"{receiver.url}/hook",
        )
        wait_until(lambda: len(receiver.received("/hook")) == 1)
        assert client.replay("shop") == 1
        wait_until(lambda: len(receiver.received("/hook")) == 2)
    bodies = [json.loads(r.body) for r in receiver.received("/hook")]
    assert [b["replays"] for b in bodies] == [0, 1]
    assert len({r.headers["webhook-id"] for r in receiver.received("/hook")}) == 2


class Launcher:
    def __init__(self) -> None:
        self.launched: list[tuple[str, dict]] = []

    def launch(self, job_name, *, run_key, run_config, tags):
        self.launched.append((job_name, dict(tags)))
        return "run"


def test_a_dagster_hook_launches_a_run_tagged_with_the_failed_event(db, client):
    launcher = Launcher()
    with Receiver(answer) as receiver, Running(CallbackWorker(db, FAST, launcher=launcher)):
        client.create(
            "shop",
            "orders",
            "o-1",
            datetime.now(UTC),
            f"{receiver.url}/fail",
            retry=SHORT,
            on_failure="dagster://on_callback_failure",
        )
        wait_until(lambda: launcher.launched)
    ((job, tags),) = launcher.launched
    failed = client.get("shop", "orders", "o-1")
    assert job == "on_callback_failure"
    assert tags["cmb/failed_callback"] == "shop/orders/o-1"
    assert tags["cmb/failed_message"] == failed.webhook_id
