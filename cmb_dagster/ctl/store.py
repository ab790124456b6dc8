"""The CTL store: (entity, parameter) -> timestamptz, with the history of every change.

Every change is recorded (old value, new value, when, by whom) and published to the pub/sub change
stream in the same transaction, so a consumer (the reactive scheduler) never misses one. Moving a
value backwards is allowed, but the change is flagged: tasks with Delta triggers on that parameter
stop firing until it passes their last-seen value again.
"""

from __future__ import annotations

import getpass
import logging
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import psycopg
from pydantic import TypeAdapter, ValidationError

from cmb_dagster import pubsub
from cmb_dagster.ctl import sql
from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.ctl.models import CtlChange, Moment, ParameterKey, check_name
from cmb_dagster.database import Database, DatabaseSource, connection_for
from cmb_dagster.inputs import refused_input, shorten
from cmb_dagster.models import describe

log = logging.getLogger("cmb_dagster.ctl")

CTL_BRANCH_ID = 4
"""The pub/sub branch that carries CTL changes: one event per transaction, ``{"changes": [...]}``."""
CTL_TOPIC = "cmb.ctl"


@dataclass(frozen=True)
class FeedItem:
    """One item of a CTL feed: its position in the feed and the values it sets (possibly none)."""

    position: int
    values: Mapping[ParameterKey, datetime]
    by: str
    only_forward: bool = False


_MOMENT = TypeAdapter(Moment)
MAX_HISTORY = 100_000
"""The most changes :meth:`CtlStore.history` returns at once."""


