"""Typed errors of the callbacks engine; each message names the event (or field) and what went wrong."""

import warnings
from typing import Any

from cmb_dagster.errors import CmbError, InvalidInput


class CallbackError(CmbError):
    """Base class of callbacks errors."""


class InvalidCallbackInput(CallbackError, InvalidInput):
    """Bad input: the message names the field; nothing was written."""


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


RENAMED = {"CallbackValidationError": InvalidCallbackInput}
"""Deprecated names of this engine's errors (kept for one release), and what they name now."""


def renamed(module: str, name: str) -> Any:
    """For a module ``__getattr__``: the error ``name`` was renamed to, with a DeprecationWarning."""
    if name not in RENAMED:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = RENAMED[name]
    warnings.warn(f"{name} is deprecated: use {new.__module__}.{new.__name__}", DeprecationWarning, stacklevel=3)
    return new


def __getattr__(name: str) -> Any:
    return renamed(__name__, name)
