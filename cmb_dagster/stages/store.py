"""The entity store and the external state API.

Writes through the API bump the version and put the entity on the change path (``stage_changes``) in
the same transaction; the worker of the entity's shard then asks the stages ``should_process``.
Writes that bypass the API (plain SQL on ``stage_entities``) reach the same change path through the
pub/sub capture of the table (see :func:`ensure_capture`), and a plain UPDATE bumps the version by
trigger, so a stage in flight notices it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from pydantic import ValidationError

from cmb_dagster.database import Database, DatabaseSource, connection_for
from cmb_dagster.inputs import check_int, refused_input, to_json
from cmb_dagster.models import describe
from cmb_dagster.notifications import channel_name
from cmb_dagster.pubsub import install_capture
from cmb_dagster.stages import sql
from cmb_dagster.stages.errors import EntityNotFound, InvalidStageInput, VersionConflict
from cmb_dagster.stages.models import (
    CHANNEL,
    Entity,
    MergePatch,
    changed_fields,
    check_entity_id,
    dump_payload,
    merge_patch,
)
from cmb_dagster.stages.stage import Stage, check_stages, stage_named

WRITER_SETTING = "cmb.stages_writer"


def capture_branch_expression(branch: int) -> str:
    """Rows written outside the API and the engine (no writer mark in the transaction) go to ``branch``."""
    return f"CASE WHEN coalesce(current_setting('{WRITER_SETTING}', true), '') = '' THEN {int(branch)} END"


def ensure_capture(db: Database) -> None:
    """Install the pub/sub capture of ``stage_entities`` once (idempotent, safe from several processes)."""
    with db.connection() as conn:
        if conn.execute(sql.CAPTURE_INSTALLED).fetchone():
            return
        conn.execute(sql.CAPTURE_LOCK, {"schema": db.schema})
        if conn.execute(sql.CAPTURE_INSTALLED).fetchone():
            return
        branch = conn.execute(sql.SETTINGS).fetchone()[1]
        install_capture(
            conn,
            f"{db.schema}.stage_entities",
            capture_branch_expression(branch),
            key=["entity_id"],
            columns=["entity_id", "version"],
            ops=["insert", "update"],
            topic="stages.entities",
            schema=db.schema,
        )


class StageStore:
    """Entities and stage states: ``put`` / ``patch`` / ``delete`` / ``get``, ``read_state`` / ``update_state``.

    ``stages`` (Stage instances) name the stages the state API accepts and give their state models.
    """

    def __init__(self, source: DatabaseSource, stages: Sequence[Stage] = ()) -> None:
        self.db = Database.of(source)
        self.stages = check_stages(stages)
        self._capture_checked = False

    # -- entities ------------------------------------------------------------------------------

    def put(self, entity_id: str, payload: Mapping[str, Any], *, conn: psycopg.Connection | None = None) -> int:
        """Create or replace an entity's payload; return its version (unchanged payload: no new version).

        With ``conn`` (any connection of yours) the write joins its transaction: it exists only if that commits;
        so do :meth:`put_many`, :meth:`patch` and :meth:`delete`."""
        return self.put_many({entity_id: payload}, conn=conn)[entity_id]

    def put_many(
        self, entities: Mapping[str, Mapping[str, Any]], *, conn: psycopg.Connection | None = None
    ) -> dict[str, int]:
        """Create or replace many entities in one transaction; return their versions."""
        ids, texts = [], []
        for entity_id, payload in sorted(entities.items(), key=lambda item: str(item[0])):  # one lock order
            ids.append(check_entity_id(entity_id))
            texts.append(dump_payload(payload, f"payload of {entity_id!r}"))
        if not ids:
            return {}
        self._ensure_capture()
        field = "entity" if len(ids) == 1 else "entities"
        with refused_input(InvalidStageInput, field, conn=conn), connection_for(conn, self.db) as c:
            shard_count = c.execute(sql.BEGIN_WRITE).fetchone()[0]
            old = {row[0]: row[2] for row in c.execute(sql.LOCK_ENTITIES, {"ids": ids})}
            written = dict(c.execute(sql.UPSERT_ENTITIES, {"ids": ids, "payloads": texts}).fetchall())
            changes = [(i, _fields(old.get(i), entities[i])) for i in ids if i in written]
            enqueue_changes(c, self.db, shard_count, changes)
            versions = {i: written[i] for i in written}
            if len(versions) < len(ids):  # unchanged payloads keep their version
                for row in c.execute(sql.LOCK_ENTITIES, {"ids": [i for i in ids if i not in versions]}):
                    versions[row[0]] = row[1]
        return versions

    def patch(
        self,
        entity_id: str,
        patch: Mapping[str, Any],
        *,
        version: int | None = None,
        conn: psycopg.Connection | None = None,
    ) -> int:
        """Apply an RFC 7386 merge patch to an entity; return its new version.

        ``version``: only if the entity is at this version (else :class:`VersionConflict`)."""
        check_entity_id(entity_id)
        if not isinstance(patch, Mapping):
            raise InvalidStageInput(
                f"patch: must be a JSON object (an RFC 7386 merge patch), not {type(patch).__name__}"
            )
        dump_payload(dict(patch), "patch")
        self._ensure_capture()
        with refused_input(InvalidStageInput, "patch", conn=conn), connection_for(conn, self.db) as c:
            shard_count = c.execute(sql.BEGIN_WRITE).fetchone()[0]
            row = c.execute(sql.LOCK_ENTITIES, {"ids": [entity_id]}).fetchone()
            if row is None:
                raise EntityNotFound(f"entity_id: no entity {entity_id!r}")
            _, current, payload = row
            if version is not None and version != current:
                raise VersionConflict(f"version: entity {entity_id!r} is at version {current}, not {version}")
            new = merge_patch(payload, dict(patch))
            if new == payload:
                return current
            text = dump_payload(new, "patch")
            saved = c.execute(
                sql.UPDATE_ENTITY_IF_VERSION, {"id": entity_id, "payload": text, "version": current}
            ).fetchone()
            enqueue_changes(c, self.db, shard_count, [(entity_id, _fields(payload, new))])
            return saved[0]

    def delete(self, entity_id: str, *, conn: psycopg.Connection | None = None) -> bool:
        """Delete an entity with its states and queue entries; False if there was none."""
        check_entity_id(entity_id)
        with connection_for(conn, self.db) as c:
            c.execute(sql.BEGIN_WRITE)
            return c.execute(sql.DELETE_ENTITY, {"id": entity_id}).fetchone() is not None

    def get(self, entity_id: str) -> Entity | None:
        """The entity, or None."""
        check_entity_id(entity_id)
        with self.db.connection() as conn:
            row = conn.execute(sql.GET_ENTITY, {"id": entity_id}).fetchone()
        return None if row is None else Entity(row[0], row[1], row[2], row[3])

    # -- state API -----------------------------------------------------------------------------

    def read_state(self, entity_id: str, stage: str) -> tuple[Any, int]:
        """``(state, version)`` of ``stage`` for the entity: the stage's state model (defaults and
        version 0 when none is stored)."""
        check_entity_id(entity_id)
        spec = stage_named(self.stages, stage)
        with self.db.connection() as conn:
            row = conn.execute(sql.READ_STATE, {"id": entity_id, "stage": stage}).fetchone()
        if row is None:
            raise EntityNotFound(f"entity_id: no entity {entity_id!r}")
        return spec.load_state(row[1]), row[2]

    def update_state(self, entity_id: str, stage: str, new_state: Any, version: int) -> bool:
        """Compare-and-set: store ``new_state`` only if the state is still at ``version``; True if stored."""
        check_entity_id(entity_id)
        spec = stage_named(self.stages, stage)
        check_int(version, "version", low=0, error=InvalidStageInput)
        if isinstance(new_state, Mapping):
            try:
                new_state = spec.state_model.model_validate(new_state)
            except ValidationError as exc:
                raise InvalidStageInput(
                    f"new_state: not a valid {spec.state_model.__name__}: {describe(exc)}"
                ) from None
        if not isinstance(new_state, spec.state_model):
            raise InvalidStageInput(f"new_state: must be a {spec.state_model.__name__}, not {type(new_state).__name__}")
        text = to_json(new_state.model_dump(mode="json"), "new_state", error=InvalidStageInput)
        with refused_input(InvalidStageInput, "new_state"), self.db.connection() as conn:
            if conn.execute(sql.LOCK_ENTITY, {"id": entity_id}).fetchone() is None:
                raise EntityNotFound(f"entity_id: no entity {entity_id!r}")
            stored = conn.execute(
                sql.WRITE_STATE_IF_VERSION, {"id": entity_id, "stage": stage, "state": text, "version": version}
            ).fetchone()
        return stored is not None

    # -- internals -----------------------------------------------------------------------------

    def _ensure_capture(self) -> None:
        if not self._capture_checked:
            ensure_capture(self.db)
            self._capture_checked = True


def enqueue_changes(conn: psycopg.Connection, db: Database, shard_count: int, changes: list[tuple[str, str]]) -> None:
    """Put entities on the change path and wake the workers; each change is (entity_id, 'a,b' changed fields
    or '*')."""
    if not changes:
        return
    conn.execute(
        sql.ENQUEUE_CHANGES,
        {
            "shard_count": shard_count,
            "ids": [c[0] for c in changes],
            "fields": [c[1] for c in changes],
        },
    )
    conn.execute(sql.NOTIFY, {"channel": channel_name(db, CHANNEL), "payload": ""})


def _fields(old: Any, new: Mapping[str, Any]) -> str:
    if old is None:
        return "*"
    fields = changed_fields(old, dict(new))
    if any("," in f for f in fields):
        return "*"
    return ",".join(sorted(fields)) or "*"


__all__ = ["MergePatch", "StageStore", "enqueue_changes", "ensure_capture"]
