-- The last turn of a (handler, key, priority), read for each key of an emit or a staging, is the first row of one
-- range of this index: an exact match the planner prefers at any table size, with or without statistics (with the
-- priority outside the index, a large queue without statistics got a bitmap scan and a sort of the key's events).
DROP INDEX eventqueue_events_key_turn;
CREATE INDEX eventqueue_events_key_turn ON eventqueue_events (handler, flow_key, priority, turn) WHERE turn IS NOT NULL;
