"""Every SQL statement of the callbacks engine (tables: migrations/0004_callbacks.sql)."""

EVENT_COLUMNS = """
    event_id, bucket_id, owner_client_id, group_key, event_key, status, run_at, originally_run_at, cb_url,
    context, body, retry, attempts, main_retries, last_error, schedule_id, priority, created_at, updated_at,
    finished_at, coalesce(message_id, event_id) AS message_id, last_status_code, last_response, replays, on_failure,
    failure_of, endpoint_name
"""

# -- creating events ------------------------------------------------------------------------------

# Taken in share mode before any statement that draws event ids, and held to the transaction's end:
# writers do not wait for each other, and EVENT_ID_DRAWERS tells the poller which transactions may still
# commit ids drawn so far (see worker.EventIdHorizon). Also sets how long the transaction waits for locks.
# (The key's expression sets lock_timeout first: an argument is evaluated before the call that waits.)
TAKE_EVENT_IDS_LOCK = """pg_advisory_xact_lock_shared(hashtextextended(
    current_schema() || ':callbacks.event_ids' || left(set_config('lock_timeout', %(lock_timeout)s, true), 0), 0))"""
LOCK_EVENT_IDS = f"SELECT {TAKE_EVENT_IDS_LOCK}"

# The same lock in exclusive mode, for a change of the bucket count: it waits for every transaction drawing
# ids and keeps new ones out until commit, so each insert's bucket count is still true when it commits.
LOCK_EVENT_IDS_EXCLUSIVE = """SELECT pg_advisory_xact_lock(hashtextextended(current_schema() || ':callbacks.event_ids',
    0))"""

# The rows come as one JSON array of objects (parsed by Postgres in one pass, far cheaper to send than one
# array per column); "r" indexes the batch's distinct retry policies, each parsed once; "b" (the body), "p"
# (the priority), "f" (the failure hook) and "e" (the endpoint's name) are there only when not the default. Each
# insert also sends a wake-up hint (one NOTIFY per bucket, delivered at commit, payload "<bucket>:<epoch of the
# earliest run_at>") to the workers of buckets that got an event due before their next poll would see it. The
# table stays the truth.
_INSERT_ROWS = f"""
WITH ins AS (
    INSERT INTO callback_events AS e (event_id, bucket_id, owner_client_id, group_key, event_key,
                                      run_at, originally_run_at, cb_url, context, body, retry, schedule_id, priority,
                                      on_failure, endpoint_name)
    SELECT nextval('callback_event_ids'),
           (hashtextextended(n.o || chr(1) || n.g || chr(1) || n.k, 0) & 9223372036854775807) %% b.buckets,
           n.o, n.g, n.k, n.t, n.t, n.u, n.c, coalesce(n.b, 'envelope'), b.policies -> n.r, %(schedule_id)s::bigint,
           coalesce(n.p, 0), n.f, n.e
    FROM ROWS FROM (json_to_recordset(%(rows)s::json)
                    AS (o text, g text, k text, t timestamptz, u text, c jsonb, b text, r int, p smallint, f text,
                        e text))
         WITH ORDINALITY AS n(o, g, k, t, u, c, b, r, p, f, e, ord)
    CROSS JOIN (SELECT count(*) AS buckets, %(policies)s::jsonb AS policies, {TAKE_EVENT_IDS_LOCK}
                FROM callback_buckets) AS b  -- before any id is drawn
    ORDER BY n.ord  -- ids are drawn in the batch's order
    {{on_conflict}}
    RETURNING event_id, owner_client_id, group_key, event_key, bucket_id, run_at
)"""


def _wake(rows: str, where: str = "true") -> str:
    """SQL: the wake-up hints for the buckets of ``rows`` (bucket_id, run_at) where ``where`` holds, one NOTIFY per
    bucket (payload "<bucket>:<epoch of its earliest run_at>", delivered at commit); the count sent."""
    return f"""(SELECT count(pg_notify(current_schema() || '.' || 'callbacks',
                                w.bucket_id || ':' || extract(epoch FROM w.run_at)::text))
        FROM (SELECT bucket_id, min(run_at) AS run_at FROM {rows} WHERE {where} GROUP BY bucket_id) AS w)"""


_WAKE_SOON = _wake("ins", "run_at <= now() + make_interval(secs => %(soon)s)")

# Events whose keys are all new (the common case): a plain insert, which a key already taken fails with a
# unique violation. It costs about a third less than INSERT_EVENTS, which checks every key before its row.
# One row: the ids in ascending order, which is the batch's order.
INSERT_NEW_EVENTS = f"""{_INSERT_ROWS.format(on_conflict="")}
SELECT ARRAY(SELECT event_id FROM ins ORDER BY event_id), {_WAKE_SOON}
"""

# Events whose keys may be taken: those rows are skipped, and the caller compares them with the stored ones.
# A row per event inserted: its id and keys.
INSERT_EVENTS = f"""{_INSERT_ROWS.format(on_conflict="ON CONFLICT (owner_client_id, group_key, event_key) DO NOTHING")}
SELECT event_id, owner_client_id, group_key, event_key, {_WAKE_SOON}
FROM ins
"""

CHANNEL = "callbacks"  # LISTEN on cmb_dagster.notifications.channel_name(db, CHANNEL)
NOTIFY = "SELECT pg_notify(current_schema() || '.' || 'callbacks', %(payload)s)"

SELECT_EXISTING = f"""
SELECT {EVENT_COLUMNS} FROM callback_events
WHERE (owner_client_id, group_key, event_key) IN (
    SELECT * FROM unnest(%(owners)s::text[], %(groups)s::text[], %(keys)s::text[]))
"""

# -- reading and changing events ------------------------------------------------------------------

GET_EVENT = f"""
SELECT {EVENT_COLUMNS} FROM callback_events
WHERE owner_client_id = %(owner)s AND group_key = %(group)s AND event_key = %(key)s
"""

LOCK_EVENT = f"""
SELECT {EVENT_COLUMNS}, run_at - now() < interval '1 minute' AS due_soon FROM callback_events
WHERE owner_client_id = %(owner)s AND group_key = %(group)s AND event_key = %(key)s
FOR UPDATE
"""

LIST_EVENTS = f"""
SELECT {EVENT_COLUMNS} FROM callback_events
WHERE (%(owner)s::text IS NULL OR owner_client_id = %(owner)s)
  AND (%(group)s::text IS NULL OR group_key = %(group)s)
  AND (%(status)s::text IS NULL OR status = %(status)s)
ORDER BY run_at, event_id
LIMIT %(limit)s
"""

# A changed event gets a new id (drawn under LOCK_EVENT_IDS), so the poller sees it as freshly inserted
# wherever its new run_at falls, and a delivery of its old version in flight cannot mark it done. It is a new
# message (a new webhook-id), whose retries count from its originally_run_at.
UPDATE_EVENT = f"""
UPDATE callback_events
SET event_id = nextval('callback_event_ids'), status = 'pending', run_at = %(run_at)s,
    originally_run_at = %(originally_run_at)s, cb_url = %(cb_url)s, context = %(context)s::jsonb,
    main_retries = 0, finished_at = NULL, updated_at = now(), message_id = NULL, replayed_at = NULL, endpoint_id = NULL
WHERE event_id = %(event_id)s
RETURNING {EVENT_COLUMNS}
"""

CANCEL_EVENT = f"""
UPDATE callback_events SET status = 'cancelled', finished_at = now(), updated_at = now()
WHERE event_id = %(event_id)s
RETURNING {EVENT_COLUMNS}
"""

DELETE_EVENT = "DELETE FROM callback_events WHERE event_id = %(event_id)s"

LOG_CHANGE = """
INSERT INTO callback_change_log (action, event_id, owner_client_id, group_key, event_key, before, after)
VALUES (%(action)s, %(event_id)s, %(owner)s, %(group)s, %(key)s, %(before)s, %(after)s)
"""

CHANGE_LOG = """
SELECT change_id, at, action, event_id, before, after FROM callback_change_log
WHERE owner_client_id = %(owner)s AND group_key = %(group)s AND event_key = %(key)s
ORDER BY change_id
"""

# -- the poller (one bucket; due-ness judged by the database clock) --------------------------------

