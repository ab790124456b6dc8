-- A reactive tick's cost follows what changed, not how many tasks there are:
-- * facts: what a trigger's evaluation read (the trigger's hash, when, the current, last-seen and Settle change
--   times); the explanation is rendered from them when read. reactive_tasks.explanation and reactive_launches.reason
--   keep the text before it (a retry, a partition, a deadline), or the whole text when there are no facts.
-- * reactive_marks.by_hand: marked by an operator's command (retry, forget, set-last); a tick reads these marks
--   each time (index reactive_marks_by_hand), and all marks only when it does not know them.
-- * reactive_tasks_shown: waiting tasks in the order their explanation was last shown, so the hourly reminder
--   reads the tasks that are due, not every waiting task.
-- * reactive_tasks_launched by name too: the runs that finished are found one probe each (by scheduler alone, a
--   planner without statistics scanned every task in flight for each).
ALTER TABLE reactive_tasks ADD COLUMN facts jsonb;
ALTER TABLE reactive_launches ADD COLUMN facts jsonb;
ALTER TABLE reactive_marks ADD COLUMN by_hand boolean NOT NULL DEFAULT false;
CREATE INDEX reactive_marks_by_hand ON reactive_marks (scheduler) WHERE by_hand;
CREATE INDEX reactive_tasks_shown ON reactive_tasks (scheduler, (coalesce(shown_at, '-infinity')), priority DESC, name)
    WHERE status = 'waiting' AND defined;
DROP INDEX reactive_tasks_launched;
CREATE INDEX reactive_tasks_launched ON reactive_tasks (scheduler, name) WHERE status = 'launched';
-- * reactive_mark_batches: the tasks one statement of a tick marks (a batch of CTL changes, the runs that succeeded)
--   as one row, not a row each: the tick deletes it once it evaluated them, marking one by one those it did not get
--   to.
CREATE TABLE reactive_mark_batches (
    scheduler text NOT NULL,
    id bigint GENERATED ALWAYS AS IDENTITY,
    names text[] NOT NULL,
    PRIMARY KEY (scheduler, id)
);
-- * reactive_schedulers.tick_token: written as each tick starts; the next tick of the same process finds its own
--   token there only if no other tick ran in between (then it trusts what it knows of the marks and runs in flight).
ALTER TABLE reactive_schedulers ADD COLUMN tick_token text;
