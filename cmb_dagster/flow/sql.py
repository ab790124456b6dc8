"""Flow control's SQL: the limits of each scope, the token bucket and the concurrency slots of each key.

Every engine takes, renews and releases through the statements and fragments here; an engine's claim inlines a
fragment (:func:`take`, :func:`renew`, :func:`release`, :func:`at_limit`) in its own statement. A slot row is held
by the worker that took it: ``holder`` is that worker's name, the same for every slot it holds, and every renewal
or release names it.

Locks on a key's rows: takers lock the free slots they take FOR NO KEY UPDATE (SKIP LOCKED) and its bucket FOR
UPDATE (waiting, in (scope, key) order); ENSURE key-share-locks the key's top slot row before it adds more after
it, which conflicts with the sweep alone (FOR UPDATE, SKIP LOCKED): the sweep never waits for anyone, and a key's
slot rows are always 0..n-1, deleted or made whole.
"""

# Bucket b's tokens now, refilled at limits l's rate up to its burst.
AVAILABLE = "least(l.burst, b.tokens + l.rate * extract(epoch FROM clock_timestamp() - b.refilled_at))"
# Slot s holds nothing live.
SLOT_FREE = "s.expires_at <= now()"


def _empty_until(left: str, rate: str) -> str:
    """SQL: when a bucket with ``left`` tokens (an expression) at ``rate`` has one again."""
    return f"""CASE WHEN {left} < 1 THEN clock_timestamp() + make_interval(secs => (1 - {left}) / {rate})
                     ELSE '-infinity' END"""


def _slots_lacking(scope: str, key: str, concurrency: str) -> str:
    """SQL: whether a key (``scope``, ``key``: expressions) that found fewer free slots than it wanted is to have
    ENSURE run and be taken again: it has fewer slot rows than ``concurrency``, or none of its slots is held, the
    free ones being locked by a sweep (ENSURE waits for it, then makes the key again if it was removed) or by
    takers starting at the same time."""
    return f"""(coalesce((SELECT s.slot + 1 FROM flow_slots s WHERE s.scope = {scope} AND s.key = {key}
                          ORDER BY s.slot DESC LIMIT 1), 0) < {concurrency}
            OR NOT EXISTS (SELECT 1 FROM flow_slots s WHERE s.scope = {scope} AND s.key = {key}
                             AND s.holder IS NOT NULL AND NOT {SLOT_FREE}))"""


# Each scope's limits as registered, unless the stored ones have a higher version: a worker of an older
# deployment cannot overwrite a newer definition. A scope given without limits keeps a row without limits (and its
# version). Returns the scopes whose stored limits are newer than those given, with their version.
REGISTER = """
WITH given AS (
    SELECT * FROM unnest(%(scopes)s::text[], %(rates)s::float8[], %(bursts)s::float8[], %(concurrency)s::int[],
                         %(versions)s::int[]) AS g(scope, rate, burst, concurrency, version)
), written AS (
    INSERT INTO flow_limits AS f (scope, rate, burst, concurrency, version)
    SELECT scope, rate, burst, concurrency, version FROM given
    ON CONFLICT (scope) DO UPDATE
    SET rate = EXCLUDED.rate, burst = EXCLUDED.burst, concurrency = EXCLUDED.concurrency, version = EXCLUDED.version,
        updated_at = now()
    WHERE EXCLUDED.version >= f.version
      AND (f.rate, f.burst, f.concurrency, f.version)
          IS DISTINCT FROM (EXCLUDED.rate, EXCLUDED.burst, EXCLUDED.concurrency, EXCLUDED.version)
)
SELECT f.scope, f.version FROM flow_limits f JOIN given g USING (scope) WHERE f.version > g.version
ORDER BY f.scope
"""

# The registered scopes starting with %(prefix)s and their limits.
SCOPES = """
SELECT scope, rate, burst, concurrency, version FROM flow_limits WHERE starts_with(scope, %(prefix)s) ORDER BY scope
"""