POLL_COLUMNS = """
    event_id, run_at, originally_run_at, owner_client_id, group_key, event_key, cb_url, context::text, body,
    retry::text, attempts, main_retries, coalesce(message_id, event_id),
    extract(epoch FROM run_at - clock_timestamp())::float8 AS due_in, priority, endpoint_name
"""

# The highest event id drawn so far, then (read after it) the transactions holding LOCK_EVENT_IDS: once
# they have all ended, every id up to it is committed or rolled back.
EVENT_ID_DRAWERS = """
SELECT d.drawn,
       (SELECT coalesce(array_agg(l.virtualtransaction), '{}') FROM pg_locks l
        WHERE d.drawn IS NOT NULL AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = ((d.k >> 32) & 4294967295)::oid AND l.objid = (d.k & 4294967295)::oid)
FROM (SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END AS drawn,
             hashtextextended(current_schema() || ':callbacks.event_ids', 0) AS k
      FROM callback_event_ids OFFSET 0) AS d
"""

# Query 1: events planned ahead, in (run_at, event_id) order past the cursor, due within the lookahead.
POLL_AHEAD = f"""
SELECT {POLL_COLUMNS} FROM callback_events
WHERE bucket_id = %(bucket)s AND status = 'pending'
  AND (run_at, event_id) > (%(run_at)s, %(event_id)s)
  AND run_at <= now() + make_interval(secs => %(lookahead)s)
ORDER BY run_at, event_id
LIMIT %(limit)s
"""

# Query 2: events inserted after the cursor had passed their run_at (ids above the seen horizon). Sent with query 1,
# it reads up to the cursor query 1 started from: events between that and where query 1 moves the cursor are read
# by query 1 if their ids are within the horizon (committed before the writers were read), and by the next query 2
# otherwise. It reads the bucket's pending ids above the horizon (callback_events_pending_ids), whatever the
# statistics: run_at is checked outside the subquery (OFFSET 0 keeps it there), where no index could use it.
POLL_LATE = f"""
SELECT {POLL_COLUMNS} FROM (
    SELECT * FROM callback_events
    WHERE bucket_id = %(bucket)s AND status = 'pending' AND event_id > %(max_event_id)s
    ORDER BY event_id
    OFFSET 0
) AS e
WHERE run_at <= %(run_at)s
ORDER BY event_id
LIMIT %(limit)s
"""

# Query 0: events above priority 0 already due, highest first, past those this worker holds (%(held)s), read
# ahead of the due backlog of queries 1 and 2 (which read them again later only if they are still pending, and
# the worker keeps one delivery per id). By the index callback_events_urgent whatever the statistics: one probe
# per priority level present (a skip scan, highest first), then that level's due events in run_at order; events
# not yet due cost nothing.
POLL_URGENT = f"""
WITH RECURSIVE p(level) AS (
    SELECT max(priority) FROM callback_events WHERE bucket_id = %(bucket)s AND status = 'pending' AND priority > 0
    UNION ALL
    SELECT (SELECT max(e.priority) FROM callback_events e
            WHERE e.bucket_id = %(bucket)s AND e.status = 'pending' AND e.priority > 0 AND e.priority < p.level)
    FROM p WHERE p.level IS NOT NULL
)
SELECT {POLL_COLUMNS} FROM p CROSS JOIN LATERAL (
    SELECT * FROM callback_events e
    WHERE e.bucket_id = %(bucket)s AND e.status = 'pending' AND e.priority > 0 AND e.priority = p.level
      AND e.run_at <= now() AND e.event_id <> ALL(%(held)s::bigint[])
    ORDER BY e.run_at, e.event_id
    LIMIT %(limit)s
) AS e
WHERE p.level IS NOT NULL
LIMIT %(limit)s
"""

LEASE_REMAINING = """
SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM leases
WHERE kind = %(kind)s AND partition = %(partition)s AND owner = %(owner)s AND fence = %(fence)s
"""

LOAD_WATERMARK = "SELECT max_run_at, cursor_event_id, max_event_id FROM callback_buckets WHERE bucket_id = %(bucket)s"

SAVE_WATERMARK = """
UPDATE callback_buckets SET max_run_at = %(run_at)s, cursor_event_id = %(event_id)s, max_event_id = %(max_event_id)s
WHERE bucket_id = %(bucket)s
"""

# The catch-up policy of schedule s: how many of its most recent missed fire times are still called.
CALLS_KEPT = "CASE s.catch_up WHEN 'none' THEN 0 WHEN 'latest' THEN 1 ELSE s.catch_up_limit END"

# The gate calls pass just before they start, in one statement: the leases of their buckets (share-locked in
# the order given, ascending as renewals lock them, so the two never deadlock), then the events still pending
# in the version polled (an update gives the event a new id) and due by the database's clock, counted in
# attempts. The row locks it takes make cancel, update and delete wait until the calls it let through have
# started. A schedule's fire time never tried and found later than its misfire grace is missed: it is called only
# if fewer than the schedule's catch-up policy keeps (CALLS_KEPT) of its later fire times are due, and cancelled
# otherwise (decided here, under the row lock, whichever worker finds it). An event whose endpoint (the batch's
# endpoints are %(owners)s/%(endpoints)s, and %(pairs)s gives each id's by its place, NULL: none) is not closed is not
# called: it is held ('held' while its endpoint is open, 'disabled' while it is disabled), except an open endpoint's
# probe (PROBE_HELD chose it). Returns how many leases are held (nothing is counted unless all are), the ids let
# through, the ids still pending (the others are gone), and the probes let through with their endpoints.
# Its commit need not wait for the WAL flush (synchronous_commit off): the row locks are what orders it
# before a cancel, and a cancel's own (synchronous) commit flushes the gate's commit record with it. A gate
# lost in a crash only undercounts attempts.
_BREAKERS = """
), breakers AS MATERIALIZED (  -- the batch's endpoints that are not closed (callback_endpoints_unhealthy)
    SELECT c.endpoint_id, c.state, c.probe_event, u.pair
    FROM unnest(%(owners)s::text[], %(endpoints)s::text[]) WITH ORDINALITY AS u(owner_client_id, endpoint, pair)
    JOIN callback_endpoints c ON c.owner_client_id = u.owner_client_id AND c.endpoint = u.endpoint
    WHERE c.state <> 'closed'
), stopped AS MATERIALIZED (  -- their pending events (%(pairs)s: each event's endpoint, by its place in the list)
    SELECT u.event_id, b.endpoint_id, b.state,
           b.state = 'open' AND u.event_id IS NOT DISTINCT FROM b.probe_event AS probe
    FROM breakers b
    JOIN unnest(%(ids)s::bigint[], %(pairs)s::int[]) AS u(event_id, pair) ON u.pair = b.pair
    JOIN polled p ON p.event_id = u.event_id AND p.status = 'pending'
), probes AS MATERIALIZED (  -- the probe of each open endpoint, if it is in the batch
    SELECT event_id, endpoint_id FROM stopped WHERE probe
), blocked AS MATERIALIZED (
    SELECT event_id, endpoint_id, state FROM stopped WHERE NOT probe
), holding AS (
    UPDATE callback_events e
    SET status = CASE b.state WHEN 'disabled' THEN 'disabled' ELSE 'held' END, endpoint_id = b.endpoint_id,
        updated_at = now()
    FROM blocked b
    WHERE e.event_id = b.event_id AND e.status = 'pending' AND (SELECT ok FROM allowed)
    RETURNING e.event_id"""

# What the gate has of the breakers when the worker knows every endpoint to be closed: nothing stopped.
_NO_BREAKERS = """
), probes AS (
    SELECT NULL::bigint AS event_id, NULL::bigint AS endpoint_id WHERE false
), blocked AS (
    SELECT NULL::bigint AS event_id WHERE false
), holding AS (
    SELECT NULL::bigint AS event_id WHERE false"""


