"""Every query of the reactive scheduler (tables ``reactive_schedulers``, ``reactive_tasks``)."""

# -- reactive scheduler: definitions ----------------------------------------------------------

DEFINITIONS_HASH = "SELECT definitions_hash FROM reactive_schedulers WHERE name = %(scheduler)s"

SAVE_DEFINITIONS_HASH = """
INSERT INTO reactive_schedulers (name, definitions_hash) VALUES (%(scheduler)s, %(hash)s)
ON CONFLICT (name) DO UPDATE SET definitions_hash = EXCLUDED.definitions_hash, synced_at = now()
"""

# A task whose trigger or time zone changed, or that comes back, is marked for evaluation; a new
# priority or ``produces`` alone is saved without marking it.
UPSERT_TASKS = """
INSERT INTO reactive_tasks AS t (scheduler, name, trigger, trigger_hash, priority, timezone, produces)
SELECT %(scheduler)s, d.name, d.trigger, d.trigger_hash, d.priority, d.timezone, d.produces
FROM unnest(%(names)s::text[], %(triggers)s::jsonb[], %(hashes)s::text[], %(priorities)s::int[], %(timezones)s::text[],
            %(produces)s::jsonb[])
     AS d(name, trigger, trigger_hash, priority, timezone, produces)
ORDER BY d.name
ON CONFLICT (scheduler, name) DO UPDATE
    SET trigger = EXCLUDED.trigger,
        trigger_hash = EXCLUDED.trigger_hash,
        priority = EXCLUDED.priority,
        timezone = EXCLUDED.timezone,
        produces = EXCLUDED.produces,
        defined = true,
        dirty = t.dirty OR t.trigger_hash <> EXCLUDED.trigger_hash OR NOT t.defined,
        updated_at = now()
    WHERE t.trigger_hash <> EXCLUDED.trigger_hash OR t.priority <> EXCLUDED.priority OR NOT t.defined
       OR t.produces <> EXCLUDED.produces
"""

UNDEFINE_MISSING_TASKS = """
UPDATE reactive_tasks SET defined = false, updated_at = now()
WHERE scheduler = %(scheduler)s AND defined AND NOT (name = ANY(%(names)s::text[]))
"""

# -- reactive scheduler: change stream ---------------------------------------------------------

MARK_DIRTY = """
UPDATE reactive_tasks SET dirty = true
WHERE scheduler = %(scheduler)s AND name = ANY(%(names)s::text[]) AND NOT dirty
"""

NOTE_BACKWARDS = """
UPDATE reactive_tasks SET backwards_note = n.note
FROM unnest(%(names)s::text[], %(notes)s::text[]) AS n(name, note)
WHERE scheduler = %(scheduler)s AND reactive_tasks.name = n.name
"""

# -- reactive scheduler: runs in flight --------------------------------------------------------

LAUNCHED_TASKS = """
SELECT name, run_key, run_id, launched_at, attempts, ready_values, explanation, produces
FROM reactive_tasks WHERE scheduler = %(scheduler)s AND status = 'launched'
"""

NOTE_RUN_IDS = """
UPDATE reactive_tasks SET run_id = r.run_id
FROM unnest(%(names)s::text[], %(run_ids)s::text[]) AS r(name, run_id)
WHERE scheduler = %(scheduler)s AND reactive_tasks.name = r.name AND reactive_tasks.run_id IS DISTINCT FROM r.run_id
"""

# Success: the values the run was launched on become the task's last-seen state; its trigger is
# evaluated again. Failure: the trigger stays armed (ready_values kept) and the task waits a backoff.
FINISH_RUNS = """
WITH finished AS (
    SELECT * FROM unnest(%(names)s::text[], %(run_keys)s::text[], %(run_ids)s::text[],
                         %(successes)s::boolean[], %(backoff_until)s::timestamptz[])
         AS f(name, run_key, run_id, success, backoff_until)
), tasks AS (
    UPDATE reactive_tasks t
    SET status = CASE WHEN f.success THEN 'waiting' ELSE 'backoff' END,
        dirty = f.success,
        last_values = CASE WHEN f.success THEN t.ready_values ELSE t.last_values END,
        last_success_at = CASE WHEN f.success THEN %(now)s ELSE t.last_success_at END,
        backwards_note = CASE WHEN f.success THEN NULL ELSE t.backwards_note END,
        attempts = CASE WHEN f.success THEN 0 ELSE t.attempts + 1 END,
        backoff_until = CASE WHEN f.success THEN NULL ELSE f.backoff_until END,
        run_id = f.run_id,
        updated_at = %(now)s
    FROM finished f
    WHERE t.scheduler = %(scheduler)s AND t.name = f.name AND t.status = 'launched' AND t.run_key = f.run_key
    RETURNING t.name
)
UPDATE reactive_launches l
SET outcome = CASE WHEN f.success THEN 'success' ELSE 'failure' END, run_id = f.run_id, finished_at = %(now)s
FROM finished f
WHERE l.scheduler = %(scheduler)s AND l.run_key = f.run_key AND l.outcome IS NULL
  AND f.name IN (SELECT name FROM tasks)
"""

