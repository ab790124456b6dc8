-- The event queue's status counts an event a rule holds as held also before a worker parked it: the handler index
-- also carries each event's namespace and module (what a rule names), so the status is read from it alone.
DROP INDEX eventqueue_events_handler;
CREATE INDEX eventqueue_events_handler ON eventqueue_events (handler, visible_at)
    INCLUDE (locked_at, delay_until, enqueued_at, namespace, module);