# The bucket of (scope, key) pairs, made full where missing; and more free slots where all are taken: slot rows
# are made as they are needed (64 at first, then twice as many), up to the scope's concurrency. The top slot row
# is key-share-locked: a sweep deleting the key meanwhile is waited for (its rows are then made again from 0).
ENSURE = """
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


def take(wants: str, holder: str) -> str:
    """The CTEs of a take: per row of ``wants`` (a relation of scope, key, want: the grants wanted, slots: how many
    of them need a slot - the others hold one already -, ttl: the seconds a slot is held), free slots are taken
    (skipping those locked by another taker) for at most as many grants as the key's tokens allow, held by
    ``holder`` (an SQL expression). Rows of scopes without a registered limit are dropped.

    ``flow_granted`` (scope, key, n: grants, held: of them already holding a slot, wait: when none was granted for
    want of tokens the seconds until the next one, missing: the key lacks its bucket or slot rows - ENSURE makes
    them, then the take runs again) and ``flow_taken`` (scope, key, slot, r: its place among the key's slots taken,
    1 first) hold the result. Buckets are locked in (scope, key) order, so takers never deadlock."""
    return f"""flow_wants AS MATERIALIZED (
    SELECT w.scope, w.key, w.want, w.slots, w.ttl, f.rate, f.burst, f.concurrency
    FROM {wants} AS w JOIN flow_limits f ON f.scope = w.scope
    WHERE f.rate IS NOT NULL OR f.concurrency IS NOT NULL
), flow_free AS MATERIALIZED (
    SELECT w.scope, w.key, f.slot, row_number() OVER (PARTITION BY w.scope, w.key ORDER BY f.slot) AS r
    FROM flow_wants w CROSS JOIN LATERAL (
        SELECT s.slot FROM flow_slots s
        WHERE s.scope = w.scope AND s.key = w.key AND s.slot < w.concurrency AND {SLOT_FREE}
        ORDER BY s.slot LIMIT w.slots
        FOR NO KEY UPDATE OF s SKIP LOCKED
    ) AS f
    WHERE w.concurrency IS NOT NULL
), flow_can AS MATERIALIZED (
    SELECT w.*,
           CASE WHEN w.concurrency IS NULL THEN w.want
                ELSE w.want - w.slots + (SELECT count(*) FROM flow_free f WHERE f.scope = w.scope AND f.key = w.key)
           END AS n
    FROM flow_wants w
), flow_now AS MATERIALIZED (
    SELECT b.scope, b.key, c.rate, c.n, {AVAILABLE.replace("l.", "c.")} AS avail
    FROM flow_buckets b JOIN flow_can c ON b.scope = c.scope AND b.key = c.key
    WHERE c.rate IS NOT NULL
    ORDER BY b.scope, b.key
    FOR UPDATE OF b
), flow_tokens AS (
    UPDATE flow_buckets b
    SET tokens = t.avail - t.took, refilled_at = clock_timestamp(),
        empty_until = {_empty_until("(t.avail - t.took)", "t.rate")}
    FROM (SELECT n.*, least(floor(greatest(n.avail, 0)), n.n) AS took FROM flow_now n) AS t
    WHERE b.scope = t.scope AND b.key = t.key
), flow_granted AS MATERIALIZED (
    SELECT c.scope, c.key, c.want - c.slots AS held,
           CASE WHEN c.rate IS NULL THEN c.n ELSE coalesce(least(floor(greatest(t.avail, 0)), t.n), 0) END::int AS n,
           CASE WHEN c.rate IS NOT NULL AND coalesce(floor(greatest(t.avail, 0)), 0) < 1
                THEN greatest((1 - t.avail) / t.rate, 0) END AS wait,
           (c.rate IS NOT NULL AND t.key IS NULL)
           OR (c.concurrency IS NOT NULL AND c.n < c.want
               AND {_slots_lacking("c.scope", "c.key", "c.concurrency")}) AS missing
    FROM flow_can c LEFT JOIN flow_now t ON t.scope = c.scope AND t.key = c.key
), flow_taken AS (
    UPDATE flow_slots s
    SET holder = {holder}, taken_at = now(), expires_at = now() + make_interval(secs => c.ttl)
    FROM flow_free f JOIN flow_granted g ON g.scope = f.scope AND g.key = f.key
         JOIN flow_can c ON c.scope = f.scope AND c.key = f.key
    WHERE s.scope = f.scope AND s.key = f.key AND s.slot = f.slot AND f.r <= g.n - g.held
    RETURNING s.scope, s.key, s.slot, f.r
)"""


# flow.take: the grants per (scope, key) of %(scopes)s, %(keys)s: %(want)s grants wanted, %(slots)s of them needing
# a slot, held by %(holder)s for %(ttl)s seconds. Returns, per key of a registered scope: the grants, the slots
# taken, the seconds until a token, whether the key lacks rows.
TAKE = f"""
WITH {
    take(
        "(SELECT u.*, %(ttl)s::float8 AS ttl FROM unnest(%(scopes)s::text[], %(keys)s::text[], %(want)s::int[], "
        "%(slots)s::int[]) AS u(scope, key, want, slots))",
        "%(holder)s",
    )
}
SELECT g.scope, g.key, g.n,
       ARRAY(SELECT t.slot FROM flow_taken t WHERE t.scope = g.scope AND t.key = g.key ORDER BY t.slot), g.wait,
       g.missing
