-- Indexes that let the status of the stages, the event queue and pub/sub (the metrics endpoint, the CLI, the Dagster
-- observations) be read per stage or handler from indexes, whatever the statistics, instead of a scan of the queue.
-- Stages: the entries with a failed attempt that are not parked, per stage.
CREATE INDEX stage_queue_failing ON stage_queue (stage) WHERE parked_at IS NULL AND attempts > 0;
-- Event queue: a handler's events by visibility, with what the status counts (index-only once vacuumed).
CREATE INDEX eventqueue_events_handler ON eventqueue_events (handler, visible_at) INCLUDE (locked_at, delay_until, enqueued_at);
-- Pub/sub: a consumer's parked events not replayed yet, counted from the index alone once vacuumed (the lag).
CREATE INDEX pubsub_dead_letters_parked ON pubsub_dead_letters (consumer_id, branch_id) WHERE replayed_at IS NULL;
