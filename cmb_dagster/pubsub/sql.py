"""Every SQL statement of the pub/sub engine (tables and functions: migrations/0002_pubsub.sql,
0008_pubsub_poison_retention.sql and 0025_pubsub_replay.sql).

Statements run on connections whose search_path starts with the cmb schema; the capture DDL, which
lives next to a user's table, names cmb objects through ``{cmb}`` (a psycopg.sql.Identifier).
"""

from psycopg.sql import SQL

# -- watermarks ----------------------------------------------------------------------------------

_WATERMARK_COLUMNS = """
    consumer_id, branch_id, snapshot::text, target::text, txid::text, event_id, delivered, handler,
    failing_event, attempts, crashes, pubsub_restore_problem(coalesce(target, snapshot)) AS restore_problem
"""

LOCK_WATERMARK = f"""
SELECT {_WATERMARK_COLUMNS} FROM pubsub_watermarks
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s
FOR NO KEY UPDATE
"""

LOCK_WATERMARK_OR_SKIP = LOCK_WATERMARK + " SKIP LOCKED"

WATERMARK_EXISTS = "SELECT 1 FROM pubsub_watermarks WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s"

CREATE_WATERMARK = """
INSERT INTO pubsub_watermarks (consumer_id, branch_id) VALUES (%(consumer_id)s, %(branch_id)s)
ON CONFLICT DO NOTHING
"""

REGISTERED_HANDLER = """
SELECT handler FROM pubsub_watermarks WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s
"""

REGISTRATION = """
SELECT handler, topics, filter FROM pubsub_watermarks WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s
"""

# The handler path (kept when the consumer's handler has none), the topics and the filter it reads with.
REGISTER_CONSUMER = """
INSERT INTO pubsub_watermarks (consumer_id, branch_id, handler, topics, filter)
VALUES (%(consumer_id)s, %(branch_id)s, %(handler)s, %(topics)s, %(filter)s)
ON CONFLICT (consumer_id, branch_id) DO UPDATE
SET handler = coalesce(EXCLUDED.handler, pubsub_watermarks.handler), topics = EXCLUDED.topics,
    filter = EXCLUDED.filter, updated_at = now()
"""

# A new consumer's watermark: at the beginning of history ('beginning', 'earliest_kept') or at the current
# snapshot ('now'); 'beginning' notes when trim has already deleted events of the branch.
START_CONSUMER = """
INSERT INTO pubsub_watermarks (consumer_id, branch_id, handler, topics, filter, snapshot, notice)
SELECT %(consumer_id)s, %(branch_id)s, %(handler)s, %(topics)s, %(filter)s,
       CASE WHEN %(start)s = 'now' THEN pubsub_snapshot() ELSE '1:1:'::pg_snapshot END,
       CASE WHEN %(start)s = 'beginning' THEN
           (SELECT format('started from the beginning of branch %%s, but trim had already deleted %%s of its events '
                          '(up to txid %%s, last trim %%s): the consumer never sees them', t.branch_id, t.events,
                          t.last_txid, to_char(t.last_trim_at, 'YYYY-MM-DD HH24:MI:SSOF'))
            FROM pubsub_trimmed t WHERE t.branch_id = %(branch_id)s)
       END
ON CONFLICT (consumer_id, branch_id) DO NOTHING
RETURNING notice
"""

DROP_CONSUMER = "DELETE FROM pubsub_watermarks WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s"

SAVE_WATERMARK = """
UPDATE pubsub_watermarks
SET snapshot = %(snapshot)s::pg_snapshot, target = %(target)s::pg_snapshot, txid = %(txid)s::xid8,
    event_id = %(event_id)s, delivered = delivered + %(count)s, updated_at = now(),
    failing_event = NULL, attempts = 0, crashes = 0, first_failed_at = NULL, last_failed_at = NULL, last_error = NULL
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s
"""

# A sensor's watermark row mirrors the cursor Dagster last stored, so trim keeps what it has not read.
RECORD_WATERMARK = """
INSERT INTO pubsub_watermarks AS w (consumer_id, branch_id, snapshot, target, txid, event_id, delivered)
VALUES (%(consumer_id)s, %(branch_id)s, %(snapshot)s::pg_snapshot, %(target)s::pg_snapshot, %(txid)s::xid8,
        %(event_id)s, %(delivered)s)
ON CONFLICT (consumer_id, branch_id) DO UPDATE
SET snapshot = EXCLUDED.snapshot, target = EXCLUDED.target, txid = EXCLUDED.txid, event_id = EXCLUDED.event_id,
    delivered = EXCLUDED.delivered, updated_at = now()
"""


