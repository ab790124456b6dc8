-- Runs of a reactive task's user code (partition, run config, tags) that began and never ended: counted
-- before the code runs, cleared when it ends; a task at max_crashes is not run again until retried.
ALTER TABLE reactive_tasks ADD COLUMN crashes smallint NOT NULL DEFAULT 0;