def _gate(breakers: str) -> str:
    return f"""WITH held AS (
    SELECT l.partition FROM leases l
    JOIN unnest(%(partitions)s::text[], %(fences)s::bigint[]) WITH ORDINALITY AS u(partition, fence, ord)
      ON l.kind = %(kind)s AND l.partition = u.partition AND l.fence = u.fence
    WHERE l.owner = %(owner)s AND l.expires_at > now()
    ORDER BY u.ord
    FOR SHARE OF l
), async AS (
    SELECT set_config('synchronous_commit', 'off', true) AS v
), polled AS MATERIALIZED (  -- by primary key (the pending index has no use here, statistics or not)
    SELECT event_id, status, schedule_id, originally_run_at, attempts FROM callback_events
    WHERE event_id = ANY(%(ids)s::bigint[])
), allowed AS (
    SELECT (SELECT count(*) FROM held) = cardinality(%(partitions)s::text[])
           AND (SELECT v FROM async) = 'off' AS ok{breakers}
), missed AS MATERIALIZED (  -- by the schedules' and fire times' primary keys
    SELECT p.event_id, s.catch_up FROM polled p JOIN callback_schedules s ON s.schedule_id = p.schedule_id
    WHERE p.status = 'pending' AND p.attempts = 0 AND p.event_id NOT IN (SELECT event_id FROM blocked)
      AND p.originally_run_at < clock_timestamp() - make_interval(secs => s.misfire_grace_seconds)
      AND (SELECT count(*) FROM (SELECT FROM callback_scheduled_events f
                                 WHERE f.schedule_id = p.schedule_id AND f.fire_at > p.originally_run_at
                                   AND f.fire_at <= clock_timestamp()
                                 LIMIT {CALLS_KEPT}) AS later) >= {CALLS_KEPT}
), skipped AS (
    UPDATE callback_events e
    SET status = 'cancelled', finished_at = now(), updated_at = now(),
        last_error = 'missed fire time, not called (catch_up=' || m.catch_up || ')'
    FROM missed m
    WHERE e.event_id = m.event_id AND e.status = 'pending' AND (SELECT ok FROM allowed)
    RETURNING e.event_id
), go AS (
    UPDATE callback_events e SET attempts = e.attempts + 1
    FROM polled p
    WHERE e.event_id = p.event_id AND p.status = 'pending' AND e.status = 'pending' AND e.run_at <= clock_timestamp()
      AND p.event_id NOT IN (SELECT event_id FROM missed) AND p.event_id NOT IN (SELECT event_id FROM blocked)
      AND (SELECT ok FROM allowed)
    RETURNING e.event_id
)
SELECT (SELECT count(*) FROM held)::int,
       ARRAY(SELECT event_id FROM go),
       ARRAY(SELECT event_id FROM polled WHERE status = 'pending'
             EXCEPT SELECT event_id FROM skipped EXCEPT SELECT event_id FROM holding),
       ARRAY(SELECT event_id FROM probes WHERE event_id IN (SELECT event_id FROM go) ORDER BY event_id),
       ARRAY(SELECT endpoint_id FROM probes WHERE event_id IN (SELECT event_id FROM go) ORDER BY event_id)
"""


GATE = _gate(_BREAKERS)
# The same while every endpoint is closed, as the worker last read (ENDPOINT_WORK, every half second, or its own
# write that opened one): less to plan for every batch of calls.
GATE_ALL_CLOSED = _gate(_NO_BREAKERS)

# An outcome that could not be written (e.g. a stored policy out of range): the event fails with the reason.
FAIL_EVENT = """
UPDATE callback_events SET status = 'failed', last_error = %(error)s, finished_at = now(), updated_at = now()
WHERE event_id = %(event_id)s AND status = 'pending'
"""

# Outcomes of calls, in one statement (attempts were counted by the gate), with the last answer's status code and
# the first bytes of its body. 'retry' moves run_at (never to or before the cursor's run_at, so query 1 finds it
# again) unless stop_after_delay has passed since originally_run_at (or the last replay): then 'failed'. 'held' (a
# failed probe of the endpoint %(probed)s) waits for its endpoint again while it is open (a retry otherwise).
# Planned by the primary key whatever the statistics: each event is read by its id (OFFSET 0 keeps the lookup per id),
# and the update matches the status it read rather than the literal 'pending', which would let a planner without
# statistics on status (autovacuum off) read the whole partial pending index for every batch. The deadline is only
# computed for a retry, so an outcome that ends an event is written whatever its stored stop_after_delay.
FINISH_EVENTS = """
WITH read AS MATERIALIZED (
    SELECT u.*, e.status AS read_status, e.originally_run_at, e.stop_after_delay
    FROM unnest(%(ids)s::bigint[], %(outcomes)s::text[], %(errors)s::text[], %(delays)s::float8[],
                %(codes)s::smallint[], %(responses)s::text[], %(probed)s::bigint[])
         AS u(event_id, outcome, error, delay, code, response, probed)
    CROSS JOIN LATERAL (
        SELECT e.status, coalesce(e.replayed_at, e.originally_run_at) AS originally_run_at,
               e.retry ->> 'stop_after_delay' AS stop_after_delay
        FROM callback_events e
        WHERE e.event_id = u.event_id
        OFFSET 0
    ) e
    WHERE e.status = 'pending'
), still_open AS MATERIALIZED (  -- key-share-locked: a release of the endpoint's held events waits for this one
    SELECT c.endpoint_id FROM callback_endpoints c
    WHERE c.endpoint_id IN (SELECT probed FROM read WHERE outcome = 'held') AND c.state = 'open'
    FOR KEY SHARE
), d AS (
    SELECT read.*, read.originally_run_at + make_interval(secs => read.stop_after_delay::float8) AS deadline FROM read
), s AS (
    SELECT d.*, CASE WHEN d.outcome = 'held' AND d.probed IN (SELECT endpoint_id FROM still_open)
                     THEN 'held'
                     WHEN d.outcome NOT IN ('retry', 'held') THEN d.outcome
                     WHEN now() >= d.deadline THEN 'failed'
                     ELSE 'pending' END AS new_status
    FROM d
)
UPDATE callback_events e
SET status = s.new_status,
    run_at = CASE WHEN s.new_status = 'pending'
                  THEN greatest(least(now() + make_interval(secs => s.delay), s.deadline),
                                %(cursor_run_at)s::timestamptz + interval '1 microsecond')
                  ELSE e.run_at END,
    main_retries = e.main_retries + (s.new_status = 'pending')::int,
    endpoint_id = CASE WHEN s.new_status = 'held' THEN s.probed END,
    last_error = coalesce(s.error, e.last_error),
    last_status_code = s.code,
    last_response = s.response,
    finished_at = CASE WHEN s.new_status NOT IN ('pending', 'held') THEN now() END,
    updated_at = now()
FROM s
WHERE e.event_id = ANY(%(ids)s::bigint[]) AND e.event_id = s.event_id AND e.status = s.read_status
"""

# -- buckets --------------------------------------------------------------------------------------

BUCKET_IDS = "SELECT bucket_id FROM callback_buckets ORDER BY bucket_id"

BUCKET_COUNT = "SELECT count(*) FROM callback_buckets"

LOCK_BUCKETS = "LOCK TABLE callback_buckets IN SHARE ROW EXCLUSIVE MODE"

ADD_BUCKETS = """
INSERT INTO callback_buckets (bucket_id)
SELECT generate_series((SELECT count(*) FROM callback_buckets), %(count)s - 1)
"""

# Lowering the count: the rows of removed buckets go; inserts read the count under LOCK_EVENT_IDS, which
# LOCK_EVENT_IDS_EXCLUSIVE excludes, so each one lands in a bucket that exists when it commits. Pending events of
# removed buckets stay put until MOVE_EVENTS (run by whoever holds the removed bucket's lease) gives them a live
# bucket.
REMOVE_BUCKETS = "DELETE FROM callback_buckets WHERE bucket_id >= %(count)s"

# Buckets removed by a lowering that still have pending events, ascending (one index probe per bucket).
STRANDED_BUCKETS = """
WITH RECURSIVE s(bucket_id) AS (
    SELECT min(bucket_id) FROM callback_events
    WHERE status = 'pending' AND bucket_id >= (SELECT count(*) FROM callback_buckets)
    UNION ALL
    SELECT (SELECT min(e.bucket_id) FROM callback_events e WHERE e.status = 'pending' AND e.bucket_id > s.bucket_id)
    FROM s WHERE s.bucket_id IS NOT NULL
)
SELECT bucket_id FROM s WHERE bucket_id IS NOT NULL
"""

