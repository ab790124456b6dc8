"""Typed errors of the callbacks engine; each message names the event (or field) and what went wrong."""

from cmb_dagster.errors import CmbError, InvalidInput


class CallbackError(CmbError):
    """Base class of callbacks errors."""


class CallbackNotFound(CallbackError):
    """No event (or schedule) has these keys."""


class CallbackInvalidState(CallbackError):
    """The event's status forbids this change (e.g. cancelling a notified event)."""


class CallbackConflict(CallbackError):
    """An event with these keys exists with a different payload."""


class CallbackTimeout(CallbackError, TimeoutError):
    """A create waited longer than ``CallbackSettings.create_timeout`` for a connection, a lock or its commit.

    The message says whether the event may still have been written: creating it again with the same
    keys and payload is safe either way (it returns the id).
    """


class CallbackValidationError(CallbackError, InvalidInput):
    """Bad input: the message names the field; nothing was written."""
