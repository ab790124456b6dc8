-- Pub/sub on the bad day (issue 34): rewinding a consumer, backfilling a table's existing rows as
-- 'snapshot' events, and consumers that read a subset of a branch (topics, a predicate on the event).

ALTER TABLE pubsub_events DROP CONSTRAINT pubsub_events_op_check;
ALTER TABLE pubsub_events ADD CONSTRAINT pubsub_events_op_check
    CHECK (op IN ('insert', 'update', 'delete', 'publish', 'snapshot'));

-- What a consumer registered to read (NULL: everything), and its last rewind (one line: who, when, from, to).
ALTER TABLE pubsub_watermarks
    ADD COLUMN topics      text[],
    ADD COLUMN filter      text,
    ADD COLUMN rewound_at  timestamptz,
    ADD COLUMN last_rewind text;

-- The newest created_at among the events trim deleted: a rewind to a time before it is refused.
ALTER TABLE pubsub_trimmed ADD COLUMN last_created_at timestamptz;

-- Backfills: a table's existing rows published into a branch, batch after batch in primary key order. Each
-- batch writes its events and moves last_key in one transaction, holding this row locked: a run killed
-- mid-batch leaves nothing of that batch, and the same call resumes after last_key.
CREATE TABLE pubsub_backfills (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    table_name  text        NOT NULL,                 -- 'schema.table'
    branch_id   bigint      NOT NULL,
    topic       text        NOT NULL,
    predicate   text,                                 -- the rows' filter (SQL over the table's columns), or NULL
    batch_size  integer     NOT NULL CHECK (batch_size BETWEEN 1 AND 100000),
    key_columns text[]      NOT NULL,                 -- the primary key, in index order
    last_key    jsonb,                                -- the key of the last row published (NULL: none yet)
    rows_done   bigint      NOT NULL DEFAULT 0,
    batches     bigint      NOT NULL DEFAULT 0,
    state       text        NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'failed', 'done')),
    error       text,
    started_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
-- One unfinished backfill per table, branch, topic and predicate: calling backfill again resumes it.
CREATE UNIQUE INDEX pubsub_backfills_unfinished
    ON pubsub_backfills (table_name, branch_id, topic, md5(coalesce(predicate, '')))
    WHERE state <> 'done';
