-- The whole cmb schema as the migrations in this folder leave it (generated; do not edit by hand:
-- add a migration, then run `python tests/migration/test_schema.py`). Read it to see every table.

CREATE SCHEMA cmb;

CREATE FUNCTION cmb.pubsub_events_written() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'cmb', 'public'
    AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pubsub_clock c, pg_control_system() s WHERE c.system_identifier <> s.system_identifier) THEN
        RAISE EXCEPTION 'cmb pubsub: the stream''s txids come from another Postgres cluster (pg_dump/pg_restore); events are refused until `cmb-dagster pubsub reset` has run'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.pubsub', '');
    RETURN NULL;
END
$$;

CREATE FUNCTION cmb.pubsub_filter_error(doc jsonb, filter jsonpath, vars jsonb) RETURNS text
    LANGUAGE plpgsql STABLE
    AS $$
BEGIN
    PERFORM jsonb_path_match_tz(doc, filter, vars, true);
    RETURN NULL;
EXCEPTION WHEN OTHERS THEN
    RETURN SQLERRM;
END
$$;

CREATE FUNCTION cmb.pubsub_restore_problem(stored pg_snapshot) RETURNS text
    LANGUAGE sql
    SET search_path TO 'cmb', 'public'
    SET jit TO 'off'
    AS $$
    SELECT CASE
        WHEN c.system_identifier <> s.system_identifier THEN
            format('the stream''s txids come from Postgres cluster %s but this is cluster %s',
                   c.system_identifier, s.system_identifier)
        WHEN pg_snapshot_xmax(stored)::text::numeric > pg_snapshot_xmax(pg_current_snapshot())::text::numeric + c.shift THEN
            format('a stored snapshot (%s) is ahead of the current txid (%s)', stored, pubsub_snapshot())
    END
    FROM pubsub_clock c, pg_control_system() s
$$;

CREATE FUNCTION cmb.pubsub_snapshot() RETURNS pg_snapshot
    LANGUAGE sql
    SET search_path TO 'cmb', 'public'
    SET jit TO 'off'
    AS $$
    WITH now AS (
        SELECT pg_current_snapshot() AS snap, pg_current_xact_id_if_assigned() AS me, c.shift
        FROM pubsub_clock c
    ), running AS (
        SELECT x FROM now, pg_snapshot_xip(now.snap) AS x
        UNION
        SELECT me FROM now WHERE me IS NOT NULL AND pg_visible_in_snapshot(me, snap)
    )
    SELECT format('%s:%s:%s',
                  pg_snapshot_xmin(snap)::text::numeric + shift,
                  pg_snapshot_xmax(snap)::text::numeric + shift,
                  (SELECT coalesce(string_agg((x::text::numeric + now.shift)::text, ',' ORDER BY x), '')
                   FROM running))::pg_snapshot
    FROM now
$$;

CREATE FUNCTION cmb.pubsub_statement_snapshot() RETURNS pg_snapshot
    LANGUAGE sql STABLE
    SET search_path TO 'cmb', 'public'
    SET jit TO 'off'
    AS $$
    WITH now AS (
        SELECT pg_current_snapshot() AS snap, pg_current_xact_id_if_assigned() AS me, c.shift
        FROM pubsub_clock c
    ), running AS (
        SELECT x FROM now, pg_snapshot_xip(now.snap) AS x
        UNION
        SELECT me FROM now WHERE me IS NOT NULL AND pg_visible_in_snapshot(me, snap)
    )
    SELECT format('%s:%s:%s',
                  pg_snapshot_xmin(snap)::text::numeric + shift,
                  pg_snapshot_xmax(snap)::text::numeric + shift,
                  (SELECT coalesce(string_agg((x::text::numeric + now.shift)::text, ',' ORDER BY x), '')
                   FROM running))::pg_snapshot
    FROM now
$$;

CREATE FUNCTION cmb.pubsub_txid() RETURNS xid8
    LANGUAGE sql
    SET search_path TO 'cmb', 'public'
    SET jit TO 'off'
    AS $$ SELECT (pg_current_xact_id()::text::numeric + shift)::text::xid8 FROM pubsub_clock $$;

CREATE FUNCTION cmb.stage_entities_bump() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'cmb', 'public'
    AS $$
BEGIN
    IF NEW.version = OLD.version AND NEW.payload IS DISTINCT FROM OLD.payload THEN
        NEW.version := OLD.version + 1;
        NEW.updated_at := now();
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION cmb.stage_entities_deleted() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'cmb', 'public'
    AS $$
BEGIN
    DELETE FROM stage_states s USING deleted_rows d WHERE s.entity_id = d.entity_id;
    DELETE FROM stage_queue q USING deleted_rows d WHERE q.entity_id = d.entity_id;
    DELETE FROM stage_changes c USING deleted_rows d WHERE c.entity_id = d.entity_id;
    RETURN NULL;
END
$$;

