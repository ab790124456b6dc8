"""Operator functions of the callbacks engine: its status (events per status, per worker job's buckets, limits
per key), its queue depths at a bounded cost (the metrics), the number of buckets, dead letters and their replay,
failure hooks per owner, and signing secrets."""

from __future__ import annotations

import warnings
from typing import Any

import psycopg
from psycopg.rows import dict_row
from pydantic import BaseModel, Field

from cmb_dagster import flow
from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.errors import InvalidCallbackInput
from cmb_dagster.callbacks.hosts import check_url, endpoint_key
from cmb_dagster.callbacks.models import (
    MAX_BUCKETS,
    MAX_OWNER_LENGTH,
    MAX_URL_LENGTH,
    BucketSetCounts,
    CallbackCounts,
    CallbackEvent,
    CallbackSettings,
    CallbacksStatus,
    DeadLetters,
    EndpointCounts,
    EndpointHealth,
    EndpointPolicy,
    EndpointState,
    LimitUse,
    SigningSecretInfo,
    check_key,
    validated,
)
from cmb_dagster.callbacks.signing import SECRET_KINDS, SecretKind, check_secret, kind_of, new_secret, public_key_of
from cmb_dagster.callbacks.worker import move_stranded_events
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.inputs import refused_input


class _BucketCount(BaseModel):
    count: int = Field(ge=1, le=MAX_BUCKETS)
    move_batch: int = CallbackSettings.model_fields["move_batch"]


class _StatusRequest(BaseModel):
    bucket_sets: int = Field(ge=0, le=MAX_BUCKETS)


def status(
    database: DatabaseSource, *, bucket_sets: int = 0, totals: bool = True, limits: bool = True, endpoints: bool = True
) -> CallbacksStatus:
    """What the engine reports.

    ``totals``: events per status over every bucket, overdue pending events and the age of the oldest one (one
    scan of the events). ``bucket_sets``: for each of that many sets of buckets (set i: the buckets with
    ``id % bucket_sets == i``, one worker job's), the figures its observations plot (read from the indexes).
    ``limits``: each key of the limits the workers registered (destination hosts, owners, groups; at most
    ``LIMIT_KEYS_SHOWN``), its limits and the calls in flight. ``endpoints``: how many endpoints are open and
    disabled, and the first ``UNHEALTHY_SHOWN`` of them (disabled first).
    """
    sets = validated(_StatusRequest, {"bucket_sets": bucket_sets}).bucket_sets
    with Database.of(database).connection() as conn:
        counts = _rows(conn, sql.STATUS_COUNTS, {}, CallbackCounts)[0] if totals else None
        per_set = _rows(conn, sql.BUCKET_SET_COUNTS, {"sets": sets}, BucketSetCounts) if sets else []
        uses = _limit_uses(conn) if limits else []
        health = _rows(conn, sql.ENDPOINT_COUNTS, {}, EndpointCounts)[0] if endpoints else None
        unhealthy = _unhealthy(conn) if health is not None and (health.open or health.disabled) else []
    return CallbacksStatus(totals=counts, bucket_sets=per_set, limits=uses, endpoints=health, unhealthy=unhealthy)


UNHEALTHY_SHOWN = 20


def endpoint_counts(database: DatabaseSource) -> EndpointCounts:
    """How many endpoints are open and disabled (from the index of the endpoints that are not closed)."""
    with Database.of(database).connection() as conn:
        return _rows(conn, sql.ENDPOINT_COUNTS, {}, EndpointCounts)[0]


def _unhealthy(conn: psycopg.Connection) -> list[EndpointHealth]:
    shown = []
    for state in ("disabled", "open"):
        params = {"owner": None, "state": state, "limit": UNHEALTHY_SHOWN - len(shown)}
        if params["limit"] > 0:
            shown += _rows(conn, sql.LIST_ENDPOINTS, params, EndpointHealth)
    return shown


LIMIT_KEYS_SHOWN = 1000


