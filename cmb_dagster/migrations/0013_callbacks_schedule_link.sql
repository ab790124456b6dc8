-- Callbacks: an event's link to its schedule is kept by the schedule's delete (which clears it under the
-- schedule's row lock, the lock the materializer holds while it creates events) instead of a foreign key,
-- whose check every insert queued once per row, NULL or not.
ALTER TABLE callback_events DROP CONSTRAINT callback_events_schedule_id_fkey;
