-- Callbacks (CallMeBack): delayed HTTP / Dagster callbacks with buckets, retries, schedules and cleanup.
-- Tables are prefixed callback_ because the cmb schema is shared with other engines.

-- A bucket is served by one worker at a time (lease kind 'callbacks.bucket'); its poller watermark lives
-- here so a worker that takes a bucket over continues where the previous one stopped.
CREATE TABLE callback_buckets (
    bucket_id    integer     PRIMARY KEY CHECK (bucket_id >= 0),
    max_run_at   timestamptz NOT NULL DEFAULT '1970-01-01 00:00:00+00',  -- query 1 cursor: (max_run_at, cursor_event_id)
    cursor_event_id bigint   NOT NULL DEFAULT 0,
    max_event_id bigint      NOT NULL DEFAULT 0,            -- query 2: every event id <= this was seen
    created_at   timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 200);

INSERT INTO callback_buckets (bucket_id) SELECT generate_series(0, 3);

CREATE TABLE callback_schedules (
    schedule_id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner_client_id    text        NOT NULL,
    group_key          text        NOT NULL,
    schedule_key       text        NOT NULL,
    cron               text        NOT NULL,
    timezone           text        NOT NULL,
    cb_url             text        NOT NULL,
    context            jsonb,
    retry              jsonb       NOT NULL,
    horizon_seconds    integer     NOT NULL CHECK (horizon_seconds > 0),
    paused             boolean     NOT NULL DEFAULT false,
    materialized_until timestamptz NOT NULL,                -- fire times up to here have their events
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    UNIQUE (owner_client_id, group_key, schedule_key)
);

CREATE TABLE callback_events (
    event_id          bigint      PRIMARY KEY,              -- from callback_event_ids, under the insert lock
    bucket_id         integer     NOT NULL,
    owner_client_id   text        NOT NULL,
    group_key         text        NOT NULL,
    event_key         text        NOT NULL,
    status            text        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'notified', 'failed', 'cancelled', 'rejected')),
    run_at            timestamptz NOT NULL,                 -- when to call (moves with main retries)
    originally_run_at timestamptz NOT NULL,                 -- when it was meant for (retry expiry counts from it)
    cb_url            text        NOT NULL,
    context           jsonb,
    retry             jsonb       NOT NULL,
    attempts          integer     NOT NULL DEFAULT 0,       -- calls made, fast retries included
    main_retries      integer     NOT NULL DEFAULT 0,       -- reschedules done
    last_error        text,
    schedule_id       bigint      REFERENCES callback_schedules ON DELETE SET NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    UNIQUE (owner_client_id, group_key, event_key)
) WITH (fillfactor = 85, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
        autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);

CREATE SEQUENCE callback_event_ids OWNED BY callback_events.event_id;

-- The poller's index: pending events of a bucket in (run_at, event_id) order.
CREATE INDEX callback_events_pending ON callback_events (bucket_id, run_at, event_id) WHERE status = 'pending';
CREATE INDEX callback_events_finished ON callback_events (run_at) WHERE status <> 'pending';
CREATE INDEX callback_events_schedule ON callback_events (schedule_id) WHERE schedule_id IS NOT NULL;

-- One row per (schedule, fire time): the guard against two events for one fire time.
CREATE TABLE callback_scheduled_events (
    schedule_id bigint      NOT NULL REFERENCES callback_schedules ON DELETE CASCADE,
    fire_at     timestamptz NOT NULL,
    event_id    bigint,                          -- the event created for it
    PRIMARY KEY (schedule_id, fire_at)
);

CREATE TABLE callback_change_log (
    change_id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    action          text        NOT NULL CHECK (action IN ('update', 'cancel', 'delete')),
    event_id        bigint      NOT NULL,
    owner_client_id text        NOT NULL,
    group_key       text        NOT NULL,
    event_key       text        NOT NULL,
    before          jsonb       NOT NULL,
    after           jsonb
);
CREATE INDEX callback_change_log_at ON callback_change_log (at);
CREATE INDEX callback_change_log_key ON callback_change_log (owner_client_id, group_key, event_key);
