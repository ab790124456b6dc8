"""Every query of the event queue engine.

The hot path is three statements: EMIT (one insert for any number of events, plus one NOTIFY),
CLAIM_DUE (a batch claimed in one statement) and DELETE_DONE (the events a batch finished, sent as they
finish, before their locks can lapse). CLAIM_DUE walks the index on
``visible_at`` in order and stops after ``limit`` rows, so it needs no planner statistics. Its handler
filter is written ``array_position(...) IS NOT NULL`` on purpose: without statistics the planner takes
``handler = ANY(...)`` to keep 0.5% of the rows and then prefers reading every due row and sorting them;
an IS NOT NULL test is estimated to keep nearly all rows, so the ordered index scan with LIMIT wins.
"""

# -- emit -------------------------------------------------------------------------------------------

# Nothing is inserted when any handler is unknown (the first unknown one is returned instead).
EMIT = """
WITH v AS (
    SELECT * FROM unnest(%(namespaces)s::text[], %(modules)s::text[], %(handlers)s::text[],
                         %(modifiers)s::text[], %(values)s::jsonb[], %(delays)s::float8[])
           WITH ORDINALITY AS v(namespace, module, handler, modifier, value, delay, n)
), unknown AS (
    SELECT v.handler FROM v WHERE NOT EXISTS (SELECT 1 FROM eventqueue_handlers h WHERE h.name = v.handler) LIMIT 1
), inserted AS (
    INSERT INTO eventqueue_events (namespace, module, handler, modifier, value, delay_until, visible_at)
    SELECT v.namespace, v.module, v.handler, v.modifier, v.value,
           now() + make_interval(secs => v.delay), now() + make_interval(secs => v.delay)
    FROM v
    WHERE NOT EXISTS (SELECT 1 FROM unknown)
    ORDER BY v.n
    RETURNING id
)
SELECT (SELECT handler FROM unknown),
       (SELECT array_agg(id ORDER BY id) FROM inserted),
       CASE WHEN EXISTS (SELECT 1 FROM inserted)
            THEN pg_notify(current_schema() || '.eventqueue', %(payload)s) END
"""

# -- dequeue ----------------------------------------------------------------------------------------

_RULE = """
(SELECT r.rule_type FROM eventqueue_rules r
 WHERE r.namespace = e.namespace AND r.handler = e.handler AND r.event_space = e.module
 ORDER BY r.rule_type LIMIT 1 FOR KEY SHARE)  -- 'block' before 'pause'
"""

# What a claim does with its candidates: held ones are parked (visible_at = 'infinity'); one that has
# already begun max_crashes runs that never ended goes to the dead letters; the others are claimed
# (compare-and-set on locked_at), their crashes counted up before any handler runs. Each claim also
# returns the newest rule it read ('rules' row): a worker acknowledges that rule once no event claimed
# before it is still to start.
_APPLY = """
rules AS MATERIALIZED (
    SELECT coalesce(max(id), 0) AS newest FROM eventqueue_rules
), held AS (
    UPDATE eventqueue_events e SET visible_at = 'infinity'
    FROM candidates c WHERE e.id = c.id AND c.decision IN ('pause', 'block')
    RETURNING e.id, c.decision
), crashed AS (
    DELETE FROM eventqueue_events e
    USING candidates c, eventqueue_handlers h
    WHERE e.id = c.id AND c.decision = 'claim' AND h.name = e.handler AND e.crashes >= h.max_crashes
    RETURNING e.id, e.namespace, e.module, e.handler, e.modifier, e.value, e.retries, e.enqueued_at, e.crashes
), dead AS (
    INSERT INTO eventqueue_dead
        (id, namespace, module, handler, modifier, value, retries, enqueued_at, error, traceback)
    SELECT id, namespace, module, handler, modifier, value, retries, enqueued_at,
           format('%%s runs in a row ended with the death of their worker (a crash, kill -9 or OOM)', crashes), ''
    FROM crashed
    RETURNING id
), claimed AS (
    UPDATE eventqueue_events e
    SET locked_at = now(), visible_at = now() + make_interval(secs => h.lock_expiry_seconds), crashes = e.crashes + 1
    FROM candidates c, eventqueue_handlers h
    WHERE e.id = c.id AND c.decision = 'claim' AND c.take AND h.name = e.handler AND e.crashes < h.max_crashes
      AND e.locked_at IS NOT DISTINCT FROM c.seen_locked_at        -- compare-and-set on locked_at
    RETURNING e.id, e.namespace, e.module, e.handler, e.modifier, e.value, e.retries, e.enqueued_at,
              e.locked_at, c.seen_locked_at
)
SELECT 'claim', id, namespace, module, handler, modifier, value, retries, enqueued_at, locked_at, seen_locked_at
FROM claimed
UNION ALL
SELECT decision, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM held
UNION ALL
SELECT 'crashed', id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM dead
UNION ALL
SELECT decision, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM candidates
WHERE decision NOT IN ('claim', 'pause', 'block')
UNION ALL
SELECT 'lock_claim_failed', c.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM candidates c
WHERE c.decision = 'claim' AND c.take AND NOT EXISTS (SELECT 1 FROM claimed WHERE claimed.id = c.id)
  AND NOT EXISTS (SELECT 1 FROM crashed WHERE crashed.id = c.id)
UNION ALL
SELECT 'rules', newest, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM rules
"""