def _limit_uses(conn: psycopg.Connection) -> list[LimitUse]:
    scopes = [limits.scope for limits in flow.scopes(conn, "callbacks/")]
    return [
        LimitUse(
            scope=use.scope,
            key=use.key,
            concurrency=use.concurrency,
            in_flight=use.in_flight,
            rate_per_second=use.rate_per_second,
            burst=use.burst,
            tokens=use.tokens,
        )
        for use in flow.usage(conn, scopes, limit=LIMIT_KEYS_SHOWN)
    ]


class BucketSetDepth(BaseModel):
    """Pending and overdue events of one bucket set and the oldest overdue one's age; ``exact``: counted, not
    estimated (see :func:`depths`)."""

    bucket_set: int
    pending: int
    overdue: int
    oldest_overdue_seconds: float
    exact: bool


EXACT_UP_TO = 1000
"""Pending events per bucket counted one by one at most (fewer past 16 buckets); deeper buckets are estimated."""
SAMPLE_WINDOWS = 128
SAMPLE_WIDTH = 32


def depths(database: DatabaseSource, *, bucket_sets: int = 1) -> list[BucketSetDepth]:
    """Per bucket set (set i: the buckets with ``id % bucket_sets == i``): pending and overdue events and the
    oldest overdue age, read from the indexes at a cost bounded whatever the depth.

    A bucket's pending count is exact up to ``EXACT_UP_TO`` (divided among the buckets past 16, 100 at least), its
    overdue count too unless all of those are overdue, the oldest overdue age always. Deeper buckets are estimated
    from one sample of ``SAMPLE_WINDOWS`` windows of ``SAMPLE_WIDTH`` event ids spread over their pending ids
    (``exact`` is then false).
    """
    sets = validated(_BucketCount, {"count": bucket_sets}).count
    with Database.of(database).connection() as conn:
        buckets = max(conn.execute(sql.BUCKET_COUNT).fetchone()[0], 1)
        params = {
            "sets": sets,
            "bound": max(100, min(EXACT_UP_TO, EXACT_UP_TO * 16 // buckets)),
            "windows": SAMPLE_WINDOWS,
            "width": SAMPLE_WIDTH,
        }
        conn.execute(sql.NO_JIT)  # a bounded read: compiling its plan would cost more than running it
        return _rows(conn, sql.BUCKET_SET_DEPTHS, params, BucketSetDepth)


def _rows(conn: psycopg.Connection, statement: str, params: dict[str, Any], model: type[BaseModel]) -> list[Any]:
    cursor = conn.execute(statement, params)
    columns = [c.name for c in cursor.description or ()]
    return [model(**dict(zip(columns, row, strict=True))) for row in cursor.fetchall()]


def callback_counts(database: DatabaseSource) -> CallbackCounts:
    """Deprecated: ``status(database).totals``."""
    warnings.warn(
        "callback_counts(db) is deprecated: use cmb_dagster.callbacks.admin.status(db).totals",
        DeprecationWarning,
        stacklevel=2,
    )
    return status(database).totals  # type: ignore[return-value]


def bucket_set_counts(database: DatabaseSource, sets: int) -> list[BucketSetCounts]:
    """Deprecated: ``status(database, bucket_sets=sets, totals=False).bucket_sets``."""
    warnings.warn(
        "bucket_set_counts(db, sets) is deprecated: use "
        "cmb_dagster.callbacks.admin.status(db, bucket_sets=sets, totals=False).bucket_sets",
        DeprecationWarning,
        stacklevel=2,
    )
    return status(database, bucket_sets=sets, totals=False).bucket_sets


def set_bucket_count(
    database: DatabaseSource, count: int, *, move_batch: int = CallbackSettings.model_fields["move_batch"].default
) -> list[int]:
    """Set the number of buckets to ``count`` (1 to MAX_BUCKETS); return the bucket ids.

    Raising adds empty buckets (existing events keep theirs). Lowering removes the highest ones at once
    (new events go to the rest) and their pending events move to the remaining buckets: here, for a removed
    bucket no worker holds, otherwise by its worker once its calls in flight have ended. Nothing is lost and
    nothing is called twice by the move.
    """
    request = validated(_BucketCount, {"count": count, "move_batch": move_batch})
    count = request.count
    db = Database.of(database)
    with db.connection() as conn:
        conn.execute(sql.LOCK_EVENT_IDS_EXCLUSIVE)  # inserts read the count under the shared lock: none is half-way
        conn.execute(sql.LOCK_BUCKETS)
        current = len(conn.execute(sql.BUCKET_IDS).fetchall())
        if count > current:
            conn.execute(sql.ADD_BUCKETS, {"count": count})
        elif count < current:
            conn.execute(sql.REMOVE_BUCKETS, {"count": count})
    move_stranded_events(db, request.move_batch)
    with db.connection() as conn:
        return [row[0] for row in conn.execute(sql.BUCKET_IDS)]


# -- dead letters and replay ----------------------------------------------------------------------------


@refused_input(InvalidCallbackInput, "arguments")
def failed(database: DatabaseSource, **selection: Any) -> list[CallbackEvent]:
    """The dead letters (events failed for good) of a :class:`DeadLetters` selection, oldest failure first, with
    their last error, status code and response excerpt."""
    chosen = _dead_letters(selection)
    with Database.of(database).connection() as conn:
        rows = conn.cursor(row_factory=dict_row).execute(sql.LIST_FAILED, chosen.params()).fetchall()
    return [CallbackEvent.model_validate(row) for row in rows]


@refused_input(InvalidCallbackInput, "arguments")
def replay(database: DatabaseSource, **selection: Any) -> int:
    """Send the dead letters of a :class:`DeadLetters` selection again (``limit`` at most, oldest failure first);
    return how many.

    Each goes back to pending, due now, for a new round of its retry policy (attempts from 0, stop_after_delay
    counted from now, ``replays`` one more), with the same webhook-id. Only events still failed are touched, each
    by one replay: a concurrent replay skips them, and a call of an older version can neither start nor write.
    """
    chosen = _dead_letters(selection)
    with Database.of(database).connection() as conn:
        conn.execute(sql.LOCK_EVENT_IDS, {"lock_timeout": "0"})  # before new ids are drawn
        return conn.execute(sql.REPLAY_FAILED, chosen.params()).fetchone()[0]


def _dead_letters(selection: dict[str, Any]) -> DeadLetters:
    chosen = validated(DeadLetters, selection)
    for name in ("owner_client_id", "group_key", "event_key"):
        if (value := getattr(chosen, name)) is not None:
            check_key(value, name)
    return chosen


# -- failure hooks per owner ----------------------------------------------------------------------------


@refused_input(InvalidCallbackInput, "arguments")
def set_failure_hook(
    database: DatabaseSource, owner_client_id: str, url: str | None, settings: CallbackSettings | None = None
) -> None:
    """Call ``url`` (an http(s) URL the settings allow, or ``dagster://<job>``) once when an event of the owner
    without its own ``on_failure`` fails for good; None: no hook."""
    check_key(owner_client_id, "owner_client_id")
    if url is not None:
        check_url(url, settings or CallbackSettings(), "on_failure")
    with Database.of(database).connection() as conn:
        conn.execute(sql.SET_OWNER_HOOK, {"owner": owner_client_id, "url": url})


@refused_input(InvalidCallbackInput, "arguments")
def failure_hook(database: DatabaseSource, owner_client_id: str) -> str | None:
    """The owner's failure hook (None: none)."""
    check_key(owner_client_id, "owner_client_id")
    with Database.of(database).connection() as conn:
        row = conn.execute(sql.GET_OWNER_HOOK, {"owner": owner_client_id}).fetchone()
    return None if row is None else row[0]


# -- endpoints (circuit breakers) -------------------------------------------------------------------------

MAX_ENDPOINTS_LISTED = 10_000


class _EndpointSelection(BaseModel):
    owner_client_id: str | None = Field(default=None, min_length=1, max_length=MAX_OWNER_LENGTH)
    state: EndpointState | None = None
    limit: int = Field(default=100, ge=1, le=MAX_ENDPOINTS_LISTED)


@refused_input(InvalidCallbackInput, "arguments")
def endpoints(
    database: DatabaseSource, owner_client_id: str | None = None, *, state: str | None = None, limit: int = 100
) -> list[EndpointHealth]:
    """The endpoints' health (of one owner, in one state), disabled first, then open, then closed; ``limit`` at
    most (1 to 10,000)."""
    chosen = validated(_EndpointSelection, {"owner_client_id": owner_client_id, "state": state, "limit": limit})
    if chosen.owner_client_id is not None:
        check_key(chosen.owner_client_id, "owner_client_id")
    params = {"owner": chosen.owner_client_id, "state": chosen.state, "limit": chosen.limit}
    with Database.of(database).connection() as conn:
        return _rows(conn, sql.LIST_ENDPOINTS, params, EndpointHealth)


def _endpoint(owner_client_id: str, endpoint: str) -> dict[str, str]:
    check_key(owner_client_id, "owner_client_id")
    normalised = endpoint_key(endpoint) if isinstance(endpoint, str) and len(endpoint) <= MAX_URL_LENGTH else None
    if normalised is None:
        raise InvalidCallbackInput("endpoint: expected an http(s) URL (its query is ignored) or an endpoint name")
    return {"owner": owner_client_id, "endpoint": normalised}


@refused_input(InvalidCallbackInput, "arguments")
def enable_endpoint(database: DatabaseSource, owner_client_id: str, endpoint: str) -> int:
    """Close the owner's ``endpoint`` (a URL of it) whatever its state, and send its held and disabled events again,
    oldest first, within its limits; return how many. InvalidCallbackInput if the endpoint is unknown."""
    params = _endpoint(owner_client_id, endpoint)
    with Database.of(database).connection() as conn:
        endpoint_id, events = conn.execute(sql.ENABLE_ENDPOINT, params).fetchone()
    if endpoint_id is None:
        raise InvalidCallbackInput(f"endpoint: {params['endpoint']!r} of owner {owner_client_id!r} is not known")
    return events


@refused_input(InvalidCallbackInput, "arguments")
def disable_endpoint(database: DatabaseSource, owner_client_id: str, endpoint: str) -> int:
    """Disable the owner's ``endpoint`` (a URL of it): its events are kept as ``disabled`` until it is enabled;
    return how many of its held events were kept so."""
    params = _endpoint(owner_client_id, endpoint)
    with Database.of(database).connection() as conn:
        return conn.execute(sql.DISABLE_ENDPOINT, params).fetchone()[1]


@refused_input(InvalidCallbackInput, "arguments")
def set_endpoint_policy(database: DatabaseSource, owner_client_id: str, policy: EndpointPolicy | None) -> None:
    """The circuit breaker policy of the owner's endpoints (None: the workers' ``CallbackSettings.endpoint_policy``);
    workers apply it to the next outcomes they write."""
    check_key(owner_client_id, "owner_client_id")
    if policy is not None and not isinstance(policy, EndpointPolicy):
        policy = validated(EndpointPolicy, policy)
    text = None if policy is None else policy.model_dump_json()
    with Database.of(database).connection() as conn:
        conn.execute(sql.SET_ENDPOINT_POLICY, {"owner": owner_client_id, "policy": text})


@refused_input(InvalidCallbackInput, "arguments")
def endpoint_policy(database: DatabaseSource, owner_client_id: str) -> EndpointPolicy | None:
    """The owner's own endpoint policy (None: the workers' default applies)."""
    check_key(owner_client_id, "owner_client_id")
    with Database.of(database).connection() as conn:
        row = conn.execute(sql.GET_ENDPOINT_POLICY, {"owner": owner_client_id}).fetchone()
    return None if row is None or row[0] is None else EndpointPolicy.model_validate_json(row[0])


# -- signing secrets --------------------------------------------------------------------------------------

MAX_PREVIOUS_VALID_FOR = 366 * 86400.0  # seconds a rotated-out secret may stay active, at most
SECRETS_LISTED = 100


@refused_input(InvalidCallbackInput, "arguments")
def rotate_secret(
    database: DatabaseSource,
    owner_client_id: str,
    secret: str | None = None,
    *,
    previous_valid_for: float | None = 86400.0,
    kind: SecretKind | None = None,
) -> str:
    """Add a signing secret for the owner's callbacks: ``secret`` (an HMAC secret ``whsec_<base64>`` or an ed25519
    signing key ``whsk_<base64 of a 32-byte seed>``, its prefix tells which) or a new random one of ``kind``
    (default ``"hmac"``; a given secret of another kind is refused).

    Returns what receivers verify with: an HMAC secret itself (the only time it is shown), an ed25519 key's public
    key ``whpk_<base64>`` (its private key is never shown). The newest secret before it stays active with it (calls
    carry both signatures) for ``previous_valid_for`` seconds (None: until :func:`retire_secrets`); older ones are
    retired. Workers sign with it within ``CallbackSettings.secrets_refresh``.
    """
    check_key(owner_client_id, "owner_client_id")
    if kind is not None and kind not in SECRET_KINDS:
        raise InvalidCallbackInput("kind: must be 'hmac' or 'ed25519'")
    secret = new_secret(kind or "hmac") if secret is None else check_secret(secret)
    if kind is not None and kind_of(secret) != kind:
        raise InvalidCallbackInput(f"kind: {kind!r}, but the secret given is an {kind_of(secret)} one (its prefix)")
    if previous_valid_for is not None and not 0 <= previous_valid_for <= MAX_PREVIOUS_VALID_FOR:
        raise InvalidCallbackInput(f"previous_valid_for: must be 0 to {MAX_PREVIOUS_VALID_FOR:g} seconds or None")
    params = {"owner": owner_client_id, "secret": secret, "previous_for": previous_valid_for}
    with Database.of(database).connection() as conn:
        conn.execute(sql.LOCK_OWNER_SECRETS, params)
        conn.execute(sql.RETIRE_OLDER_SECRETS, params)
        conn.execute(sql.EXPIRE_PREVIOUS_SECRET, params)
        conn.execute(sql.INSERT_SECRET, params)
    return public_key_of(secret) or secret


@refused_input(InvalidCallbackInput, "arguments")
def retire_secrets(database: DatabaseSource, owner_client_id: str, *, keep_newest: bool = True) -> int:
    """Retire the owner's active secrets but the newest (``keep_newest=False``: all of them, and its callbacks go
    unsigned); return how many. Workers stop signing with them within ``CallbackSettings.secrets_refresh``."""
    check_key(owner_client_id, "owner_client_id")
    params = {"owner": owner_client_id, "all": not keep_newest}
    with Database.of(database).connection() as conn:
        conn.execute(sql.LOCK_OWNER_SECRETS, params)
        return conn.execute(sql.RETIRE_SECRETS, params).rowcount


@refused_input(InvalidCallbackInput, "arguments")
def signing_secrets(database: DatabaseSource, owner_client_id: str) -> list[SigningSecretInfo]:
    """The owner's secrets, newest first (at most ``SECRETS_LISTED``): kind, when made, expiring or retired, whether
    active, and an ed25519 key's public key; never the secrets themselves."""
    check_key(owner_client_id, "owner_client_id")
    with Database.of(database).connection() as conn:
        cursor = conn.cursor(row_factory=dict_row)
        rows = cursor.execute(sql.LIST_SECRETS, {"owner": owner_client_id, "limit": SECRETS_LISTED}).fetchall()
    return [_secret_info(**row) for row in rows]


def _secret_info(secret: str, **row: Any) -> SigningSecretInfo:
    return SigningSecretInfo(**row, kind=kind_of(secret), public_key=public_key_of(secret))