# -- reading ------------------------------------------------------------------------------------


RESTORE_PROBLEM = "SELECT pubsub_restore_problem(%(snapshot)s::pg_snapshot)"

_EVENT_COLUMNS = "e.id, e.txid, e.branch_id, e.topic, e.op, e.key, e.payload, e.created_at"

# The events of a branch that the target snapshot shows committed and %(snapshot)s does not, after the
# position (txid, event_id), in (txid, id) order. Such a txid is either one %(snapshot)s listed as
# running (an index scan per such txid), or one at or above its xmax (one index range scan): neither
# part revisits delivered events.
#
# The target is %(target)s when a difference is half delivered, else taken here (one round trip):
# the current snapshot, or with %(strict)s (order="txid") "h:h:", which shows committed exactly the
# txids below h, the oldest transaction still running that may write here; no target (NULL) while h
# is not beyond %(snapshot)s. A running txid that pg_stat_activity shows in another database cannot
# write this stream's events and does not count (one that already ended, a prepared transaction, or
# one whose session we may not see counts: conservative). The target is this statement's own snapshot
# (pubsub_statement_snapshot is STABLE): it never shows committed a transaction whose events the
# statement cannot see. Returns one row: the target, and the events as one JSON array of
# [id, txid, branch_id, topic, op, key, payload, created_at] (one json.loads per batch instead of two
# jsonb decodes and a timestamp per event: the client's cost per event halves).
_TARGET = """
target AS MATERIALIZED (
    SELECT CASE
        WHEN %(target)s::pg_snapshot IS NOT NULL THEN %(target)s::pg_snapshot
        WHEN NOT %(strict)s THEN pubsub_statement_snapshot()
        ELSE (SELECT format('%%s:%%s:', m.horizon, m.horizon)::pg_snapshot
              FROM pubsub_clock c, pubsub_statement_snapshot() AS s,
              LATERAL (SELECT coalesce(min(x), pg_snapshot_xmax(s)) AS horizon
                       FROM pg_snapshot_xip(s) AS x
                       WHERE ((x::text::numeric - c.shift) %% 4294967296)::bigint NOT IN (
                           SELECT a.backend_xid::text::bigint FROM pg_stat_activity a
                           WHERE a.backend_xid IS NOT NULL AND a.datname IS DISTINCT FROM current_database())
                      ) AS m
              WHERE m.horizon > pg_snapshot_xmax(%(snapshot)s::pg_snapshot))
    END AS t
)"""

# The next %(limit)s events after the position, in (txid, id) order. The events at or above the snapshot's xmax are
# read from one lower bound, the position or the xmax whichever is later (ids start at 1): given both, the index scan
# would start at the position, the branch's first event when no batch is half delivered.
_NEXT_EVENTS = f"""(
    (SELECT {_EVENT_COLUMNS}
     FROM pg_snapshot_xip(%(snapshot)s::pg_snapshot) AS x
     CROSS JOIN LATERAL (
         SELECT * FROM pubsub_events e
         WHERE e.branch_id = %(branch_id)s AND e.txid = x AND (e.txid, e.id) > (%(txid)s::xid8, %(event_id)s)
         ORDER BY e.id LIMIT %(limit)s
     ) AS e
     WHERE pg_visible_in_snapshot(x, (SELECT t FROM target))
     ORDER BY e.txid, e.id LIMIT %(limit)s)
    UNION ALL
    (SELECT {_EVENT_COLUMNS} FROM pubsub_events e
     WHERE e.branch_id = %(branch_id)s
       AND (e.txid, e.id) > (greatest(%(txid)s::xid8, pg_snapshot_xmax(%(snapshot)s::pg_snapshot)),
                             CASE WHEN %(txid)s::xid8 >= pg_snapshot_xmax(%(snapshot)s::pg_snapshot)
                                  THEN %(event_id)s::bigint ELSE 0 END)
       AND e.txid < (SELECT pg_snapshot_xmax(t) FROM target)
       AND pg_visible_in_snapshot(e.txid, (SELECT t FROM target))
     ORDER BY e.txid, e.id LIMIT %(limit)s)
    ORDER BY 2, 1
    LIMIT %(limit)s
)"""

