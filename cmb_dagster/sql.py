"""Every query of the foundation: the worker runtime's leases (table ``leases``), the health checks' states and the
settings of a write joining an application's transaction (flow control's are in cmb_dagster/flow/sql.py)."""

# A write on an application's connection: the cmb schema first on the search path for the write alone. The
# settings a write may change for its transaction are read before it and given back after it.
ENTER_SCHEMA = """
WITH before AS MATERIALIZED (
    SELECT current_setting('search_path') AS search_path, current_setting('lock_timeout') AS lock_timeout,
           current_setting('statement_timeout') AS statement_timeout
)
SELECT search_path, lock_timeout, statement_timeout,
       set_config('search_path', format('%%I, public', %(schema)s::text), true)
FROM before
"""
LEAVE_SCHEMA = """
SELECT set_config('search_path', %s, true), set_config('lock_timeout', %s, true),
       set_config('statement_timeout', %s, true)
"""

# Renew the partitions that are ours and unexpired, take those that are free or expired (the fence grows on
# a takeover). A renewal changes no key column, so it does not wait for our own transactions that check a
# lease (FOR KEY SHARE); a takeover changes the fence, a key column (unique index leases_fence), so it waits
# for them. ``inherited``: the previous holder neither renewed nor released it (it died or stalled).
ACQUIRE_LEASES = """
WITH wanted AS (
    SELECT DISTINCT p FROM unnest(%(partitions)s::text[]) AS p
), renewed AS (
    UPDATE leases l SET expires_at = now() + make_interval(secs => %(ttl)s)
    FROM wanted
    WHERE l.kind = %(kind)s AND l.partition = wanted.p AND l.owner = %(owner)s AND l.expires_at > now()
    RETURNING l.partition, l.fence
), previous AS (
    SELECT l.partition, l.expires_at FROM leases l JOIN wanted ON l.kind = %(kind)s AND l.partition = wanted.p
), taken AS (
    INSERT INTO leases AS l (kind, partition, owner, expires_at)
    SELECT %(kind)s, wanted.p, %(owner)s, now() + make_interval(secs => %(ttl)s)
    FROM wanted WHERE wanted.p NOT IN (SELECT partition FROM renewed)
    ON CONFLICT (kind, partition) DO UPDATE
        SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at, fence = l.fence + 1, acquired_at = now()
        WHERE l.expires_at <= now()
    RETURNING l.partition, l.fence
)
SELECT partition, fence, false FROM renewed
UNION ALL
SELECT t.partition, t.fence, coalesce(p.expires_at > '-infinity', false)
FROM taken t LEFT JOIN previous p ON p.partition = t.partition
"""

# Give partitions up at once (they expire now).
# Released leases are announced on the leases channel (payload: the kind), so a successor waiting for them
# takes them at once instead of at its next renewal.
RELEASE_LEASES = """
WITH released AS (
    UPDATE leases SET expires_at = '-infinity'
    WHERE kind = %(kind)s AND owner = %(owner)s AND partition = ANY(%(partitions)s::text[])
    RETURNING 1
)
SELECT pg_notify(%(channel)s, %(kind)s) FROM (SELECT 1 FROM released LIMIT 1) r
"""

# Is the lease still ours and unexpired? Key-share-locks the row until the transaction ends: no takeover
# (a fence change) until then, while our own renewals go on.
CHECK_LEASE = """
SELECT 1 FROM leases
WHERE kind = %(kind)s AND partition = %(partition)s AND owner = %(owner)s AND fence = %(fence)s
  AND expires_at > now()
FOR KEY SHARE
"""

# CHECK_LEASE for several partitions of one kind and owner at once: the partitions still held.
CHECK_LEASES = """
SELECT l.partition FROM leases l
JOIN unnest(%(partitions)s::text[], %(fences)s::bigint[]) AS u(partition, fence)
  ON l.kind = %(kind)s AND l.partition = u.partition AND l.fence = u.fence
WHERE l.owner = %(owner)s AND l.expires_at > now()
ORDER BY l.partition
FOR KEY SHARE OF l
"""

# Every lease, for operators (read only): seconds until it expires (negative once expired; -Infinity: released).
LIST_LEASES = """
SELECT kind, partition, owner, fence, acquired_at,
       extract(epoch FROM expires_at)::float8 - extract(epoch FROM clock_timestamp())::float8 AS expires_in
FROM leases
ORDER BY kind, partition
"""

