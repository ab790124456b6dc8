"""Every query of the stage scheduler."""

# -- settings and sharding ---------------------------------------------------------------------

# Writers that place rows in shards hold the settings row FOR KEY SHARE until they commit, so a
# re-shard (FOR UPDATE) waits for them and they for it. The writer mark keeps the pub/sub capture of
# stage_entities for writes that bypass the API.
BEGIN_WRITE = """
SELECT shard_count, capture_branch, results_branch,
       set_config('cmb.stages_writer', 'api', true)
FROM stage_settings FOR KEY SHARE
"""

SETTINGS = "SELECT shard_count, capture_branch, results_branch FROM stage_settings"

LOCK_SETTINGS = "SELECT shard_count FROM stage_settings FOR UPDATE"

RESHARD_QUEUE = """
UPDATE stage_queue SET shard_id = stage_hash(entity_id) %% %(n)s WHERE shard_id <> stage_hash(entity_id) %% %(n)s
"""
RESHARD_CHANGES = """
UPDATE stage_changes SET shard_id = stage_hash(entity_id) %% %(n)s WHERE shard_id <> stage_hash(entity_id) %% %(n)s
"""
SET_SHARD_COUNT = "UPDATE stage_settings SET shard_count = %(n)s, updated_at = now()"

CAPTURE_INSTALLED = """
SELECT 1 FROM pg_trigger WHERE tgrelid = 'stage_entities'::regclass AND tgname = 'cmb_pubsub_update'
"""
CAPTURE_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%(schema)s || ':stages.capture', 0))"

NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"

# -- the entity store --------------------------------------------------------------------------

GET_ENTITY = "SELECT entity_id, version, payload, updated_at FROM stage_entities WHERE entity_id = %(id)s"

LOCK_ENTITIES = """
SELECT entity_id, version, payload FROM stage_entities WHERE entity_id = ANY(%(ids)b::text[])
ORDER BY entity_id FOR NO KEY UPDATE
"""

# Insert new entities and update changed ones; unchanged payloads are left alone.
UPSERT_ENTITIES = """
INSERT INTO stage_entities AS e (entity_id, payload)
SELECT u.entity_id, u.payload::jsonb FROM unnest(%(ids)b::text[], %(payloads)b::text[]) AS u(entity_id, payload)
ON CONFLICT (entity_id) DO UPDATE
    SET payload = EXCLUDED.payload, version = e.version + 1, updated_at = now()
    WHERE e.payload IS DISTINCT FROM EXCLUDED.payload
RETURNING entity_id, version
"""

UPDATE_ENTITY_IF_VERSION = """
UPDATE stage_entities SET payload = %(payload)s::jsonb, version = version + 1, updated_at = now()
WHERE entity_id = %(id)s AND version = %(version)s
RETURNING version
"""

DELETE_ENTITY = "DELETE FROM stage_entities WHERE entity_id = %(id)s RETURNING version"

# The change path: the stages of these entities are asked should_process by the worker of their shard.
ENQUEUE_CHANGES = """
INSERT INTO stage_changes AS c (entity_id, shard_id, fields)
SELECT u.entity_id, stage_hash(u.entity_id) %% %(shard_count)s,
       CASE WHEN u.fields = '*' THEN NULL ELSE string_to_array(u.fields, ',') END
FROM unnest(%(ids)b::text[], %(fields)b::text[]) AS u(entity_id, fields)
JOIN stage_entities e ON e.entity_id = u.entity_id
ORDER BY u.entity_id  -- one lock order for every writer of changes
ON CONFLICT (entity_id) DO UPDATE
    SET fields = CASE WHEN c.fields IS NULL OR EXCLUDED.fields IS NULL THEN NULL
                      ELSE ARRAY(SELECT DISTINCT unnest(c.fields || EXCLUDED.fields)) END
"""

# -- state API -----------------------------------------------------------------------------------

READ_STATE = """
SELECT e.entity_id, s.state, coalesce(s.version, 0)
FROM stage_entities e LEFT JOIN stage_states s ON s.entity_id = e.entity_id AND s.stage = %(stage)s
WHERE e.entity_id = %(id)s
"""

# Every state writer locks the entity row first (the stage engine's commit does too), so a CAS and a stage
# commit of the same entity never interleave.
LOCK_ENTITY = "SELECT 1 FROM stage_entities WHERE entity_id = %(id)s FOR NO KEY UPDATE"

