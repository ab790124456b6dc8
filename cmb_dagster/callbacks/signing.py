"""Signed callbacks (Standard Webhooks): the headers of a call, and the owners' secrets.

Every HTTP call carries ``webhook-id`` (``cb_<message_id>``: the same for every call of one version of an event)
and ``webhook-timestamp`` (the call's time, in seconds); a call of an owner with signing secrets also carries
``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">`` per active secret (two during a rotation),
computed by the ``standardwebhooks`` package over the exact bytes sent.
"""

from __future__ import annotations

import base64
import binascii
import functools
import secrets
from datetime import UTC, datetime

from standardwebhooks import Webhook

from cmb_dagster.callbacks.errors import InvalidCallbackInput

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # a new secret's key: 256 random bits, as long as the HMAC-SHA256 block needs at most
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 24, 64


def new_secret() -> str:
    """A fresh secret, ``whsec_<base64 of 32 random bytes>``."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def check_secret(secret: str) -> str:
    """``secret`` if it is ``whsec_<base64>`` of 24 to 64 bytes; else InvalidCallbackInput (not quoting it)."""
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise InvalidCallbackInput(f"secret: must start with {SECRET_PREFIX!r} (Standard Webhooks' format)")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidCallbackInput(f"secret: not {SECRET_PREFIX}<base64>") from None
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise InvalidCallbackInput(f"secret: its key must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes")
    return secret


def webhook_id(message_id: int) -> str:
    """The ``webhook-id`` of the calls of message ``message_id``."""
    return f"cb_{message_id}"


def signature_headers(message_id: int, timestamp: int, body: bytes, active: tuple[str, ...]) -> bytes:
    """The Standard Webhooks headers of one call (each line ending in CRLF): id, timestamp and, with secrets, one
    signature per active secret."""
    msg_id = webhook_id(message_id)
    headers = f"webhook-id: {msg_id}\r\nwebhook-timestamp: {timestamp}\r\n"
    if active:
        at = datetime.fromtimestamp(timestamp, UTC)
        text = body.decode()  # JSON text: UTF-8, so signing the text signs the bytes sent
        signatures = " ".join(_signer(secret).sign(msg_id, at, text) for secret in active)
        headers += f"webhook-signature: {signatures}\r\n"
    return headers.encode()


@functools.lru_cache(maxsize=1024)
def _signer(secret: str) -> Webhook:
    return Webhook(secret)  # decodes the key once per secret
