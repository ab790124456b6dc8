-- Endpoint health of the callbacks engine: a circuit breaker per (owner, endpoint), written by the workers from the
-- outcomes of calls. An endpoint is an HTTP target without its query: scheme://host[:port]/path.
-- * state: 'closed' (calls go out), 'open' (due events are held; one probe per probe_interval), 'disabled' (open
--   longer than the owner's disable_after, or by an operator: events are kept as 'disabled' until it is enabled).
-- * consecutive_failures, window_*: failed calls in a row, and calls and failures in the current window.
-- * probes, probe_interval, probe_at, probe_event: failed probes since it opened, the wait before the next one, when
--   it may start, and the event sent as the probe (its oldest held event, which the gate alone lets through).
-- * releasing_since: closed with held events still to send back since then (workers release them in batches,
--   oldest first); NULL: none.
-- * disables: how many times it was disabled (each disable notifies once: its hook key carries this number).
CREATE TABLE callback_endpoints (
    endpoint_id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner_client_id      text        NOT NULL,
    endpoint             text        NOT NULL,
    state                text        NOT NULL DEFAULT 'closed' CHECK (state IN ('closed', 'open', 'disabled')),
    consecutive_failures integer     NOT NULL DEFAULT 0,
    window_started_at    timestamptz NOT NULL DEFAULT now(),
    window_calls         integer     NOT NULL DEFAULT 0,
    window_failures      integer     NOT NULL DEFAULT 0,
    last_success_at      timestamptz,
    last_failure_at      timestamptz,
    last_error           text,
    last_status_code     smallint,
    opened_at            timestamptz,
    probes               integer     NOT NULL DEFAULT 0,
    probe_interval       float8,
    probe_at             timestamptz,
    probe_event          bigint,
    disabled_at          timestamptz,
    disabled_by          text,
    disables             integer     NOT NULL DEFAULT 0,
    releasing_since      timestamptz,
    updated_at           timestamptz NOT NULL DEFAULT now(),
    UNIQUE (owner_client_id, endpoint)
);
-- What the gate looks up for every batch of calls: only endpoints that are not closed are in it.
CREATE INDEX callback_endpoints_unhealthy ON callback_endpoints (owner_client_id, endpoint) WHERE state <> 'closed';
CREATE INDEX callback_endpoints_open ON callback_endpoints (opened_at) WHERE state = 'open';
CREATE INDEX callback_endpoints_probes ON callback_endpoints (probe_at) WHERE state = 'open';
CREATE INDEX callback_endpoints_releasing ON callback_endpoints (releasing_since) WHERE releasing_since IS NOT NULL;

-- Events wait for their endpoint as 'held' (open) or 'disabled' (disabled), with endpoint_id set. endpoint_name: the
-- endpoint an owner named for the event (NULL: its URL without the query).
ALTER TABLE callback_events
    ADD COLUMN endpoint_id bigint,
    ADD COLUMN endpoint_name text,
    DROP CONSTRAINT callback_events_status_check,
    ADD CONSTRAINT callback_events_status_check
        CHECK (status IN ('pending', 'notified', 'failed', 'cancelled', 'rejected', 'held', 'disabled')) NOT VALID;
ALTER TABLE callback_events VALIDATE CONSTRAINT callback_events_status_check;
CREATE INDEX callback_events_held ON callback_events (endpoint_id, run_at, event_id) WHERE status IN ('held', 'disabled');

-- An owner's endpoint policy (EndpointPolicy as JSON; NULL: the workers' CallbackSettings.endpoint_policy).
ALTER TABLE callback_owner_settings ADD COLUMN endpoint_policy jsonb;