# The compare-and-set itself: the state is written only while its version is %(version)s (0: no state yet),
# checked on the row as it is when written, whatever the statement's snapshot saw.
WRITE_STATE_IF_VERSION = """
WITH updated AS (
    UPDATE stage_states SET state = %(state)s::jsonb, version = version + 1, updated_at = now()
    WHERE entity_id = %(id)s AND stage = %(stage)s AND version = %(version)s
    RETURNING version
), inserted AS (
    INSERT INTO stage_states AS s (entity_id, stage, state, version)
    SELECT %(id)s, %(stage)s, %(state)s::jsonb, 1 WHERE %(version)s = 0
    ON CONFLICT (entity_id, stage) DO NOTHING
    RETURNING version
)
SELECT version FROM updated UNION ALL SELECT version FROM inserted
"""


def _states(entity: str) -> str:
    """Every stage's state of the entity ``<entity>.entity_id``: {stage: [state, version, runs, window start]}."""
    return f"""(SELECT jsonb_object_agg(s.stage, jsonb_build_array(s.state, s.version, s.runs,
                                          extract(epoch FROM s.window_start)))
        FROM stage_states s WHERE s.entity_id = {entity}.entity_id)"""


def _states_and_due_stages(entity: str) -> str:
    """:func:`_states`, and the stages the entity is due in on the main lane (filters in FILTER: the primary key
    drives it)."""
    return f"""{_states(entity)},
       (SELECT array_agg(q2.stage) FILTER (WHERE q2.lane = 0 AND q2.due_at <= now() AND q2.parked_at IS NULL)
        FROM stage_queue q2 WHERE q2.entity_id = {entity}.entity_id)"""


# -- processing ----------------------------------------------------------------------------------

# The batch's write transaction: the settings row as BEGIN_WRITE locks it, under the engine's writer mark.
BEGIN_BATCH = """
SELECT shard_count, results_branch, set_config('cmb.stages_writer', 'engine', true)
FROM stage_settings FOR KEY SHARE
"""