# The worker's batch: due (or lock-expired) events of its handlers, oldest visibility first. Held rows
# are skipped, not waited for. Events under a rule are parked (visible_at = 'infinity'), the rule row
# share-locked so an unpause waits for this transaction and then finds them parked. An event whose earlier
# run never ended (crashes > 0) is claimed alone: the batch is then that one event.
CLAIM_DUE = f"""
WITH due AS (
    SELECT e.id, e.locked_at AS seen_locked_at, e.crashes, e.visible_at, coalesce({_RULE}, 'claim') AS decision
    FROM eventqueue_events e
    WHERE e.visible_at <= now() AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL
    ORDER BY e.visible_at
    LIMIT %(limit)s
    FOR UPDATE OF e SKIP LOCKED
), suspect AS (
    SELECT id FROM due WHERE decision = 'claim' AND crashes > 0 ORDER BY visible_at LIMIT 1
), candidates AS (
    SELECT due.*, NOT EXISTS (SELECT 1 FROM suspect) OR id = (SELECT id FROM suspect) AS take
    FROM due
    WHERE decision <> 'claim' OR NOT EXISTS (SELECT 1 FROM suspect) OR id = (SELECT id FROM suspect)
), {_APPLY}
"""

# The flowchart for named events (a notification that names them): each row says which edge it took.
CLAIM_IDS = f"""
WITH candidates AS (
    SELECT e.id, e.locked_at AS seen_locked_at, true AS take,
           coalesce({_RULE},
                    CASE WHEN e.delay_until > now() THEN 'delay_not_yet'
                         WHEN e.locked_at IS NOT NULL AND e.visible_at > now() THEN 'is_locked'
                         ELSE 'claim' END) AS decision
    FROM eventqueue_events e
    WHERE e.id = ANY(%(ids)s::bigint[]) AND e.handler = ANY(%(handlers)s::text[])
    FOR UPDATE OF e SKIP LOCKED
), {_APPLY}
"""

EXISTING_IDS = "SELECT id FROM eventqueue_events WHERE id = ANY(%(ids)s::bigint[])"

# Seconds until the next event of these handlers becomes visible (for the worker's sleep).
NEXT_VISIBLE = """
SELECT extract(epoch FROM visible_at - now())::float8 FROM eventqueue_events
WHERE array_position(%(handlers)s::text[], handler) IS NOT NULL AND visible_at > now() AND visible_at < 'infinity'
ORDER BY visible_at LIMIT 1
"""

DELETE_DONE = "DELETE FROM eventqueue_events WHERE id = ANY(%(ids)s::bigint[])"

# The worker still runs these events (or has them to start, or to delete): their locks last another expiry.
EXTEND_LOCKS = """
UPDATE eventqueue_events e SET visible_at = now() + make_interval(secs => h.lock_expiry_seconds)
FROM unnest(%(ids)s::bigint[], %(locked)s::timestamptz[]) AS u(id, locked_at), eventqueue_handlers h
WHERE e.id = u.id AND e.locked_at = u.locked_at AND h.name = e.handler
"""

# After a rule changed: of the claimed events not started yet, those a rule now holds are parked and their
# claim undone; then the worker acknowledges the newest rule (pause() and block() wait for that).
RECHECK_RULES = f"""
WITH rules AS MATERIALIZED (
    SELECT coalesce(max(id), 0) AS newest FROM eventqueue_rules
), held AS (
    UPDATE eventqueue_events e
    SET visible_at = 'infinity', locked_at = NULL, crashes = greatest(e.crashes - 1, 0)
    FROM unnest(%(ids)s::bigint[], %(locked)s::timestamptz[]) AS u(id, locked_at)
    WHERE e.id = u.id AND e.locked_at = u.locked_at AND {_RULE} IS NOT NULL
    RETURNING e.id
), ack AS (
    INSERT INTO eventqueue_workers AS w (owner, rules_seen) SELECT %(owner)s, newest FROM rules
    ON CONFLICT (owner) DO UPDATE SET rules_seen = greatest(w.rules_seen, EXCLUDED.rules_seen), seen_at = now()
)
SELECT (SELECT newest FROM rules), ARRAY(SELECT id FROM held)
"""

