-- Event queue flow control: keys, priorities and fair turns.
-- * eventqueue_handlers.key_path: where an event's key is read at emit ({value,account}: value->>'account';
--   {namespace}, {module}, {modifier}); NULL: every event of the handler has the key ''.
-- * eventqueue_events.priority: higher first. turn: the event's place among the ready events of its priority,
--   given round-robin over keys (each key's events take turns after that key's events already ready, no
--   earlier than the head); NULL while the event waits (delayed, retried later, claimed, held). A claim
--   stages the waiting events that came due, then reads the ready ones in (priority, turn) order.
-- * eventqueue_events.flow_slot: the concurrency slot its claim holds (flow_slots), NULL without one.
ALTER TABLE eventqueue_handlers ADD COLUMN key_path text[];
ALTER TABLE eventqueue_events ADD COLUMN flow_key text NOT NULL DEFAULT '';
ALTER TABLE eventqueue_events ADD COLUMN priority smallint NOT NULL DEFAULT 0;
ALTER TABLE eventqueue_events ADD COLUMN turn bigint;
ALTER TABLE eventqueue_events ADD COLUMN flow_slot integer;
ALTER TABLE eventqueue_dead ADD COLUMN priority smallint NOT NULL DEFAULT 0;

DROP INDEX eventqueue_events_visible;
CREATE INDEX eventqueue_events_ready ON eventqueue_events (priority DESC, turn, id) WHERE turn IS NOT NULL;
CREATE INDEX eventqueue_events_waiting ON eventqueue_events (visible_at) WHERE turn IS NULL;
CREATE INDEX eventqueue_events_key_turn ON eventqueue_events (handler, flow_key, turn) WHERE turn IS NOT NULL;

-- Debounce: the events of a debounced handler's key that come within its window are one row, a batch: value holds
-- the member events in order ({id, namespace, module, modifier, value, enqueued_at}), batch_count how many. An
-- emit joins the newest open batch of its key (unclaimed, never failed) and moves its due time to debounce after
-- now, no later than max_wait after the batch began; a batch holds at most max_batch events.
ALTER TABLE eventqueue_handlers ADD COLUMN debounce_seconds float8 CHECK (debounce_seconds > 0);
ALTER TABLE eventqueue_handlers ADD COLUMN max_wait_seconds float8 CHECK (max_wait_seconds > 0);
ALTER TABLE eventqueue_handlers ADD COLUMN max_batch integer CHECK (max_batch > 0);
ALTER TABLE eventqueue_events ADD COLUMN batch_count integer;
ALTER TABLE eventqueue_dead ADD COLUMN batch_count integer;
CREATE INDEX eventqueue_events_open_batch ON eventqueue_events (handler, flow_key, id)
    WHERE batch_count IS NOT NULL AND locked_at IS NULL;
