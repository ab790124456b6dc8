-- Isolation of a bad item (cmb_dagster/isolation.py): crash counters kept before user code runs, leases
-- whose fence is a key column, and the event queue's rule acknowledgements.

-- The fence as a key column: a takeover (which changes it) waits for transactions that checked the lease
-- FOR KEY SHARE, while the holder's own renewals (which change only expires_at) do not.
CREATE UNIQUE INDEX leases_fence ON leases (kind, partition, fence);

-- Runs of an entry that began (claimed by a worker) and never ended; cleared by any orderly end.
ALTER TABLE stage_queue ADD COLUMN crashes smallint NOT NULL DEFAULT 0;

ALTER TABLE eventqueue_events ADD COLUMN crashes smallint NOT NULL DEFAULT 0;
ALTER TABLE eventqueue_handlers
    ADD COLUMN max_crashes integer NOT NULL DEFAULT 3 CHECK (max_crashes >= 1);

-- Per running worker: the newest pause/block rule it applies to every event it starts from now on.
-- pause() and block() wait for every live worker to get there.
CREATE TABLE eventqueue_workers (
    owner      text        PRIMARY KEY,
    rules_seen bigint      NOT NULL DEFAULT 0,
    seen_at    timestamptz NOT NULL DEFAULT now()
);

-- Crashed deliveries of failing_event (counted only when a consumer takes over from a worker that died).
ALTER TABLE pubsub_watermarks ADD COLUMN crashes integer NOT NULL DEFAULT 0;