# The queue's peek and the loading, over several shards and stages, as one claim committed before
# any stage runs: each (shard, stage)'s due entries (the low-priority lane only where the main one has nothing
# due), except entities whose call is still running (%(busy)s); of those, one entry per entity (one stage at a
# time on an entity), the earliest due first, up to %(limit)s entries and about %(max_bytes)s bytes of payload
# (the first always). Claiming adds one to each entry's crashes; an entry that already has crashes began a run
# that never ended, so it is claimed alone, and parked once it reaches its stage's max_crashes. Nothing is
# claimed unless the worker still holds every lease given and the shard count is %(shard_count)s. Returns each
# entry claimed ('run': with its shard, the entity, every stage's state of it and the stages it is due in) or
# parked.
# Its commit need not wait for the WAL flush: what it records (crashes) matters when a worker dies, and a
# worker's death does not lose what the server has; a server crash only undercounts crashes.
CLAIM = f"""
WITH allowed AS (
    SELECT (cardinality(%(partitions)s::text[]) = 0
            OR (SELECT count(*) FROM leases l
                JOIN unnest(%(partitions)s::text[], %(fences)s::bigint[]) AS u(partition, fence)
                  ON l.kind = %(kind)s AND l.partition = u.partition AND l.fence = u.fence
                WHERE l.owner = %(owner)s AND l.expires_at > now()) = cardinality(%(partitions)s::text[]))
       AND (%(shard_count)s::int IS NULL OR (SELECT shard_count FROM stage_settings) = %(shard_count)s)
       AND set_config('synchronous_commit', 'off', true) = 'off' AS ok
), picked AS (
    SELECT q.entity_id, q.stage, q.attempts, q.crashes, q.due_at, st.max_crashes
    FROM unnest(%(shards)s::int[]) AS sh(shard_id)
    CROSS JOIN unnest(%(stages)s::text[], %(limits)s::int[], %(max_crashes)s::int[]) AS st(stage, lim, max_crashes)
    CROSS JOIN (VALUES (0::smallint), (1::smallint)) AS ln(lane)
    CROSS JOIN LATERAL (
        SELECT q.entity_id, q.stage, q.attempts, q.crashes, q.due_at
        FROM stage_queue q
        WHERE q.shard_id = sh.shard_id AND q.stage = st.stage AND q.lane = ln.lane
          AND q.parked_at IS NULL AND q.due_at <= now()
          AND (ln.lane = 0 OR NOT EXISTS (
                SELECT 1 FROM stage_queue m
                WHERE m.shard_id = sh.shard_id AND m.stage = st.stage AND m.lane = 0
                  AND m.parked_at IS NULL AND m.due_at <= now()))
          AND q.entity_id <> ALL(%(busy)s::text[])
        ORDER BY q.due_at
        LIMIT st.lim
        FOR UPDATE SKIP LOCKED
    ) q
    WHERE (SELECT ok FROM allowed)
), chosen AS (
    SELECT * FROM (SELECT DISTINCT ON (entity_id) * FROM picked ORDER BY entity_id, due_at, stage) one
    ORDER BY due_at
    LIMIT %(limit)s
), sized AS (  -- the payload's stored size, by primary key (a join could read the whole table without statistics)
    SELECT c.*, sum(c.bytes) OVER (ORDER BY c.due_at, c.entity_id) - c.bytes AS bytes_before
    FROM (SELECT c.*, coalesce((SELECT pg_column_size(e.payload) FROM stage_entities e WHERE e.entity_id = c.entity_id),
                               0) AS bytes
          FROM chosen c WHERE c.crashes = 0) c
), suspect AS (
    SELECT entity_id, stage FROM chosen WHERE crashes > 0 AND crashes < max_crashes ORDER BY due_at LIMIT 1
), taken AS (
    SELECT entity_id, stage, attempts, crashes, due_at FROM suspect JOIN chosen USING (entity_id, stage)
    UNION ALL
    SELECT entity_id, stage, attempts, crashes, due_at FROM sized
    WHERE bytes_before < %(max_bytes)s AND NOT EXISTS (SELECT 1 FROM suspect)
), marked AS (
    UPDATE stage_queue q SET crashes = q.crashes + 1
    FROM taken t WHERE q.entity_id = t.entity_id AND q.stage = t.stage
    RETURNING q.entity_id, q.stage, t.attempts, t.crashes, t.due_at, q.shard_id
), parked AS (
    UPDATE stage_queue q
    SET parked_at = now(), crashes = 0, attempts = q.attempts + 1,
        last_error = format('%%s runs in a row ended with the death of their worker (a crash, kill -9 or OOM)',
                            c.crashes)
    FROM chosen c WHERE c.crashes >= c.max_crashes AND q.entity_id = c.entity_id AND q.stage = c.stage
    RETURNING q.entity_id, q.stage, q.attempts, c.crashes
)
(SELECT 'run', m.entity_id, m.stage, m.attempts, m.crashes, m.shard_id, e.version, e.payload,
       {_states_and_due_stages("m")}
FROM marked m LEFT JOIN stage_entities e ON e.entity_id = m.entity_id
ORDER BY m.due_at)
UNION ALL
SELECT 'parked', p.entity_id, p.stage, p.attempts, p.crashes, NULL, NULL, NULL, NULL, NULL FROM parked p
"""

# Entries claimed and not run (their key had no token or flow slot, another entry runs alone first, or the worker
# stops while their calls run): their claim is undone.
RELEASE = """
UPDATE stage_queue SET crashes = greatest(crashes - 1, 0)
WHERE stage = %(stage)s AND entity_id = ANY(%(ids)s::text[])
"""

# The change path's batch: changed entities of some shards, with every state and the stages queued. Read
# without locks (only the shard's lease holder asks); DELETE_CHANGES then removes only the changes that were
# not written again meanwhile (same xmin), so a writer's newer fields are asked about in the next batch.
PEEK_CHANGES = f"""
WITH picked AS (
    SELECT c.entity_id, c.fields, c.changed_at, c.xmin::text AS seen
    FROM unnest(%(shards)s::int[]) AS sh(shard_id)
    CROSS JOIN LATERAL (
        SELECT c.entity_id, c.fields, c.changed_at, c.xmin FROM stage_changes c
        WHERE c.shard_id = sh.shard_id
        ORDER BY c.changed_at
        LIMIT %(limit)s
    ) c
), chosen AS (
    SELECT * FROM picked ORDER BY changed_at LIMIT %(limit)s
)
SELECT p.entity_id, p.fields, p.seen, e.version, e.payload,
       {_states_and_due_stages("p")}
FROM chosen p LEFT JOIN stage_entities e ON e.entity_id = p.entity_id
"""

