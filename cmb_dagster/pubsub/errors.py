"""Errors of the pub/sub engine."""

from cmb_dagster import errors
from cmb_dagster.errors import CmbError


class PubSubError(CmbError):
    """Base class of the pub/sub engine's errors."""


class InvalidInput(PubSubError, errors.InvalidInput):
    """An argument is invalid; the message names the field. Nothing was written."""


class ConsumerBusy(PubSubError):
    """Another consumer with the same id and branch holds the watermark (non-blocking lock only)."""


class StreamRestored(PubSubError):
    """The stream's txids come from another cluster (pg_dump/pg_restore); `cmb-dagster pubsub reset` fixes it."""


class HandlerFailed(PubSubError):
    """A consumer's handler raised; its batch was rolled back and the watermark did not move."""
