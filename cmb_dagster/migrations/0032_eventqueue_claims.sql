-- A claimed event carries the liveness lease of the worker that runs it: locked_by is the lease's partition (the
-- worker's owner name), lock_fence its fence. eventqueue_events_claimed holds only the events being run: it finds
-- the worker running a key's events, and the events of workers whose lease lapsed (they go back to the queue).
ALTER TABLE eventqueue_events ADD COLUMN locked_by text, ADD COLUMN lock_fence bigint;
CREATE INDEX eventqueue_events_claimed ON eventqueue_events (handler, flow_key) WHERE locked_by IS NOT NULL;