# A batch of a removed bucket's pending events moves to the live bucket its keys hash to, under LOCK_EVENT_IDS
# and a new id: the receiving poller sees them as freshly inserted (query 1 or 2, whatever its cursor), and a
# call of an old id can neither pass the gate nor write an outcome. Nothing moves if the bucket is live again.
MOVE_EVENTS = f"""
WITH live AS (SELECT count(*) AS buckets FROM callback_buckets),
moving AS (
    SELECT event_id FROM callback_events
    WHERE bucket_id = %(bucket)s AND status = 'pending' AND %(bucket)s >= (SELECT buckets FROM live)
    ORDER BY run_at, event_id
    LIMIT %(limit)s
    FOR UPDATE
), moved AS (
    UPDATE callback_events e
    SET event_id = nextval('callback_event_ids'), message_id = coalesce(e.message_id, e.event_id),
        bucket_id = (hashtextextended(e.owner_client_id || chr(1) || e.group_key || chr(1) || e.event_key, 0)
                     & 9223372036854775807) %% (SELECT buckets FROM live)
    FROM moving WHERE e.event_id = moving.event_id
    RETURNING e.bucket_id, e.run_at
)
SELECT count(*)::int, {_wake("moved")}
FROM moved
"""

# -- schedules ------------------------------------------------------------------------------------

SCHEDULE_COLUMNS = """
    schedule_id, owner_client_id, group_key, schedule_key, cron, timezone, cb_url, context, retry,
    horizon_seconds AS horizon, catch_up, catch_up_limit, misfire_grace_seconds AS misfire_grace, paused,
    materialized_until, created_at
"""

INSERT_SCHEDULE = f"""
INSERT INTO callback_schedules (owner_client_id, group_key, schedule_key, cron, timezone, cb_url, context, retry,
                                horizon_seconds, catch_up, catch_up_limit, misfire_grace_seconds, materialized_until)
VALUES (%(owner)s, %(group)s, %(key)s, %(cron)s, %(timezone)s, %(cb_url)s, %(context)s::jsonb, %(retry)s::jsonb,
        %(horizon)s, %(catch_up)s, %(catch_up_limit)s, %(misfire_grace)s, now())
ON CONFLICT (owner_client_id, group_key, schedule_key) DO NOTHING
RETURNING {SCHEDULE_COLUMNS}
"""

GET_SCHEDULE = f"""
SELECT {SCHEDULE_COLUMNS} FROM callback_schedules
WHERE owner_client_id = %(owner)s AND group_key = %(group)s AND schedule_key = %(key)s
"""

LIST_SCHEDULES = f"""
SELECT {SCHEDULE_COLUMNS} FROM callback_schedules
WHERE (%(owner)s::text IS NULL OR owner_client_id = %(owner)s)
ORDER BY schedule_id
"""

# One materializer per schedule at a time; others skip it.
CLAIM_SCHEDULES = f"""
SELECT {SCHEDULE_COLUMNS}, {CALLS_KEPT} AS calls_kept, now() AS db_now FROM callback_schedules s
WHERE NOT paused AND materialized_until < now() + make_interval(secs => horizon_seconds)
ORDER BY schedule_id
FOR UPDATE SKIP LOCKED
"""

# Fire times that already have an event are skipped: never two events for one (schedule, fire time).
CLAIM_FIRE_TIMES = """
INSERT INTO callback_scheduled_events (schedule_id, fire_at, event_id)
SELECT %(schedule_id)s, f, NULL FROM unnest(%(fire_ats)s::timestamptz[]) AS f
ON CONFLICT DO NOTHING
RETURNING fire_at
"""

LINK_FIRE_TIMES = """
UPDATE callback_scheduled_events s SET event_id = u.event_id
FROM unnest(%(fire_ats)s::timestamptz[], %(event_ids)s::bigint[]) AS u(fire_at, event_id)
WHERE s.schedule_id = %(schedule_id)s AND s.fire_at = u.fire_at
"""

SET_MATERIALIZED = "UPDATE callback_schedules SET materialized_until = %(until)s WHERE schedule_id = %(schedule_id)s"

LOCK_SCHEDULE = f"""
SELECT {SCHEDULE_COLUMNS} FROM callback_schedules
WHERE owner_client_id = %(owner)s AND group_key = %(group)s AND schedule_key = %(key)s
FOR UPDATE
"""

# Pausing or deleting drops the schedule's future events and their fire times, so resuming re-creates them.
DROP_FUTURE_EVENTS = """
WITH gone AS (
    DELETE FROM callback_events
    WHERE schedule_id = %(schedule_id)s AND status = 'pending' AND originally_run_at > now()
    RETURNING originally_run_at
)
DELETE FROM callback_scheduled_events
WHERE schedule_id = %(schedule_id)s AND (fire_at > now() OR fire_at IN (SELECT originally_run_at FROM gone))
"""

PAUSE_SCHEDULE = """
UPDATE callback_schedules SET paused = true, materialized_until = least(materialized_until, now()), updated_at = now()
WHERE schedule_id = %(schedule_id)s
"""

RESUME_SCHEDULE = """
UPDATE callback_schedules SET paused = false, materialized_until = greatest(materialized_until, now()),
       updated_at = now()
WHERE schedule_id = %(schedule_id)s
"""

# Run after LOCK_SCHEDULE, which waits for a materializer holding the schedule: the events it created are
# visible here, and no other can be created for it.
DELETE_SCHEDULE = """
WITH gone AS (DELETE FROM callback_schedules WHERE schedule_id = %(schedule_id)s)
UPDATE callback_events SET schedule_id = NULL WHERE schedule_id = %(schedule_id)s
"""

# -- cleanup --------------------------------------------------------------------------------------

CLEAN_EVENTS = """
WITH doomed AS (
    SELECT event_id FROM callback_events
    WHERE status <> 'pending' AND status NOT IN ('held', 'disabled')  -- those still wait for their endpoint
      AND run_at < now() - make_interval(days => %(ttl_days)s)
    LIMIT %(limit)s
)
DELETE FROM callback_events e USING doomed WHERE e.event_id = doomed.event_id
"""

CLEAN_CHANGE_LOG = """
WITH doomed AS (
    SELECT change_id FROM callback_change_log WHERE at < now() - make_interval(days => %(ttl_days)s) LIMIT %(limit)s
)
DELETE FROM callback_change_log c USING doomed WHERE c.change_id = doomed.change_id
"""

CLEAN_SCHEDULED_EVENTS = """
DELETE FROM callback_scheduled_events WHERE fire_at < now() - make_interval(days => %(ttl_days)s)
"""

# -- operator status ---------------------------------------------------------------------------

STATUS_COUNTS = """
SELECT count(*) FILTER (WHERE status = 'pending')                   AS pending,
       count(*) FILTER (WHERE status = 'pending' AND run_at < now()) AS overdue,
       count(*) FILTER (WHERE status = 'notified')                  AS notified,
       count(*) FILTER (WHERE status = 'failed')                    AS failed,
       count(*) FILTER (WHERE status = 'rejected')                  AS rejected,
       count(*) FILTER (WHERE status = 'cancelled')                 AS cancelled,
       count(*) FILTER (WHERE status = 'held')                      AS held,
       count(*) FILTER (WHERE status = 'disabled')                  AS disabled,
       coalesce(extract(epoch FROM now() - min(run_at) FILTER (WHERE status = 'pending' AND run_at < now())), 0)
                                                                    AS oldest_overdue_seconds
FROM callback_events
"""