_EVENT_ARRAY = (
    "json_build_array(b.id, b.txid::text::numeric, b.branch_id, b.topic, b.op, b.key, b.payload, b.created_at)"
)

READ_BATCH = f"""
WITH {_TARGET}
SELECT (SELECT t::text FROM target),
       (SELECT json_agg({_EVENT_ARRAY} ORDER BY b.txid, b.id)::text  -- as xid8: txids' text does not sort as they do
        FROM {_NEXT_EVENTS} AS b)
"""

# A consumer's filter (%(topics)s, and %(filter)s, an SQL/JSON path predicate over the payload with the variables
# $topic, $op and $key) applies to the events read: a batch reads up to %(limit)s - 1 events, delivers those the
# filter keeps, and returns how many it read and the position of the last one, so the watermark moves past
# filtered-out events and a batch's work stays bounded. (Consumers without a filter read with READ_BATCH: numbering
# and keeping the events read costs them a third of their speed.) The path is parsed once per statement (an
# InitPlan) and evaluated silently: an event on which it meets a missing field, a wrong type, a bad number or date
# does not match. READ_JUDGED_BATCH, for a batch on which the filter raised anyway, judges each event apart
# (pubsub_filter_error) and also returns the events it raised on, as [id, txid, error].
_FILTER = "filter AS MATERIALIZED (SELECT %(filter)s::jsonpath AS path)"
_EVENT_VARIABLES = "jsonb_build_object('topic', b.topic, 'op', b.op, 'key', b.key)"
_EVENT_MATCHES = f"""(%(filter)s::text IS NULL
                OR jsonb_path_match_tz(b.payload, (SELECT path FROM filter), {_EVENT_VARIABLES}, true))"""
_SCANNED = f"""scanned AS MATERIALIZED (
    SELECT b.*, row_number() OVER (ORDER BY b.txid, b.id) AS cmb_n FROM {_NEXT_EVENTS} AS b
)"""
_LAST_SCANNED = """(SELECT json_build_array(b.txid::text, b.id)::text FROM scanned b WHERE b.cmb_n < %(limit)s
        ORDER BY b.cmb_n DESC LIMIT 1)"""
_OF_TOPICS = "(%(topics)s::text[] IS NULL OR b.topic = ANY (%(topics)s::text[]))"

READ_FILTERED_BATCH = f"""
WITH {_TARGET}, {_FILTER}, {_SCANNED}
SELECT (SELECT t::text FROM target),
       (SELECT json_agg({_EVENT_ARRAY} ORDER BY b.txid, b.id)::text
        FROM scanned b
        WHERE b.cmb_n < %(limit)s AND {_OF_TOPICS} AND {_EVENT_MATCHES}),
       (SELECT count(*) FROM scanned),
       {_LAST_SCANNED}
"""

READ_JUDGED_BATCH = f"""
WITH {_TARGET}, {_FILTER}, {_SCANNED}, judged AS MATERIALIZED (
    SELECT b.*, pubsub_filter_error(b.payload, (SELECT path FROM filter), {_EVENT_VARIABLES}) AS cmb_error
    FROM scanned b WHERE b.cmb_n < %(limit)s AND {_OF_TOPICS}
)
SELECT (SELECT t::text FROM target),
       (SELECT json_agg({_EVENT_ARRAY} ORDER BY b.txid, b.id)::text
        FROM judged b WHERE CASE WHEN b.cmb_error IS NULL THEN {_EVENT_MATCHES} END),
       (SELECT count(*) FROM scanned),
       {_LAST_SCANNED},
       (SELECT json_agg(json_build_array(b.id, b.txid::text, b.cmb_error) ORDER BY b.txid, b.id)::text
        FROM judged b WHERE b.cmb_error IS NOT NULL)
"""

# -- failures and dead letters -------------------------------------------------------------------

# One more failed attempt on %(event_id)s (the count starts again when the failing event changes); a failure
# is an orderly end of a run, so it clears the crash count.
RECORD_FAILURE = """
UPDATE pubsub_watermarks
SET attempts = CASE WHEN failing_event = %(event_id)s THEN attempts + 1 ELSE 1 END,
    first_failed_at = CASE WHEN failing_event = %(event_id)s THEN first_failed_at ELSE now() END,
    failing_event = %(event_id)s, last_failed_at = now(), last_error = %(error)s, updated_at = now(), crashes = 0
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s
RETURNING attempts, first_failed_at
"""

