"""Signed callbacks: a receiver verifies every call with the ``standardwebhooks`` package; secrets rotate and are
never shown again."""

import json
import logging
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
import standardwebhooks.webhooks
from callback_settings import FAST as FAST_SETTINGS
from receiver import Receiver
from running import Running
from standardwebhooks import Webhook, WebhookVerificationError
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackWorker, InvalidCallbackInput, RetryPolicy

FAST = FAST_SETTINGS.model_copy(update={"secrets_refresh": 0.2})
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


@pytest.fixture
def client(db):
    with CallbackClient(db, FAST) as c:
        yield c


def call(client, receiver, key, owner="shop", path="/cb", **kwargs):
    client.create(owner, "orders", key, datetime.now(UTC), f"{receiver.url}{path}", {"n": key}, **kwargs)


def test_a_receiver_verifies_each_call_and_refuses_a_tampered_or_stale_one(db, client, monkeypatch):
    secret = client.rotate_secret("shop")
    assert secret.startswith("whsec_")
    with Receiver() as receiver, Running(CallbackWorker(db, FAST)):
        call(client, receiver, "o-1")
        (request,) = wait_until(receiver.received)
    event = client.get("shop", "orders", "o-1")
    assert request.headers["webhook-id"] == event.webhook_id == f"cb_{event.message_id}"
    assert abs(int(request.headers["webhook-timestamp"]) - datetime.now(UTC).timestamp()) < 60
    verified = Webhook(secret).verify(request.body, request.headers)
    assert verified["event_key"] == "o-1" and verified["context"] == {"n": "o-1"}

    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(request.body.replace(b"o-1", b"o-2"), request.headers)  # tampered body
    with pytest.raises(WebhookVerificationError):  # another id
        Webhook(secret).verify(request.body, {**request.headers, "webhook-id": request.headers["webhook-id"] + "0"})
    with pytest.raises(WebhookVerificationError):  # another secret
        Webhook(client.rotate_secret("other")).verify(request.body, request.headers)
    moved = str(int(request.headers["webhook-timestamp"]) + 1)  # a fresh timestamp on an old signature
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(request.body, {**request.headers, "webhook-timestamp": moved})

    class TenMinutesLater(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(minutes=10)

    monkeypatch.setattr(standardwebhooks.webhooks, "datetime", TenMinutesLater)
    with pytest.raises(WebhookVerificationError, match="too old"):  # the same request, replayed 10 minutes later
        Webhook(secret).verify(request.body, request.headers)


def test_retries_of_an_event_carry_one_id_and_an_update_starts_another(db, client):
    secret = client.rotate_secret("shop")
    answers = iter([500, 500])

    def answer(request):
        return next(answers, 200), b""

    retry = RetryPolicy(fast_retries=3)
    with Receiver(answer) as receiver, Running(CallbackWorker(db, FAST)):
        call(client, receiver, "o-1", retry=retry, body="context")
        wait_until(lambda: len(receiver.received()) == 3)
        calls = receiver.received()
        client.create("shop", "orders", "o-2", datetime.now(UTC) + timedelta(hours=1), f"{receiver.url}/cb")
        before = client.get("shop", "orders", "o-2")
        client.update("shop", "orders", "o-2", run_at=datetime.now(UTC))
        wait_until(lambda: len(receiver.received()) == 4)
    assert len({r.headers["webhook-id"] for r in calls}) == 1
    for r in calls:
        assert json.loads(r.body) == {"n": "o-1"}  # the context alone, signed as sent
        Webhook(secret).verify(r.body, r.headers)
    updated = receiver.received()[3]
    assert updated.headers["webhook-id"] == client.get("shop", "orders", "o-2").webhook_id != before.webhook_id


def test_rotation_signs_with_both_secrets_until_the_old_one_is_retired(db, client):
    with Receiver() as receiver, Running(CallbackWorker(db, FAST)):
        call(client, receiver, "unsigned")
        (unsigned,) = wait_until(receiver.received)
        assert "webhook-signature" not in unsigned.headers  # an owner without a secret: id and timestamp only
        assert unsigned.headers["webhook-id"].startswith("cb_")

        old = client.rotate_secret("shop")
        new = client.rotate_secret("shop", previous_valid_for=None)
        newest = client.rotate_secret("shop", previous_valid_for=None)  # the oldest is retired: two stay active

        def signatures():
            """The signatures of a new call (the worker signs with the secrets it read within secrets_refresh)."""
            key = f"k{len(receiver.received())}"
            call(client, receiver, key)
            request = wait_until(lambda: next((r for r in receiver.received() if key.encode() in r.body), None))
            return request.headers["webhook-signature"].split(" ") if "webhook-signature" in request.headers else []

        wait_until(lambda: len(signatures()) == 2)
        request = receiver.received()[-1]
        Webhook(new).verify(request.body, request.headers)
        Webhook(newest).verify(request.body, request.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(old).verify(request.body, request.headers)

        assert client.retire_secrets("shop") == 1
        wait_until(lambda: len(signatures()) == 1)
        request = receiver.received()[-1]
        Webhook(newest).verify(request.body, request.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(new).verify(request.body, request.headers)

        assert client.retire_secrets("shop", keep_newest=False) == 1
        wait_until(lambda: signatures() == [])


def test_a_rotated_secret_is_shown_once_and_nowhere_else(db, database_url, client, caplog):
    given = "whsec_" + "QUJD" * 8  # 24 bytes
    assert client.rotate_secret("shop", given) == given
    for bad in ("QUJD" * 8, "whsec_not base64!", "whsec_QUJD"):
        with pytest.raises(InvalidCallbackInput) as raised:
            client.rotate_secret("shop", bad)
        assert bad not in str(raised.value)
    env = {**os.environ, "CMB_DATABASE_URL": database_url}

    def cli(*args):
        out = subprocess.run([*CLI, "callbacks", *args], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout + out.stderr

    printed = cli("secret", "rotate", "--owner", "shop").strip()
    Webhook(printed)  # a usable secret
    with caplog.at_level(logging.DEBUG), Receiver(lambda r: (500, b"no")) as receiver:
        call(client, receiver, "o-1", retry=RetryPolicy(stop_after_delay=0.5, fast_retries=1, delay=0.1))
        with Running(CallbackWorker(db, FAST)):
            wait_until(lambda: client.get("shop", "orders", "o-1").status == "failed")
    shown = [
        cli("secret", "list", "--owner", "shop"),
        cli("show", "shop", "orders", "o-1"),
        cli("status"),
        cli("failed", "--json"),
        cli("list"),
        caplog.text,
        repr(client.failed()),
    ]
    assert "active" in shown[0]
    for text in shown:
        assert given not in text and printed not in text
        assert printed.removeprefix("whsec_") not in text
