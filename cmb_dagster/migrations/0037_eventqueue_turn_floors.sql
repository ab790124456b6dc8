-- Where each priority's ready events begin in turn order, so that emits, stagings and claims read bounded ranges of
-- eventqueue_events_ready and eventqueue_events_key_turn instead of stepping over the entries of every event claimed
-- since the oldest snapshot. ``next`` is the lowest turn ready when a worker last looked (or, none being ready, the
-- event ids' high mark): new turns are never below it. ``floor`` is the ``next`` of the look before (at least a
-- second older): claims read from it, so an event whose transaction was still open at the last look is not passed
-- over. One row per priority in use; a row is written at most once a second.
CREATE TABLE eventqueue_turn_floors (
    priority smallint PRIMARY KEY,
    floor bigint NOT NULL DEFAULT 0,
    next bigint NOT NULL DEFAULT 0,
    shifted_at timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 10);

-- The ready events in claim order (priority descending, then turn), the priority negated so that a claim can start
-- a range at one priority's floor with a row comparison (the planner keeps it an ordered index scan whatever the
-- statistics, where an equality on the priority would be taken to keep 0.5% of the rows and sorted). Turns are never
-- negative; the predicate says ``turn >= 0`` so that only a query saying so reads this index (a key's last turn is
-- read from eventqueue_events_key_turn, whatever the statistics suggest).
DROP INDEX eventqueue_events_ready;
CREATE INDEX eventqueue_events_ready ON eventqueue_events ((-priority::integer), turn, id) WHERE turn >= 0;

-- The waiting events no worker holds (delayed, retried, released) apart from those being run (their lock's expiry):
-- a worker's sleep and each claim's look for waiting events that came due read the first, and do not step over the
-- entries of every event claimed since the oldest snapshot; the lock expiries are looked at every few seconds.
DROP INDEX eventqueue_events_waiting;
CREATE INDEX eventqueue_events_waiting ON eventqueue_events (visible_at) WHERE turn IS NULL AND locked_by IS NULL;
CREATE INDEX eventqueue_events_locks ON eventqueue_events (visible_at) WHERE turn IS NULL AND locked_by IS NOT NULL;
