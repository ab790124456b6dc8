-- Signed requests, dead letters with replay, and failure hooks of the callbacks engine.
-- * message_id: the event's message id (webhook-id 'cb_<message_id>'), the same for every call of one version of
--   the event; NULL: its event_id. An update starts a new message (NULL again); a move or a replay keeps it.
-- * last_status_code, last_response: the HTTP status and the first bytes of the body of the last answer.
-- * replays, replayed_at: how often the event was replayed, and when last (its retries count from then).
-- * on_failure: the event's failure hook (else its owner's, callback_owner_settings); failure_of: on a hook
--   event, the message id of the event whose failure it reports (a hook has no hook).
ALTER TABLE callback_events
    ADD COLUMN message_id bigint,
    ADD COLUMN last_status_code smallint,
    ADD COLUMN last_response text,
    ADD COLUMN replays integer NOT NULL DEFAULT 0,
    ADD COLUMN replayed_at timestamptz,
    ADD COLUMN on_failure text,
    ADD COLUMN failure_of bigint;

-- The dead letters (failed for good), by time of failure: what `callbacks failed` lists and `replay` picks.
CREATE INDEX callback_events_dead ON callback_events (finished_at, event_id) WHERE status = 'failed';

-- Signing secrets per owner (Standard Webhooks, 'whsec_<base64>'): the active ones (not retired, not expired)
-- sign every HTTP callback of the owner; at most two are active, for a rotation.
CREATE TABLE callback_signing_secrets (
    secret_id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner_client_id text        NOT NULL,
    secret          text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz,                            -- NULL: until retired
    retired_at      timestamptz
);
CREATE INDEX callback_signing_secrets_active ON callback_signing_secrets (owner_client_id, created_at)
    WHERE retired_at IS NULL;

-- Settings per owner that every worker reads: the failure hook of the owner's events without their own.
CREATE TABLE callback_owner_settings (
    owner_client_id text        PRIMARY KEY,
    on_failure      text,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
