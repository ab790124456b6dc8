-- What a callback's HTTP request carries: the envelope (the event's keys, times, attempt and context), or its
-- context alone (for receivers with a fixed format, e.g. a chat webhook's {"text": ...}).
ALTER TABLE callback_events ADD COLUMN body text NOT NULL DEFAULT 'envelope' CHECK (body IN ('envelope', 'context'));