CREATE FUNCTION cmb.stage_hash(entity_id text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN ((('x'::text || substr(md5(entity_id), 1, 8)))::bit(32))::bigint;

CREATE TABLE cmb.callback_buckets (
    bucket_id integer NOT NULL,
    max_run_at timestamp with time zone DEFAULT '1970-01-01 00:00:00+00'::timestamp with time zone NOT NULL,
    cursor_event_id bigint DEFAULT 0 NOT NULL,
    max_event_id bigint DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT callback_buckets_bucket_id_check CHECK ((bucket_id >= 0))
)
WITH (fillfactor='50', autovacuum_vacuum_scale_factor='0', autovacuum_vacuum_threshold='200');

CREATE TABLE cmb.callback_change_log (
    change_id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    action text NOT NULL,
    event_id bigint NOT NULL,
    owner_client_id text NOT NULL,
    group_key text NOT NULL,
    event_key text NOT NULL,
    before jsonb NOT NULL,
    after jsonb,
    CONSTRAINT callback_change_log_action_check CHECK ((action = ANY (ARRAY['update'::text, 'cancel'::text, 'delete'::text])))
);

ALTER TABLE cmb.callback_change_log ALTER COLUMN change_id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.callback_change_log_change_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.callback_endpoints (
    endpoint_id bigint NOT NULL,
    owner_client_id text NOT NULL,
    endpoint text NOT NULL,
    state text DEFAULT 'closed'::text NOT NULL,
    consecutive_failures integer DEFAULT 0 NOT NULL,
    window_started_at timestamp with time zone DEFAULT now() NOT NULL,
    window_calls integer DEFAULT 0 NOT NULL,
    window_failures integer DEFAULT 0 NOT NULL,
    last_success_at timestamp with time zone,
    last_failure_at timestamp with time zone,
    last_error text,
    last_status_code smallint,
    opened_at timestamp with time zone,
    probes integer DEFAULT 0 NOT NULL,
    probe_interval double precision,
    probe_at timestamp with time zone,
    probe_event bigint,
    disabled_at timestamp with time zone,
    disabled_by text,
    disables integer DEFAULT 0 NOT NULL,
    releasing_since timestamp with time zone,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT callback_endpoints_state_check CHECK ((state = ANY (ARRAY['closed'::text, 'open'::text, 'disabled'::text])))
);

ALTER TABLE cmb.callback_endpoints ALTER COLUMN endpoint_id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.callback_endpoints_endpoint_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.callback_events (
    event_id bigint NOT NULL,
    bucket_id integer NOT NULL,
    owner_client_id text NOT NULL,
    group_key text NOT NULL,
    event_key text NOT NULL,
    status text DEFAULT 'pending'::text NOT NULL,
    run_at timestamp with time zone NOT NULL,
    originally_run_at timestamp with time zone NOT NULL,
    cb_url text NOT NULL,
    context jsonb,
    retry jsonb NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    main_retries integer DEFAULT 0 NOT NULL,
    last_error text,
    schedule_id bigint,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    body text DEFAULT 'envelope'::text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    message_id bigint,
    last_status_code smallint,
    last_response text,
    replays integer DEFAULT 0 NOT NULL,
    replayed_at timestamp with time zone,
    on_failure text,
    failure_of bigint,
    endpoint_id bigint,
    endpoint_name text,
    CONSTRAINT callback_events_body_check CHECK ((body = ANY (ARRAY['envelope'::text, 'context'::text]))),
    CONSTRAINT callback_events_priority_check CHECK (((priority >= '-1000'::integer) AND (priority <= 1000))),
    CONSTRAINT callback_events_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'notified'::text, 'failed'::text, 'cancelled'::text, 'rejected'::text, 'held'::text, 'disabled'::text])))
)
WITH (fillfactor='85', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_cost_delay='0');

CREATE SEQUENCE cmb.callback_event_ids
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE cmb.callback_event_ids OWNED BY cmb.callback_events.event_id;

CREATE TABLE cmb.callback_owner_settings (
    owner_client_id text NOT NULL,
    on_failure text,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    endpoint_policy jsonb
);

CREATE TABLE cmb.callback_scheduled_events (
    schedule_id bigint NOT NULL,
    fire_at timestamp with time zone NOT NULL,
    event_id bigint
);

CREATE TABLE cmb.callback_schedules (
    schedule_id bigint NOT NULL,
    owner_client_id text NOT NULL,
    group_key text NOT NULL,
    schedule_key text NOT NULL,
    cron text NOT NULL,
    timezone text NOT NULL,
    cb_url text NOT NULL,
    context jsonb,
    retry jsonb NOT NULL,
    horizon_seconds integer NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    materialized_until timestamp with time zone NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    catch_up text DEFAULT 'latest'::text NOT NULL,
    catch_up_limit integer DEFAULT 100 NOT NULL,
    misfire_grace_seconds integer DEFAULT 60 NOT NULL,
    CONSTRAINT callback_schedules_catch_up_check CHECK ((catch_up = ANY (ARRAY['none'::text, 'latest'::text, 'all'::text]))),
    CONSTRAINT callback_schedules_catch_up_limit_check CHECK (((catch_up_limit >= 1) AND (catch_up_limit <= 1000))),
    CONSTRAINT callback_schedules_horizon_seconds_check CHECK ((horizon_seconds > 0)),
    CONSTRAINT callback_schedules_misfire_grace_check CHECK (((misfire_grace_seconds >= 1) AND (misfire_grace_seconds <= 86400)))
);

ALTER TABLE cmb.callback_schedules ALTER COLUMN schedule_id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.callback_schedules_schedule_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.callback_signing_secrets (
    secret_id bigint NOT NULL,
    owner_client_id text NOT NULL,
    secret text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    expires_at timestamp with time zone,
    retired_at timestamp with time zone
);

ALTER TABLE cmb.callback_signing_secrets ALTER COLUMN secret_id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.callback_signing_secrets_secret_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.check_states (
    asset jsonb NOT NULL,
    check_name text NOT NULL,
    severity text NOT NULL,
    previous text NOT NULL,
    text text NOT NULL,
    changed_at timestamp with time zone DEFAULT now() NOT NULL,
    scope text DEFAULT ''::text NOT NULL,
    CONSTRAINT check_states_previous_check CHECK ((previous = ANY (ARRAY['ok'::text, 'warn'::text, 'error'::text]))),
    CONSTRAINT check_states_severity_check CHECK ((severity = ANY (ARRAY['ok'::text, 'warn'::text, 'error'::text])))
);

