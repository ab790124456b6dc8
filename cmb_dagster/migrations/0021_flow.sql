-- Flow control shared by the engines (cmb_dagster/flow.py): limits per scope (an event queue handler, a stage,
-- a callback destination), and per key within a scope a token bucket and concurrency slots.
-- * flow_limits: what an engine registered for a scope; rate in tokens per second, burst the bucket's size.
-- * flow_buckets: a key's tokens as of refilled_at (refilled at the scope's rate up to its burst when read);
--   empty_until: when a bucket left below one token has one again (a claim passes over the keys still empty).
-- * flow_slots: slot 0..concurrency-1 of a key; a slot is in use while expires_at is in the future. The commit
--   that finishes the item frees it; a dead holder's slot frees itself when expires_at passes.
CREATE TABLE flow_limits (
    scope       text        PRIMARY KEY,
    rate        float8      CHECK (rate > 0),
    burst       float8      CHECK (burst >= 1),
    concurrency integer     CHECK (concurrency > 0),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CHECK ((rate IS NULL) = (burst IS NULL))
);

CREATE TABLE flow_buckets (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    tokens      float8      NOT NULL,
    refilled_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    empty_until timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (scope, key)
);
CREATE INDEX flow_buckets_empty ON flow_buckets (empty_until);

CREATE TABLE flow_slots (
    scope      text        NOT NULL,
    key        text        NOT NULL,
    slot       integer     NOT NULL CHECK (slot >= 0),
    item       text,
    taken_at   timestamptz,
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (scope, key, slot)
);
CREATE INDEX flow_slots_taken ON flow_slots (scope, key) WHERE item IS NOT NULL;