# Locks in entity id order, as writers upsert changes (a transaction deleting in another order could deadlock
# with them).
DELETE_CHANGES = """
WITH doomed AS (
    SELECT c.entity_id FROM stage_changes c JOIN unnest(%(ids)s::text[], %(seen)s::text[]) AS u(entity_id, seen)
      ON c.entity_id = u.entity_id AND c.xmin::text = u.seen
    ORDER BY c.entity_id
    FOR UPDATE OF c
)
DELETE FROM stage_changes c USING doomed d WHERE c.entity_id = d.entity_id
"""

# The optimistic check, in two statements sent together: lock the entities processed, then (a new
# snapshot, taken after the locks) read their versions and the processing stage's state version.
LOCK_PROCESSED = """
SELECT 1 FROM stage_entities WHERE entity_id = ANY(%(ids)b::text[]) ORDER BY entity_id FOR NO KEY UPDATE
"""
CHECK_VERSIONS = """
SELECT u.entity_id, u.stage, e.version, coalesce(s.version, 0)
FROM unnest(%(ids)b::text[], %(stages)b::text[]) AS u(entity_id, stage)
JOIN stage_entities e ON e.entity_id = u.entity_id
LEFT JOIN stage_states s ON s.entity_id = u.entity_id AND s.stage = u.stage
"""

SAVE_ENTITIES = """
UPDATE stage_entities e SET payload = u.payload::jsonb, version = e.version + 1, updated_at = now()
FROM unnest(%(ids)b::text[], %(payloads)b::text[]) AS u(entity_id, payload)
WHERE e.entity_id = u.entity_id
"""

# States of committed entities: the new state (changed = true) or the old one, and the run counter
# of the re-trigger window.
SAVE_STATES = """
INSERT INTO stage_states AS s (entity_id, stage, state, version, runs, window_start)
SELECT u.entity_id, %(stage)s, u.state::jsonb, u.changed::int, 1, now()
FROM unnest(%(ids)b::text[], %(states)b::text[], %(changed)b::bool[]) AS u(entity_id, state, changed)
ON CONFLICT (entity_id, stage) DO UPDATE SET
    state = CASE WHEN EXCLUDED.version > 0 THEN EXCLUDED.state ELSE s.state END,
    version = s.version + EXCLUDED.version,
    runs = CASE WHEN s.window_start > now() - make_interval(secs => %(window)s) THEN s.runs + 1 ELSE 1 END,
    window_start = CASE WHEN s.window_start > now() - make_interval(secs => %(window)s) THEN s.window_start
                        ELSE now() END,
    updated_at = now()
"""

# Entries done without a timer are deleted; those that set one get it as their due time.
DELETE_ENTRIES = "DELETE FROM stage_queue WHERE stage = %(stage)s AND entity_id = ANY(%(ids)b::text[])"
SET_TIMERS = """
UPDATE stage_queue q
SET due_at = u.due_at, lane = 0, attempts = 0, conflicts = 0, crashes = 0, last_error = NULL, enqueued_at = now()
FROM unnest(%(ids)b::text[], %(dues)b::timestamptz[]) AS u(entity_id, due_at)
WHERE q.stage = %(stage)s AND q.entity_id = u.entity_id
"""

# The offer: at most one entry per (entity, stage). An earlier due time wins; the main
# lane wins over the low-priority one; parked entries stay parked.
OFFER = """
INSERT INTO stage_queue AS q (entity_id, stage, shard_id, lane, due_at)
SELECT u.entity_id, u.stage, stage_hash(u.entity_id) %% %(shard_count)s, 0, u.due_at
FROM unnest(%(ids)b::text[], %(stages)b::text[], %(dues)b::timestamptz[]) AS u(entity_id, stage, due_at)
ON CONFLICT (entity_id, stage) DO UPDATE
    SET due_at = least(q.due_at, EXCLUDED.due_at), lane = 0
    WHERE q.parked_at IS NULL AND (q.due_at > EXCLUDED.due_at OR q.lane <> 0)
"""

# The rescan's offer: the low-priority lane, only where the entity is in no queue of the stage.
OFFER_LOW = """
INSERT INTO stage_queue (entity_id, stage, shard_id, lane, due_at)
SELECT u.entity_id, u.stage, stage_hash(u.entity_id) %% %(shard_count)s, 1, u.due_at
FROM unnest(%(ids)b::text[], %(stages)b::text[], %(dues)b::timestamptz[]) AS u(entity_id, stage, due_at)
JOIN stage_entities e ON e.entity_id = u.entity_id
ON CONFLICT (entity_id, stage) DO NOTHING
"""