# A delivery of %(event_id)s alone is about to begin, committed before the handler runs: if the worker dies in
# it, the next holder of the consumer finds the crash counted.
RECORD_START = """
UPDATE pubsub_watermarks
SET crashes = CASE WHEN failing_event = %(event_id)s THEN crashes + 1 ELSE 1 END,
    attempts = CASE WHEN failing_event = %(event_id)s THEN attempts ELSE 0 END,
    first_failed_at = CASE WHEN failing_event = %(event_id)s THEN first_failed_at END,
    failing_event = %(event_id)s, updated_at = now()
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s
"""

PARK_EVENT = """
INSERT INTO pubsub_dead_letters (consumer_id, branch_id, event_id, txid, topic, op, key, payload, created_at,
                                 error, traceback, attempts, first_failed_at, last_failed_at)
SELECT %(consumer_id)s, %(branch_id)s, e.id, e.txid, e.topic, e.op, e.key, e.payload, e.created_at,
       %(error)s, %(traceback)s, %(attempts)s, %(first_failed_at)s, now()
FROM pubsub_events e
WHERE e.branch_id = %(branch_id)s AND e.txid = %(txid)s::xid8 AND e.id = %(event_id)s
ON CONFLICT (consumer_id, branch_id, event_id) DO UPDATE
SET error = EXCLUDED.error, traceback = EXCLUDED.traceback, attempts = EXCLUDED.attempts,
    last_failed_at = EXCLUDED.last_failed_at, parked_at = now(), replayed_at = NULL
"""

DEAD_LETTER_COLUMNS = """consumer_id, branch_id, event_id, txid::text, topic, op, key, payload, created_at,
    error, traceback, attempts, first_failed_at, last_failed_at, parked_at, replayed_at"""

DEAD_LETTERS = f"""
SELECT {DEAD_LETTER_COLUMNS} FROM pubsub_dead_letters
WHERE (%(consumer_id)s::text IS NULL OR consumer_id = %(consumer_id)s)
  AND (%(branch_id)s::bigint IS NULL OR branch_id = %(branch_id)s)
  AND (%(all)s OR replayed_at IS NULL)
ORDER BY consumer_id, branch_id, event_id
"""

# The next parked event to replay (ids above %(after)s), locked so concurrent replays take different ones.
NEXT_DEAD_LETTER = f"""
SELECT {DEAD_LETTER_COLUMNS} FROM pubsub_dead_letters
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s AND replayed_at IS NULL
  AND event_id > %(after)s AND (%(event_ids)s::bigint[] IS NULL OR event_id = ANY (%(event_ids)s::bigint[]))
ORDER BY event_id LIMIT 1
FOR UPDATE SKIP LOCKED
"""

DEAD_LETTER_REPLAYED = """
UPDATE pubsub_dead_letters SET replayed_at = now()
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s AND event_id = %(event_id)s
"""

DEAD_LETTER_FAILED_AGAIN = """
UPDATE pubsub_dead_letters
SET attempts = attempts + 1, last_failed_at = now(), error = %(error)s, traceback = %(traceback)s
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s AND event_id = %(event_id)s
"""

# -- producing ----------------------------------------------------------------------------------

EVENTS_TABLE = """
SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass('pubsub_events')
"""

PUBLISH = SQL("""
INSERT INTO {events} (branch_id, topic, op, key, payload)
VALUES (%(branch_id)s, %(topic)s, 'publish', %(key)s::jsonb, %(payload)s::jsonb)
RETURNING id
""")

# What a backfill would read: the table %(table)s names (a name Postgres parses, found in the catalog), whether it
# lives in a schema of cmb (this deployment's, %(schema)s, or another's: a schema holding cmb's migrations and
# stream) or of the system, and whether the current role may read it.
BACKFILL_SOURCE = """
SELECT n.nspname, c.relname, c.relkind,
       n.nspname IN (%(schema)s, 'information_schema') OR n.nspname LIKE 'pg\\_%%'
           OR (SELECT count(*) FROM pg_class k
               WHERE k.relnamespace = n.oid AND k.relname IN ('schema_migrations', 'pubsub_events')) = 2,
       has_table_privilege(c.oid, 'SELECT')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(table)s)
"""

