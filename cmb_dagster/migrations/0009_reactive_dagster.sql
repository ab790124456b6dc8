-- Reactive tasks that speak Dagster.
-- * reactive_schedulers.location: the code location that syncs a scheduler's tasks (two locations whose names
--   normalise to one scheduler name must not take turns rewriting its tasks); ticked_at: its last tick.
-- * reactive_schedulers.manual_after: how far hand-launched runs tagged cmb/reactive/task were read.
-- * reactive_tasks.partition_key: the partition of the run in flight (kept for a relaunch or a retry).
-- * reactive_launches.partition_key, manual: the audit trail says which partition, and which runs were launched
--   by hand (run_key 'manual:<run id>', so one run is recorded once).
-- * ctl_feeds.identity: the identity of the storage a feed's positions belong to (Dagster's run storage id):
--   a new storage starts again from its beginning.

ALTER TABLE reactive_schedulers ADD COLUMN location text;
ALTER TABLE reactive_schedulers ADD COLUMN ticked_at timestamptz;
ALTER TABLE reactive_schedulers ADD COLUMN manual_after timestamptz;

ALTER TABLE reactive_tasks ADD COLUMN partition_key text;

ALTER TABLE reactive_launches ADD COLUMN partition_key text;
ALTER TABLE reactive_launches ADD COLUMN manual boolean NOT NULL DEFAULT false;

ALTER TABLE ctl_feeds ADD COLUMN identity text;
