"""Every query of the foundation: the worker runtime's leases (table ``leases``), the health checks' states, flow
control, and the settings of a write joining an application's transaction."""

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

# -- flow control (cmb_dagster/flow.py) ---------------------------------------------------------------

# Locks on a key's rows: takers lock the free slots they take FOR NO KEY UPDATE (SKIP LOCKED) and its bucket FOR
# UPDATE (waiting, in (scope, key) order); FLOW_ENSURE key-share-locks the key's top slot row before it adds more
# after it, which conflicts with the sweep alone (FOR UPDATE, SKIP LOCKED): the sweep never waits for anyone, and a
# key's slot rows are always 0..n-1, deleted or made whole.
#
# SQL expressions the engines' claims share. FLOW_AVAILABLE: bucket b's tokens now, refilled at limits l's
# rate up to its burst. FLOW_SLOT_FREE: slot s holds nothing live.
FLOW_AVAILABLE = "least(l.burst, b.tokens + l.rate * extract(epoch FROM clock_timestamp() - b.refilled_at))"
FLOW_SLOT_FREE = "s.expires_at <= now()"


def flow_empty_until(left: str) -> str:
    """SQL: when a bucket with ``left`` tokens (an expression) at its scope's rate ``l.rate`` has one again."""
    return f"""CASE WHEN {left} < 1 THEN clock_timestamp() + make_interval(secs => (1 - {left}) / l.rate)
                     ELSE '-infinity' END"""


def flow_slots_lacking(scope: str, key: str, concurrency: str) -> str:
    """SQL: whether a key (``scope``, ``key``: expressions) that found fewer free slots than it wanted is to have
    FLOW_ENSURE run and be taken again: it has fewer slot rows than ``concurrency``, or none of its slots is held, the
    free ones being locked by a sweep (FLOW_ENSURE waits for it, then makes the key again if it was removed) or by
    takers starting at the same time."""
    return f"""(coalesce((SELECT s.slot + 1 FROM flow_slots s WHERE s.scope = {scope} AND s.key = {key}
                          ORDER BY s.slot DESC LIMIT 1), 0) < {concurrency}
            OR NOT EXISTS (SELECT 1 FROM flow_slots s WHERE s.scope = {scope} AND s.key = {key} AND s.item IS NOT NULL
                             AND NOT {FLOW_SLOT_FREE}))"""


# Each scope's limits as registered (upsert), and the scopes given without limits forgotten.
FLOW_REGISTER = """
WITH given AS (
    SELECT * FROM unnest(%(scopes)s::text[], %(rates)s::float8[], %(bursts)s::float8[], %(concurrency)s::int[])
        AS g(scope, rate, burst, concurrency)
), forgotten AS (
    DELETE FROM flow_limits f USING given g
    WHERE f.scope = g.scope AND g.rate IS NULL AND g.concurrency IS NULL
)
INSERT INTO flow_limits AS f (scope, rate, burst, concurrency)
SELECT scope, rate, burst, concurrency FROM given WHERE rate IS NOT NULL OR concurrency IS NOT NULL
ON CONFLICT (scope) DO UPDATE SET rate = EXCLUDED.rate, burst = EXCLUDED.burst, concurrency = EXCLUDED.concurrency,
                                  updated_at = now()
WHERE (f.rate, f.burst, f.concurrency) IS DISTINCT FROM (EXCLUDED.rate, EXCLUDED.burst, EXCLUDED.concurrency)
"""

# The bucket of (scope, key) pairs, made full where missing; and more free slots where all are taken: slot rows
# are made as they are needed (64 at first, then twice as many), up to the scope's concurrency. The top slot row
# is key-share-locked: a sweep deleting the key meanwhile is waited for (its rows are then made again from 0).
FLOW_ENSURE = """
WITH pairs AS (
    SELECT DISTINCT p.scope, p.key, l.rate, l.burst, l.concurrency
    FROM unnest(%(scopes)s::text[], %(keys)s::text[]) AS p(scope, key) JOIN flow_limits l ON l.scope = p.scope
), buckets AS (
    INSERT INTO flow_buckets (scope, key, tokens)
    SELECT scope, key, burst FROM pairs WHERE rate IS NOT NULL
    ON CONFLICT DO NOTHING
), made AS (
    SELECT p.*, coalesce((SELECT s.slot + 1 FROM flow_slots s WHERE s.scope = p.scope AND s.key = p.key
                          ORDER BY s.slot DESC LIMIT 1 FOR KEY SHARE), 0) AS n
    FROM pairs p WHERE p.concurrency IS NOT NULL
)
INSERT INTO flow_slots (scope, key, slot)
SELECT scope, key, slot FROM made, generate_series(n, least(concurrency, greatest(64, 2 * n)) - 1) AS slot
ON CONFLICT DO NOTHING
"""

