"""Every SQL statement of the CTL store (tables ``ctl_values``, ``ctl_history`` and ``ctl_feeds``, created by
migrations/0003_ctl.sql)."""

# -- CTL store --------------------------------------------------------------------------------

# ``only_forward``: a value at or before the current one is left as it is (not a change, not recorded).
# Upsert many values and record each real change in the history, in one statement. In ON CONFLICT
# DO UPDATE, ``v.value`` is the row as locked by this statement, so the old value is exact even
# when several writers set the same parameter at once. Rows are written in key order (no deadlocks).
SET_VALUES = """
WITH changed AS (
    INSERT INTO ctl_values AS v (entity, parameter, value, updated_by)
    SELECT i.entity, i.parameter, i.value, %(by)s
    FROM unnest(%(entities)s::text[], %(parameters)s::text[], %(values)s::timestamptz[]) AS i(entity, parameter, value)
    ORDER BY i.entity, i.parameter
    ON CONFLICT (entity, parameter) DO UPDATE
        SET previous_value = v.value,
            value = EXCLUDED.value,
            version = v.version + 1,
            updated_at = now(),
            updated_by = EXCLUDED.updated_by
        WHERE v.value IS DISTINCT FROM EXCLUDED.value AND (NOT %(only_forward)s OR EXCLUDED.value > v.value)
    RETURNING entity, parameter, previous_value, value
)
INSERT INTO ctl_history (entity, parameter, old_value, new_value, backwards, changed_by)
SELECT entity, parameter, previous_value, value, coalesce(value < previous_value, false), %(by)s
FROM changed
ORDER BY entity, parameter
RETURNING id, entity, parameter, old_value, new_value, backwards, changed_at, changed_by
"""

GET_VALUES = """
SELECT v.entity, v.parameter, v.value
FROM ctl_values v
JOIN unnest(%(entities)s::text[], %(parameters)s::text[]) AS k(entity, parameter) USING (entity, parameter)
"""

HISTORY = """
SELECT id, entity, parameter, old_value, new_value, backwards, changed_at, changed_by
FROM ctl_history
WHERE (%(entity)s::text IS NULL OR entity = %(entity)s)
  AND (%(parameter)s::text IS NULL OR parameter = %(parameter)s)
  AND (NOT %(backwards_only)s OR backwards)
ORDER BY id DESC
LIMIT %(limit)s
"""

LIST_VALUES = """
SELECT entity, parameter, value, version, updated_at, updated_by
FROM ctl_values
WHERE (%(entity)s::text IS NULL OR entity = %(entity)s)
ORDER BY entity, parameter
"""

ENSURE_FEED = "INSERT INTO ctl_feeds (name) VALUES (%(name)s) ON CONFLICT (name) DO NOTHING"

# A feed's position, locked for the caller's transaction; no row when another process holds it.
LOCK_FEED = "SELECT position, identity FROM ctl_feeds WHERE name = %(name)s FOR UPDATE SKIP LOCKED"

# A feed read from a new storage starts again from its beginning; a feed without identity adopts one.
RESET_FEED = """
UPDATE ctl_feeds SET position = %(position)s, identity = %(identity)s, updated_at = now() WHERE name = %(name)s
"""

MOVE_FEED = "UPDATE ctl_feeds SET position = %(position)s, updated_at = now() WHERE name = %(name)s"

# Values as they were at a moment: the newest recorded change at or before it (index ctl_history_parameter).
VALUES_AS_OF = """
SELECT k.entity, k.parameter, h.new_value
FROM unnest(%(entities)s::text[], %(parameters)s::text[]) AS k(entity, parameter)
CROSS JOIN LATERAL (
    SELECT new_value FROM ctl_history h
    WHERE h.entity = k.entity AND h.parameter = k.parameter AND h.changed_at <= %(at)s
    ORDER BY h.id DESC LIMIT 1
) h
"""