ACKNOWLEDGE_RULES = """
INSERT INTO eventqueue_workers AS w (owner, rules_seen) VALUES (%(owner)s, %(rule)s)
ON CONFLICT (owner) DO UPDATE SET rules_seen = greatest(w.rules_seen, EXCLUDED.rules_seen), seen_at = now()
"""

FORGET_WORKER = "DELETE FROM eventqueue_workers WHERE owner = %(owner)s"

# Live workers (their liveness lease unexpired) that have not acknowledged rule %(rule)s yet.
UNACKNOWLEDGED = """
SELECT l.partition FROM leases l LEFT JOIN eventqueue_workers w ON w.owner = l.partition
WHERE l.kind = %(kind)s AND l.expires_at > now() AND coalesce(w.rules_seen, 0) < %(rule)s
ORDER BY l.partition
"""

# RetryAllowed: increment, delay with backoff; only while the lock is still ours.
RETRY = """
UPDATE eventqueue_events
SET retries = retries + 1, locked_at = NULL, last_error = %(error)s, crashes = 0,
    delay_until = now() + make_interval(secs => %(delay)s), visible_at = now() + make_interval(secs => %(delay)s)
WHERE id = %(id)s AND locked_at = %(locked_at)s
"""

# RetryTooMany: into the dead-letter table with the last error and traceback.
KILL = """
WITH moved AS (
    DELETE FROM eventqueue_events WHERE id = %(id)s AND locked_at = %(locked_at)s
    RETURNING id, namespace, module, handler, modifier, value, retries, enqueued_at
)
INSERT INTO eventqueue_dead (id, namespace, module, handler, modifier, value, retries, enqueued_at, error, traceback)
SELECT id, namespace, module, handler, modifier, value, retries, enqueued_at, %(error)s, %(traceback)s FROM moved
RETURNING id
"""

# -- handlers ---------------------------------------------------------------------------------------

REGISTER_HANDLERS = """
INSERT INTO eventqueue_handlers AS h (name, kind, lock_expiry_seconds, max_retries, retry_delay_seconds,
                                      max_retry_delay_seconds, max_crashes)
SELECT * FROM unnest(%(names)s::text[], %(kinds)s::text[], %(lock_expiry)s::float8[], %(max_retries)s::int[],
                     %(backoff_first)s::float8[], %(backoff_max)s::float8[], %(max_crashes)s::int[])
ON CONFLICT (name) DO UPDATE SET
    kind = EXCLUDED.kind, lock_expiry_seconds = EXCLUDED.lock_expiry_seconds, max_retries = EXCLUDED.max_retries,
    retry_delay_seconds = EXCLUDED.retry_delay_seconds, max_retry_delay_seconds = EXCLUDED.max_retry_delay_seconds,
    max_crashes = EXCLUDED.max_crashes, registered_at = now()
"""

HANDLER_EXISTS = "SELECT 1 FROM eventqueue_handlers WHERE name = %(handler)s"

# -- rules ------------------------------------------------------------------------------------------

# A new rule, and a hint to every worker to check the events it has claimed against it (on commit).
ADD_RULE = """
WITH added AS (
    INSERT INTO eventqueue_rules (rule_type, namespace, handler, event_space)
    VALUES (%(rule_type)s, %(namespace)s, %(handler)s, %(event_space)s)
    ON CONFLICT DO NOTHING
    RETURNING id
)
SELECT id, pg_notify(current_schema() || '.eventqueue', 'rules') FROM added
"""

# Deleting waits for claimers that share-locked the rule; the next statement then sees what they parked.
DELETE_RULE = """
DELETE FROM eventqueue_rules
WHERE rule_type = %(rule_type)s AND namespace = %(namespace)s AND handler = %(handler)s
  AND event_space = %(event_space)s
RETURNING id
"""

