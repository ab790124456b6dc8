-- CTL store (entity, parameter) -> timestamptz with the history of every change, and the state of the
-- reactive scheduler: one row per reactive task with its last-seen values, status and retry backoff.

CREATE TABLE ctl_values (
    entity         text        NOT NULL,
    parameter      text        NOT NULL,
    value          timestamptz NOT NULL,
    previous_value timestamptz,                      -- the value before the last change (NULL: first value)
    version        bigint      NOT NULL DEFAULT 1,   -- grows by one at each change
    updated_at     timestamptz NOT NULL DEFAULT now(),
    updated_by     text        NOT NULL,
    PRIMARY KEY (entity, parameter),
    CHECK (entity <> '' AND parameter <> '')
);

CREATE TABLE ctl_history (
    id         bigserial   PRIMARY KEY,
    entity     text        NOT NULL,
    parameter  text        NOT NULL,
    old_value  timestamptz,                          -- NULL: the parameter's first value
    new_value  timestamptz NOT NULL,
    backwards  boolean     NOT NULL,                 -- new < old: breaks reactivity of tasks that use it
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text        NOT NULL
);
CREATE INDEX ctl_history_parameter ON ctl_history (entity, parameter, id);
CREATE INDEX ctl_history_backwards ON ctl_history (id) WHERE backwards;

-- Positions of feeds that write CTL exactly once, e.g. Dagster asset materializations carrying 'cmb/ctl'.
CREATE TABLE ctl_feeds (
    name       text        PRIMARY KEY,
    position   bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- One reactive scheduler per code location, named in its definitions.
CREATE TABLE reactive_schedulers (
    name             text        PRIMARY KEY,
    definitions_hash text        NOT NULL,           -- hash of every task definition last synced
    synced_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE reactive_tasks (
    scheduler      text        NOT NULL REFERENCES reactive_schedulers (name) ON DELETE CASCADE,
    name           text        NOT NULL,
    trigger        jsonb       NOT NULL,             -- the trigger's JSON form, as defined in code
    trigger_hash   text        NOT NULL,
    priority       integer     NOT NULL DEFAULT 0,
    timezone       text        NOT NULL DEFAULT 'UTC',
    defined        boolean     NOT NULL DEFAULT true,  -- false: gone from the code location (state kept)
    status         text        NOT NULL DEFAULT 'new'
                   CHECK (status IN ('new', 'waiting', 'ready', 'launched', 'backoff', 'error')),
    dirty          boolean     NOT NULL DEFAULT true,  -- an input changed since the last evaluation
    last_values    jsonb       NOT NULL DEFAULT '{}',  -- {entity: {parameter: value}} seen by the last successful run
    ready_values   jsonb,                            -- values the trigger fired on (status ready/launched/backoff)
    run_key        text,                             -- the run in flight (status launched) or that failed (backoff)
    run_id         text,
    launched_at    timestamptz,
    attempts       integer     NOT NULL DEFAULT 0,   -- consecutive failed runs
    backoff_until  timestamptz,
    explanation    text,                             -- why the last evaluation fired or waited
    evaluated_at   timestamptz,
    backwards_note text,                             -- a parameter it uses moved backwards (cleared by a success)
    last_success_at timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scheduler, name)
);
CREATE INDEX reactive_tasks_dirty ON reactive_tasks (scheduler, priority DESC, name) WHERE dirty AND defined;
CREATE INDEX reactive_tasks_ready ON reactive_tasks (scheduler, priority DESC, name) WHERE status = 'ready' AND defined;
CREATE INDEX reactive_tasks_launched ON reactive_tasks (scheduler) WHERE status = 'launched';
CREATE INDEX reactive_tasks_backoff ON reactive_tasks (scheduler, backoff_until) WHERE status = 'backoff';

-- Every launch with its outcome: the audit trail, and the attempt number of a run_key.
CREATE TABLE reactive_launches (
    id          bigserial   PRIMARY KEY,
    scheduler   text        NOT NULL,
    task        text        NOT NULL,
    run_key     text        NOT NULL,
    values_hash text        NOT NULL,
    attempt     integer     NOT NULL,                -- launches of this task on the same values before this one
    ctl_values  jsonb       NOT NULL,
    reason      text        NOT NULL,
    launched_at timestamptz NOT NULL DEFAULT now(),
    run_id      text,
    outcome     text        CHECK (outcome IN ('success', 'failure')),
    finished_at timestamptz
);
CREATE UNIQUE INDEX reactive_launches_run_key ON reactive_launches (scheduler, run_key);
CREATE INDEX reactive_launches_task ON reactive_launches (scheduler, task, values_hash);
