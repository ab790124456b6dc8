-- When a waiting task's explanation (its blocking trigger) was last shown in the scheduler's tick log: shown on
-- every tick where it changed, reminded at most once an hour otherwise.
ALTER TABLE reactive_tasks ADD COLUMN shown_at timestamptz;
-- When the launch's reason and CTL values were written into its run's log (by the run's executor before its
-- first step, or by the scheduler when it first sees the run): written once.
ALTER TABLE reactive_launches ADD COLUMN logged_at timestamptz;
