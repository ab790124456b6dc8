-- The stage scheduler's rate limits and max parallelism live in the shared flow control (0021_flow.sql):
-- scopes stages/<stage> (tokens) and stages/<stage>/parallel (batch slots).
DROP TABLE stage_rate_limits;
