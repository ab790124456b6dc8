"""Signed callbacks: a receiver verifies every call with the ``standardwebhooks`` package (v1, HMAC) or an ed25519
public key (v1a); secrets rotate and are never shown again."""

import base64
import json
import logging
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
import standardwebhooks.webhooks
from callback_settings import FAST as FAST_SETTINGS
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from receiver import Receiver
from running import Running
from standardwebhooks import Webhook, WebhookVerificationError
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackWorker, InvalidCallbackInput, RetryPolicy, admin
from cmb_dagster.callbacks.signing import signature_headers, signatures

FAST = FAST_SETTINGS.model_copy(update={"secrets_refresh": 0.2})
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


@pytest.fixture
def client(db):
    with CallbackClient(db, FAST) as c:
        yield c


def call(client, receiver, key, owner="shop", path="/cb", **kwargs):
    client.create(owner, "orders", key, datetime.now(UTC), f"{receiver.url}{path}", {"n": key}, **kwargs)


def run_cli(database_url, *args):
    """``cmb-dagster callbacks ARGS`` in a process of its own; fails the test unless it succeeds."""
    env = {**os.environ, "CMB_DATABASE_URL": database_url}
    out = subprocess.run([*CLI, "callbacks", *args], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def versions(headers):
    """The versions of the request's signatures (``v1``, ``v1a``), sorted; none when it is unsigned."""
    return sorted(s.partition(",")[0] for s in headers.get("webhook-signature", "").split(" ") if s)


def v1a_verifies(public_key, body, headers):
    """Whether one v1a signature of the headers verifies with ``public_key`` (``whpk_<base64>``) over
    ``id.timestamp.body``: what a receiver given only the public key checks."""
    key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key.removeprefix("whpk_")))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    for signature in headers["webhook-signature"].split(" "):
        version, _, value = signature.partition(",")
        if version == "v1a":
            try:
                key.verify(base64.b64decode(value), signed)
                return True
            except InvalidSignature:
                pass
    return False


def stored_secrets(db):
    """Every secret of the database, as stored (what must appear in no output)."""
    with db.connection() as conn:
        return [row[0] for row in conn.execute("SELECT secret FROM callback_signing_secrets")]


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

    def cli(*args):
        out = run_cli(database_url, *args)
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