FAILED = """
UPDATE stage_queue q
SET attempts = q.attempts + 1, last_error = u.error, crashes = 0,
    due_at = now() + make_interval(secs => u.delay),
    parked_at = CASE WHEN q.attempts + 1 >= %(max_attempts)s THEN now() END
FROM unnest(%(ids)b::text[], %(errors)b::text[], %(delays)b::float8[]) AS u(entity_id, error, delay)
WHERE q.stage = %(stage)s AND q.entity_id = u.entity_id
RETURNING q.parked_at IS NOT NULL
"""

CONFLICTED = """
UPDATE stage_queue q
SET conflicts = q.conflicts + 1, crashes = 0,
    due_at = CASE WHEN (q.conflicts + 1) %% %(max_conflicts)s = 0 THEN now() + interval '1 second' ELSE q.due_at END
WHERE q.stage = %(stage)s AND q.entity_id = ANY(%(ids)b::text[])
RETURNING q.entity_id, q.conflicts
"""

COUNT = """
INSERT INTO stage_counters AS c (stage, shard_id, processed, changed, conflicts, errors, parked, capped)
SELECT u.* FROM unnest(%(stages)b::text[], %(shards)b::int[], %(processed)b::bigint[], %(changed)b::bigint[],
                       %(conflicts)b::bigint[], %(errors)b::bigint[], %(parked)b::bigint[], %(capped)b::bigint[])
    AS u(stage, shard_id, processed, changed, conflicts, errors, parked, capped)
ON CONFLICT (stage, shard_id) DO UPDATE SET
    processed = c.processed + EXCLUDED.processed, changed = c.changed + EXCLUDED.changed,
    conflicts = c.conflicts + EXCLUDED.conflicts, errors = c.errors + EXCLUDED.errors,
    parked = c.parked + EXCLUDED.parked, capped = c.capped + EXCLUDED.capped, updated_at = now()
"""

# Post-save publication: the bulk form of cmb_dagster.pubsub.publish (same columns, same txid default),
# after the batch's other writes: the saved entity and the stage's state as the table holds them.
PUBLISH = """
INSERT INTO pubsub_events (branch_id, topic, op, key, payload)
SELECT %(branch)s, %(topic)s, 'publish', jsonb_build_object('entity_id', u.entity_id),
       jsonb_build_object('stage', %(stage)s::text, 'entity_id', u.entity_id, 'version', e.version,
                          'payload', e.payload, 'state', s.state, 'changed', u.changed)
FROM unnest(%(ids)b::text[], %(changed)b::bool[]) WITH ORDINALITY AS u(entity_id, changed, n)
JOIN stage_entities e ON e.entity_id = u.entity_id
LEFT JOIN stage_states s ON s.entity_id = u.entity_id AND s.stage = %(stage)s::text
ORDER BY u.n
"""

# What some shards have: per stage and lane the earliest entry's due time (lane -1: the change path),
# and the server's clock, so a worker runs only the batches that have work and sleeps until the next timer.
PLAN = """
SELECT st, ln, min(d.due_at), clock_timestamp()
FROM unnest(%(stages)b::text[]) AS st, (VALUES (0::smallint), (1::smallint)) AS l(ln),
     unnest(%(shards)b::int[]) AS sh(shard_id),
     LATERAL (SELECT min(q.due_at) AS due_at FROM stage_queue q
              WHERE q.shard_id = sh.shard_id AND q.stage = st AND q.lane = ln AND q.parked_at IS NULL) d
GROUP BY st, ln
UNION ALL
SELECT '', -1, min(d.changed_at), clock_timestamp()
FROM unnest(%(shards)b::int[]) AS sh(shard_id),
     LATERAL (SELECT min(c.changed_at) AS changed_at FROM stage_changes c WHERE c.shard_id = sh.shard_id) d
"""


# -- rescan --------------------------------------------------------------------------------------

RESCAN_PAGE = f"""
SELECT e.entity_id, e.version, e.payload, {_states("e")},
       (SELECT array_agg(q.stage) FROM stage_queue q WHERE q.entity_id = e.entity_id)
FROM stage_entities e
WHERE e.entity_id > %(after)s
ORDER BY e.entity_id
LIMIT %(limit)s
"""

# -- admin ---------------------------------------------------------------------------------------