TABLE_INFO = """
SELECT n.nspname, c.relname, c.relkind
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(table)s)
"""

TABLE_COLUMNS = """
SELECT attname FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped
ORDER BY attnum
"""

PRIMARY_KEY_COLUMNS = """
SELECT a.attname FROM pg_index i
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
WHERE i.indrelid = to_regclass(%(table)s) AND i.indisprimary
ORDER BY array_position(i.indkey::int2[], a.attnum)
"""

# Compiles the branch expression against the table without reading a row.
CHECK_BRANCH = SQL(
    "SELECT ({branch})::bigint FROM {table} AS captured_row, (SELECT 'INSERT'::text AS tg_op) AS tg LIMIT 0"
)

# One statement-level trigger function per captured table; its triggers pass the transition table
# as ``changed_rows``. The explicit lock on the events table comes before reading the clock, so that
# `pubsub reset` (which locks the events table first) never races a producer's txid.
CAPTURE_FUNCTION = SQL("""
CREATE OR REPLACE FUNCTION {cmb}.{function}() RETURNS trigger
LANGUAGE plpgsql SET search_path = {table_schema}, public AS $body$
#variable_conflict use_column
DECLARE
    cmb_txid xid8;
BEGIN
    LOCK TABLE {cmb}.pubsub_events IN ROW EXCLUSIVE MODE;
    cmb_txid := {cmb}.pubsub_txid();
    INSERT INTO {cmb}.pubsub_events (txid, branch_id, topic, op, key, payload)
    SELECT cmb_txid, captured.branch_id, {topic}, lower(TG_OP), captured.key, captured.payload
    FROM (SELECT ({branch})::bigint AS branch_id, {key} AS key, {payload} AS payload
          FROM changed_rows AS captured_row) AS captured
    WHERE captured.branch_id IS NOT NULL;
    RETURN NULL;
END
$body$
""")

CAPTURE_TRIGGER = SQL("""
CREATE TRIGGER {trigger} AFTER {op} ON {table}
REFERENCING {transition} TABLE AS changed_rows
FOR EACH STATEMENT EXECUTE FUNCTION {cmb}.{function}()
""")

DROP_TRIGGER = SQL("DROP TRIGGER IF EXISTS {trigger} ON {table}")

DROP_CAPTURE_FUNCTION = SQL("DROP FUNCTION IF EXISTS {cmb}.{function}()")

# -- operations ---------------------------------------------------------------------------------

# Per watermark: events committed now and not yet delivered, and the age of the oldest of them; how long they have
# waited while nobody held the consumer's lease (its partition is ``consumer@branch``; a released lease expired
# at -infinity).
LAG = """
SELECT w.consumer_id, w.branch_id, w.delivered, w.handler, w.updated_at, behind.events, behind.seconds,
       w.failing_event, w.attempts, w.last_error, w.notice, w.topics, w.filter, w.last_rewind,
       (SELECT count(*) FROM pubsub_dead_letters d
        WHERE d.consumer_id = w.consumer_id AND d.branch_id = w.branch_id AND d.replayed_at IS NULL) AS parked,
       CASE WHEN behind.events = 0 OR lease.expires_at > now() THEN 0
            ELSE least(behind.seconds, coalesce(extract(epoch FROM now() - nullif(lease.expires_at, '-infinity')),
                                                behind.seconds))::float8
       END AS unserved_seconds
FROM pubsub_watermarks w
LEFT JOIN leases lease ON lease.kind = %(lease_kind)s AND lease.partition = w.consumer_id || '@' || w.branch_id,
pubsub_snapshot() AS now,
LATERAL (
    SELECT count(*) AS events,
           coalesce(extract(epoch FROM clock_timestamp() - min(e.created_at)), 0)::float8 AS seconds
    FROM pubsub_events e
    WHERE e.branch_id = w.branch_id
      AND e.txid >= pg_snapshot_xmin(w.snapshot)
      AND pg_visible_in_snapshot(e.txid, now)
      AND NOT pg_visible_in_snapshot(e.txid, w.snapshot)
      AND NOT (w.target IS NOT NULL AND pg_visible_in_snapshot(e.txid, w.target)
               AND (e.txid, e.id) <= (w.txid, w.event_id))
) AS behind
WHERE (%(consumer_id)s::text IS NULL OR w.consumer_id = %(consumer_id)s)
  AND (%(branch_id)s::bigint IS NULL OR w.branch_id = %(branch_id)s)
ORDER BY w.consumer_id, w.branch_id
"""

