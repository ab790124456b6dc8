-- Callbacks observations per bucket set: events finished lately, by finish time, read from the index alone.
CREATE INDEX callback_events_outcomes ON callback_events (finished_at) INCLUDE (bucket_id, status)
    WHERE status <> 'pending';