# Per stage, from the indexes whatever the statistics: the (shard, stage) pairs of unparked entries by a skip scan
# of stage_queue_due (one probe per pair), each pair's entries counted from that index; parked and failing entries
# likewise from their partial indexes (the stages that have some, then each one's count).
QUEUE_STATUS = """
WITH RECURSIVE pairs(shard_id, stage) AS (
    (SELECT shard_id, stage FROM stage_queue WHERE parked_at IS NULL ORDER BY shard_id, stage LIMIT 1)
    UNION ALL
    SELECT n.shard_id, n.stage FROM pairs p
    CROSS JOIN LATERAL (
        SELECT q.shard_id, q.stage FROM stage_queue q
        WHERE q.parked_at IS NULL AND (q.shard_id, q.stage) > (p.shard_id, p.stage)
        ORDER BY q.shard_id, q.stage LIMIT 1
    ) AS n
), live AS (
    SELECT p.stage, sum(c.queued) AS queued, sum(c.timers) AS timers, sum(c.low) AS low, min(c.oldest) AS oldest
    FROM pairs p
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE q.lane = 0 AND q.due_at <= now()) AS queued,
               count(*) FILTER (WHERE q.lane = 0 AND q.due_at > now()) AS timers,
               count(*) FILTER (WHERE q.lane = 1) AS low,
               min(q.due_at) FILTER (WHERE q.lane = 0 AND q.due_at <= now()) AS oldest
        FROM stage_queue q
        WHERE q.parked_at IS NULL AND q.shard_id = p.shard_id AND q.stage = p.stage
    ) AS c
    GROUP BY p.stage
), parked_stages(stage) AS (
    (SELECT stage FROM stage_queue WHERE parked_at IS NOT NULL ORDER BY stage LIMIT 1)
    UNION ALL
    SELECT (SELECT q.stage FROM stage_queue q WHERE q.parked_at IS NOT NULL AND q.stage > p.stage
            ORDER BY q.stage LIMIT 1)
    FROM parked_stages p WHERE p.stage IS NOT NULL
), parked AS (
    SELECT p.stage, (SELECT count(*) FROM stage_queue q WHERE q.parked_at IS NOT NULL AND q.stage = p.stage) AS parked
    FROM parked_stages p WHERE p.stage IS NOT NULL
), failing_stages(stage) AS (
    (SELECT stage FROM stage_queue WHERE parked_at IS NULL AND attempts > 0 ORDER BY stage LIMIT 1)
    UNION ALL
    SELECT (SELECT q.stage FROM stage_queue q WHERE q.parked_at IS NULL AND q.attempts > 0 AND q.stage > f.stage
            ORDER BY q.stage LIMIT 1)
    FROM failing_stages f WHERE f.stage IS NOT NULL
), failing AS (
    SELECT f.stage,
           (SELECT count(*) FROM stage_queue q WHERE q.parked_at IS NULL AND q.attempts > 0 AND q.stage = f.stage)
               AS failing
    FROM failing_stages f WHERE f.stage IS NOT NULL
)
SELECT stage, coalesce(l.queued, 0)::bigint, coalesce(l.timers, 0)::bigint, coalesce(l.low, 0)::bigint,
       coalesce(extract(epoch FROM now() - l.oldest), 0)::float8, coalesce(p.parked, 0), coalesce(f.failing, 0)
FROM live l FULL JOIN parked p USING (stage) FULL JOIN failing f USING (stage)
"""

COUNTERS = """
SELECT stage, sum(processed)::bigint, sum(changed)::bigint, sum(conflicts)::bigint, sum(errors)::bigint,
       sum(capped)::bigint
FROM stage_counters GROUP BY stage
"""

LIST_ENTRIES = """
SELECT entity_id, stage, shard_id, lane, due_at, attempts, conflicts, crashes, last_error, parked_at
FROM stage_queue
WHERE (%(stage)s::text IS NULL OR stage = %(stage)s) AND (%(entity)s::text IS NULL OR entity_id = %(entity)s)
  AND (NOT %(problems)s OR attempts > 0 OR parked_at IS NOT NULL)
ORDER BY due_at
LIMIT %(limit)s
"""

RETRY = """
UPDATE stage_queue SET parked_at = NULL, attempts = 0, crashes = 0, due_at = now(), last_error = NULL
WHERE parked_at IS NOT NULL
  AND (%(stage)s::text IS NULL OR stage = %(stage)s) AND (%(entity)s::text IS NULL OR entity_id = %(entity)s)
"""