# Up to %(want)s grants for (scope, key): a free slot each (under a concurrency limit) and a token each (under a
# rate limit), given to %(items)s in order; returns the grants, the slots given, when nothing was granted for
# want of tokens the seconds until the next token, and whether the key lacks its bucket (as locked: a sweep may
# have removed it meanwhile) or slot rows (flow_slots_lacking): FLOW_ENSURE makes them, then the take runs again.
FLOW_TAKE = f"""
WITH l AS MATERIALIZED (
    SELECT rate, burst, concurrency FROM flow_limits WHERE scope = %(scope)s
), free AS MATERIALIZED (
    SELECT s.slot FROM flow_slots s, l
    WHERE s.scope = %(scope)s AND s.key = %(key)s AND s.slot < l.concurrency AND {FLOW_SLOT_FREE}
    ORDER BY s.slot LIMIT %(want)s
    FOR NO KEY UPDATE OF s SKIP LOCKED
), can AS (
    SELECT CASE WHEN l.concurrency IS NULL THEN %(want)s ELSE (SELECT count(*) FROM free) END AS n FROM l
), now_ AS (
    SELECT b.scope, b.key, {FLOW_AVAILABLE} AS avail, l.rate
    FROM flow_buckets b, l WHERE b.scope = %(scope)s AND b.key = %(key)s
    FOR UPDATE OF b
), bucket AS (
    UPDATE flow_buckets b
    SET tokens = now_.avail - least(floor(greatest(now_.avail, 0)), (SELECT n FROM can)),
        refilled_at = clock_timestamp(),
        empty_until = {flow_empty_until("(now_.avail - least(floor(greatest(now_.avail, 0)), (SELECT n FROM can)))")}
    FROM now_, l WHERE b.scope = now_.scope AND b.key = now_.key
    RETURNING least(floor(greatest(now_.avail, 0)), (SELECT n FROM can))::int AS took,
              greatest((1 - now_.avail) / now_.rate, 0) AS wait
), granted AS (
    SELECT CASE WHEN l.rate IS NULL THEN (SELECT n FROM can) ELSE coalesce((SELECT took FROM bucket), 0) END AS n
    FROM l
), slots AS (
    UPDATE flow_slots s
    SET item = u.item, taken_at = now(), expires_at = now() + make_interval(secs => %(ttl)s)
    FROM (SELECT slot, row_number() OVER (ORDER BY slot) AS r FROM free) f
    JOIN unnest(%(items)s::text[]) WITH ORDINALITY AS u(item, r) USING (r)
    WHERE s.scope = %(scope)s AND s.key = %(key)s AND s.slot = f.slot AND f.r <= (SELECT n FROM granted)
    RETURNING s.slot, f.r
)
SELECT coalesce((SELECT n FROM granted), 0)::int, ARRAY(SELECT slot FROM slots ORDER BY r),
       CASE WHEN coalesce((SELECT n FROM granted), 0) = 0 THEN (SELECT wait FROM bucket) END,
       (SELECT (l.rate IS NOT NULL AND NOT EXISTS (SELECT 1 FROM now_))
               OR (l.concurrency IS NOT NULL AND (SELECT count(*) FROM free) < %(want)s
                   AND {flow_slots_lacking("%(scope)s", "%(key)s", "l.concurrency")})
        FROM l)
"""

# The slots %(slots)s of (scope, key) held for %(items)s last another %(ttl)s seconds.
FLOW_RENEW = """
UPDATE flow_slots s SET expires_at = now() + make_interval(secs => %(ttl)s)
FROM unnest(%(slots)s::int[], %(items)s::text[]) AS u(slot, item)
WHERE s.scope = %(scope)s AND s.key = %(key)s AND s.slot = u.slot AND s.item = u.item AND s.expires_at > now()
"""

# The slots %(slots)s of (scope, key) that %(items)s hold, freed.
FLOW_RELEASE = """
UPDATE flow_slots s SET item = NULL, taken_at = NULL, expires_at = '-infinity'
FROM unnest(%(slots)s::int[], %(items)s::text[]) AS u(slot, item)
WHERE s.scope = %(scope)s AND s.key = %(key)s AND s.slot = u.slot AND s.item = u.item
"""

# Per key of the scopes given (those that have a bucket or slots): the limits, the tokens now, the slots in use.
FLOW_USAGE = f"""
SELECT k.scope, k.key, l.rate, l.burst, l.concurrency,
       (SELECT {FLOW_AVAILABLE} FROM flow_buckets b WHERE b.scope = k.scope AND b.key = k.key) AS tokens,
       (SELECT count(*) FROM flow_slots s WHERE s.scope = k.scope AND s.key = k.key AND s.slot < l.concurrency
          AND NOT {FLOW_SLOT_FREE})::int AS in_flight
FROM (SELECT scope, key FROM flow_buckets WHERE scope = ANY(%(scopes)s)
      UNION SELECT scope, key FROM flow_slots WHERE scope = ANY(%(scopes)s)) AS k
JOIN flow_limits l ON l.scope = k.scope
ORDER BY k.scope, k.key
LIMIT %(limit)s
"""

