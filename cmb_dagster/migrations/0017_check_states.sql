-- The health checks' states: the latest severity of each (asset, check), and every change of one, which alerts
-- are sent from (``alerted_at``: the alert's callback was created).
CREATE TABLE check_states (
    asset jsonb NOT NULL,
    check_name text NOT NULL,
    severity text NOT NULL CHECK (severity IN ('ok', 'warn', 'error')),
    previous text NOT NULL CHECK (previous IN ('ok', 'warn', 'error')),
    text text NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (asset, check_name)
);

CREATE TABLE check_transitions (
    id bigserial PRIMARY KEY,
    asset jsonb NOT NULL,
    check_name text NOT NULL,
    previous text NOT NULL,
    severity text NOT NULL,
    text text NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    alerted_at timestamptz
);

CREATE INDEX check_transitions_unalerted ON check_transitions (id) WHERE alerted_at IS NULL;