# Per bucket set (bucket_id % sets): pending, overdue and the oldest overdue age from the pending index;
# outcomes of the last hour from the outcomes index (both scans are bounded by their index conditions).
BUCKET_SET_COUNTS = """
WITH p AS (
    SELECT bucket_id %% %(sets)s AS bucket_set, count(*) AS pending,
           count(*) FILTER (WHERE run_at < now()) AS overdue,
           extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at < now())) AS oldest
    FROM callback_events
    WHERE status = 'pending' AND bucket_id >= 0
    GROUP BY 1
), d AS (  -- the dead letters, by their index
    SELECT bucket_id %% %(sets)s AS bucket_set, count(*) AS dead
    FROM callback_events
    WHERE status = 'failed' AND finished_at >= '-infinity'
    GROUP BY 1
), h AS (  -- events waiting for their endpoint, by their index
    SELECT bucket_id %% %(sets)s AS bucket_set, count(*) FILTER (WHERE status = 'held') AS held,
           count(*) FILTER (WHERE status = 'disabled') AS disabled,
           count(DISTINCT endpoint_id) FILTER (WHERE status = 'held') AS open_endpoints,
           count(DISTINCT endpoint_id) FILTER (WHERE status = 'disabled') AS disabled_endpoints
    FROM callback_events
    WHERE status IN ('held', 'disabled') AND endpoint_id IS NOT NULL
    GROUP BY 1
), f AS (
    SELECT bucket_id %% %(sets)s AS bucket_set,
           count(*) FILTER (WHERE status = 'notified') AS notified,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'rejected') AS rejected
    FROM callback_events
    WHERE status <> 'pending'
      AND finished_at > now() - interval '1 hour' AND finished_at <= now()  -- a range: the index
    GROUP BY 1
)
SELECT s.bucket_set, coalesce(p.pending, 0) AS pending, coalesce(p.overdue, 0) AS overdue,
       coalesce(p.oldest, 0)::float8 AS oldest_overdue_seconds, coalesce(f.notified, 0) AS notified_last_hour,
       coalesce(f.failed, 0) AS failed_last_hour, coalesce(f.rejected, 0) AS rejected_last_hour,
       coalesce(d.dead, 0) AS dead_letters, coalesce(h.held, 0) AS held, coalesce(h.disabled, 0) AS disabled,
       coalesce(h.open_endpoints, 0) AS open_endpoints, coalesce(h.disabled_endpoints, 0) AS disabled_endpoints
FROM generate_series(0, %(sets)s - 1) AS s(bucket_set)
LEFT JOIN p USING (bucket_set) LEFT JOIN f USING (bucket_set) LEFT JOIN d USING (bucket_set)
LEFT JOIN h USING (bucket_set)
ORDER BY s.bucket_set
"""

# Per bucket set (bucket_id %% sets), for the metrics: pending and overdue events and the oldest overdue age, at a
# bounded cost whatever the depth. Each bucket with pending events (a skip scan of the pending ids' index, one probe
# per bucket) has its first %(bound)s + 1 pending events read in run_at order from the pending index: up to
# %(bound)s, its pending count is exact, and so is its overdue count while some of those are not yet due; the oldest
# overdue age always is. Deeper buckets are estimated from one sample: %(windows)s windows of at most %(width)s
# consecutive ids (read along the primary key, every event in them), one at a random place in each equal slice of
# the range of their pending ids, each bucket's pending events found there scaled to the range. ``exact``: no
# bucket of the set was estimated.
NO_JIT = "SELECT set_config('jit', 'off', true)"

BUCKET_SET_DEPTHS = """
WITH RECURSIVE b(bucket_id) AS (
    SELECT min(bucket_id) FROM callback_events WHERE status = 'pending'
    UNION ALL
    SELECT (SELECT min(e.bucket_id) FROM callback_events e WHERE e.status = 'pending' AND e.bucket_id > b.bucket_id)
    FROM b WHERE b.bucket_id IS NOT NULL
), counted AS MATERIALIZED (
    SELECT b.bucket_id, f.counted, f.overdue, f.oldest
    FROM b
    CROSS JOIN LATERAL (
        SELECT count(*) AS counted, count(*) FILTER (WHERE first.run_at < now()) AS overdue,
               min(first.run_at) FILTER (WHERE first.run_at < now()) AS oldest
        FROM (SELECT e.run_at FROM callback_events e
              WHERE e.status = 'pending' AND e.bucket_id = b.bucket_id
                AND (e.run_at, e.event_id) >= ('-infinity', -9223372036854775808)  -- the pending index, in order
              ORDER BY e.run_at, e.event_id LIMIT %(bound)s + 1) AS first
    ) AS f
    WHERE b.bucket_id IS NOT NULL
), ids AS MATERIALIZED (
    SELECT min((SELECT min(e.event_id) FROM callback_events e WHERE e.status = 'pending' AND e.bucket_id = c.bucket_id))
               AS lo,
           max((SELECT max(e.event_id) FROM callback_events e WHERE e.status = 'pending' AND e.bucket_id = c.bucket_id))
               AS hi
    FROM counted c
    WHERE c.counted > %(bound)s
), windows AS MATERIALIZED (
    SELECT ids.lo + floor(i * r.slice + random() * greatest(r.slice - r.width, 0))::bigint AS start, r.width,
           r.slice / r.width AS scale
    FROM ids
    CROSS JOIN LATERAL (
        SELECT (ids.hi - ids.lo + 1)::float8 / %(windows)s AS slice,
               least(%(width)s, ceil((ids.hi - ids.lo + 1)::float8 / %(windows)s))::bigint AS width
    ) AS r
    CROSS JOIN generate_series(0, %(windows)s - 1) AS i
    WHERE ids.lo IS NOT NULL
), sampled AS (
    SELECT e.bucket_id, sum(w.scale) AS pending, sum(w.scale) FILTER (WHERE e.run_at < now()) AS overdue
    FROM windows w
    CROSS JOIN LATERAL (  -- no status here: the primary key is the one index that can serve it
        SELECT e.bucket_id, e.run_at, e.status FROM callback_events e
        WHERE e.event_id >= w.start AND e.event_id < w.start + w.width
        ORDER BY e.event_id LIMIT w.width
    ) AS e
    WHERE e.status = 'pending'
    GROUP BY e.bucket_id
), per_bucket AS (
    SELECT c.bucket_id, c.counted <= %(bound)s AS exact, c.oldest,
           CASE WHEN c.counted <= %(bound)s THEN c.counted ELSE greatest(s.pending, c.counted) END AS pending,
           CASE WHEN c.overdue <= %(bound)s THEN c.overdue ELSE greatest(s.overdue, c.overdue) END AS overdue
    FROM counted c LEFT JOIN sampled s USING (bucket_id)
), per_set AS (
    SELECT bucket_id %% %(sets)s AS bucket_set, sum(pending) AS pending, sum(overdue) AS overdue,
           min(oldest) AS oldest, bool_and(exact) AS exact
    FROM per_bucket GROUP BY 1
)
SELECT s.bucket_set, round(coalesce(p.pending, 0))::bigint AS pending, round(coalesce(p.overdue, 0))::bigint AS overdue,
       coalesce(extract(epoch FROM now() - p.oldest), 0)::float8 AS oldest_overdue_seconds,
       coalesce(p.exact, true) AS exact
FROM generate_series(0, %(sets)s - 1) AS s(bucket_set)
LEFT JOIN per_set p USING (bucket_set)
ORDER BY s.bucket_set
"""

# -- failure hooks, dead letters and replay, signing secrets -------------------------------------------


# The failure hooks of the events %(ids)s that failed for good in this transaction (finished_at = now()), run in the
# transaction that wrote their outcomes: each hook is a new event (group %(group)s, due now) calling the event's
# on_failure, else its owner's, with what failed (the context, sent as the body; for a dagster:// hook, run tags).
# A hook event has no hook itself (failure_of is set). The lock on event ids is taken only when there is a hook.
def _hook_events(hooks: str, tags: str, body: str, failure_of: str) -> str:
    """SQL: CTEs ``b`` and ``ins`` making a hook event (group %(group)s, due now, the retry policy %(retry)s) for each
    row of the CTE ``hooks`` (its owner_client_id, hook_key and hook_url): for a dagster:// hook the run ``tags``,
    else the ``body`` (both expressions over ``h``), and ``failure_of`` (a hook event has no hook itself). The lock
    on event ids is taken only when there is a hook; ``ins`` returns each new event's bucket_id and run_at."""
    return f"""), b AS MATERIALIZED (
    SELECT (SELECT count(*) FROM callback_buckets) AS buckets, {TAKE_EVENT_IDS_LOCK} AS locked
    WHERE EXISTS (SELECT FROM {hooks})
), ins AS (
    INSERT INTO callback_events (event_id, bucket_id, owner_client_id, group_key, event_key, run_at,
                                 originally_run_at, cb_url, context, body, retry, failure_of)
    SELECT nextval('callback_event_ids'),
           (hashtextextended(h.owner_client_id || chr(1) || %(group)s || chr(1) || h.hook_key, 0)
            & 9223372036854775807) %% b.buckets,
           h.owner_client_id, %(group)s, h.hook_key, now(), now(), h.hook_url,
           CASE WHEN h.hook_url LIKE 'dagster://%%' THEN jsonb_build_object('tags', {tags}) ELSE {body} END,
           CASE WHEN h.hook_url LIKE 'dagster://%%' THEN 'envelope' ELSE 'context' END, %(retry)s::jsonb, {failure_of}
    FROM {hooks} h CROSS JOIN b
    ON CONFLICT (owner_client_id, group_key, event_key) DO NOTHING
    RETURNING bucket_id, run_at
)"""