FROM flow_granted g
"""


def renew(held: str, holder: str) -> str:
    """An UPDATE: the slots of ``held`` (a relation of scope, key, slot, ttl) that ``holder`` (an SQL expression)
    still holds last another ttl seconds; it returns those renewed (the others expired: no longer held)."""
    return f"""UPDATE flow_slots s SET expires_at = now() + make_interval(secs => h.ttl)
    FROM {held} AS h
    WHERE s.scope = h.scope AND s.key = h.key AND s.slot = h.slot AND s.holder = {holder} AND s.expires_at > now()
    RETURNING s.scope, s.key, s.slot"""


def release(held: str, holder: str) -> str:
    """An UPDATE: the slots of ``held`` (a relation of scope, key, slot) that ``holder`` (an SQL expression) holds,
    freed; it returns the rows of ``held`` freed."""
    return f"""UPDATE flow_slots s SET holder = NULL, taken_at = NULL, expires_at = '-infinity'
    FROM {held} AS h
    WHERE s.scope = h.scope AND s.key = h.key AND s.slot = h.slot AND s.holder = {holder}
    RETURNING h.*"""


_HELD = """(SELECT u.*, %(ttl)s::float8 AS ttl
    FROM unnest(%(scopes)s::text[], %(keys)s::text[], %(slots)s::int[]) AS u(scope, key, slot))"""

# flow.renew: the slots (%(scopes)s, %(keys)s, %(slots)s) %(holder)s holds last another %(ttl)s seconds.
RENEW = renew(_HELD, "%(holder)s")

# flow.release: the slots (%(scopes)s, %(keys)s, %(slots)s) %(holder)s holds, freed.
RELEASE = release(_HELD, "%(holder)s")


def at_limit(scopes: str) -> str:
    """A query: the keys of ``scopes`` (an SQL text[] expression) at their rate limit (an empty bucket: with the
    seconds until a token) or their concurrency limit (every slot taken: NULL), through the indexes on the few
    buckets empty now and on the slots taken."""
    return f"""SELECT b.scope, b.key, extract(epoch FROM b.empty_until - clock_timestamp())::float8 AS wait
    FROM flow_buckets b
    WHERE b.empty_until > now() AND b.empty_until > clock_timestamp()  -- now(): a range of the index on empty_until
      AND b.scope = ANY({scopes})
    UNION ALL
    SELECT s.scope, s.key, NULL
    FROM flow_slots s JOIN flow_limits l ON l.scope = s.scope
    WHERE s.holder IS NOT NULL AND NOT {SLOT_FREE} AND s.slot < l.concurrency AND s.scope = ANY({scopes})
    GROUP BY s.scope, s.key, l.concurrency HAVING count(*) >= l.concurrency"""


# Per key of the scopes given (those that have a bucket or slots): the limits, the tokens now, the slots in use.
USAGE = f"""
SELECT k.scope, k.key, l.rate, l.burst, l.concurrency,
       (SELECT {AVAILABLE} FROM flow_buckets b WHERE b.scope = k.scope AND b.key = k.key) AS tokens,
       (SELECT count(*) FROM flow_slots s WHERE s.scope = k.scope AND s.key = k.key AND s.slot < l.concurrency
          AND NOT {SLOT_FREE})::int AS in_flight
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
SWEEP_LOCK = f"""
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
      AND NOT EXISTS (SELECT 1 FROM flow_slots s WHERE s.scope = w.scope AND s.key = w.key AND s.holder IS NOT NULL
                        AND NOT {SLOT_FREE})
      AND NOT EXISTS (SELECT 1 FROM flow_buckets b WHERE b.scope = w.scope AND b.key = w.key AND l.rate IS NOT NULL
                        AND {AVAILABLE} < l.burst)
), locked AS MATERIALIZED (  -- each one's bucket, locked where it is still full (rechecked on its newest version)
    SELECT l.scope, l.key, b.key IS NOT NULL AS bucket
    FROM idle l LEFT JOIN LATERAL (
        SELECT b.key FROM flow_buckets b
        WHERE b.scope = l.scope AND b.key = l.key AND (l.rate IS NULL OR {AVAILABLE} >= l.burst)
        FOR UPDATE OF b SKIP LOCKED
    ) AS b ON true
    WHERE b.key IS NOT NULL OR NOT EXISTS (SELECT 1 FROM flow_buckets x WHERE x.scope = l.scope AND x.key = l.key)
), slots AS MATERIALIZED (  -- then its free slot rows
    SELECT k.scope, k.key, k.bucket, f.locked,
           (SELECT count(*) FROM flow_slots s WHERE s.scope = k.scope AND s.key = k.key) AS seen
    FROM locked k CROSS JOIN LATERAL (
        SELECT count(*) AS locked
        FROM (SELECT 1 FROM flow_slots s WHERE s.scope = k.scope AND s.key = k.key AND {SLOT_FREE}
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
SWEEP_DELETE = """
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
