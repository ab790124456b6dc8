"""Every query of the event queue engine.

The hot path is three statements: EMIT (one insert for any number of events, plus one NOTIFY),
CLAIM_DUE (a batch claimed in one statement) and DELETE_DONE. CLAIM_DUE walks the index on
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

_APPLY = """
held AS (
    UPDATE eventqueue_events e SET visible_at = 'infinity'
    FROM candidates c WHERE e.id = c.id AND c.decision IN ('pause', 'block')
    RETURNING e.id, c.decision
), claimed AS (
    UPDATE eventqueue_events e
    SET locked_at = now(), visible_at = now() + make_interval(secs => h.lock_expiry_seconds)
    FROM candidates c, eventqueue_handlers h
    WHERE e.id = c.id AND c.decision = 'claim' AND h.name = e.handler
      AND e.locked_at IS NOT DISTINCT FROM c.seen_locked_at        -- compare-and-set on locked_at
    RETURNING e.id, e.namespace, e.module, e.handler, e.modifier, e.value, e.retries, e.enqueued_at,
              e.locked_at, c.seen_locked_at
)
SELECT 'claim', id, namespace, module, handler, modifier, value, retries, enqueued_at, locked_at, seen_locked_at
FROM claimed
UNION ALL
SELECT decision, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM held
UNION ALL
SELECT decision, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM candidates
WHERE decision NOT IN ('claim', 'pause', 'block')
UNION ALL
SELECT 'lock_claim_failed', c.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM candidates c
WHERE c.decision = 'claim' AND NOT EXISTS (SELECT 1 FROM claimed WHERE claimed.id = c.id)
"""

# The worker's batch: due (or lock-expired) events of its handlers, oldest visibility first. Held rows
# are skipped, not waited for. Events under a rule are parked (visible_at = 'infinity'), the rule row
# share-locked so an unpause waits for this transaction and then finds them parked.
CLAIM_DUE = f"""
WITH candidates AS (
    SELECT e.id, e.locked_at AS seen_locked_at, coalesce({_RULE}, 'claim') AS decision
    FROM eventqueue_events e
    WHERE e.visible_at <= now() AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL
    ORDER BY e.visible_at
    LIMIT %(limit)s
    FOR UPDATE OF e SKIP LOCKED
), {_APPLY}
"""

# The flowchart for named events (a notification that names them): each row says which edge it took.
CLAIM_IDS = f"""
WITH candidates AS (
    SELECT e.id, e.locked_at AS seen_locked_at,
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

# When the next event of these handlers becomes visible (for the worker's sleep).
NEXT_VISIBLE = """
SELECT visible_at, now() FROM eventqueue_events
WHERE array_position(%(handlers)s::text[], handler) IS NOT NULL AND visible_at > now() AND visible_at < 'infinity'
ORDER BY visible_at LIMIT 1
"""

DELETE_DONE = "DELETE FROM eventqueue_events WHERE id = ANY(%(ids)s::bigint[])"

# RetryAllowed: increment, delay with backoff; only while the lock is still ours.
RETRY = """
UPDATE eventqueue_events
SET retries = retries + 1, locked_at = NULL, last_error = %(error)s,
    delay_until = now() + make_interval(secs => %(delay)s), visible_at = now() + make_interval(secs => %(delay)s)
WHERE id = %(id)s AND locked_at = %(locked_at)s
"""

# RetryTooMany: into the dead-letter table with the last error (the original design deleted it).
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
                                      max_retry_delay_seconds)
SELECT * FROM unnest(%(names)s::text[], %(kinds)s::text[], %(lock_expiry)s::float8[], %(max_retries)s::int[],
                     %(retry_delay)s::float8[], %(max_retry_delay)s::float8[])
ON CONFLICT (name) DO UPDATE SET
    kind = EXCLUDED.kind, lock_expiry_seconds = EXCLUDED.lock_expiry_seconds, max_retries = EXCLUDED.max_retries,
    retry_delay_seconds = EXCLUDED.retry_delay_seconds, max_retry_delay_seconds = EXCLUDED.max_retry_delay_seconds,
    registered_at = now()
"""

HANDLER_EXISTS = "SELECT 1 FROM eventqueue_handlers WHERE name = %(handler)s"

# -- rules ------------------------------------------------------------------------------------------

ADD_RULE = """
INSERT INTO eventqueue_rules (rule_type, namespace, handler, event_space)
VALUES (%(rule_type)s, %(namespace)s, %(handler)s, %(event_space)s)
ON CONFLICT DO NOTHING
RETURNING id
"""

# Deleting waits for claimers that share-locked the rule; the next statement then sees what they parked.
DELETE_RULE = """
DELETE FROM eventqueue_rules
WHERE rule_type = %(rule_type)s AND namespace = %(namespace)s AND handler = %(handler)s AND event_space = %(event_space)s
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

STATUS = """
WITH counts AS (
    SELECT handler,
           count(*) FILTER (WHERE visible_at = 'infinity') AS held,
           count(*) FILTER (WHERE visible_at < 'infinity' AND locked_at IS NULL AND delay_until <= now()) AS queued,
           count(*) FILTER (WHERE visible_at < 'infinity' AND locked_at IS NULL AND delay_until > now()) AS delayed,
           count(*) FILTER (WHERE visible_at < 'infinity' AND locked_at IS NOT NULL) AS locked,
           extract(epoch FROM now() - min(enqueued_at) FILTER (
               WHERE visible_at < 'infinity' AND locked_at IS NULL AND delay_until <= now()))::float8 AS oldest
    FROM eventqueue_events GROUP BY handler
), dead AS (
    SELECT handler, count(*) AS dead FROM eventqueue_dead GROUP BY handler
)
SELECT h.name, h.kind, coalesce(c.queued, 0), coalesce(c.delayed, 0), coalesce(c.locked, 0), coalesce(c.held, 0),
       coalesce(d.dead, 0), coalesce(c.oldest, 0),
       (SELECT array_agg(r.rule_type || ' ' || r.namespace || '/' || r.event_space ORDER BY r.id)
        FROM eventqueue_rules r WHERE r.handler = h.name)
FROM eventqueue_handlers h
LEFT JOIN counts c ON c.handler = h.name
LEFT JOIN dead d ON d.handler = h.name
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