def test_v1a_signs_as_the_standard_webhooks_reference_does():
    """The vector of standard-webhooks' Go library (TestAsymmetricWebhookSign), through the function the headers of
    every call are signed with."""
    key = "whsk_VEVTVFNJR05JTkdLRVlET05PVFVTRVRISVNGT1JBTlk="
    body = b'{"test": 2432232314}'
    expected = "v1a,tQ9V2XOqn7jL/DQenEFpqIugdBVtiMmER5mhSkXBNwM0mkATuDe6KYYUuxqtaiHeYGb7KaaBRdM5WqyeFiL8Ag=="
    assert signatures("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body, (key,)) == expected
    headers = signature_headers(7, 1614265330, body, (key,)).decode()
    assert f"webhook-signature: {signatures('cb_7', 1614265330, body, (key,))}\r\n" in headers


def test_a_receiver_verifies_ed25519_calls_with_the_public_key_alone(db, client):
    public_key = client.rotate_secret("shop", kind="ed25519")
    assert public_key.startswith("whpk_") and len(base64.b64decode(public_key.removeprefix("whpk_"))) == 32
    with Receiver() as receiver, Running(CallbackWorker(db, FAST)):
        for n in range(3):
            call(client, receiver, f"o-{n}")
        requests = wait_until(lambda: len(receiver.received()) == 3 and receiver.received())
    other = client.rotate_secret("other", kind="ed25519")
    for request in requests:
        body, headers = request.body, request.headers
        assert versions(headers) == ["v1a"]
        assert v1a_verifies(public_key, body, headers)
        assert not v1a_verifies(public_key, body.replace(b'"o-', b'"x-'), headers)  # tampered body
        assert not v1a_verifies(public_key, body, {**headers, "webhook-id": headers["webhook-id"] + "0"})
        moved = str(int(headers["webhook-timestamp"]) + 1)
        assert not v1a_verifies(public_key, body, {**headers, "webhook-timestamp": moved})
        assert not v1a_verifies(other, body, headers)  # another owner's key


def test_a_rotation_from_hmac_to_ed25519_signs_with_both_until_the_hmac_secret_is_retired(db, client):
    secret = client.rotate_secret("shop")
    public_key = client.rotate_secret("shop", kind="ed25519", previous_valid_for=None)
    with Receiver() as receiver, Running(CallbackWorker(db, FAST)):

        def new_call():
            """A new call's request (the worker signs with the secrets it read within secrets_refresh)."""
            key = f"k{len(receiver.received())}"
            call(client, receiver, key)
            return wait_until(lambda: next((r for r in receiver.received() if key.encode() in r.body), None))

        both = new_call()
        assert versions(both.headers) == ["v1", "v1a"]
        Webhook(secret).verify(both.body, both.headers)
        assert v1a_verifies(public_key, both.body, both.headers)

        assert client.retire_secrets("shop") == 1
        wait_until(lambda: versions(new_call().headers) == ["v1a"])
    after = receiver.received()[-1]
    assert v1a_verifies(public_key, after.body, after.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(after.body, after.headers)


def test_secret_list_shows_kinds_and_public_keys_and_no_signing_key_appears_anywhere(db, database_url, client, caplog):
    seed = bytes(range(32))
    given = "whsk_" + base64.b64encode(seed).decode()
    given_public = (
        "whpk_" + base64.b64encode(Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()).decode()
    )
    client.rotate_secret("shop")
    assert client.rotate_secret("shop", given) == given_public  # the prefix tells the kind

    before = admin.signing_secrets(db, "shop")
    short, long = (base64.b64encode(bytes(n)).decode() for n in (31, 33))
    for bad in ("whsk_not base64!", f"whsk_{short}", f"whsk_{long}"):
        with pytest.raises(InvalidCallbackInput, match="^secret: ") as raised:
            client.rotate_secret("shop", bad, kind="ed25519")
        assert bad not in str(raised.value) and bad.removeprefix("whsk_") not in str(raised.value)
    for secret, kind in ((given, "hmac"), ("whsec_" + "QUJD" * 8, "ed25519"), (None, "rsa")):
        with pytest.raises(InvalidCallbackInput, match="^kind: ") as raised:
            client.rotate_secret("shop", secret, kind=kind)
        assert given not in str(raised.value) and given.removeprefix("whsk_") not in str(raised.value)
    assert admin.signing_secrets(db, "shop") == before  # nothing was written

    rotated = run_cli(database_url, "secret", "rotate", "--owner", "shop", "--ed25519")
    printed = rotated.stdout.strip()
    assert printed.startswith("whpk_") and "\n" not in printed
    assert "verify" in rotated.stderr and len(rotated.stderr.strip().splitlines()) == 1
    infos = admin.signing_secrets(db, "shop")
    assert [(i.kind, i.public_key, i.active) for i in infos] == [
        ("ed25519", printed, True),
        ("ed25519", given_public, True),  # the previous one, for previous_valid_for
        ("hmac", None, False),
    ]
    listed = run_cli(database_url, "secret", "list", "--owner", "shop").stdout.splitlines()
    assert [row.split("\t")[1:3] for row in listed] == [
        ["ed25519", "active"],
        ["ed25519", "active"],
        ["hmac", "retired"],
    ]
    assert listed[0].endswith(f"public key {printed}") and listed[1].endswith(f"public key {given_public}")
    assert "public key" not in listed[2]

    with caplog.at_level(logging.DEBUG), Receiver(lambda r: (500, b"no")) as receiver:
        call(client, receiver, "o-1", retry=RetryPolicy(stop_after_delay=0.5, fast_retries=1, delay=0.1))
        with Running(CallbackWorker(db, FAST)):
            wait_until(lambda: client.get("shop", "orders", "o-1").status == "failed")
    assert versions(receiver.received()[0].headers) == ["v1a", "v1a"]  # the calls were signed with both keys
    shown = [
        rotated.stdout + rotated.stderr,
        "\n".join(listed),
        *(run_cli(database_url, *args).stdout for args in (["show", "shop", "orders", "o-1"], ["status"], ["list"])),
        run_cli(database_url, "failed", "--json").stdout,
        caplog.text,
        repr(client.failed()),
        repr(infos),
        str([i.model_dump() for i in infos]),
    ]
    keys = stored_secrets(db)
    assert given in keys and len(keys) == 3
    for text in shown:
        for key in keys:
            assert key not in text and key.split("_", 1)[1] not in text
