-- Runs the engines ask Dagster for: a worker stores a request, the code location's launch sensor of that job
-- turns it into a RunRequest with its run key (Dagster starts one run per key) and deletes it on its next tick.
CREATE TABLE run_requests (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    location text NOT NULL,
    sensor text NOT NULL,
    run_key text NOT NULL,
    run_config jsonb NOT NULL,
    tags jsonb NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (location, sensor, run_key)
);
CREATE INDEX run_requests_by_sensor ON run_requests (location, sensor, id);