_FAILURE_HOOK_EVENTS = _hook_events(
    "hooks",
    tags="""jsonb_build_object(
                    'cmb/failed_callback', left(h.owner_client_id || '/' || h.group_key || '/' || h.event_key, 250),
                    'cmb/failed_message', 'cb_' || h.message_id)""",
    body="""jsonb_build_object(
                    'owner_client_id', h.owner_client_id, 'group_key', h.group_key, 'event_key', h.event_key,
                    'webhook_id', 'cb_' || h.message_id, 'url', h.cb_url, 'attempts', h.attempts,
                    'replays', h.replays, 'last_error', h.last_error, 'status_code', h.last_status_code,
                    'response', h.last_response, 'failed_at', h.finished_at)""",
    failure_of="h.message_id",
)

INSERT_FAILURE_HOOKS = f"""
WITH failed AS MATERIALIZED (
    SELECT e.owner_client_id, e.group_key, e.event_key, e.cb_url, e.attempts, e.replays, e.last_error,
           e.last_status_code, e.last_response, e.finished_at, coalesce(e.message_id, e.event_id) AS message_id,
           coalesce(e.on_failure, o.on_failure) AS hook_url
    FROM callback_events e LEFT JOIN callback_owner_settings o ON o.owner_client_id = e.owner_client_id
    WHERE e.event_id = ANY(%(ids)s::bigint[]) AND e.status = 'failed' AND e.finished_at = now()
      AND e.failure_of IS NULL AND coalesce(e.on_failure, o.on_failure) IS NOT NULL
), hooks AS (
    SELECT f.*, f.event_key || '@failed:' || f.message_id || ':' || f.replays AS hook_key FROM failed f
{_FAILURE_HOOK_EVENTS}
SELECT count(*)::int, {_wake("ins")}
FROM ins
"""

_DEAD_LETTERS = """
    status = 'failed' AND finished_at >= %(since)s AND finished_at < %(until)s
    AND (%(owner)s::text IS NULL OR owner_client_id = %(owner)s)
    AND (%(group)s::text IS NULL OR group_key = %(group)s)
    AND (%(key)s::text IS NULL OR event_key = %(key)s)
"""

# Dead letters (failed for good), oldest failure first, by the index callback_events_dead.
LIST_FAILED = f"""
SELECT {EVENT_COLUMNS} FROM callback_events
WHERE {_DEAD_LETTERS}
ORDER BY finished_at, event_id
LIMIT %(limit)s
"""

# Dead letters back to pending, due now, for a new round: attempts and main retries from 0, retries counted from
# now (replayed_at), one more replay, the same message id. Only rows still failed are touched (locked: a concurrent
# replay skips them, and then finds them pending), and each gets a new event id (run after LOCK_EVENT_IDS), so a
# delivery of an older version can neither pass the gate nor write an outcome. Wakes the workers of their buckets.
REPLAY_FAILED = f"""
WITH picked AS (
    SELECT event_id FROM callback_events
    WHERE {_DEAD_LETTERS}
    ORDER BY finished_at, event_id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), replayed AS (
    UPDATE callback_events e
    SET event_id = nextval('callback_event_ids'), message_id = coalesce(e.message_id, e.event_id),
        status = 'pending', run_at = now(), replayed_at = now(), attempts = 0, main_retries = 0,
        replays = e.replays + 1, finished_at = NULL, updated_at = now()
    FROM picked
    WHERE e.event_id = picked.event_id AND e.status = 'failed'
    RETURNING e.bucket_id, e.run_at
)
SELECT count(*)::int, {_wake("replayed")}
FROM replayed
"""

SET_OWNER_HOOK = """
INSERT INTO callback_owner_settings (owner_client_id, on_failure) VALUES (%(owner)s, %(url)s)
ON CONFLICT (owner_client_id) DO UPDATE SET on_failure = excluded.on_failure, updated_at = now()
"""

GET_OWNER_HOOK = "SELECT on_failure FROM callback_owner_settings WHERE owner_client_id = %(owner)s"

_ACTIVE_SECRET = "retired_at IS NULL AND (expires_at IS NULL OR expires_at > now())"

# Rotations and retirements of one owner's secrets, one at a time (held to the transaction's end).
LOCK_OWNER_SECRETS = """SELECT pg_advisory_xact_lock(
    hashtextextended(current_schema() || ':callbacks.secrets:' || %(owner)s, 0))"""

# Before a new secret: every active secret but the newest is retired (at most two stay active), and the newest
# expires within %(previous_for)s seconds (NULL: when retired).
RETIRE_OLDER_SECRETS = f"""
UPDATE callback_signing_secrets SET retired_at = now()
WHERE owner_client_id = %(owner)s AND retired_at IS NULL
  AND secret_id NOT IN (SELECT secret_id FROM callback_signing_secrets
                        WHERE owner_client_id = %(owner)s AND {_ACTIVE_SECRET}
                        ORDER BY created_at DESC, secret_id DESC LIMIT 1)
"""

EXPIRE_PREVIOUS_SECRET = f"""
UPDATE callback_signing_secrets
SET expires_at = least(coalesce(expires_at, 'infinity'), now() + make_interval(secs => %(previous_for)s))
WHERE owner_client_id = %(owner)s AND {_ACTIVE_SECRET} AND %(previous_for)s::float8 IS NOT NULL
"""

INSERT_SECRET = """
INSERT INTO callback_signing_secrets (owner_client_id, secret) VALUES (%(owner)s, %(secret)s) RETURNING secret_id
"""

# Retires the owner's active secrets: all of them, or all but the newest.
RETIRE_SECRETS = f"""
UPDATE callback_signing_secrets SET retired_at = now()
WHERE owner_client_id = %(owner)s AND {_ACTIVE_SECRET}
  AND (%(all)s OR secret_id NOT IN (SELECT secret_id FROM callback_signing_secrets
                                    WHERE owner_client_id = %(owner)s AND {_ACTIVE_SECRET}
                                    ORDER BY created_at DESC, secret_id DESC LIMIT 1))
"""

# What is known of an owner's secrets; the secret goes to Python alone, which derives its kind and public key from
# it and shows neither it nor any part of it.
LIST_SECRETS = f"""
SELECT secret_id, secret, created_at, expires_at, retired_at, {_ACTIVE_SECRET} AS active
FROM callback_signing_secrets
WHERE owner_client_id = %(owner)s
ORDER BY created_at DESC, secret_id DESC
LIMIT %(limit)s
"""

# The active secrets of %(owners)s, newest first (at most two each): the worker's gate reads them when its copy of
# an owner's is older than CallbackSettings.secrets_refresh.
ACTIVE_SECRETS = f"""
SELECT owner_client_id, (array_agg(secret ORDER BY created_at DESC, secret_id DESC))[1:2]
FROM callback_signing_secrets
WHERE owner_client_id = ANY(%(owners)s::text[]) AND {_ACTIVE_SECRET}
GROUP BY owner_client_id
"""

# -- endpoint health (circuit breakers) -----------------------------------------------------------------

# The outcomes of a batch of calls, per (owner, endpoint), added to its health: calls and failures of the current
# window (a new one starts once %(window)s seconds, or the owner's own, have passed), failures in a row (those after
# the batch's last success when it had one), the last success and failure. Rows are locked in (owner, endpoint)
# order, as every writer locks them. Returns each endpoint's figures and its owner's policy (JSON; NULL: the
# default), from which the worker decides whether it opens or closes (ENDPOINT_TRANSITIONS).
_WINDOW_OVER = """c.window_started_at <= now() - make_interval(secs => coalesce(
    (SELECT (o.endpoint_policy ->> 'window')::float8 FROM callback_owner_settings o
     WHERE o.owner_client_id = c.owner_client_id), %(window)s))"""