# Consumers keep their watermark rows while trim decides; a consumer registered meanwhile waits.
LOCK_WATERMARKS_FOR_TRIM = "LOCK TABLE pubsub_watermarks IN SHARE MODE"

# Deletes up to %(limit)s events per branch that every consumer of that branch has delivered (their
# txid shows committed in each consumer's delivered snapshot, so it is below the smallest xmax) and
# that are older than %(retain)s; counts them per branch in pubsub_trimmed; returns how many.
TRIM = """
WITH branches AS (
    SELECT branch_id, array_agg(snapshot) AS snapshots, min(pg_snapshot_xmax(snapshot)) AS xmax
    FROM pubsub_watermarks GROUP BY branch_id
), doomed AS (
    SELECT d.branch_id, d.txid, d.id FROM branches b
    CROSS JOIN LATERAL (
        SELECT e.branch_id, e.txid, e.id FROM pubsub_events e
        WHERE e.branch_id = b.branch_id AND e.txid < b.xmax
          AND e.created_at < now() - %(retain)s::interval
          AND NOT EXISTS (SELECT 1 FROM unnest(b.snapshots) AS s WHERE NOT pg_visible_in_snapshot(e.txid, s))
        ORDER BY e.txid, e.id LIMIT %(limit)s
    ) AS d
), gone AS (
    DELETE FROM pubsub_events e USING doomed d
    WHERE e.branch_id = d.branch_id AND e.txid = d.txid AND e.id = d.id
    RETURNING e.branch_id, e.txid, e.created_at
), counted AS (
    SELECT branch_id, count(*) AS events, max(txid) AS last_txid, max(created_at) AS last_created_at
    FROM gone GROUP BY branch_id
), recorded AS (
    INSERT INTO pubsub_trimmed AS t (branch_id, events, last_txid, last_created_at)
    SELECT branch_id, events, last_txid, last_created_at FROM counted
    ON CONFLICT (branch_id) DO UPDATE
    SET events = t.events + EXCLUDED.events, last_txid = greatest(t.last_txid, EXCLUDED.last_txid),
        last_created_at = greatest(t.last_created_at, EXCLUDED.last_created_at), last_trim_at = now()
)
SELECT coalesce(sum(events), 0)::bigint FROM counted
"""

# `pubsub reset`: wait out every transaction writing events and stop the clock. If the stream's txids
# come from another cluster (other system identifier, or stored values ahead of the current txid),
# raise the shift so every txid from now on sorts after every stored txid and snapshot.
RESET_LOCKS = (
    "LOCK TABLE pubsub_events IN SHARE ROW EXCLUSIVE MODE",
    "LOCK TABLE pubsub_clock IN ACCESS EXCLUSIVE MODE",
    "LOCK TABLE pubsub_watermarks IN SHARE MODE",
)

RESET = """
WITH stored AS (
    SELECT greatest(
        (SELECT max(txid)::text::numeric + 1 FROM pubsub_events),
        (SELECT max(greatest(pg_snapshot_xmax(snapshot), coalesce(pg_snapshot_xmax(target), '0'))::text::numeric)
         FROM pubsub_watermarks),
        0
    ) AS above
), raw AS (
    SELECT pg_snapshot_xmin(s)::text::numeric AS xmin, pg_snapshot_xmax(s)::text::numeric AS xmax
    FROM pg_current_snapshot() AS s
), clock AS (
    SELECT shift, system_identifier <> (SELECT system_identifier FROM pg_control_system()) AS moved
    FROM pubsub_clock
)
UPDATE pubsub_clock c
SET shift = CASE WHEN clock.moved OR stored.above > raw.xmax + clock.shift
                 THEN greatest(clock.shift, greatest(stored.above, raw.xmax + clock.shift) - raw.xmin)
                 ELSE clock.shift END::bigint,
    system_identifier = (SELECT system_identifier FROM pg_control_system()),
    reset_at = now()
FROM stored, raw, clock
RETURNING clock.shift, c.shift
"""

# -- rewinding -----------------------------------------------------------------------------------

REWIND_POINT_BY_ID = """
SELECT e.id, e.txid::text, e.created_at FROM pubsub_events e WHERE e.branch_id = %(branch_id)s AND e.id = %(event_id)s
"""

