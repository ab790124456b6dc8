-- Time-driven evaluation, deadlines and the scheduler's tick figures:
-- * reactive_tasks.wake_at: when time alone can make the task launch (a Settle's quiet time ends, a deadline
--   with on_deadline='run' passes); each tick marks the tasks whose wake_at came, for evaluation.
-- * reactive_tasks.deadline: the task's deadline as defined in code (JSON, with on_deadline; NULL: none), and
--   deadline_since, when it was defined that way: deadlines before it are not enforced.
-- * reactive_schedulers.tick_seconds: how long the scheduler's last tick took (ticked_at: when it started).
ALTER TABLE reactive_tasks ADD COLUMN wake_at timestamptz;
ALTER TABLE reactive_tasks ADD COLUMN deadline jsonb;
ALTER TABLE reactive_tasks ADD COLUMN deadline_since timestamptz;
ALTER TABLE reactive_schedulers ADD COLUMN tick_seconds double precision;
CREATE INDEX reactive_tasks_wake ON reactive_tasks (scheduler, wake_at) WHERE wake_at IS NOT NULL;
