-- Pub/sub hardening (issue 11): poison events and their dead letters, retention bookkeeping, commit
-- hints (NOTIFY), and producers refusing to write events into a restored stream until it is reset.

-- The event a consumer's handler keeps failing on (cleared when the watermark moves past it).
ALTER TABLE pubsub_watermarks
    ADD COLUMN failing_event   bigint,
    ADD COLUMN attempts        integer NOT NULL DEFAULT 0,
    ADD COLUMN first_failed_at timestamptz,
    ADD COLUMN last_failed_at  timestamptz,
    ADD COLUMN last_error      text,
    ADD COLUMN notice          text;  -- said once when the consumer registered (e.g. history was trimmed)

-- Events a consumer gave up on after max_attempts: a copy of the event (trim may delete the original),
-- the failure, and when `pubsub replay` handled it.
CREATE TABLE pubsub_dead_letters (
    consumer_id     text        NOT NULL,
    branch_id       bigint      NOT NULL,
    event_id        bigint      NOT NULL,
    txid            xid8        NOT NULL,
    topic           text        NOT NULL,
    op              text        NOT NULL,
    key             jsonb,
    payload         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL,
    error           text        NOT NULL,
    traceback       text,
    attempts        integer     NOT NULL,
    first_failed_at timestamptz NOT NULL,
    last_failed_at  timestamptz NOT NULL,
    parked_at       timestamptz NOT NULL DEFAULT now(),
    replayed_at     timestamptz,
    PRIMARY KEY (consumer_id, branch_id, event_id),
    FOREIGN KEY (consumer_id, branch_id) REFERENCES pubsub_watermarks ON DELETE CASCADE
);

-- Per branch: how many events trim has deleted, so a consumer starting from the beginning is told.
CREATE TABLE pubsub_trimmed (
    branch_id    bigint      PRIMARY KEY,
    events       bigint      NOT NULL,
    last_txid    xid8        NOT NULL,
    last_trim_at timestamptz NOT NULL DEFAULT now()
);

-- Once per statement writing events: refuse if the stream's txids come from another cluster (a
-- pg_dump/pg_restore not yet followed by `cmb-dagster pubsub reset`: such an event would sort below
-- what consumers have passed and never be delivered), then a hint on channel '<schema>.pubsub'.
-- Postgres sends notifications on commit only and folds identical ones: one per transaction.
CREATE FUNCTION pubsub_events_written() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pubsub_clock c, pg_control_system() s WHERE c.system_identifier <> s.system_identifier) THEN
        RAISE EXCEPTION 'cmb pubsub: the stream''s txids come from another Postgres cluster (pg_dump/pg_restore); events are refused until `cmb-dagster pubsub reset` has run'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.pubsub', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER pubsub_events_written AFTER INSERT ON pubsub_events
FOR EACH STATEMENT EXECUTE FUNCTION pubsub_events_written();

-- The same check as 0002's, cheaper on the hot path (consumers run it once per batch): the current
-- txid from pg_current_snapshot() directly; the full pubsub_snapshot() only to word the message.
CREATE OR REPLACE FUNCTION pubsub_restore_problem(stored pg_snapshot) RETURNS text
LANGUAGE sql VOLATILE SET search_path FROM CURRENT SET jit = off
AS $$
    SELECT CASE
        WHEN c.system_identifier <> s.system_identifier THEN
            format('the stream''s txids come from Postgres cluster %s but this is cluster %s',
                   c.system_identifier, s.system_identifier)
        WHEN pg_snapshot_xmax(stored)::text::numeric > pg_snapshot_xmax(pg_current_snapshot())::text::numeric + c.shift THEN
            format('a stored snapshot (%s) is ahead of the current txid (%s)', stored, pubsub_snapshot())
    END
    FROM pubsub_clock c, pg_control_system() s
$$;

-- pubsub_snapshot() as seen by the calling statement: STABLE, so pg_current_snapshot() inside is the
-- statement's own snapshot, not a newer one (a VOLATILE function takes a fresh snapshot per call in
-- READ COMMITTED). A consumer reads its batch and the target snapshot in one statement: the target
-- must not show committed a transaction whose rows that statement cannot see yet.
CREATE FUNCTION pubsub_statement_snapshot() RETURNS pg_snapshot
LANGUAGE sql STABLE SET search_path FROM CURRENT SET jit = off
AS $$
    WITH now AS (
        SELECT pg_current_snapshot() AS snap, pg_current_xact_id_if_assigned() AS me, c.shift
        FROM pubsub_clock c
    ), running AS (
        SELECT x FROM now, pg_snapshot_xip(now.snap) AS x
        UNION
        SELECT me FROM now WHERE me IS NOT NULL AND pg_visible_in_snapshot(me, snap)
    )
    SELECT format('%s:%s:%s',
                  pg_snapshot_xmin(snap)::text::numeric + shift,
                  pg_snapshot_xmax(snap)::text::numeric + shift,
                  (SELECT coalesce(string_agg((x::text::numeric + now.shift)::text, ',' ORDER BY x), '')
                   FROM running))::pg_snapshot
    FROM now
$$;
