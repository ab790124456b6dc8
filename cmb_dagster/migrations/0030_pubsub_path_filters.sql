-- Filters of consumers and backfills are SQL/JSON path predicates, passed as parameters of fixed statements
-- (docs/pubsub.md, "Filters"). Postgres evaluates them silently: an event or a row on which a filter would raise
-- a suppressible error (a missing field, a wrong type, a bad number or date) does not match. For the errors it
-- cannot suppress, a batch that failed judges each of its events with pubsub_filter_error, which catches them one
-- by one (a subtransaction each: never on the hot path).
CREATE FUNCTION pubsub_filter_error(doc jsonb, filter jsonpath, vars jsonb) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM jsonb_path_match_tz(doc, filter, vars, true);
    RETURN NULL;
EXCEPTION WHEN OTHERS THEN
    RETURN SQLERRM;
END
$$;

-- One row per backfill asked for (table, branch, topic, filter), not one per run: asked again once done, the same
-- row starts over (`backfill(..., again=True)`).
DELETE FROM pubsub_backfills b
WHERE EXISTS (SELECT 1 FROM pubsub_backfills n
              WHERE n.table_name = b.table_name AND n.branch_id = b.branch_id AND n.topic = b.topic
                AND n.predicate IS NOT DISTINCT FROM b.predicate AND n.id > b.id);
DROP INDEX pubsub_backfills_unfinished;
CREATE UNIQUE INDEX pubsub_backfills_asked
    ON pubsub_backfills (table_name, branch_id, topic, md5(coalesce(predicate, '')));

-- Rows passed over because the filter raised on them (the first one's key and error in last_skip).
ALTER TABLE pubsub_backfills
    ADD COLUMN rows_skipped bigint NOT NULL DEFAULT 0,
    ADD COLUMN last_skip    text;

-- An unfinished backfill whose filter is an SQL expression (which filters no longer are) cannot resume.
DO $$
DECLARE
    unfinished record;
BEGIN
    FOR unfinished IN SELECT id, predicate FROM pubsub_backfills WHERE state <> 'done' AND predicate IS NOT NULL LOOP
        BEGIN
            PERFORM unfinished.predicate::jsonpath;
        EXCEPTION WHEN OTHERS THEN
            UPDATE pubsub_backfills
            SET state = 'failed', updated_at = now(),
                error = 'its filter is an SQL expression, which a backfill no longer runs: start it again with an '
                        'SQL/JSON path filter (docs/pubsub.md, "Filters")'
            WHERE id = unfinished.id;
        END;
    END LOOP;
END
$$;