CREATE TABLE cmb.check_transitions (
    id bigint NOT NULL,
    asset jsonb NOT NULL,
    check_name text NOT NULL,
    previous text NOT NULL,
    severity text NOT NULL,
    text text NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    alerted_at timestamp with time zone,
    scope text DEFAULT ''::text NOT NULL
);

CREATE SEQUENCE cmb.check_transitions_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE cmb.check_transitions_id_seq OWNED BY cmb.check_transitions.id;

CREATE TABLE cmb.ctl_feeds (
    name text NOT NULL,
    "position" bigint DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    identity text
);

CREATE TABLE cmb.ctl_history (
    id bigint NOT NULL,
    entity text NOT NULL,
    parameter text NOT NULL,
    old_value timestamp with time zone,
    new_value timestamp with time zone NOT NULL,
    backwards boolean NOT NULL,
    changed_at timestamp with time zone DEFAULT now() NOT NULL,
    changed_by text NOT NULL
);

CREATE SEQUENCE cmb.ctl_history_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE cmb.ctl_history_id_seq OWNED BY cmb.ctl_history.id;

CREATE TABLE cmb.ctl_values (
    entity text NOT NULL,
    parameter text NOT NULL,
    value timestamp with time zone NOT NULL,
    previous_value timestamp with time zone,
    version bigint DEFAULT 1 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_by text NOT NULL,
    CONSTRAINT ctl_values_check CHECK (((entity <> ''::text) AND (parameter <> ''::text)))
);

