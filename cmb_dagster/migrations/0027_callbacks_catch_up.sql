-- Catch-up policy of callback schedules: what happens to fire times missed while no worker called them.
-- * catch_up: 'none' skips every missed fire time, 'latest' calls only the most recent one, 'all' calls the
--   catch_up_limit most recent ones.
-- * misfire_grace_seconds: a fire time whose event has not started this long after it counts as missed.
ALTER TABLE callback_schedules
    ADD COLUMN catch_up text NOT NULL DEFAULT 'latest'
        CONSTRAINT callback_schedules_catch_up_check CHECK (catch_up IN ('none', 'latest', 'all')),
    ADD COLUMN catch_up_limit integer NOT NULL DEFAULT 100
        CONSTRAINT callback_schedules_catch_up_limit_check CHECK (catch_up_limit BETWEEN 1 AND 1000),
    ADD COLUMN misfire_grace_seconds integer NOT NULL DEFAULT 60
        CONSTRAINT callback_schedules_misfire_grace_check CHECK (misfire_grace_seconds BETWEEN 1 AND 86400);