# The first event in the stream's (txid, id) order among those of the branch created at or after %(at)s.
REWIND_POINT_BY_TIME = """
SELECT e.id, e.txid::text, e.created_at FROM pubsub_events e
WHERE e.branch_id = %(branch_id)s AND e.created_at >= %(at)s
ORDER BY e.txid, e.id LIMIT 1
"""

NOW = "SELECT now()"

TRIMMED = "SELECT last_txid::text, last_created_at FROM pubsub_trimmed WHERE branch_id = %(branch_id)s"

REWIND_WATERMARK = """
UPDATE pubsub_watermarks
SET snapshot = %(snapshot)s::pg_snapshot, target = %(target)s::pg_snapshot, txid = %(txid)s::xid8,
    event_id = %(event_id)s, updated_at = now(), rewound_at = now(), last_rewind = %(description)s,
    failing_event = NULL, attempts = 0, crashes = 0, first_failed_at = NULL, last_failed_at = NULL, last_error = NULL
WHERE consumer_id = %(consumer_id)s AND branch_id = %(branch_id)s
"""

# -- backfilling ---------------------------------------------------------------------------------

# Starts a backfill, or finds the one of the same table, branch, topic and filter: an unfinished one resumes (with
# the new batch size), a done one stays done unless %(again)s, which starts it over. Returns its id and state.
START_BACKFILL = """
WITH asked AS (
    INSERT INTO pubsub_backfills (table_name, branch_id, topic, predicate, batch_size, key_columns)
    VALUES (%(table)s, %(branch_id)s, %(topic)s, %(predicate)s, %(batch_size)s, %(key_columns)s)
    ON CONFLICT (table_name, branch_id, topic, md5(coalesce(predicate, ''))) DO UPDATE
    SET batch_size = EXCLUDED.batch_size, state = 'running', error = NULL, updated_at = now(),
        key_columns = CASE WHEN pubsub_backfills.state = 'done' THEN EXCLUDED.key_columns
                           ELSE pubsub_backfills.key_columns END,
        last_key = CASE WHEN pubsub_backfills.state = 'done' THEN NULL ELSE pubsub_backfills.last_key END,
        rows_done = CASE WHEN pubsub_backfills.state = 'done' THEN 0 ELSE pubsub_backfills.rows_done END,
        batches = CASE WHEN pubsub_backfills.state = 'done' THEN 0 ELSE pubsub_backfills.batches END,
        rows_skipped = CASE WHEN pubsub_backfills.state = 'done' THEN 0 ELSE pubsub_backfills.rows_skipped END,
        last_skip = CASE WHEN pubsub_backfills.state = 'done' THEN NULL ELSE pubsub_backfills.last_skip END,
        started_at = CASE WHEN pubsub_backfills.state = 'done' THEN now() ELSE pubsub_backfills.started_at END,
        finished_at = NULL
    WHERE pubsub_backfills.state <> 'done' OR %(again)s
    RETURNING id, state
)
SELECT id, state FROM asked
UNION ALL
SELECT id, state FROM pubsub_backfills
WHERE table_name = %(table)s AND branch_id = %(branch_id)s AND topic = %(topic)s
  AND predicate IS NOT DISTINCT FROM %(predicate)s AND NOT EXISTS (SELECT 1 FROM asked)
"""

LOCK_BACKFILL = "SELECT last_key, state FROM pubsub_backfills WHERE id = %(id)s FOR UPDATE"

LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %(timeout)s, true)"

# One batch: the next %(limit)s rows after the last key (its columns from %(last_key)s, a JSON object of the
# key), locked FOR SHARE, each written as a snapshot event (the event's id, drawn after the row lock is
# held, is its version: docs/pubsub.md, "Backfill"); returns how many and the key of the last one.
# {table}, {after} and the key expressions are identifiers the catalog named; {after} is TRUE on the first batch,
# else the row comparison of the key columns with those of `last` (InitPlans: the primary key's index serves it).
# %(where)s is the backfill's filter (an SQL/JSON path predicate over the row, evaluated silently) or NULL.
_LAST_KEY = "last AS MATERIALIZED (SELECT * FROM jsonb_populate_record(NULL::{table}, %(last_key)s::jsonb))"
_ROW_FILTER = "filter AS MATERIALIZED (SELECT %(where)s::jsonpath AS path)"
_NO_VARIABLES = "'{{}}'"  # (braces doubled: the statement is formatted with identifiers)
_ROW_MATCHES = f"""(%(where)s::text IS NULL
          OR jsonb_path_match_tz(to_jsonb(r), (SELECT path FROM filter), {_NO_VARIABLES}, true))"""
