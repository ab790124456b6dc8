-- Priorities of callbacks (flow control: cmb_dagster/flow.py, the callbacks' limits per destination).
-- * callback_events.priority: among events due, higher is called first; those above 0 are read ahead of the
--   due backlog, by callback_events_urgent (one probe per bucket, whatever the statistics).
ALTER TABLE callback_events ADD COLUMN priority smallint NOT NULL DEFAULT 0
    CONSTRAINT callback_events_priority_check CHECK (priority BETWEEN -1000 AND 1000);
CREATE INDEX callback_events_urgent ON callback_events (bucket_id, priority DESC, run_at, event_id)
    WHERE status = 'pending' AND priority > 0;