# The sweep (flow.sweep), first statement: of the keys walked in (scope, key) order from %(scope)s, %(key)s on
# (those with a bucket or slot rows: the buckets' keys by their primary key, the slots' keys by a skip scan of
# theirs, so the walk reads %(limit)s keys whatever the statistics), those idle - a full bucket (or none, or no rate
# limit any more), no slot held - get their bucket and every slot row locked, skipping those another transaction
# holds. Returns ('idle', scope, key, whether it has a bucket, its slot rows) for the idle keys whose rows are all
# locked, and ('next', scope, key) for the key the next batch starts at, if any.
FLOW_SWEEP_LOCK = f"""
WITH RECURSIVE slot_keys(scope, key, n) AS (
    (SELECT s.scope, s.key, 1 FROM flow_slots s WHERE (s.scope, s.key) >= (%(scope)s, %(key)s)
     ORDER BY s.scope, s.key, s.slot LIMIT 1)
    UNION ALL
    SELECT nxt.scope, nxt.key, k.n + 1
    FROM slot_keys k CROSS JOIN LATERAL (
        SELECT s.scope, s.key FROM flow_slots s WHERE (s.scope, s.key) > (k.scope, k.key)
        ORDER BY s.scope, s.key, s.slot LIMIT 1
    ) AS nxt
    WHERE k.n <= %(limit)s
), walked AS MATERIALIZED (
    SELECT scope, key, row_number() OVER (ORDER BY scope, key) AS n
    FROM (SELECT scope, key FROM slot_keys
          UNION
          (SELECT b.scope, b.key FROM flow_buckets b WHERE (b.scope, b.key) >= (%(scope)s, %(key)s)
           ORDER BY b.scope, b.key LIMIT %(limit)s + 1)) AS k
    ORDER BY scope, key LIMIT %(limit)s + 1
), idle AS MATERIALIZED (  -- as this statement sees them
    SELECT w.scope, w.key, l.rate, l.burst
    FROM walked w LEFT JOIN flow_limits l ON l.scope = w.scope
    WHERE w.n <= %(limit)s
      AND NOT EXISTS (SELECT 1 FROM flow_slots s WHERE s.scope = w.scope AND s.key = w.key AND s.item IS NOT NULL
                        AND NOT {FLOW_SLOT_FREE})
      AND NOT EXISTS (SELECT 1 FROM flow_buckets b WHERE b.scope = w.scope AND b.key = w.key AND l.rate IS NOT NULL
                        AND {FLOW_AVAILABLE} < l.burst)
), locked AS MATERIALIZED (  -- each one's bucket, locked where it is still full (rechecked on its newest version)
    SELECT l.scope, l.key, b.key IS NOT NULL AS bucket
    FROM idle l LEFT JOIN LATERAL (
        SELECT b.key FROM flow_buckets b
        WHERE b.scope = l.scope AND b.key = l.key AND (l.rate IS NULL OR {FLOW_AVAILABLE} >= l.burst)
        FOR UPDATE OF b SKIP LOCKED
    ) AS b ON true
    WHERE b.key IS NOT NULL OR NOT EXISTS (SELECT 1 FROM flow_buckets x WHERE x.scope = l.scope AND x.key = l.key)
), slots AS MATERIALIZED (  -- then its free slot rows
    SELECT k.scope, k.key, k.bucket, f.locked,
           (SELECT count(*) FROM flow_slots s WHERE s.scope = k.scope AND s.key = k.key) AS seen
    FROM locked k CROSS JOIN LATERAL (
        SELECT count(*) AS locked
        FROM (SELECT 1 FROM flow_slots s WHERE s.scope = k.scope AND s.key = k.key AND {FLOW_SLOT_FREE}
              FOR UPDATE OF s SKIP LOCKED) AS s
    ) AS f
)
SELECT 'idle', scope, key, bucket, locked::int FROM slots WHERE locked = seen
UNION ALL
SELECT 'next', scope, key, NULL, NULL FROM walked WHERE n = %(limit)s + 1
"""

# The sweep, second statement (a later snapshot, same transaction): the rows of the keys locked by the first,
# deleted, where no row was added since (a bucket or slot rows made meanwhile: the key is left whole). Returns how
# many keys were removed.
FLOW_SWEEP_DELETE = """
WITH idle AS MATERIALIZED (
    SELECT g.scope, g.key
    FROM unnest(%(scopes)s::text[], %(keys)s::text[], %(buckets)s::bool[], %(slots)s::int[])
        AS g(scope, key, bucket, slots)
    WHERE EXISTS (SELECT 1 FROM flow_buckets b WHERE b.scope = g.scope AND b.key = g.key) = g.bucket
      AND (SELECT count(*) FROM flow_slots s WHERE s.scope = g.scope AND s.key = g.key) = g.slots
), buckets AS (
    DELETE FROM flow_buckets b USING idle i WHERE b.scope = i.scope AND b.key = i.key
), slots AS (
    DELETE FROM flow_slots s USING idle i WHERE s.scope = i.scope AND s.key = i.key
)
SELECT count(*)::int FROM idle
"""
