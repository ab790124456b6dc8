-- What a reactive task's job writes to CTL: while its run is queued or running, lower-priority tasks
-- wait for the higher-priority tasks that read those parameters. Not part of the trigger: changing it
-- does not evaluate the task again.

ALTER TABLE reactive_tasks ADD COLUMN produces jsonb NOT NULL DEFAULT '[]';  -- [[entity, parameter], ...]