def default_actor() -> str:
    """Who writes when no ``by`` is given: ``user@host``."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class CtlStore:
    """CTL values over the cmb database.

    Each method takes an optional ``conn``: pass the connection your data is written with (any connection of
    yours, whatever its search path) to commit the CTL change together with the data; without it the store
    uses a pooled connection and commits at once.
    """

    def __init__(self, database: DatabaseSource, *, actor: str | None = None) -> None:
        self.database = Database.of(database)
        self.actor = check_name(actor or default_actor(), "actor")

    def set(
        self,
        entity: str,
        parameter: str,
        value: datetime,
        *,
        by: str | None = None,
        conn: psycopg.Connection | None = None,
        only_forward: bool = False,
    ) -> CtlChange | None:
        """Set one value; return the recorded change, or None when the value was already that.

        ``only_forward=True`` leaves a value that is already at or after ``value`` as it is (e.g. a
        backfill writing an older partition's value after a newer one): nothing is recorded.
        """
        changes = self.set_many({(entity, parameter): value}, by=by, conn=conn, only_forward=only_forward)
        return changes[0] if changes else None

    def set_many(
        self,
        values: Mapping[ParameterKey, datetime],
        *,
        by: str | None = None,
        conn: psycopg.Connection | None = None,
        only_forward: bool = False,
    ) -> list[CtlChange]:
        """Set several values atomically; return the changes recorded (unchanged values are skipped).

        ``only_forward=True`` skips each value that would move its parameter backwards (or keep it).
        """
        rows = check_values(values)
        if not rows:
            return []
        params = {
            "entities": [entity for entity, _ in rows],
            "parameters": [parameter for _, parameter in rows],
            "values": list(rows.values()),
            "by": self.actor if by is None else check_name(by, "by"),
            "only_forward": bool(only_forward),
        }
        # in a transaction of its own, or a savepoint of the caller's: a refusal leaves the caller's transaction usable
        with refused_input(InvalidCtlInput, "values", conn=conn), connection_for(conn, self.database) as c:
            changes = [CtlChange(**row) for row in _dict_rows(c.execute(sql.SET_VALUES, params))]
            if changes:
                payload = {"changes": [change.payload() for change in changes]}
                try:
                    pubsub.publish(CTL_BRANCH_ID, payload, topic=CTL_TOPIC, schema=self.database.schema, conn=c)
                except pubsub.InvalidPubSubInput as exc:
                    raise InvalidCtlInput(
                        f"values: the change event of {len(changes)} changes is refused ({exc}); set fewer at once"
                    ) from exc
        for change in changes:
            if change.backwards:
                log.warning(
                    "CTL %s/%s moved backwards from %s to %s (by %s): tasks with Delta triggers on it "
                    "wait until it passes their last-seen value",
                    change.entity,
                    change.parameter,
                    change.old_value,
                    change.new_value,
                    change.changed_by,
                )
        return changes

    def get(self, entity: str, parameter: str, *, conn: psycopg.Connection | None = None) -> datetime | None:
        """The current value, or None when the parameter has none yet."""
        return self.get_many([(entity, parameter)], conn=conn).get((entity, parameter))

    def get_many(
        self, pairs: Iterable[ParameterKey], *, conn: psycopg.Connection | None = None
    ) -> dict[ParameterKey, datetime]:
        """Current values of ``pairs`` in one query; parameters without a value are left out."""
        keys = _check_keys(pairs)
        if not keys:
            return {}
        with connection_for(conn, self.database) as c:
            return read_values(c, keys)

    def history(
        self,
        entity: str | None = None,
        parameter: str | None = None,
        *,
        limit: int = 100,
        backwards_only: bool = False,
    ) -> list[CtlChange]:
        """Recorded changes, newest first, optionally of one entity / parameter or backwards moves only."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HISTORY:
            raise InvalidCtlInput(f"limit: must be a whole number from 1 to {MAX_HISTORY}, got {limit!r}")
        params = {
            "entity": _filter(entity, "entity"),
            "parameter": _filter(parameter, "parameter"),
            "limit": limit,
            "backwards_only": bool(backwards_only),
        }
        with self.database.connection() as conn:
            return [CtlChange(**row) for row in _dict_rows(conn.execute(sql.HISTORY, params))]

    def ingest(
        self,
        feed: str,
        read: Callable[[int], Sequence[FeedItem]],
        *,
        identity: str | None = None,
        newest: int | None = None,
        on_restart: Callable[[str], None] | None = None,
    ) -> list[CtlChange] | None:
        """Apply the next items of a feed exactly once; None when another process is applying it.

        ``read(position)`` returns the items after ``position`` in order. Their values and the new
        position commit together, so a crash re-reads nothing twice and skips nothing.

        ``identity`` names the storage the positions belong to (e.g. Dagster's run storage id) and
        ``newest`` is that storage's newest position: when the identity differs from the one stored with
        the feed, or the stored position is ahead of ``newest``, the storage is new (a fresh instance, a
        reset database) and the feed starts again from its beginning; ``on_restart`` (and the log) says so.
        """
        feed = check_name(feed, "feed")
        with self.database.connection() as conn:
            conn.execute(sql.ENSURE_FEED, {"name": feed})
            conn.commit()
            row = conn.execute(sql.LOCK_FEED, {"name": feed}).fetchone()
            if row is None:
                return None
            position, known = row
            why = None
            if identity is not None and known is not None and identity != known:
                why = f"its storage changed (identity {identity}, was {known})"
            elif newest is not None and position > newest:
                why = f"its position {position} is ahead of the storage's newest entry {newest}"
            if why is not None:
                message = f"CTL feed {feed}: {why}; a new storage: reading it from its beginning"
                log.warning(message)
                if on_restart is not None:
                    on_restart(message)
                position = 0
            if why is not None or (identity is not None and identity != known):
                conn.execute(sql.RESET_FEED, {"name": feed, "identity": identity or known, "position": position})
            items = read(position)
            changes = []
            for item in items:
                try:
                    changes.extend(self.set_many(item.values, by=item.by, conn=conn, only_forward=item.only_forward))
                except InvalidCtlInput as exc:
                    log.warning("CTL feed %s: item %s skipped: %s", feed, item.position, exc)
            if items:
                conn.execute(sql.MOVE_FEED, {"name": feed, "position": items[-1].position})
        return changes

    def values(self, entity: str | None = None) -> list[dict[str, object]]:
        """Every current value (of one entity), with version and last writer."""
        entity = _filter(entity, "entity")
        with self.database.connection() as conn:
            return _dict_rows(conn.execute(sql.LIST_VALUES, {"entity": entity}))


def read_values(conn: psycopg.Connection, keys: Sequence[ParameterKey]) -> dict[ParameterKey, datetime]:
    """Current values of already valid ``keys`` in one query; parameters without a value are left out."""
    params = {"entities": [k[0] for k in keys], "parameters": [k[1] for k in keys]}
    return {(entity, parameter): value for entity, parameter, value in conn.execute(sql.GET_VALUES, params)}


def values_as_of(
    conn: psycopg.Connection, keys: Sequence[ParameterKey], moment: datetime
) -> dict[ParameterKey, datetime]:
    """The values of already valid ``keys`` as they were at ``moment`` (from the history of changes)."""
    if not keys:
        return {}
    params = {"entities": [k[0] for k in keys], "parameters": [k[1] for k in keys], "at": moment}
    return {(entity, parameter): value for entity, parameter, value in conn.execute(sql.VALUES_AS_OF, params)}


def check_values(values: object) -> dict[ParameterKey, datetime]:
    """``values`` if it maps (entity, parameter) pairs of valid names to aware datetimes CTL can hold;
    :class:`InvalidCtlInput` naming the key and the field otherwise."""
    if not isinstance(values, Mapping):
        raise InvalidCtlInput(f"CTL values must be a mapping {{(entity, parameter): datetime}}, got {shorten(values)}")
    checked = {}
    for key, value in values.items():
        try:
            checked[check_key(key)] = _moment(value)
        except InvalidCtlInput as exc:
            raise InvalidCtlInput(f"invalid CTL value for {shorten(key)}: {exc}; nothing was written") from None
    return checked


def check_key(key: object) -> ParameterKey:
    """``key`` as an (entity, parameter) pair of CTL names."""
    if not (isinstance(key, tuple | list) and len(key) == 2):
        raise InvalidCtlInput(f"key: expected an (entity, parameter) pair, got {shorten(key)}")
    return check_name(key[0], "entity"), check_name(key[1], "parameter")


def _check_keys(pairs: Iterable[ParameterKey]) -> list[ParameterKey]:
    try:
        keys = list(pairs)
    except TypeError:
        raise InvalidCtlInput(f"CTL keys must be (entity, parameter) pairs, got {shorten(pairs)}") from None
    checked = []
    for key in keys:
        try:
            checked.append(check_key(key))
        except InvalidCtlInput as exc:
            raise InvalidCtlInput(f"invalid CTL key {shorten(key)}: {exc}") from None
    return checked


def _moment(value: object) -> datetime:
    try:
        return _MOMENT.validate_python(value)
    except ValidationError as exc:
        problem = describe(exc)  # "value: ..." (a value has no field path)
        got = "" if "got " in problem else f" (got {shorten(value)})"
        raise InvalidCtlInput(f"{problem}{got}") from None


def _filter(value: object, field: str) -> str | None:
    return None if value is None else check_name(value, field)


def _dict_rows(cursor: psycopg.Cursor) -> list[dict[str, object]]:
    names = [column.name for column in cursor.description or ()]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def values_to_json(values: Mapping[ParameterKey, datetime]) -> dict[str, dict[str, str]]:
    """``{(entity, parameter): value}`` as ``{entity: {parameter: iso}}`` (how values are stored and tagged)."""
    nested: dict[str, dict[str, str]] = {}
    for (entity, parameter), value in sorted(values.items()):
        nested.setdefault(entity, {})[parameter] = value.isoformat()
    return nested


def values_from_json(nested: Mapping[str, Mapping[str, str]] | None) -> dict[ParameterKey, datetime]:
    """The inverse of :func:`values_to_json`."""
    return {
        (entity, parameter): datetime.fromisoformat(value)
        for entity, parameters in (nested or {}).items()
        for parameter, value in parameters.items()
    }
