"""What a ``dagster://<job>`` callback may launch: a job named as Dagster names jobs, with a context of run config
and tags that Dagster takes."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from cmb_dagster.callbacks.errors import InvalidCallbackInput

DAGSTER_SCHEME = "dagster"
JOB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The context of a dagster:// event: the launched run's config and tags.
DAGSTER_CONTEXT_KEYS = ("run_config", "tags")
DAGSTER_CONTEXT_SHAPE = "an object with only run_config (an object) and tags (an object of strings)"
# Dagster's rule for tag keys (dagster._utils.tags.VALID_TAG_KEY_REGEX, without the asset-only 'dagster/kind/').
_TAG_KEY = re.compile(r"([A-Za-z0-9_.-]{1,63}/)?[A-Za-z0-9_.-]{1,63}")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_./-]{1,130}")
_DAGSTER_TAG_PREFIXES = ("dagster/", ".dagster/")  # Dagster's own tags (system and hidden)
# The 'dagster/' tags a run may be given (dagster._core.storage.tags.USER_EDITABLE_SYSTEM_TAGS)
DAGSTER_USER_TAGS = (
    "dagster/priority",
    "dagster/max_retries",
    "dagster/retry_strategy",
    "dagster/max_runtime",
    "dagster/isolation",
    "dagster/retry_on_asset_or_op_failure",
)
CALLBACK_TAG = "cmb/callback"  # the event's keys
# Tags the engine sets on the runs it launches (the event's keys, and its run key, also under an older release's name).
ENGINE_TAGS = (CALLBACK_TAG, "cmb/callbacks.run_key", "cmb/callback_run_key")
# A tag value at most: Dagster indexes (key, value) of run tags in a btree, whose entries Postgres caps near 2.7 kB.
MAX_TAG_VALUE_BYTES = 1024


def dagster_job_name(url: str) -> str | None:
    """The job of a ``dagster://<job>`` URL, None for other URLs."""
    parts = urlsplit(url)
    return parts.netloc if parts.scheme == DAGSTER_SCHEME else None


def check_dagster_context(context: Any) -> None:
    """Refuse a context a ``dagster://`` target cannot launch a run with: it must be an object whose keys are only
    ``run_config`` (an object) and ``tags`` (an object of strings, keys and values as a Dagster run takes them).
    InvalidCallbackInput names the field (``context.<key>``, ``context.tags.<key>``)."""
    if not isinstance(context, dict):
        raise InvalidCallbackInput(f"context: for dagster:// targets it must be {DAGSTER_CONTEXT_SHAPE}")
    for key in context:
        if key not in DAGSTER_CONTEXT_KEYS:
            where = _field("context", str(key))
            raise InvalidCallbackInput(
                f"{where}: unknown key; for dagster:// targets the context is {DAGSTER_CONTEXT_SHAPE}"
            )
    if not isinstance(context.get("run_config", {}), dict):
        raise InvalidCallbackInput("context.run_config: must be an object (the run's config)")
    tags = context.get("tags", {})
    if not isinstance(tags, dict):
        raise InvalidCallbackInput("context.tags: must be an object of strings (the run's tags)")
    for key, value in tags.items():
        problem = _tag_problem(key, value)
        if problem is not None:
            raise InvalidCallbackInput(f"{_field('context.tags', str(key))}: {problem}")


def _tag_problem(key: Any, value: Any) -> str | None:
    """What keeps ``key: value`` from being a tag of a Dagster run (None: nothing)."""
    if not isinstance(key, str) or not _TAG_KEY.fullmatch(key):
        return (
            "not a Dagster tag key (letters, digits, '_', '-' and '.', at most 63 characters, optionally after a "
            "'namespace/' of at most 63)"
        )
    if key.startswith(_DAGSTER_TAG_PREFIXES) and key not in DAGSTER_USER_TAGS:
        return f"reserved by Dagster (of its 'dagster/' tags a run may set {', '.join(DAGSTER_USER_TAGS)})"
    if key in ENGINE_TAGS:
        return "set by the callbacks engine on every run it launches"
    if not isinstance(value, str):
        return f"must be a string, not {_json_type(value)}"
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_TAG_VALUE_BYTES:
        return f"{size} bytes, at most {MAX_TAG_VALUE_BYTES} allowed"
    return None


def _field(prefix: str, key: str) -> str:
    """The field ``key`` of ``prefix`` as an error names it: ``prefix.key``, or ``prefix['k...']`` for odd keys."""
    if _PLAIN_KEY.fullmatch(key):
        return f"{prefix}.{key}"
    shown = key if len(key) <= 60 else f"{key[:57]}..."
    return f"{prefix}[{shown!r}]"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "an object" if isinstance(value, dict) else "an array"
