-- Stage scheduler (seed 001): entities, per-stage private state, per-stage queues with timers,
-- the change path, limits and counters. Tables are prefixed stage_ (the cmb schema is shared).

-- One row: the shard count and the pub/sub branches of the engine. Every writer that places a row in
-- a shard locks it FOR KEY SHARE; changing the shard count locks it FOR UPDATE and re-shards.
CREATE TABLE stage_settings (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    shard_count     integer NOT NULL DEFAULT 8 CHECK (shard_count BETWEEN 1 AND 4096),
    capture_branch  bigint  NOT NULL DEFAULT 1200001,   -- writes that bypass the API (pub/sub capture)
    results_branch  bigint  NOT NULL DEFAULT 1200002,   -- post-save publication of entity + state
    updated_at      timestamptz NOT NULL DEFAULT now()
);
INSERT INTO stage_settings DEFAULT VALUES;

-- Stable across processes and Python versions: the first 32 bits of md5(entity_id), as Python's
-- int(hashlib.md5(id.encode()).hexdigest()[:8], 16).
CREATE FUNCTION stage_hash(entity_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ('x' || substr(md5(entity_id), 1, 8))::bit(32)::bigint;

CREATE TABLE stage_entities (
    entity_id  text        PRIMARY KEY CHECK (length(entity_id) BETWEEN 1 AND 256),
    version    bigint      NOT NULL DEFAULT 1,
    payload    jsonb       NOT NULL CHECK (jsonb_typeof(payload) = 'object'),
    updated_at timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 80);

-- A plain SQL UPDATE that changes the payload but not the version still bumps it, so the optimistic
-- check of a stage in flight sees it.
CREATE FUNCTION stage_entities_bump() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF NEW.version = OLD.version AND NEW.payload IS DISTINCT FROM OLD.payload THEN
        NEW.version := OLD.version + 1;
        NEW.updated_at := now();
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER stage_entities_bump BEFORE UPDATE ON stage_entities
FOR EACH ROW EXECUTE FUNCTION stage_entities_bump();

-- A stage's private state beside the entity; version counts state changes (compare-and-set API).
-- runs / window_start: process calls in the current re-trigger window (the cap of seed's
-- "combinatorial explosion").
CREATE TABLE stage_states (
    entity_id    text        NOT NULL,
    stage        text        NOT NULL,
    state        jsonb,
    version      bigint      NOT NULL DEFAULT 0,
    runs         integer     NOT NULL DEFAULT 0,
    window_start timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (entity_id, stage)
) WITH (fillfactor = 80);

-- The seed's queue and queue_inverted as one table with two indexes: the primary key is
-- queue_inverted (an entity at most once per stage), stage_queue_due is queue. lane 0 is the main
-- queue, lane 1 the low-priority (rescan) queue. A timer is an entry with a future due_at.
CREATE TABLE stage_queue (
    entity_id   text        NOT NULL,
    stage       text        NOT NULL,
    shard_id    integer     NOT NULL,
    lane        smallint    NOT NULL DEFAULT 0 CHECK (lane IN (0, 1)),
    due_at      timestamptz NOT NULL,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,      -- failed process calls
    conflicts   integer     NOT NULL DEFAULT 0,      -- optimistic-check retries
    last_error  text,
    parked_at   timestamptz,                         -- set after max attempts; retried by hand
    PRIMARY KEY (entity_id, stage)
) WITH (fillfactor = 70);
CREATE INDEX stage_queue_due ON stage_queue (shard_id, stage, lane, due_at) WHERE parked_at IS NULL;
CREATE INDEX stage_queue_parked ON stage_queue (stage) WHERE parked_at IS NOT NULL;

-- The change path: entities written through the API (or captured from plain SQL) whose stages have
-- not yet been asked should_process. fields: top-level payload keys that changed (NULL: unknown/all).
CREATE TABLE stage_changes (
    entity_id  text        PRIMARY KEY,
    shard_id   integer     NOT NULL,
    fields     text[],
    changed_at timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 70);
CREATE INDEX stage_changes_shard ON stage_changes (shard_id, changed_at);

-- No foreign keys to stage_entities (a per-row check on every queue, state and change write): deleting
-- entities (through the API or plain SQL) removes their states, queue entries and changes here, once
-- per statement; the engine also drops entries whose entity has gone.
CREATE FUNCTION stage_entities_deleted() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM stage_states s USING deleted_rows d WHERE s.entity_id = d.entity_id;
    DELETE FROM stage_queue q USING deleted_rows d WHERE q.entity_id = d.entity_id;
    DELETE FROM stage_changes c USING deleted_rows d WHERE c.entity_id = d.entity_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER stage_entities_deleted AFTER DELETE ON stage_entities
REFERENCING OLD TABLE AS deleted_rows FOR EACH STATEMENT EXECUTE FUNCTION stage_entities_deleted();

-- Token buckets of stages with a rate limit, shared by every worker.
CREATE TABLE stage_rate_limits (
    stage       text        PRIMARY KEY,
    tokens      float8      NOT NULL,
    refilled_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Counters per stage and shard (one row per writer shard: no hot row between workers).
CREATE TABLE stage_counters (
    stage           text    NOT NULL,
    shard_id        integer NOT NULL,
    processed       bigint  NOT NULL DEFAULT 0,
    changed         bigint  NOT NULL DEFAULT 0,
    conflicts       bigint  NOT NULL DEFAULT 0,
    errors          bigint  NOT NULL DEFAULT 0,
    parked          bigint  NOT NULL DEFAULT 0,
    capped          bigint  NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stage, shard_id)
);