RECORD_ENDPOINTS = f"""
WITH async AS (  -- counts: a crash may lose the last ones (the next answers count again), never an event
    SELECT set_config('synchronous_commit', 'off', true)
)
INSERT INTO callback_endpoints AS c (owner_client_id, endpoint, consecutive_failures, window_calls, window_failures,
                                     last_success_at, last_failure_at, last_error, last_status_code)
SELECT u.owner, u.endpoint, u.tail, u.calls, u.failures, CASE WHEN u.calls > u.failures THEN now() END,
       CASE WHEN u.failures > 0 THEN now() END, u.error, u.code
FROM unnest(%(owners)s::text[], %(endpoints)s::text[], %(calls)s::int[], %(failures)s::int[], %(trailing)s::int[],
            %(errors)s::text[], %(codes)s::smallint[]) AS u(owner, endpoint, calls, failures, tail, error, code)
CROSS JOIN async
ORDER BY u.owner, u.endpoint
ON CONFLICT (owner_client_id, endpoint) DO UPDATE SET
    consecutive_failures = CASE WHEN excluded.last_success_at IS NOT NULL THEN excluded.consecutive_failures
                                ELSE c.consecutive_failures + excluded.consecutive_failures END,
    window_started_at = CASE WHEN {_WINDOW_OVER} THEN now() ELSE c.window_started_at END,
    window_calls = CASE WHEN {_WINDOW_OVER} THEN 0 ELSE c.window_calls END + excluded.window_calls,
    window_failures = CASE WHEN {_WINDOW_OVER} THEN 0 ELSE c.window_failures END + excluded.window_failures,
    last_success_at = coalesce(excluded.last_success_at, c.last_success_at),
    last_failure_at = coalesce(excluded.last_failure_at, c.last_failure_at),
    last_error = CASE WHEN excluded.last_failure_at IS NOT NULL THEN excluded.last_error ELSE c.last_error END,
    last_status_code = CASE WHEN excluded.last_failure_at IS NOT NULL THEN excluded.last_status_code
                            ELSE c.last_status_code END,
    updated_at = now()
RETURNING c.endpoint_id, c.owner_client_id, c.endpoint, c.state, c.consecutive_failures, c.window_calls,
          c.window_failures, c.probes, c.last_success_at = now() AS succeeded,
          (SELECT o.endpoint_policy::text FROM callback_owner_settings o WHERE o.owner_client_id = c.owner_client_id)
"""

# What the worker decided from RECORD_ENDPOINTS (in the same transaction, the rows still locked): an endpoint
# opens (its first probe after %(intervals)s), closes (its held events are then released: releasing_since), or waits
# longer after a failed probe. A disabled endpoint changes only by an operator.
ENDPOINT_TRANSITIONS = """
UPDATE callback_endpoints c
SET state = u.state,
    opened_at = CASE WHEN u.state = 'open' AND c.state <> 'open' THEN now() WHEN u.state = 'open' THEN c.opened_at END,
    probes = u.probes,
    probe_interval = CASE WHEN u.state = 'open' THEN u.probe_interval END,
    probe_at = CASE WHEN u.state = 'open' THEN now() + make_interval(secs => u.probe_interval) END,
    probe_event = CASE WHEN u.state = 'open' AND c.state = 'open' THEN c.probe_event END,
    releasing_since = CASE WHEN c.state = 'open' AND u.state = 'closed' THEN coalesce(c.releasing_since, now())
                           ELSE c.releasing_since END,
    window_started_at = CASE WHEN u.state = 'closed' THEN now() ELSE c.window_started_at END,
    window_calls = CASE WHEN u.state = 'closed' THEN 0 ELSE c.window_calls END,
    window_failures = CASE WHEN u.state = 'closed' THEN 0 ELSE c.window_failures END,
    updated_at = now()
FROM unnest(%(ids)s::bigint[], %(states)s::text[], %(probes)s::int[], %(intervals)s::float8[])
     AS u(endpoint_id, state, probes, probe_interval)
WHERE c.endpoint_id = u.endpoint_id AND c.state <> 'disabled'
"""

# The probes of open endpoints whose probe time has come (a batch at a time, one worker each: SKIP LOCKED): each
# one's oldest held event goes back to pending as its probe (a new id drawn after LOCK_EVENT_IDS, as a create draws
# one, so the poller reads it; the same webhook-id), which the gate alone lets through, and the next probe time
# moves a probe interval ahead. An open endpoint with nothing held waits for its next event. Returns how many.
PROBE_HELD = f"""
WITH due AS MATERIALIZED (
    SELECT c.endpoint_id, c.probe_interval FROM callback_endpoints c
    WHERE c.state = 'open' AND c.probe_at <= now()
    ORDER BY c.probe_at
    LIMIT 100
    FOR UPDATE SKIP LOCKED
), picked AS MATERIALIZED (
    SELECT due.endpoint_id, due.probe_interval, h.event_id, nextval('callback_event_ids') AS new_id
    FROM due CROSS JOIN LATERAL (
        SELECT e.event_id FROM callback_events e
        WHERE e.endpoint_id = due.endpoint_id AND e.status = 'held'
        ORDER BY e.run_at, e.event_id
        LIMIT 1
        FOR UPDATE OF e SKIP LOCKED
    ) AS h
), sent AS (
    UPDATE callback_events e
    SET event_id = p.new_id, message_id = coalesce(e.message_id, e.event_id), status = 'pending', endpoint_id = NULL,
        updated_at = now()
    FROM picked p
    WHERE e.event_id = p.event_id
    RETURNING e.bucket_id, e.run_at
), claimed AS (
    UPDATE callback_endpoints c
    SET probe_event = p.new_id, probe_at = now() + make_interval(secs => coalesce(p.probe_interval, 60)),
        updated_at = now()
    FROM picked p
    WHERE c.endpoint_id = p.endpoint_id
)
SELECT count(*)::int, {_wake("sent")}
FROM sent
"""

# The endpoint upkeep of a worker (ENDPOINT_WORK, PROBE_HELD, RELEASE_HELD, DISABLE_ENDPOINTS) runs every half
# second whatever the size of callback_endpoints: its transactions plan by the partial indexes of the few endpoints
# that are not closed, never by a read of every endpoint, whatever the statistics say (a table analyzed while empty
# looks empty to the planner until it is analyzed again).
NO_SEQSCAN = "SELECT set_config('enable_seqscan', 'off', true)"

# Whether a probe is due (callback_endpoints_probes), whether an endpoint has held events to release, and whether
# every endpoint is closed (callback_endpoints_unhealthy; the gate then has no breaker to look up).
ENDPOINT_WORK = """
SELECT EXISTS (SELECT FROM callback_endpoints WHERE state = 'open' AND probe_at <= now()),
       EXISTS (SELECT FROM callback_endpoints WHERE releasing_since <= now() AND state = 'closed'),
       NOT EXISTS (SELECT FROM callback_endpoints WHERE state <> 'closed')
"""

# One closed endpoint with held events (not locked by another worker): up to %(limit)s of them, oldest first, back
# to pending with new ids drawn in that order (run after LOCK_EVENT_IDS, as a create: the poller sees them as freshly
# inserted, and query 2 reads them by id, so oldest first) and the same webhook-id. The endpoint is done releasing
# once fewer than %(limit)s were left. Returns whether an endpoint was found, how many events were released, and the
# wake-up hints sent.
RELEASE_HELD = f"""
WITH ep AS MATERIALIZED (
    SELECT endpoint_id FROM callback_endpoints WHERE releasing_since <= now() AND state = 'closed'
    ORDER BY releasing_since LIMIT 1
    FOR UPDATE SKIP LOCKED
), picked AS MATERIALIZED (
    SELECT h.event_id, nextval('callback_event_ids') AS new_id
    FROM (SELECT e.event_id FROM callback_events e
          WHERE e.endpoint_id = (SELECT endpoint_id FROM ep) AND e.status = 'held'
          ORDER BY e.run_at, e.event_id
          LIMIT %(limit)s
          FOR UPDATE OF e) AS h
), released AS (
    UPDATE callback_events e
    SET event_id = p.new_id, message_id = coalesce(e.message_id, e.event_id), status = 'pending', endpoint_id = NULL,
        updated_at = now()
    FROM picked p
    WHERE e.event_id = p.event_id
    RETURNING e.bucket_id, e.run_at
), done AS (
    UPDATE callback_endpoints c SET releasing_since = NULL, updated_at = now()
    WHERE c.endpoint_id = (SELECT endpoint_id FROM ep) AND (SELECT count(*) FROM picked) < %(limit)s
)
SELECT (SELECT count(*) FROM ep)::int, count(*)::int, {_wake("released")}
FROM released
"""

