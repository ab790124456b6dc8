"""Signed callbacks (Standard Webhooks): the headers of a call, and the owners' secrets.

Every HTTP call carries ``webhook-id`` (``cb_<message_id>``: the same for every call of one version of an event)
and ``webhook-timestamp`` (the call's time, in seconds); a call of an owner with signing secrets also carries
``webhook-signature``, one signature of ``"id.timestamp.body"`` (the exact bytes sent) per active secret (two during
a rotation): ``v1,<base64 HMAC-SHA256>`` for an HMAC secret (``whsec_<base64>``, computed by the ``standardwebhooks``
package), ``v1a,<base64 ed25519 signature>`` for an ed25519 signing key (``whsk_<base64 of its 32-byte seed>``),
which receivers verify with its public key (``whpk_<base64 of the 32-byte raw key>``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from standardwebhooks import Webhook

from cmb_dagster.callbacks.errors import InvalidCallbackInput

SecretKind = Literal["hmac", "ed25519"]
SECRET_KINDS: tuple[SecretKind, ...] = ("hmac", "ed25519")

SECRET_PREFIX = "whsec_"  # an HMAC secret
SIGNING_KEY_PREFIX = "whsk_"  # an ed25519 signing (private) key
PUBLIC_KEY_PREFIX = "whpk_"  # an ed25519 public key: what receivers of v1a signatures are given
SECRET_BYTES = 32  # a new secret's key: 256 random bits, as long as the HMAC-SHA256 block needs at most
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 24, 64
ED25519_SEED_BYTES = 32  # an ed25519 private key is its 32-byte seed

Sign = Callable[[str, int, bytes], str]  # (msg_id, timestamp, body) -> one versioned signature


def new_secret(kind: SecretKind = "hmac") -> str:
    """A fresh random secret of ``kind``: ``whsec_<base64 of 32 bytes>`` or ``whsk_<base64 of a 32-byte seed>``."""
    if kind == "ed25519":
        return SIGNING_KEY_PREFIX + base64.b64encode(secrets.token_bytes(ED25519_SEED_BYTES)).decode()
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def check_secret(secret: str) -> str:
    """``secret`` if it is ``whsec_<base64>`` of 24 to 64 bytes or ``whsk_<base64>`` of 32 bytes; else
    InvalidCallbackInput (not quoting it)."""
    if isinstance(secret, str) and secret.startswith(SIGNING_KEY_PREFIX):
        if len(_key_bytes(secret, SIGNING_KEY_PREFIX)) != ED25519_SEED_BYTES:
            raise InvalidCallbackInput(f"secret: an ed25519 key must be {ED25519_SEED_BYTES} bytes (its seed)")
        return secret
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise InvalidCallbackInput(
            f"secret: must start with {SECRET_PREFIX!r} (HMAC) or {SIGNING_KEY_PREFIX!r} (ed25519), "
            "Standard Webhooks' formats"
        )
    if not MIN_SECRET_BYTES <= len(_key_bytes(secret, SECRET_PREFIX)) <= MAX_SECRET_BYTES:
        raise InvalidCallbackInput(f"secret: its key must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes")
    return secret


def _key_bytes(secret: str, prefix: str) -> bytes:
    try:
        return base64.b64decode(secret[len(prefix) :], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidCallbackInput(f"secret: not {prefix}<base64>") from None


def kind_of(secret: str) -> SecretKind:
    """The kind of a stored secret, told by its prefix."""
    return "ed25519" if secret.startswith(SIGNING_KEY_PREFIX) else "hmac"


def public_key_of(secret: str) -> str | None:
    """The ``whpk_<base64>`` public key of an ed25519 signing key; None for an HMAC secret."""
    if kind_of(secret) != "ed25519":
        return None
    raw = _private_key(secret).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return PUBLIC_KEY_PREFIX + base64.b64encode(raw).decode()


def webhook_id(message_id: int) -> str:
    """The ``webhook-id`` of the calls of message ``message_id``."""
    return f"cb_{message_id}"


def signatures(msg_id: str, timestamp: int, body: bytes, active: tuple[str, ...]) -> str:
    """The ``webhook-signature`` value of a call: one signature per secret of ``active``, separated by spaces."""
    return " ".join(_signer(secret)(msg_id, timestamp, body) for secret in active)


def signature_headers(message_id: int, timestamp: int, body: bytes, active: tuple[str, ...]) -> bytes:
    """The Standard Webhooks headers of one call (each line ending in CRLF): id, timestamp and, with secrets, one
    signature per active secret."""
    msg_id = webhook_id(message_id)
    headers = f"webhook-id: {msg_id}\r\nwebhook-timestamp: {timestamp}\r\n"
    if active:
        headers += f"webhook-signature: {signatures(msg_id, timestamp, body, active)}\r\n"
    return headers.encode()


@functools.lru_cache(maxsize=1024)
def _signer(secret: str) -> Sign:
    """What signs with ``secret`` (its key decoded once)."""
    if kind_of(secret) == "ed25519":
        key = _private_key(secret)

        def sign_ed25519(msg_id: str, timestamp: int, body: bytes) -> str:
            signature = key.sign(f"{msg_id}.{timestamp}.".encode() + body)
            return "v1a," + base64.b64encode(signature).decode()

        return sign_ed25519
    webhook = Webhook(secret)

    def sign_hmac(msg_id: str, timestamp: int, body: bytes) -> str:
        # JSON text: UTF-8, so signing the text signs the bytes sent
        return webhook.sign(msg_id, datetime.fromtimestamp(timestamp, UTC), body.decode())

    return sign_hmac


@functools.lru_cache(maxsize=1024)
def _private_key(secret: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(base64.b64decode(secret[len(SIGNING_KEY_PREFIX) :]))
