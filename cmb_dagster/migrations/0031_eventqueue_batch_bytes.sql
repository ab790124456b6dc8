-- A debounced batch is capped on the size its handler receives: eventqueue_events.batch_bytes is the length of the
-- batch's JSON text (as the worker reads it), kept as events join so that an emit compares it with its own events'
-- size without reading the batch. NULL for an event that is not a batch.
ALTER TABLE eventqueue_events ADD COLUMN batch_bytes bigint;
UPDATE eventqueue_events SET batch_bytes = octet_length(value::text) WHERE batch_count IS NOT NULL;