# Held events become visible again unless another rule still holds them, and workers are told.
RELEASE_HELD = """
WITH released AS (
    UPDATE eventqueue_events e
    SET visible_at = CASE WHEN e.locked_at IS NULL THEN e.delay_until
                          ELSE e.locked_at + make_interval(secs => h.lock_expiry_seconds) END
    FROM eventqueue_handlers h
    WHERE e.handler = %(handler)s AND e.namespace = %(namespace)s AND e.module = %(event_space)s
      AND e.visible_at = 'infinity' AND h.name = e.handler
      AND NOT EXISTS (SELECT 1 FROM eventqueue_rules r WHERE r.handler = e.handler AND r.namespace = e.namespace
                      AND r.event_space = e.module)
    RETURNING e.id
)
SELECT count(*), CASE WHEN count(*) > 0 THEN pg_notify(current_schema() || '.eventqueue', %(handler)s) END
FROM released
"""

LIST_RULES = """
SELECT rule_type, namespace, handler, event_space, created_at,
       (SELECT count(*) FROM eventqueue_events e WHERE e.handler = r.handler AND e.namespace = r.namespace
        AND e.module = r.event_space AND e.visible_at = 'infinity') AS held
FROM eventqueue_rules r ORDER BY handler, namespace, event_space, rule_type
"""

# -- status -----------------------------------------------------------------------------------------

# Per registered handler, from the indexes whatever the statistics: its events by eventqueue_events_handler, its
# dead letters by eventqueue_dead_handler.
STATUS = """
SELECT h.name AS handler, h.kind, c.queued, c.delayed, c.locked, c.held, d.dead,
       coalesce(c.oldest, 0) AS oldest_queued_seconds,
       ARRAY(SELECT r.rule_type || ' ' || r.namespace || '/' || r.event_space
             FROM eventqueue_rules r WHERE r.handler = h.name ORDER BY r.id) AS rules
FROM eventqueue_handlers h
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE e.visible_at = 'infinity') AS held,
           count(*) FILTER (WHERE e.visible_at < 'infinity' AND e.locked_at IS NULL AND e.delay_until <= now())
               AS queued,
           count(*) FILTER (WHERE e.visible_at < 'infinity' AND e.locked_at IS NULL AND e.delay_until > now())
               AS delayed,
           count(*) FILTER (WHERE e.visible_at < 'infinity' AND e.locked_at IS NOT NULL) AS locked,
           extract(epoch FROM now() - min(e.enqueued_at) FILTER (
               WHERE e.visible_at < 'infinity' AND e.locked_at IS NULL AND e.delay_until <= now()))::float8 AS oldest
    FROM eventqueue_events e WHERE e.handler = h.name
) AS c
CROSS JOIN LATERAL (SELECT count(*) AS dead FROM eventqueue_dead x WHERE x.handler = h.name) AS d
ORDER BY h.name
"""

# -- dead letters -----------------------------------------------------------------------------------

LIST_DEAD = """
SELECT id, namespace, module, handler, modifier, value, retries, enqueued_at, died_at, error, traceback
FROM eventqueue_dead
WHERE (%(handler)s::text IS NULL OR handler = %(handler)s)
ORDER BY id LIMIT %(limit)s
"""

LOCK_DEAD_IDS = "SELECT id FROM eventqueue_dead WHERE id = ANY(%(ids)s::bigint[]) FOR UPDATE"

REPLAY = """
WITH moved AS (
    DELETE FROM eventqueue_dead
    WHERE (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND (%(handler)s::text IS NULL OR handler = %(handler)s)
    RETURNING id, namespace, module, handler, modifier, value, enqueued_at
), inserted AS (
    INSERT INTO eventqueue_events (id, namespace, module, handler, modifier, value, enqueued_at)
    SELECT id, namespace, module, handler, modifier, value, enqueued_at FROM moved
    RETURNING id
)
SELECT (SELECT array_agg(id ORDER BY id) FROM inserted),
       CASE WHEN EXISTS (SELECT 1 FROM inserted) THEN pg_notify(current_schema() || '.eventqueue', '') END
"""

# -- cron -------------------------------------------------------------------------------------------

DB_NOW = "SELECT now()"

# One fire per (cron, fire_time) across all workers: the event is inserted only with its record.
CRON_FIRE = """
WITH record AS (
    INSERT INTO eventqueue_cron_records (cron, fire_time, event_id)
    VALUES (%(cron)s, %(fire_time)s, nextval(pg_get_serial_sequence('eventqueue_events', 'id')))
    ON CONFLICT DO NOTHING
    RETURNING event_id
), inserted AS (
    INSERT INTO eventqueue_events (id, namespace, module, handler, modifier, value)
    SELECT event_id, %(namespace)s, %(module)s, %(handler)s, %(modifier)s, %(value)s::jsonb FROM record
    RETURNING id
)
SELECT id, pg_notify(current_schema() || '.eventqueue', %(handler)s) FROM inserted
"""