_DISABLED_NOTICE_EVENTS = _hook_events(
    "notices",
    tags="jsonb_build_object('cmb/disabled_endpoint', left(h.owner_client_id || ' ' || h.endpoint, 250))",
    body="""jsonb_build_object(
                    'type', 'endpoint.disabled', 'owner_client_id', h.owner_client_id, 'endpoint', h.endpoint,
                    'opened_at', h.opened_at, 'disabled_at', h.disabled_at, 'last_success_at', h.last_success_at,
                    'last_error', h.last_error, 'status_code', h.last_status_code, 'events', h.events)""",
    failure_of="0",
)

# Endpoints open longer than their owner's disable_after (else %(disable_after)s; NULL: never) are disabled, a
# batch at a time (one worker each: SKIP LOCKED): their held events become 'disabled', and the owner's failure hook
# (if any) gets one notification event per disable (group %(group)s, key endpoint.disabled@<endpoint id>:<disables>,
# in this transaction: a worker killed before the commit leaves it all to the next). Returns what was disabled.
DISABLE_ENDPOINTS = f"""
WITH due AS (
    SELECT c.endpoint_id FROM callback_endpoints c
    LEFT JOIN callback_owner_settings o ON o.owner_client_id = c.owner_client_id
    WHERE c.state = 'open'
      AND c.opened_at <= now() - make_interval(secs => CASE WHEN o.endpoint_policy ? 'disable_after'
                                                            THEN (o.endpoint_policy ->> 'disable_after')::float8
                                                            ELSE %(disable_after)s::float8 END)
    ORDER BY c.opened_at
    LIMIT 100
    FOR UPDATE OF c SKIP LOCKED
), disabled AS (
    UPDATE callback_endpoints c
    SET state = 'disabled', disabled_at = now(), disabled_by = 'breaker', disables = c.disables + 1, probe_at = NULL,
        releasing_since = NULL, updated_at = now()
    FROM due
    WHERE c.endpoint_id = due.endpoint_id AND c.state = 'open'
    RETURNING c.*
), parked AS (
    UPDATE callback_events e SET status = 'disabled', updated_at = now()
    FROM disabled d
    WHERE e.endpoint_id = d.endpoint_id AND e.status = 'held'
    RETURNING e.endpoint_id
), counted AS MATERIALIZED (
    SELECT d.*, (SELECT count(*) FROM parked p WHERE p.endpoint_id = d.endpoint_id) AS events, o.on_failure AS hook_url
    FROM disabled d LEFT JOIN callback_owner_settings o ON o.owner_client_id = d.owner_client_id
), notices AS (
    SELECT n.*, 'endpoint.disabled@' || n.endpoint_id || ':' || n.disables AS hook_key
    FROM counted n WHERE n.hook_url IS NOT NULL
{_DISABLED_NOTICE_EVENTS}
SELECT n.owner_client_id, n.endpoint, n.opened_at, n.events, n.last_error, (SELECT count(*) FROM ins)::int,
       {_wake("ins")}
FROM counted n
"""

ENDPOINT_COLUMNS = """
    c.endpoint_id, c.owner_client_id, c.endpoint, c.state, c.consecutive_failures, c.window_started_at,
    c.window_calls, c.window_failures, c.last_success_at, c.last_failure_at, c.last_error, c.last_status_code,
    c.opened_at, c.probes, c.probe_at, c.disabled_at, c.disabled_by, c.releasing_since IS NOT NULL AS releasing,
    c.updated_at,
    (SELECT count(*) FROM callback_events e WHERE e.endpoint_id = c.endpoint_id AND e.status = 'held') AS held,
    (SELECT count(*) FROM callback_events e WHERE e.endpoint_id = c.endpoint_id AND e.status = 'disabled') AS disabled
"""

# Endpoints as operators list them: the unhealthy first (disabled, open), then by owner and endpoint.
LIST_ENDPOINTS = f"""
SELECT {ENDPOINT_COLUMNS} FROM callback_endpoints c
WHERE (%(owner)s::text IS NULL OR c.owner_client_id = %(owner)s) AND (%(state)s::text IS NULL OR c.state = %(state)s)
ORDER BY CASE c.state WHEN 'disabled' THEN 0 WHEN 'open' THEN 1 ELSE 2 END, c.owner_client_id, c.endpoint
LIMIT %(limit)s
"""

# An operator enables an endpoint: closed, its counts from zero, its disabled events held again and released by the
# workers (releasing_since), oldest first. Returns the endpoint's id and how many events will be sent again.
ENABLE_ENDPOINT = """
WITH ep AS (
    UPDATE callback_endpoints
    SET state = 'closed', releasing_since = now(), opened_at = NULL, probe_at = NULL, probe_interval = NULL, probes = 0,
        consecutive_failures = 0, window_started_at = now(), window_calls = 0, window_failures = 0, disabled_at = NULL,
        disabled_by = NULL, updated_at = now()
    WHERE owner_client_id = %(owner)s AND endpoint = %(endpoint)s
    RETURNING endpoint_id
), unparked AS (
    UPDATE callback_events e SET status = 'held', updated_at = now()
    FROM ep
    WHERE e.endpoint_id = ep.endpoint_id AND e.status IN ('held', 'disabled')
    RETURNING e.event_id
)
SELECT (SELECT endpoint_id FROM ep), (SELECT count(*) FROM unparked)::int
"""

# An operator disables an endpoint (known or not): its held events become 'disabled', and so does every event of it
# a gate finds due, until it is enabled. No notification: the operator knows.
DISABLE_ENDPOINT = """
WITH ep AS (
    INSERT INTO callback_endpoints AS c (owner_client_id, endpoint, state, disabled_at, disabled_by)
    VALUES (%(owner)s, %(endpoint)s, 'disabled', now(), 'operator')
    ON CONFLICT (owner_client_id, endpoint) DO UPDATE
    SET state = 'disabled', disabled_at = now(), disabled_by = 'operator', probe_at = NULL, releasing_since = NULL,
        updated_at = now()
    RETURNING endpoint_id
), parked AS (
    UPDATE callback_events e SET status = 'disabled', updated_at = now()
    FROM ep
    WHERE e.endpoint_id = ep.endpoint_id AND e.status = 'held'
    RETURNING e.event_id
)
SELECT (SELECT endpoint_id FROM ep), (SELECT count(*) FROM parked)::int
"""

SET_ENDPOINT_POLICY = """
INSERT INTO callback_owner_settings (owner_client_id, endpoint_policy) VALUES (%(owner)s, %(policy)s::jsonb)
ON CONFLICT (owner_client_id) DO UPDATE SET endpoint_policy = excluded.endpoint_policy, updated_at = now()
"""

GET_ENDPOINT_POLICY = "SELECT endpoint_policy::text FROM callback_owner_settings WHERE owner_client_id = %(owner)s"

# How many endpoints are open and disabled (the index of endpoints that are not closed).
ENDPOINT_COUNTS = """
SELECT count(*) FILTER (WHERE state = 'open') AS open, count(*) FILTER (WHERE state = 'disabled') AS disabled
FROM callback_endpoints WHERE state <> 'closed'
"""

# Closed endpoints with nothing to release and no call for %(ttl_days)s days are forgotten.
CLEAN_ENDPOINTS = """
DELETE FROM callback_endpoints
WHERE state = 'closed' AND releasing_since IS NULL AND updated_at < now() - make_interval(days => %(ttl_days)s)
"""
