-- Pub/sub change stream (cmb_dagster.pubsub): the txid clock, the events, the consumers' watermarks.
-- Design notes live in cmb_dagster/pubsub/__init__.py; the queries in cmb_dagster/pubsub/sql.py.

-- Txids as the stream records them: pg_current_xact_id() + shift. The shift is 0 until
-- `cmb-dagster pubsub reset` raises it after a pg_dump/pg_restore into another cluster, so that new
-- txids sort after every restored one and stored snapshots keep their meaning without rewriting events.
CREATE TABLE pubsub_clock (
    singleton         boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    shift             bigint      NOT NULL DEFAULT 0 CHECK (shift >= 0),
    system_identifier bigint,     -- pg_control_system() of the cluster whose txids the stream holds
    reset_at          timestamptz
);
INSERT INTO pubsub_clock (system_identifier) SELECT system_identifier FROM pg_control_system();

-- The producing transaction's txid on the stream's clock.
CREATE FUNCTION pubsub_txid() RETURNS xid8
LANGUAGE sql VOLATILE SET search_path FROM CURRENT SET jit = off  -- planned anew per call: JIT would cost ~200 ms
AS $$ SELECT (pg_current_xact_id()::text::numeric + shift)::text::xid8 FROM pubsub_clock $$;

-- pg_current_snapshot() on the stream's clock, with this transaction's own txid counted as running
-- (Postgres counts it as visible once a later txid has completed), so that events this transaction
-- writes are delivered after it commits rather than taken for already delivered.
CREATE FUNCTION pubsub_snapshot() RETURNS pg_snapshot
LANGUAGE sql VOLATILE SET search_path FROM CURRENT SET jit = off  -- planned anew per call: JIT would cost ~200 ms
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

-- Why txids recorded with `stored` cannot be trusted here (a restore into another cluster), or NULL.
CREATE FUNCTION pubsub_restore_problem(stored pg_snapshot) RETURNS text
LANGUAGE sql VOLATILE SET search_path FROM CURRENT SET jit = off  -- planned anew per call: JIT would cost ~200 ms
AS $$
    SELECT CASE
        WHEN c.system_identifier <> s.system_identifier THEN
            format('the stream''s txids come from Postgres cluster %s but this is cluster %s',
                   c.system_identifier, s.system_identifier)
        WHEN pg_snapshot_xmax(stored) > pg_snapshot_xmax(pubsub_snapshot()) THEN
            format('a stored snapshot (%s) is ahead of the current txid (%s)', stored, pubsub_snapshot())
    END
    FROM pubsub_clock c, pg_control_system() s
$$;

CREATE TABLE pubsub_events (
    id         bigint      GENERATED ALWAYS AS IDENTITY,
    txid       xid8        NOT NULL DEFAULT pubsub_txid(),   -- the producing transaction
    branch_id  bigint      NOT NULL,
    topic      text        NOT NULL,                         -- 'schema.table' for captured rows
    op         text        NOT NULL CHECK (op IN ('insert', 'update', 'delete', 'publish')),
    key        jsonb,                                        -- the row's key columns, for captured rows
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (branch_id, txid, id)                        -- the reading order of a branch
);

CREATE TABLE pubsub_watermarks (
    consumer_id text        NOT NULL CHECK (consumer_id ~ '^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$'),
    branch_id   bigint      NOT NULL,
    snapshot    pg_snapshot NOT NULL DEFAULT '1:1:',  -- every event whose txid it shows committed is delivered
    target      pg_snapshot,                          -- the next snapshot, while its events go out in batches
    txid        xid8        NOT NULL DEFAULT '0',     -- (txid, event_id) of the last event delivered;
    event_id    bigint      NOT NULL DEFAULT 0,       --   while target is set, the position within it
    delivered   bigint      NOT NULL DEFAULT 0,       -- events delivered so far
    handler     text,                                 -- 'module:function', for the CLI and Dagster
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_id, branch_id)
);