CREATE TABLE cmb.eventqueue_cron_records (
    cron text NOT NULL,
    fire_time timestamp with time zone NOT NULL,
    event_id bigint NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE cmb.eventqueue_dead (
    id bigint NOT NULL,
    namespace text NOT NULL,
    module text NOT NULL,
    handler text NOT NULL,
    modifier text NOT NULL,
    value jsonb NOT NULL,
    retries integer NOT NULL,
    enqueued_at timestamp with time zone NOT NULL,
    died_at timestamp with time zone DEFAULT now() NOT NULL,
    error text NOT NULL,
    traceback text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    batch_count integer
);

CREATE TABLE cmb.eventqueue_events (
    id bigint NOT NULL,
    namespace text NOT NULL,
    module text NOT NULL,
    handler text NOT NULL,
    modifier text NOT NULL,
    value jsonb NOT NULL,
    retries integer DEFAULT 0 NOT NULL,
    delay_until timestamp with time zone DEFAULT now() NOT NULL,
    enqueued_at timestamp with time zone DEFAULT now() NOT NULL,
    locked_at timestamp with time zone,
    visible_at timestamp with time zone DEFAULT now() NOT NULL,
    last_error text,
    crashes smallint DEFAULT 0 NOT NULL,
    flow_key text DEFAULT ''::text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    turn bigint,
    flow_slot integer,
    batch_count integer,
    batch_bytes bigint,
    locked_by text,
    lock_fence bigint
)
WITH (fillfactor='80');

ALTER TABLE cmb.eventqueue_events ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY (
    SEQUENCE NAME cmb.eventqueue_events_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.eventqueue_handlers (
    name text NOT NULL,
    kind text DEFAULT 'python'::text NOT NULL,
    lock_expiry_seconds double precision NOT NULL,
    max_retries integer NOT NULL,
    retry_delay_seconds double precision NOT NULL,
    max_retry_delay_seconds double precision NOT NULL,
    registered_at timestamp with time zone DEFAULT now() NOT NULL,
    max_crashes integer DEFAULT 3 NOT NULL,
    key_path text[],
    debounce_seconds double precision,
    max_wait_seconds double precision,
    max_batch integer,
    CONSTRAINT eventqueue_handlers_debounce_seconds_check CHECK ((debounce_seconds > (0)::double precision)),
    CONSTRAINT eventqueue_handlers_kind_check CHECK ((kind = ANY (ARRAY['python'::text, 'dagster_job'::text]))),
    CONSTRAINT eventqueue_handlers_lock_expiry_seconds_check CHECK ((lock_expiry_seconds > (0)::double precision)),
    CONSTRAINT eventqueue_handlers_max_batch_check CHECK ((max_batch > 0)),
    CONSTRAINT eventqueue_handlers_max_crashes_check CHECK ((max_crashes >= 1)),
    CONSTRAINT eventqueue_handlers_max_retries_check CHECK ((max_retries >= 0)),
    CONSTRAINT eventqueue_handlers_max_retry_delay_seconds_check CHECK ((max_retry_delay_seconds >= (0)::double precision)),
    CONSTRAINT eventqueue_handlers_max_wait_seconds_check CHECK ((max_wait_seconds > (0)::double precision)),
    CONSTRAINT eventqueue_handlers_name_check CHECK ((name <> ''::text)),
    CONSTRAINT eventqueue_handlers_retry_delay_seconds_check CHECK ((retry_delay_seconds >= (0)::double precision))
);

CREATE TABLE cmb.eventqueue_rules (
    id bigint NOT NULL,
    rule_type text NOT NULL,
    namespace text NOT NULL,
    handler text NOT NULL,
    event_space text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT eventqueue_rules_rule_type_check CHECK ((rule_type = ANY (ARRAY['pause'::text, 'block'::text])))
);

ALTER TABLE cmb.eventqueue_rules ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.eventqueue_rules_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.eventqueue_turn_floors (
    priority smallint NOT NULL,
    floor bigint DEFAULT 0 NOT NULL,
    next bigint DEFAULT 0 NOT NULL,
    shifted_at timestamp with time zone DEFAULT now() NOT NULL
)
WITH (fillfactor='10');

CREATE TABLE cmb.eventqueue_workers (
    owner text NOT NULL,
    rules_seen bigint DEFAULT 0 NOT NULL,
    seen_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE cmb.flow_buckets (
    scope text NOT NULL,
    key text NOT NULL,
    tokens double precision NOT NULL,
    refilled_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    empty_until timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL
);

CREATE TABLE cmb.flow_limits (
    scope text NOT NULL,
    rate double precision,
    burst double precision,
    concurrency integer,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    version integer DEFAULT 0 NOT NULL,
    CONSTRAINT flow_limits_burst_check CHECK ((burst >= (1)::double precision)),
    CONSTRAINT flow_limits_check CHECK (((rate IS NULL) = (burst IS NULL))),
    CONSTRAINT flow_limits_concurrency_check CHECK ((concurrency > 0)),
    CONSTRAINT flow_limits_rate_check CHECK ((rate > (0)::double precision)),
    CONSTRAINT flow_limits_version_check CHECK ((version >= 0))
);

CREATE TABLE cmb.flow_slots (
    scope text NOT NULL,
    key text NOT NULL,
    slot integer NOT NULL,
    holder text,
    taken_at timestamp with time zone,
    expires_at timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    CONSTRAINT flow_slots_slot_check CHECK ((slot >= 0))
);

CREATE TABLE cmb.health_checks (
    id bigint NOT NULL,
    checked_at timestamp with time zone DEFAULT now() NOT NULL,
    source text NOT NULL,
    server_version text NOT NULL,
    schema_version integer NOT NULL
);

CREATE SEQUENCE cmb.health_checks_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE cmb.health_checks_id_seq OWNED BY cmb.health_checks.id;

CREATE TABLE cmb.leases (
    kind text NOT NULL,
    partition text NOT NULL,
    owner text NOT NULL,
    fence bigint DEFAULT 1 NOT NULL,
    acquired_at timestamp with time zone DEFAULT now() NOT NULL,
    expires_at timestamp with time zone NOT NULL
);

CREATE TABLE cmb.pubsub_backfills (
    id bigint NOT NULL,
    table_name text NOT NULL,
    branch_id bigint NOT NULL,
    topic text NOT NULL,
    predicate text,
    batch_size integer NOT NULL,
    key_columns text[] NOT NULL,
    last_key jsonb,
    rows_done bigint DEFAULT 0 NOT NULL,
    batches bigint DEFAULT 0 NOT NULL,
    state text DEFAULT 'running'::text NOT NULL,
    error text,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    rows_skipped bigint DEFAULT 0 NOT NULL,
    last_skip text,
    CONSTRAINT pubsub_backfills_batch_size_check CHECK (((batch_size >= 1) AND (batch_size <= 100000))),
    CONSTRAINT pubsub_backfills_state_check CHECK ((state = ANY (ARRAY['running'::text, 'failed'::text, 'done'::text])))
);

ALTER TABLE cmb.pubsub_backfills ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.pubsub_backfills_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.pubsub_clock (
    singleton boolean DEFAULT true NOT NULL,
    shift bigint DEFAULT 0 NOT NULL,
    system_identifier bigint,
    reset_at timestamp with time zone,
    CONSTRAINT pubsub_clock_shift_check CHECK ((shift >= 0)),
    CONSTRAINT pubsub_clock_singleton_check CHECK (singleton)
);

CREATE TABLE cmb.pubsub_dead_letters (
    consumer_id text NOT NULL,
    branch_id bigint NOT NULL,
    event_id bigint NOT NULL,
    txid xid8 NOT NULL,
    topic text NOT NULL,
    op text NOT NULL,
    key jsonb,
    payload jsonb NOT NULL,
    created_at timestamp with time zone NOT NULL,
    error text NOT NULL,
    traceback text,
    attempts integer NOT NULL,
    first_failed_at timestamp with time zone NOT NULL,
    last_failed_at timestamp with time zone NOT NULL,
    parked_at timestamp with time zone DEFAULT now() NOT NULL,
    replayed_at timestamp with time zone
);

CREATE TABLE cmb.pubsub_events (
    id bigint NOT NULL,
    txid xid8 DEFAULT cmb.pubsub_txid() NOT NULL,
    branch_id bigint NOT NULL,
    topic text NOT NULL,
    op text NOT NULL,
    key jsonb,
    payload jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT pubsub_events_op_check CHECK ((op = ANY (ARRAY['insert'::text, 'update'::text, 'delete'::text, 'publish'::text, 'snapshot'::text])))
);

ALTER TABLE cmb.pubsub_events ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.pubsub_events_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.pubsub_trimmed (
    branch_id bigint NOT NULL,
    events bigint NOT NULL,
    last_txid xid8 NOT NULL,
    last_trim_at timestamp with time zone DEFAULT now() NOT NULL,
    last_created_at timestamp with time zone
);

CREATE TABLE cmb.pubsub_watermarks (
    consumer_id text NOT NULL,
    branch_id bigint NOT NULL,
    snapshot pg_snapshot DEFAULT '1:1:'::pg_snapshot NOT NULL,
    target pg_snapshot,
    txid xid8 DEFAULT '0'::xid8 NOT NULL,
    event_id bigint DEFAULT 0 NOT NULL,
    delivered bigint DEFAULT 0 NOT NULL,
    handler text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    failing_event bigint,
    attempts integer DEFAULT 0 NOT NULL,
    first_failed_at timestamp with time zone,
    last_failed_at timestamp with time zone,
    last_error text,
    notice text,
    crashes integer DEFAULT 0 NOT NULL,
    topics text[],
    filter text,
    rewound_at timestamp with time zone,
    last_rewind text,
    CONSTRAINT pubsub_watermarks_consumer_id_check CHECK ((consumer_id ~ '^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$'::text))
);

CREATE TABLE cmb.reactive_launches (
    id bigint NOT NULL,
    scheduler text NOT NULL,
    task text NOT NULL,
    run_key text NOT NULL,
    values_hash text NOT NULL,
    attempt integer NOT NULL,
    ctl_values jsonb NOT NULL,
    reason text NOT NULL,
    launched_at timestamp with time zone DEFAULT now() NOT NULL,
    run_id text,
    outcome text,
    finished_at timestamp with time zone,
    partition_key text,
    manual boolean DEFAULT false NOT NULL,
    logged_at timestamp with time zone,
    facts jsonb,
    CONSTRAINT reactive_launches_outcome_check CHECK ((outcome = ANY (ARRAY['success'::text, 'failure'::text])))
);

CREATE SEQUENCE cmb.reactive_launches_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE cmb.reactive_launches_id_seq OWNED BY cmb.reactive_launches.id;

CREATE TABLE cmb.reactive_mark_batches (
    scheduler text NOT NULL,
    id bigint NOT NULL,
    names text[] NOT NULL
);

ALTER TABLE cmb.reactive_mark_batches ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.reactive_mark_batches_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.reactive_marks (
    scheduler text NOT NULL,
    name text NOT NULL,
    by_hand boolean DEFAULT false NOT NULL
);

CREATE TABLE cmb.reactive_schedulers (
    name text NOT NULL,
    definitions_hash text NOT NULL,
    synced_at timestamp with time zone DEFAULT now() NOT NULL,
    location text,
    ticked_at timestamp with time zone,
    manual_after timestamp with time zone,
    tick_seconds double precision,
    tick_token text
);

CREATE TABLE cmb.reactive_tasks (
    scheduler text NOT NULL,
    name text NOT NULL,
    trigger jsonb NOT NULL,
    trigger_hash text NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    timezone text DEFAULT 'UTC'::text NOT NULL,
    defined boolean DEFAULT true NOT NULL,
    status text DEFAULT 'new'::text NOT NULL,
    last_values jsonb DEFAULT '{}'::jsonb NOT NULL,
    ready_values jsonb,
    run_key text,
    run_id text,
    launched_at timestamp with time zone,
    attempts integer DEFAULT 0 NOT NULL,
    backoff_until timestamp with time zone,
    explanation text,
    evaluated_at timestamp with time zone,
    backwards_note text,
    last_success_at timestamp with time zone,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    produces jsonb DEFAULT '[]'::jsonb NOT NULL,
    partition_key text,
    crashes smallint DEFAULT 0 NOT NULL,
    shown_at timestamp with time zone,
    wake_at timestamp with time zone,
    deadline jsonb,
    deadline_since timestamp with time zone,
    facts jsonb,
    CONSTRAINT reactive_tasks_status_check CHECK ((status = ANY (ARRAY['new'::text, 'waiting'::text, 'ready'::text, 'launched'::text, 'backoff'::text, 'error'::text])))
);

CREATE TABLE cmb.run_requests (
    id bigint NOT NULL,
    location text NOT NULL,
    sensor text NOT NULL,
    run_key text NOT NULL,
    run_config jsonb NOT NULL,
    tags jsonb NOT NULL,
    requested_at timestamp with time zone DEFAULT now() NOT NULL
);

ALTER TABLE cmb.run_requests ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME cmb.run_requests_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE cmb.schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE cmb.stage_changes (
    entity_id text NOT NULL,
    shard_id integer NOT NULL,
    fields text[],
    changed_at timestamp with time zone DEFAULT now() NOT NULL
)
WITH (fillfactor='70');

CREATE TABLE cmb.stage_counters (
    stage text NOT NULL,
    shard_id integer NOT NULL,
    processed bigint DEFAULT 0 NOT NULL,
    changed bigint DEFAULT 0 NOT NULL,
    conflicts bigint DEFAULT 0 NOT NULL,
    errors bigint DEFAULT 0 NOT NULL,
    parked bigint DEFAULT 0 NOT NULL,
    capped bigint DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE cmb.stage_entities (
    entity_id text NOT NULL,
    version bigint DEFAULT 1 NOT NULL,
    payload jsonb NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT stage_entities_entity_id_check CHECK (((length(entity_id) >= 1) AND (length(entity_id) <= 256))),
    CONSTRAINT stage_entities_payload_check CHECK ((jsonb_typeof(payload) = 'object'::text))
)
WITH (fillfactor='80');

CREATE TABLE cmb.stage_queue (
    entity_id text NOT NULL,
    stage text NOT NULL,
    shard_id integer NOT NULL,
    lane smallint DEFAULT 0 NOT NULL,
    due_at timestamp with time zone NOT NULL,
    enqueued_at timestamp with time zone DEFAULT now() NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    conflicts integer DEFAULT 0 NOT NULL,
    last_error text,
    parked_at timestamp with time zone,
    crashes smallint DEFAULT 0 NOT NULL,
    CONSTRAINT stage_queue_lane_check CHECK ((lane = ANY (ARRAY[0, 1])))
)
WITH (fillfactor='70');

CREATE TABLE cmb.stage_settings (
    singleton boolean DEFAULT true NOT NULL,
    shard_count integer DEFAULT 8 NOT NULL,
    capture_branch bigint DEFAULT 1200001 NOT NULL,
    results_branch bigint DEFAULT 1200002 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT stage_settings_shard_count_check CHECK (((shard_count >= 1) AND (shard_count <= 4096))),
    CONSTRAINT stage_settings_singleton_check CHECK (singleton)
);

CREATE TABLE cmb.stage_states (
    entity_id text NOT NULL,
    stage text NOT NULL,
    state jsonb,
    version bigint DEFAULT 0 NOT NULL,
    runs integer DEFAULT 0 NOT NULL,
    window_start timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
)
WITH (fillfactor='80');

ALTER TABLE ONLY cmb.check_transitions ALTER COLUMN id SET DEFAULT nextval('cmb.check_transitions_id_seq'::regclass);

ALTER TABLE ONLY cmb.ctl_history ALTER COLUMN id SET DEFAULT nextval('cmb.ctl_history_id_seq'::regclass);

ALTER TABLE ONLY cmb.health_checks ALTER COLUMN id SET DEFAULT nextval('cmb.health_checks_id_seq'::regclass);

ALTER TABLE ONLY cmb.reactive_launches ALTER COLUMN id SET DEFAULT nextval('cmb.reactive_launches_id_seq'::regclass);

ALTER TABLE ONLY cmb.callback_buckets
    ADD CONSTRAINT callback_buckets_pkey PRIMARY KEY (bucket_id);

ALTER TABLE ONLY cmb.callback_change_log
    ADD CONSTRAINT callback_change_log_pkey PRIMARY KEY (change_id);

ALTER TABLE ONLY cmb.callback_endpoints
    ADD CONSTRAINT callback_endpoints_owner_client_id_endpoint_key UNIQUE (owner_client_id, endpoint);

ALTER TABLE ONLY cmb.callback_endpoints
    ADD CONSTRAINT callback_endpoints_pkey PRIMARY KEY (endpoint_id);

ALTER TABLE ONLY cmb.callback_events
    ADD CONSTRAINT callback_events_owner_client_id_group_key_event_key_key UNIQUE (owner_client_id, group_key, event_key);

ALTER TABLE ONLY cmb.callback_events
    ADD CONSTRAINT callback_events_pkey PRIMARY KEY (event_id);

ALTER TABLE ONLY cmb.callback_owner_settings
    ADD CONSTRAINT callback_owner_settings_pkey PRIMARY KEY (owner_client_id);

ALTER TABLE ONLY cmb.callback_scheduled_events
    ADD CONSTRAINT callback_scheduled_events_pkey PRIMARY KEY (schedule_id, fire_at);

ALTER TABLE ONLY cmb.callback_schedules
    ADD CONSTRAINT callback_schedules_owner_client_id_group_key_schedule_key_key UNIQUE (owner_client_id, group_key, schedule_key);

ALTER TABLE ONLY cmb.callback_schedules
    ADD CONSTRAINT callback_schedules_pkey PRIMARY KEY (schedule_id);

ALTER TABLE ONLY cmb.callback_signing_secrets
    ADD CONSTRAINT callback_signing_secrets_pkey PRIMARY KEY (secret_id);

ALTER TABLE ONLY cmb.check_states
    ADD CONSTRAINT check_states_pkey PRIMARY KEY (asset, check_name, scope);

ALTER TABLE ONLY cmb.check_transitions
    ADD CONSTRAINT check_transitions_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.ctl_feeds
    ADD CONSTRAINT ctl_feeds_pkey PRIMARY KEY (name);

ALTER TABLE ONLY cmb.ctl_history
    ADD CONSTRAINT ctl_history_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.ctl_values
    ADD CONSTRAINT ctl_values_pkey PRIMARY KEY (entity, parameter);

ALTER TABLE ONLY cmb.eventqueue_cron_records
    ADD CONSTRAINT eventqueue_cron_records_pkey PRIMARY KEY (cron, fire_time);

ALTER TABLE ONLY cmb.eventqueue_dead
    ADD CONSTRAINT eventqueue_dead_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.eventqueue_events
    ADD CONSTRAINT eventqueue_events_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.eventqueue_handlers
    ADD CONSTRAINT eventqueue_handlers_pkey PRIMARY KEY (name);

ALTER TABLE ONLY cmb.eventqueue_rules
    ADD CONSTRAINT eventqueue_rules_handler_namespace_event_space_rule_type_key UNIQUE (handler, namespace, event_space, rule_type);

ALTER TABLE ONLY cmb.eventqueue_rules
    ADD CONSTRAINT eventqueue_rules_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.eventqueue_turn_floors
    ADD CONSTRAINT eventqueue_turn_floors_pkey PRIMARY KEY (priority);

ALTER TABLE ONLY cmb.eventqueue_workers
    ADD CONSTRAINT eventqueue_workers_pkey PRIMARY KEY (owner);

ALTER TABLE ONLY cmb.flow_buckets
    ADD CONSTRAINT flow_buckets_pkey PRIMARY KEY (scope, key);

ALTER TABLE ONLY cmb.flow_limits
    ADD CONSTRAINT flow_limits_pkey PRIMARY KEY (scope);

ALTER TABLE ONLY cmb.flow_slots
    ADD CONSTRAINT flow_slots_pkey PRIMARY KEY (scope, key, slot);

ALTER TABLE ONLY cmb.health_checks
    ADD CONSTRAINT health_checks_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.leases
    ADD CONSTRAINT leases_pkey PRIMARY KEY (kind, partition);

ALTER TABLE ONLY cmb.pubsub_backfills
    ADD CONSTRAINT pubsub_backfills_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.pubsub_clock
    ADD CONSTRAINT pubsub_clock_pkey PRIMARY KEY (singleton);

ALTER TABLE ONLY cmb.pubsub_dead_letters
    ADD CONSTRAINT pubsub_dead_letters_pkey PRIMARY KEY (consumer_id, branch_id, event_id);

ALTER TABLE ONLY cmb.pubsub_events
    ADD CONSTRAINT pubsub_events_pkey PRIMARY KEY (branch_id, txid, id);

ALTER TABLE ONLY cmb.pubsub_trimmed
    ADD CONSTRAINT pubsub_trimmed_pkey PRIMARY KEY (branch_id);

ALTER TABLE ONLY cmb.pubsub_watermarks
    ADD CONSTRAINT pubsub_watermarks_pkey PRIMARY KEY (consumer_id, branch_id);

ALTER TABLE ONLY cmb.reactive_launches
    ADD CONSTRAINT reactive_launches_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.reactive_mark_batches
    ADD CONSTRAINT reactive_mark_batches_pkey PRIMARY KEY (scheduler, id);

ALTER TABLE ONLY cmb.reactive_marks
    ADD CONSTRAINT reactive_marks_pkey PRIMARY KEY (scheduler, name);

ALTER TABLE ONLY cmb.reactive_schedulers
    ADD CONSTRAINT reactive_schedulers_pkey PRIMARY KEY (name);

ALTER TABLE ONLY cmb.reactive_tasks
    ADD CONSTRAINT reactive_tasks_pkey PRIMARY KEY (scheduler, name);

ALTER TABLE ONLY cmb.run_requests
    ADD CONSTRAINT run_requests_location_sensor_run_key_key UNIQUE (location, sensor, run_key);

ALTER TABLE ONLY cmb.run_requests
    ADD CONSTRAINT run_requests_pkey PRIMARY KEY (id);

ALTER TABLE ONLY cmb.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);

ALTER TABLE ONLY cmb.stage_changes
    ADD CONSTRAINT stage_changes_pkey PRIMARY KEY (entity_id);

ALTER TABLE ONLY cmb.stage_counters
    ADD CONSTRAINT stage_counters_pkey PRIMARY KEY (stage, shard_id);

ALTER TABLE ONLY cmb.stage_entities
    ADD CONSTRAINT stage_entities_pkey PRIMARY KEY (entity_id);

ALTER TABLE ONLY cmb.stage_queue
    ADD CONSTRAINT stage_queue_pkey PRIMARY KEY (entity_id, stage);

ALTER TABLE ONLY cmb.stage_settings
    ADD CONSTRAINT stage_settings_pkey PRIMARY KEY (singleton);

ALTER TABLE ONLY cmb.stage_states
    ADD CONSTRAINT stage_states_pkey PRIMARY KEY (entity_id, stage);

CREATE INDEX callback_change_log_at ON cmb.callback_change_log USING btree (at);

CREATE INDEX callback_change_log_key ON cmb.callback_change_log USING btree (owner_client_id, group_key, event_key);

CREATE INDEX callback_endpoints_open ON cmb.callback_endpoints USING btree (opened_at) WHERE (state = 'open'::text);

CREATE INDEX callback_endpoints_probes ON cmb.callback_endpoints USING btree (probe_at) WHERE (state = 'open'::text);

CREATE INDEX callback_endpoints_releasing ON cmb.callback_endpoints USING btree (releasing_since) WHERE (releasing_since IS NOT NULL);

CREATE INDEX callback_endpoints_unhealthy ON cmb.callback_endpoints USING btree (owner_client_id, endpoint) WHERE (state <> 'closed'::text);

CREATE INDEX callback_events_dead ON cmb.callback_events USING btree (finished_at, event_id) WHERE (status = 'failed'::text);

CREATE INDEX callback_events_finished ON cmb.callback_events USING btree (run_at) WHERE (status <> 'pending'::text);

CREATE INDEX callback_events_held ON cmb.callback_events USING btree (endpoint_id, run_at, event_id) WHERE (status = ANY (ARRAY['held'::text, 'disabled'::text]));

CREATE INDEX callback_events_outcomes ON cmb.callback_events USING btree (finished_at) INCLUDE (bucket_id, status) WHERE (status <> 'pending'::text);

CREATE INDEX callback_events_pending ON cmb.callback_events USING btree (bucket_id, run_at, event_id) WHERE (status = 'pending'::text);

CREATE INDEX callback_events_pending_ids ON cmb.callback_events USING btree (bucket_id, event_id) WHERE (status = 'pending'::text);

CREATE INDEX callback_events_schedule ON cmb.callback_events USING btree (schedule_id) WHERE (schedule_id IS NOT NULL);

CREATE INDEX callback_events_urgent ON cmb.callback_events USING btree (bucket_id, priority DESC, run_at, event_id) WHERE ((status = 'pending'::text) AND (priority > 0));

CREATE INDEX callback_signing_secrets_active ON cmb.callback_signing_secrets USING btree (owner_client_id, created_at) WHERE (retired_at IS NULL);

CREATE INDEX check_transitions_unalerted ON cmb.check_transitions USING btree (id) WHERE (alerted_at IS NULL);

CREATE INDEX ctl_history_backwards ON cmb.ctl_history USING btree (id) WHERE backwards;

CREATE INDEX ctl_history_parameter ON cmb.ctl_history USING btree (entity, parameter, id);

CREATE INDEX eventqueue_dead_handler ON cmb.eventqueue_dead USING btree (handler, id);

CREATE INDEX eventqueue_events_claimed ON cmb.eventqueue_events USING btree (handler, flow_key) WHERE (locked_by IS NOT NULL);

CREATE INDEX eventqueue_events_handler ON cmb.eventqueue_events USING btree (handler, visible_at) INCLUDE (locked_at, delay_until, enqueued_at, namespace, module);

CREATE INDEX eventqueue_events_held ON cmb.eventqueue_events USING btree (handler, namespace, module) WHERE (visible_at = 'infinity'::timestamp with time zone);

CREATE INDEX eventqueue_events_key_turn ON cmb.eventqueue_events USING btree (handler, flow_key, priority, turn) WHERE (turn IS NOT NULL);

CREATE INDEX eventqueue_events_locks ON cmb.eventqueue_events USING btree (visible_at) WHERE ((turn IS NULL) AND (locked_by IS NOT NULL));

CREATE INDEX eventqueue_events_open_batch ON cmb.eventqueue_events USING btree (handler, flow_key, id) WHERE ((batch_count IS NOT NULL) AND (locked_at IS NULL));

CREATE INDEX eventqueue_events_ready ON cmb.eventqueue_events USING btree (((- (priority)::integer)), turn, id) WHERE (turn >= 0);

CREATE INDEX eventqueue_events_waiting ON cmb.eventqueue_events USING btree (visible_at) WHERE ((turn IS NULL) AND (locked_by IS NULL));

CREATE INDEX flow_buckets_empty ON cmb.flow_buckets USING btree (empty_until);

CREATE INDEX flow_slots_taken ON cmb.flow_slots USING btree (scope, key) WHERE (holder IS NOT NULL);

CREATE UNIQUE INDEX leases_fence ON cmb.leases USING btree (kind, partition, fence);

CREATE UNIQUE INDEX pubsub_backfills_asked ON cmb.pubsub_backfills USING btree (table_name, branch_id, topic, md5(COALESCE(predicate, ''::text)));

CREATE INDEX pubsub_dead_letters_parked ON cmb.pubsub_dead_letters USING btree (consumer_id, branch_id) WHERE (replayed_at IS NULL);

CREATE UNIQUE INDEX reactive_launches_run_key ON cmb.reactive_launches USING btree (scheduler, run_key);

CREATE INDEX reactive_launches_task ON cmb.reactive_launches USING btree (scheduler, task, values_hash);

CREATE INDEX reactive_marks_by_hand ON cmb.reactive_marks USING btree (scheduler) WHERE by_hand;

CREATE INDEX reactive_tasks_backoff ON cmb.reactive_tasks USING btree (scheduler, backoff_until) WHERE (status = 'backoff'::text);

CREATE INDEX reactive_tasks_launched ON cmb.reactive_tasks USING btree (scheduler, name) WHERE (status = 'launched'::text);

CREATE INDEX reactive_tasks_ready ON cmb.reactive_tasks USING btree (scheduler, priority DESC, name) WHERE ((status = 'ready'::text) AND defined);

CREATE INDEX reactive_tasks_shown ON cmb.reactive_tasks USING btree (scheduler, COALESCE(shown_at, '-infinity'::timestamp with time zone), priority DESC, name) WHERE ((status = 'waiting'::text) AND defined);

CREATE INDEX reactive_tasks_wake ON cmb.reactive_tasks USING btree (scheduler, wake_at) WHERE (wake_at IS NOT NULL);

CREATE INDEX run_requests_by_sensor ON cmb.run_requests USING btree (location, sensor, id);

CREATE INDEX stage_changes_shard ON cmb.stage_changes USING btree (shard_id, changed_at);

CREATE INDEX stage_queue_due ON cmb.stage_queue USING btree (shard_id, stage, lane, due_at) WHERE (parked_at IS NULL);

CREATE INDEX stage_queue_failing ON cmb.stage_queue USING btree (stage) WHERE ((parked_at IS NULL) AND (attempts > 0));

CREATE INDEX stage_queue_parked ON cmb.stage_queue USING btree (stage) WHERE (parked_at IS NOT NULL);

CREATE TRIGGER pubsub_events_written AFTER INSERT ON cmb.pubsub_events FOR EACH STATEMENT EXECUTE FUNCTION cmb.pubsub_events_written();

CREATE TRIGGER stage_entities_bump BEFORE UPDATE ON cmb.stage_entities FOR EACH ROW EXECUTE FUNCTION cmb.stage_entities_bump();

CREATE TRIGGER stage_entities_deleted AFTER DELETE ON cmb.stage_entities REFERENCING OLD TABLE AS deleted_rows FOR EACH STATEMENT EXECUTE FUNCTION cmb.stage_entities_deleted();

ALTER TABLE ONLY cmb.callback_scheduled_events
    ADD CONSTRAINT callback_scheduled_events_schedule_id_fkey FOREIGN KEY (schedule_id) REFERENCES cmb.callback_schedules(schedule_id) ON DELETE CASCADE;

ALTER TABLE ONLY cmb.eventqueue_events
    ADD CONSTRAINT eventqueue_events_handler_fkey FOREIGN KEY (handler) REFERENCES cmb.eventqueue_handlers(name);

ALTER TABLE ONLY cmb.eventqueue_rules
    ADD CONSTRAINT eventqueue_rules_handler_fkey FOREIGN KEY (handler) REFERENCES cmb.eventqueue_handlers(name);

ALTER TABLE ONLY cmb.pubsub_dead_letters
    ADD CONSTRAINT pubsub_dead_letters_consumer_id_branch_id_fkey FOREIGN KEY (consumer_id, branch_id) REFERENCES cmb.pubsub_watermarks(consumer_id, branch_id) ON DELETE CASCADE;

ALTER TABLE ONLY cmb.reactive_tasks
    ADD CONSTRAINT reactive_tasks_scheduler_fkey FOREIGN KEY (scheduler) REFERENCES cmb.reactive_schedulers(name) ON DELETE CASCADE;
