"""Errors of the pub/sub engine."""

from cmb_dagster.errors import CmbError, InvalidInput

__all__ = [
    "BackfillFailed",
    "ConsumerBusy",
    "HandlerFailed",
    "InvalidInput",
    "InvalidPubSubInput",
    "PubSubError",
    "StreamRestored",
]


class PubSubError(CmbError):
    """Base class of the pub/sub engine's errors."""


class InvalidPubSubInput(PubSubError, InvalidInput):
    """Bad input to the pub/sub engine; the message names the field. Nothing was written."""


class ConsumerBusy(PubSubError):
    """Another consumer with the same id and branch holds the watermark (non-blocking lock only)."""


class StreamRestored(PubSubError):
    """The stream's txids come from another cluster (pg_dump/pg_restore); `cmb-dagster pubsub reset` fixes it."""


class HandlerFailed(PubSubError):
    """A consumer's handler raised; its batch was rolled back and the watermark did not move."""


class BackfillFailed(PubSubError):
    """A backfill stopped on an error (recorded with it); the same call resumes it after its last batch."""
