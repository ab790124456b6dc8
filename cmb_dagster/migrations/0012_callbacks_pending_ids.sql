-- Callbacks poller, query 2: a bucket's pending events in event_id order, so that reading the ids above the
-- seen horizon starts there instead of walking every entry below the cursor (called events leave theirs until
-- vacuum).
CREATE INDEX callback_events_pending_ids ON callback_events (bucket_id, event_id) WHERE status = 'pending';