# -- Health checks (tables ``check_states``, ``check_transitions``) ---------------------------------------------

# Store each check's severity and its latest verdict's text (``changed_at``: since when it has that severity); a
# change of severity (a new check counts as having been ok) is recorded once as a transition.
# ON CONFLICT re-reads a row another writer changed meanwhile, so two processes seeing the same change record it
# once. Rows are written in key order (no deadlocks).
RECORD_CHECK_STATES = """
WITH changed AS (
    INSERT INTO check_states AS s (asset, check_name, scope, severity, previous, text)
    SELECT i.asset, i.check_name, i.scope, i.severity, 'ok', i.text
    FROM unnest(%(assets)s::jsonb[], %(checks)s::text[], %(scopes)s::text[], %(severities)s::text[], %(texts)s::text[])
        AS i(asset, check_name, scope, severity, text)
    ORDER BY i.asset, i.check_name, i.scope
    ON CONFLICT (asset, check_name, scope) DO UPDATE
        SET previous = CASE WHEN s.severity <> EXCLUDED.severity THEN s.severity ELSE s.previous END,
            severity = EXCLUDED.severity, text = EXCLUDED.text,
            changed_at = CASE WHEN s.severity <> EXCLUDED.severity THEN now() ELSE s.changed_at END
        WHERE s.severity <> EXCLUDED.severity OR s.text <> EXCLUDED.text  -- the text is the latest verdict's
    RETURNING asset, check_name, scope, previous, severity, text, changed_at = now() AS moved
)
INSERT INTO check_transitions (asset, check_name, scope, previous, severity, text)
SELECT asset, check_name, scope, previous, severity, text FROM changed WHERE moved AND previous <> severity
ORDER BY asset, check_name, scope
RETURNING id, asset, check_name, scope, previous, severity, text, at
"""

CHECK_TRANSITIONS = """
SELECT id, asset, check_name, scope, previous, severity, text, at FROM check_transitions
WHERE id > %(after)s ORDER BY id LIMIT %(limit)s
"""

# Transitions no alert was sent for, oldest first; ``fresh``: younger than the alerts' max age.
UNALERTED_TRANSITIONS = """
SELECT id, asset, check_name, scope, previous, severity, text, at,
       at > now() - make_interval(secs => %(max_age)s) AS fresh
FROM check_transitions WHERE alerted_at IS NULL ORDER BY id LIMIT %(limit)s
"""

MARK_ALERTED = "UPDATE check_transitions SET alerted_at = now() WHERE id = ANY(%(ids)s::bigint[])"

CHECK_STATES = """
SELECT asset, check_name, scope, severity, text, changed_at FROM check_states
WHERE NOT %(failing)s OR severity <> 'ok'
ORDER BY asset, check_name, scope
"""

# What holds back vacuum in this database: the session, prepared transaction or replication slot with the oldest
# snapshot (xmin) or transaction id, with its age in seconds where the server keeps one (a role that may not see
# another user's session still sees its pid, application, user and xid, not its state or times).
VACUUM_HOLDER = """
SELECT kind, pid, name, state, username, age_seconds, age_xids FROM (
    SELECT 'session' AS kind, a.pid, a.application_name AS name, a.state, a.usename AS username,
           extract(epoch FROM now() - a.xact_start)::float8 AS age_seconds,
           greatest(age(a.backend_xmin), age(a.backend_xid)) AS age_xids
    FROM pg_stat_activity a
    WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL) AND a.pid <> pg_backend_pid()
      AND (a.datname = current_database() OR a.datname IS NULL)
    UNION ALL
    SELECT 'prepared transaction', NULL, p.gid, 'prepared', p.owner::text,
           extract(epoch FROM now() - p.prepared)::float8, age(p.transaction)
    FROM pg_prepared_xacts p WHERE p.database = current_database()
    UNION ALL
    SELECT 'replication slot', s.active_pid, s.slot_name, CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL,
           NULL, age(s.xmin)
    FROM pg_replication_slots s WHERE s.xmin IS NOT NULL
) AS holders
ORDER BY age_xids DESC, age_seconds DESC NULLS LAST
LIMIT 1
"""

# Live and dead rows of every table of the cmb schema, as the statistics last counted them (no lock taken: a table
# locked by a migration or a TRUNCATE does not stop the reading).
TABLE_ROWS = """
SELECT relname, n_live_tup, n_dead_tup
FROM pg_stat_user_tables WHERE schemaname = %(schema)s
ORDER BY relname
"""