_ROW_FILTER_ERROR = f"pubsub_filter_error(to_jsonb(r), (SELECT path FROM filter), {_NO_VARIABLES})"
_WRITE_SNAPSHOTS = """written AS (
    INSERT INTO pubsub_events (branch_id, topic, op, key, payload)
    SELECT %(branch_id)s, %(topic)s, 'snapshot', {key_object}, to_jsonb(cmb_row) FROM locked
    RETURNING 1
)"""

BACKFILL_BATCH = SQL(f"""
WITH {_LAST_KEY}, {_ROW_FILTER}, locked AS MATERIALIZED (
    SELECT r AS cmb_row FROM {{table}} AS r
    WHERE {{after}} AND {_ROW_MATCHES}
    ORDER BY {{key_order}} LIMIT %(limit)s
    FOR SHARE OF r
), {_WRITE_SNAPSHOTS}
SELECT (SELECT count(*) FROM written),
       (SELECT {{key_object}} FROM locked ORDER BY {{last_order}} LIMIT 1),
       0, NULL::text, (SELECT count(*) FROM locked) < %(limit)s
""")

# A batch on which the filter raised anyway: the next %(limit)s rows after the last key are judged one by one
# (pubsub_filter_error); those it matches are locked and written as above (judged again on the version the lock
# reads), those it raised on are passed over and counted, with the last one's key and error. The batch ends at
# the last row judged, matched or not.
BACKFILL_JUDGED_BATCH = SQL(f"""
WITH {_LAST_KEY}, {_ROW_FILTER}, judged AS MATERIALIZED (
    SELECT r AS cmb_row, {_ROW_FILTER_ERROR} AS cmb_error
    FROM {{table}} AS r
    WHERE {{after}}
    ORDER BY {{key_order}} LIMIT %(limit)s
), locked AS MATERIALIZED (
    SELECT r AS cmb_row FROM {{table}} AS r
    WHERE ({{key_order}}) IN (SELECT {{judged_key}} FROM judged WHERE cmb_error IS NULL)
      AND CASE WHEN {_ROW_FILTER_ERROR} IS NULL THEN {_ROW_MATCHES} END  -- CASE: judged first, whatever the costs
    FOR SHARE OF r
), {_WRITE_SNAPSHOTS}
SELECT (SELECT count(*) FROM written),
       (SELECT {{key_object}} FROM judged ORDER BY {{last_order}} LIMIT 1),
       (SELECT count(*) FROM judged WHERE cmb_error IS NOT NULL),
       (SELECT format('key %%s: %%s', {{key_object}}, cmb_error) FROM judged WHERE cmb_error IS NOT NULL
        ORDER BY {{last_order}} LIMIT 1),
       (SELECT count(*) FROM judged) < %(limit)s
""")

BACKFILL_PROGRESS = """
UPDATE pubsub_backfills
SET last_key = coalesce(%(last_key)s::jsonb, last_key), rows_done = rows_done + %(rows)s, batches = batches + 1,
    rows_skipped = rows_skipped + %(skipped)s, last_skip = coalesce(%(skip)s, last_skip),
    updated_at = now(),
    state = CASE WHEN %(finished)s THEN 'done' ELSE 'running' END,
    finished_at = CASE WHEN %(finished)s THEN now() END
WHERE id = %(id)s
"""

BACKFILL_FAILED = """
UPDATE pubsub_backfills SET state = 'failed', error = %(error)s, updated_at = now()
WHERE id = %(id)s AND state <> 'done'
"""

BACKFILLS = """
SELECT id, table_name, branch_id, topic, predicate, batch_size, key_columns, last_key, rows_done, batches,
       rows_skipped, last_skip, state, error, started_at, updated_at, finished_at
FROM pubsub_backfills
WHERE (%(id)s::bigint IS NULL OR id = %(id)s) AND (%(all)s OR state <> 'done' OR finished_at > now() - interval '1 day')
ORDER BY id DESC LIMIT %(limit)s
"""
