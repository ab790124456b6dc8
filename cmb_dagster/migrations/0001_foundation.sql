-- Foundation: worker leases (the shared worker runtime) and health checks (the example job).

CREATE TABLE leases (
    kind        text        NOT NULL,             -- which engine's partitions: 'callbacks.bucket', 'pubsub.consumer', ...
    partition   text        NOT NULL,             -- the partition's id within that kind
    owner       text        NOT NULL,             -- the worker holding it
    fence       bigint      NOT NULL DEFAULT 1,   -- grows at each change of owner: a fencing token
    acquired_at timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (kind, partition)
);

CREATE TABLE health_checks (
    id             bigserial   PRIMARY KEY,
    checked_at     timestamptz NOT NULL DEFAULT now(),
    source         text        NOT NULL,
    server_version text        NOT NULL,
    schema_version integer     NOT NULL
);