END_BACKOFFS = """
UPDATE reactive_tasks SET status = 'waiting', dirty = true, updated_at = %(now)s
WHERE scheduler = %(scheduler)s AND status = 'backoff' AND backoff_until <= %(now)s
"""

# -- reactive scheduler: evaluation and launch -------------------------------------------------

DIRTY_TASKS = """
SELECT name, last_values, backwards_note
FROM reactive_tasks
WHERE scheduler = %(scheduler)s AND dirty AND defined AND status NOT IN ('launched', 'backoff')
ORDER BY priority DESC, name
LIMIT %(limit)s
"""

# Ready tasks with a priority in [min_priority, max_priority): a hold launches none below a bound.
READY_TASKS = """
SELECT name, last_values, backwards_note, attempts
FROM reactive_tasks
WHERE scheduler = %(scheduler)s AND status = 'ready' AND defined
  AND priority >= %(min_priority)s::bigint AND priority < %(max_priority)s::bigint
ORDER BY priority DESC, name
LIMIT %(limit)s
"""

COUNT_READY = """
SELECT count(*) FROM reactive_tasks
WHERE scheduler = %(scheduler)s AND status = 'ready' AND defined
  AND priority >= %(min_priority)s::bigint AND priority < %(max_priority)s::bigint
"""

# The highest-priority task among ``names`` whose trigger waits (the one a hold is for).
TOP_WAITING_TASK = """
SELECT name, priority
FROM reactive_tasks
WHERE scheduler = %(scheduler)s AND name = ANY(%(names)s::text[]) AND status = 'waiting' AND defined
ORDER BY priority DESC, name
LIMIT 1
"""

SAVE_EVALUATIONS = """
UPDATE reactive_tasks t
SET status = e.status, dirty = false, ready_values = e.ready_values, explanation = e.explanation,
    evaluated_at = %(now)s, updated_at = %(now)s
FROM unnest(%(names)s::text[], %(statuses)s::text[], %(ready_values)s::jsonb[], %(explanations)s::text[])
     AS e(name, status, ready_values, explanation)
WHERE t.scheduler = %(scheduler)s AND t.name = e.name AND t.status NOT IN ('launched', 'backoff')
"""

PREVIOUS_ATTEMPTS = """
SELECT task, values_hash, count(*)::int
FROM reactive_launches
JOIN unnest(%(names)s::text[], %(hashes)s::text[]) AS k(task, values_hash) USING (task, values_hash)
WHERE scheduler = %(scheduler)s
GROUP BY task, values_hash
"""

MARK_LAUNCHED = """
WITH launched AS (
    SELECT * FROM unnest(%(names)s::text[], %(run_keys)s::text[], %(values)s::jsonb[], %(hashes)s::text[],
                         %(attempts)s::int[], %(reasons)s::text[])
         AS l(name, run_key, ctl_values, values_hash, attempt, reason)
), tasks AS (
    UPDATE reactive_tasks t
    SET status = 'launched', run_key = l.run_key, run_id = NULL, launched_at = %(now)s, ready_values = l.ctl_values,
        explanation = l.reason, dirty = false, evaluated_at = %(now)s, updated_at = %(now)s
    FROM launched l
    WHERE t.scheduler = %(scheduler)s AND t.name = l.name AND t.status = 'ready'
    RETURNING t.name
)
INSERT INTO reactive_launches (scheduler, task, run_key, values_hash, attempt, ctl_values, reason, launched_at)
SELECT %(scheduler)s, l.name, l.run_key, l.values_hash, l.attempt, l.ctl_values, l.reason, %(now)s
FROM launched l JOIN tasks USING (name)
RETURNING task
"""

# -- reactive scheduler: status ---------------------------------------------------------------

TASK_STATUS = """
SELECT scheduler, name, status, defined, dirty, priority, timezone, trigger, last_values, ready_values,
       run_key, run_id, launched_at, attempts, backoff_until, explanation, evaluated_at, backwards_note,
       last_success_at, produces
FROM reactive_tasks
WHERE (%(scheduler)s::text IS NULL OR scheduler = %(scheduler)s)
  AND (%(name)s::text IS NULL OR name = %(name)s)
ORDER BY scheduler, priority DESC, name
"""

FORGET_LAST_VALUES = """
UPDATE reactive_tasks
SET last_values = CASE WHEN %(parameter)s::text[] IS NULL THEN '{}'::jsonb
                       ELSE last_values #- %(parameter)s::text[] END,
    dirty = true, backwards_note = NULL, updated_at = now()
WHERE scheduler = %(scheduler)s AND name = %(name)s
RETURNING name
"""
