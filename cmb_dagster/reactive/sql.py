"""Every query of the reactive scheduler (tables ``reactive_schedulers``, ``reactive_tasks``, ``reactive_marks``,
``reactive_launches``).

A task to evaluate (an input changed since its last evaluation) is a row of ``reactive_marks``: marking and
unmarking write that narrow table, not the wide task row.

Bulk writes pass their rows as one JSON array (``jsonb_to_recordset``): psycopg dumps a JSON string much
faster than several text arrays whose every element it escapes.
"""


# -- reactive scheduler: definitions ----------------------------------------------------------

SCHEDULER_ROW = """
SELECT definitions_hash, location, ticked_at FROM reactive_schedulers WHERE name = %(scheduler)s FOR UPDATE
"""

SAVE_DEFINITIONS_HASH = """
INSERT INTO reactive_schedulers (name, definitions_hash, location, ticked_at)
VALUES (%(scheduler)s, %(hash)s, %(location)s, %(now)s)
ON CONFLICT (name) DO UPDATE
SET definitions_hash = EXCLUDED.definitions_hash, synced_at = now(),
    location = coalesce(EXCLUDED.location, reactive_schedulers.location), ticked_at = EXCLUDED.ticked_at
"""

# The code location that syncs the scheduler's tasks.
MOVE_SCHEDULER = """
UPDATE reactive_schedulers SET location = %(location)s WHERE name = %(scheduler)s
"""

# Every tick of the owner: when it started and how long it took (another location may take the name over when it
# stops; the reactive tasks asset's check says when it stopped).
SAVE_TICK = """
UPDATE reactive_schedulers SET ticked_at = %(now)s, tick_seconds = %(seconds)s WHERE name = %(scheduler)s
"""

# The schedulers' last ticks, for their health check and metrics.
SCHEDULER_TICKS = """
SELECT name, location, ticked_at, tick_seconds FROM reactive_schedulers
WHERE %(scheduler)s::text IS NULL OR name = %(scheduler)s
ORDER BY name
"""

# The current values of CTL parameters and when each was set (constant time per parameter: the primary key).
CURRENT_VALUES = """
SELECT v.entity, v.parameter, v.value, v.updated_at
FROM ctl_values v
JOIN unnest(%(entities)s::text[], %(parameters)s::text[]) AS k(entity, parameter) USING (entity, parameter)
"""

# Other schedulers of this schema that remember task state (a renamed code location leaves its state behind).
OTHER_SCHEDULERS_WITH_STATE = """
SELECT scheduler, count(*) FROM reactive_tasks
WHERE scheduler <> %(scheduler)s AND last_values <> '{}'::jsonb
GROUP BY scheduler ORDER BY scheduler LIMIT 5
"""

# A task that is new, whose trigger or deadline changed, or that comes back, is marked for evaluation (both parts
# of the statement see the tasks as they were before it); a new priority or ``produces`` alone is saved without
# marking it. A deadline counts from when it was defined as it is (``deadline_since``).
UPSERT_TASKS = """
WITH d AS (
    SELECT * FROM unnest(%(names)s::text[], %(triggers)s::jsonb[], %(hashes)s::text[], %(priorities)s::int[],
                         %(timezones)s::text[], %(produces)s::jsonb[], %(deadlines)s::jsonb[])
         AS d(name, trigger, trigger_hash, priority, timezone, produces, deadline)
), marked AS (
    INSERT INTO reactive_marks (scheduler, name)
    SELECT %(scheduler)s, d.name
    FROM d LEFT JOIN reactive_tasks t ON t.scheduler = %(scheduler)s AND t.name = d.name
    WHERE t.name IS NULL OR t.trigger_hash <> d.trigger_hash OR NOT t.defined OR t.deadline IS DISTINCT FROM d.deadline
    ON CONFLICT DO NOTHING
)
INSERT INTO reactive_tasks AS t (scheduler, name, trigger, trigger_hash, priority, timezone, produces, deadline,
                                 deadline_since)
SELECT %(scheduler)s, d.name, d.trigger, d.trigger_hash, d.priority, d.timezone, d.produces, d.deadline,
       CASE WHEN d.deadline IS NULL THEN NULL ELSE %(now)s::timestamptz END
FROM d
ORDER BY d.name
ON CONFLICT (scheduler, name) DO UPDATE
    SET trigger = EXCLUDED.trigger,
        trigger_hash = EXCLUDED.trigger_hash,
        priority = EXCLUDED.priority,
        timezone = EXCLUDED.timezone,
        produces = EXCLUDED.produces,
        deadline = EXCLUDED.deadline,
        deadline_since = CASE WHEN t.deadline IS NOT DISTINCT FROM EXCLUDED.deadline THEN t.deadline_since
                              ELSE EXCLUDED.deadline_since END,
        defined = true,
        updated_at = now()
    WHERE t.trigger_hash <> EXCLUDED.trigger_hash OR t.priority <> EXCLUDED.priority OR NOT t.defined
       OR t.produces <> EXCLUDED.produces OR t.deadline IS DISTINCT FROM EXCLUDED.deadline
"""

UNDEFINE_MISSING_TASKS = """
UPDATE reactive_tasks SET defined = false, updated_at = now()
WHERE scheduler = %(scheduler)s AND defined AND NOT (name = ANY(%(names)s::text[]))
"""

# -- reactive scheduler: change stream ---------------------------------------------------------

MARK_TASKS = """
INSERT INTO reactive_marks (scheduler, name)
SELECT %(scheduler)s, n.name FROM unnest(%(names)b::text[]) AS n(name)
ON CONFLICT DO NOTHING
"""

NOTE_BACKWARDS = """
UPDATE reactive_tasks SET backwards_note = n.note
FROM unnest(%(names)s::text[], %(notes)s::text[]) AS n(name, note)
WHERE scheduler = %(scheduler)s AND reactive_tasks.name = n.name
"""

# -- reactive scheduler: runs in flight --------------------------------------------------------

LAUNCHED_TASKS = """
SELECT name, run_key, run_id, launched_at, attempts, ready_values, explanation, produces, partition_key
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
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS f(name text, run_key text, run_id text, success boolean, backoff_until timestamptz)
), tasks AS (
    UPDATE reactive_tasks t
    SET status = CASE WHEN f.success THEN 'waiting' ELSE 'backoff' END,
        last_values = CASE WHEN f.success THEN t.ready_values ELSE t.last_values END,
        last_success_at = CASE WHEN f.success THEN %(now)s ELSE t.last_success_at END,
        backwards_note = CASE WHEN f.success THEN NULL ELSE t.backwards_note END,
        attempts = CASE WHEN f.success THEN 0 ELSE t.attempts + 1 END,
        backoff_until = CASE WHEN f.success THEN NULL ELSE f.backoff_until END,
        run_id = f.run_id,
        updated_at = %(now)s
    FROM finished f
    WHERE t.scheduler = %(scheduler)s AND t.name = f.name AND t.status = 'launched' AND t.run_key = f.run_key
    RETURNING f.name, f.run_key, f.run_id, f.success
), marked AS (
    INSERT INTO reactive_marks (scheduler, name)
    SELECT %(scheduler)s, name FROM tasks WHERE success
    ON CONFLICT DO NOTHING
), unmarked AS (
    DELETE FROM reactive_marks m USING tasks f
    WHERE m.scheduler = %(scheduler)s AND m.name = f.name AND NOT f.success
)
UPDATE reactive_launches l
SET outcome = CASE WHEN f.success THEN 'success' ELSE 'failure' END, run_id = f.run_id, finished_at = %(now)s
FROM tasks f
WHERE l.scheduler = %(scheduler)s AND l.run_key = f.run_key AND l.outcome IS NULL
"""

END_BACKOFFS = """
WITH ended AS (
    UPDATE reactive_tasks SET status = 'waiting', updated_at = %(now)s
    WHERE scheduler = %(scheduler)s AND status = 'backoff' AND backoff_until <= %(now)s
    RETURNING name
)
INSERT INTO reactive_marks (scheduler, name) SELECT %(scheduler)s, name FROM ended ON CONFLICT DO NOTHING
"""

# Tasks whose wake time came (time alone can make them launch now) are marked for evaluation (index
# reactive_tasks_wake: the cost follows the tasks woken, not the tasks defined).
WAKE_TASKS = """
WITH woken AS (
    UPDATE reactive_tasks SET wake_at = NULL
    WHERE scheduler = %(scheduler)s AND wake_at IS NOT NULL AND wake_at <= %(now)s
    RETURNING name
)
INSERT INTO reactive_marks (scheduler, name) SELECT %(scheduler)s, name FROM woken ON CONFLICT DO NOTHING
"""

# -- reactive scheduler: evaluation and launch -------------------------------------------------

# The marked tasks to evaluate, highest priority first (read once per tick, then evaluated in batches).
MARKED_TASKS = """
SELECT t.name
FROM reactive_marks m JOIN reactive_tasks t ON t.scheduler = m.scheduler AND t.name = m.name
WHERE m.scheduler = %(scheduler)s AND t.defined AND t.status NOT IN ('launched', 'backoff')
ORDER BY t.priority DESC, t.name
"""

# One batch of marked tasks, in the order given; a ready task stays marked until the launch step.
TASKS_TO_EVALUATE = """
SELECT t.name, t.last_values, t.backwards_note, t.priority, t.attempts, t.last_success_at, t.deadline_since
FROM unnest(%(names)b::text[]) WITH ORDINALITY AS n(name, position)
JOIN reactive_tasks t ON t.scheduler = %(scheduler)s AND t.name = n.name
WHERE t.defined AND t.status NOT IN ('launched', 'backoff')
ORDER BY n.position
"""

# Ready tasks with a priority in [min_priority, max_priority): a hold launches none below a bound.
READY_TASKS = """
SELECT name, last_values, backwards_note, attempts, priority, last_success_at, deadline_since
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
WITH saved AS (
    UPDATE reactive_tasks t
    SET status = e.status, ready_values = e.ready_values, explanation = e.explanation, wake_at = e.wake_at,
        evaluated_at = %(now)s, updated_at = %(now)s, shown_at = %(now)s
    FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS e(name text, status text, ready_values jsonb, explanation text, wake_at timestamptz)
    WHERE t.scheduler = %(scheduler)s AND t.name = e.name AND t.status NOT IN ('launched', 'backoff')
    RETURNING t.name
)
DELETE FROM reactive_marks m USING saved s WHERE m.scheduler = %(scheduler)s AND m.name = s.name
"""

# A ready task whose partition does not exist yet waits for it, still marked (each tick evaluates it again), with no
# attempt counted; ``shown`` says whether its state changed (the tick log shows it then, and hourly otherwise).
WAIT_FOR_PARTITION = """
UPDATE reactive_tasks t
SET status = 'waiting', ready_values = NULL, explanation = e.explanation, evaluated_at = %(now)s, updated_at = %(now)s,
    shown_at = CASE WHEN t.status <> 'waiting' OR t.explanation IS DISTINCT FROM e.explanation THEN %(now)s
                    ELSE t.shown_at END
FROM jsonb_to_recordset(%(rows)s::jsonb) AS e(name text, explanation text)
WHERE t.scheduler = %(scheduler)s AND t.name = e.name AND t.status NOT IN ('launched', 'backoff')
RETURNING t.name, t.shown_at = %(now)s AS shown
"""

# Waiting tasks whose explanation (what blocks them) the tick log has not shown for an hour: shown again, at most
# ``limit`` a tick, highest priority first.
REMIND_WAITING = """
WITH due AS (
    SELECT name FROM reactive_tasks
    WHERE scheduler = %(scheduler)s AND status = 'waiting' AND defined
      AND (shown_at IS NULL OR shown_at <= %(since)s)
    ORDER BY priority DESC, name
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE reactive_tasks t SET shown_at = %(now)s
FROM due
WHERE t.scheduler = %(scheduler)s AND t.name = due.name
RETURNING t.name, t.explanation, t.evaluated_at, t.priority
"""

# A ready task whose launch could not be shaped (its partition, run config or tags raised) backs off.
LAUNCH_REFUSED = """
WITH refused AS (
    UPDATE reactive_tasks t
    SET status = 'backoff', ready_values = NULL, explanation = e.explanation, attempts = t.attempts + 1,
        backoff_until = e.backoff_until, evaluated_at = %(now)s, updated_at = %(now)s
    FROM jsonb_to_recordset(%(rows)s::jsonb) AS e(name text, explanation text, backoff_until timestamptz)
    WHERE t.scheduler = %(scheduler)s AND t.name = e.name AND t.status NOT IN ('launched', 'backoff')
    RETURNING t.name
)
DELETE FROM reactive_marks m USING refused r WHERE m.scheduler = %(scheduler)s AND m.name = r.name
"""

# The user code of these tasks is about to run (committed before it does): one more run counted, unless a task
# already has max_crashes runs that never ended (those are returned, and not run).
COUNT_USER_CODE = """
WITH counted AS (
    UPDATE reactive_tasks SET crashes = crashes + 1
    WHERE scheduler = %(scheduler)s AND name = ANY(%(names)s::text[]) AND crashes < %(max_crashes)s
    RETURNING name
)
SELECT t.name, t.crashes FROM reactive_tasks t
WHERE t.scheduler = %(scheduler)s AND t.name = ANY(%(names)s::text[]) AND t.name NOT IN (SELECT name FROM counted)
"""

# The user code of %(ended)s ended (returned, raised or timed out); that of %(unstarted)s never started.
END_USER_CODE = """
UPDATE reactive_tasks
SET crashes = CASE WHEN name = ANY(%(ended)s::text[]) THEN 0 ELSE greatest(crashes - 1, 0) END
WHERE scheduler = %(scheduler)s AND name = ANY(%(ended)s::text[] || %(unstarted)s::text[])
"""


def _change_task(assignments: str, returns: str = "name") -> str:
    """An UPDATE of task ``%(name)s`` of scheduler ``%(scheduler)s`` that also marks it, so the next tick evaluates
    it; it returns ``returns`` of the changed row (no row: no such task)."""
    return f"""
WITH changed AS (
    UPDATE reactive_tasks
    SET {assignments}
    WHERE scheduler = %(scheduler)s AND name = %(name)s
    RETURNING {returns}
), marked AS (
    INSERT INTO reactive_marks (scheduler, name) SELECT %(scheduler)s, %(name)s FROM changed ON CONFLICT DO NOTHING
)
SELECT {returns} FROM changed
"""


# `reactive retry`: a task parked for its crashes (or backing off) is evaluated again on the next tick.
RETRY_TASK = _change_task(
    """crashes = 0, status = CASE WHEN status = 'backoff' THEN 'waiting' ELSE status END, backoff_until = NULL,
        updated_at = now()"""
)

# One index probe (scheduler, task, values_hash) per launch: the cost does not grow with the launch history.
PREVIOUS_ATTEMPTS = """
SELECT k.task, k.values_hash, n.attempts
FROM jsonb_to_recordset(%(rows)s::jsonb) AS k(task text, values_hash text)
CROSS JOIN LATERAL (
    SELECT count(*)::int AS attempts FROM reactive_launches l
    WHERE l.scheduler = %(scheduler)s AND l.task = k.task AND l.values_hash = k.values_hash
) n
WHERE n.attempts > 0
"""

# The INSERT reads the UPDATE's RETURNING (no second join of the two row sets). Arrays, not one JSON recordset
# here: with the JSON form this statement ran for minutes at 10,000+ launches.
# Binary arrays (%(x)b): psycopg sends them without escaping each element (5,000 reasons: 4 ms, not 90 ms).
MARK_LAUNCHED = """
WITH launched AS (
    SELECT * FROM unnest(%(names)b::text[], %(run_keys)b::text[], %(values)b::jsonb[], %(hashes)b::text[],
                         %(attempts)b::int[], %(reasons)b::text[], %(partition_keys)b::text[])
         AS l(name, run_key, ctl_values, values_hash, attempt, reason, partition_key)
), tasks AS (
    UPDATE reactive_tasks t
    SET status = 'launched', run_key = l.run_key, run_id = NULL, launched_at = %(now)s, ready_values = l.ctl_values,
        explanation = l.reason, evaluated_at = %(now)s, updated_at = %(now)s, wake_at = NULL,
        partition_key = l.partition_key
    FROM launched l
    WHERE t.scheduler = %(scheduler)s AND t.name = l.name AND t.status NOT IN ('launched', 'backoff')
    RETURNING t.name, l.run_key, l.values_hash, l.attempt, l.ctl_values, l.reason, l.partition_key
), unmarked AS (
    DELETE FROM reactive_marks m USING tasks l WHERE m.scheduler = %(scheduler)s AND m.name = l.name
)
INSERT INTO reactive_launches (scheduler, task, run_key, values_hash, attempt, ctl_values, reason, launched_at,
                               partition_key)
SELECT %(scheduler)s, name, run_key, values_hash, attempt, ctl_values, reason, %(now)s, partition_key
FROM tasks
RETURNING task
"""

# `set-last` and `forget` end a backoff too: the next tick evaluates the task (a run in flight keeps its count).
_CLEAR_BACKOFF = """status = CASE WHEN status = 'backoff' THEN 'waiting' ELSE status END, backoff_until = NULL,
        attempts = CASE WHEN status = 'launched' THEN attempts ELSE 0 END"""

# -- reactive scheduler: status ---------------------------------------------------------------

TASK_STATUS = """
SELECT scheduler, name, status, defined,
       EXISTS (SELECT FROM reactive_marks m WHERE m.scheduler = t.scheduler AND m.name = t.name) AS dirty,
       priority, timezone, trigger, last_values, ready_values,
       run_key, run_id, launched_at, attempts, backoff_until, explanation, evaluated_at, backwards_note,
       last_success_at, produces, partition_key, shown_at, wake_at, deadline, deadline_since
FROM reactive_tasks t
WHERE (%(scheduler)s::text IS NULL OR scheduler = %(scheduler)s)
  AND (%(name)s::text IS NULL OR name = %(name)s)
ORDER BY scheduler, priority DESC, name
"""

FORGET_LAST_VALUES = _change_task(
    """last_values = CASE WHEN %(parameter)s::text[] IS NULL THEN '{}'::jsonb
                           ELSE last_values #- %(parameter)s::text[] END,
        backwards_note = NULL, updated_at = now(), """
    + _CLEAR_BACKOFF
)

# Move one remembered value (into the past too): the manual recovery of a Delta-type trigger.
SET_LAST_VALUE = _change_task(
    """last_values = jsonb_set(
            CASE WHEN last_values ? %(entity)s THEN last_values
                 ELSE last_values || jsonb_build_object(%(entity)s::text, '{}'::jsonb) END,
            ARRAY[%(entity)s::text, %(parameter)s::text], to_jsonb(%(value)s::text)),
        backwards_note = NULL, updated_at = now(), """
    + _CLEAR_BACKOFF,
    returns="last_values",
)

# -- reactive scheduler: runs launched by hand -------------------------------------------------

MANUAL_AFTER = "SELECT manual_after FROM reactive_schedulers WHERE name = %(scheduler)s"

SAVE_MANUAL_AFTER = """
UPDATE reactive_schedulers SET manual_after = greatest(manual_after, %(after)s) WHERE name = %(scheduler)s
"""

# Each hand-launched run is recorded once (its run_key is 'manual:<run id>'); the values it ran on become the
# task's last-seen values and the task is evaluated again. A task with a reactive run in flight keeps it.
RECORD_MANUAL_RUNS = """
WITH runs AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS r(name text, run_key text, run_id text, "values" jsonb, hash text, finished_at timestamptz)
), recorded AS (
    INSERT INTO reactive_launches (scheduler, task, run_key, values_hash, attempt, ctl_values, reason, launched_at,
                                   run_id, outcome, finished_at, manual)
    SELECT %(scheduler)s, r.name, r.run_key, r.hash, 1, r."values", 'launched by hand', r.finished_at, r.run_id,
           'success', r.finished_at, true
    FROM runs r ORDER BY r.finished_at
    ON CONFLICT (scheduler, run_key) DO NOTHING
    RETURNING task, run_id, ctl_values
), tasks AS (
    UPDATE reactive_tasks t
    SET last_values = r.ctl_values, backwards_note = NULL, last_success_at = %(now)s,
        updated_at = %(now)s
    FROM (SELECT DISTINCT ON (task) task, ctl_values FROM recorded ORDER BY task, run_id) r
    WHERE t.scheduler = %(scheduler)s AND t.name = r.task
    RETURNING t.name
), marked AS (
    INSERT INTO reactive_marks (scheduler, name) SELECT %(scheduler)s, name FROM tasks ON CONFLICT DO NOTHING
)
SELECT task, run_id, ctl_values FROM recorded
"""

# -- reactive runs: the values a launch ran on -------------------------------------------------

LAUNCH_VALUES = """
SELECT ctl_values FROM reactive_launches WHERE scheduler = %(scheduler)s AND run_key = %(run_key)s
"""

# The launch's reason and values are written into its run's log once: whoever claims it first (the run's executor
# before its first step, or the scheduler when it first sees the run) writes it.
CLAIM_LAUNCH_LOG = """
UPDATE reactive_launches SET logged_at = now()
WHERE scheduler = %(scheduler)s AND run_key = %(run_key)s AND logged_at IS NULL
RETURNING task, ctl_values, reason
"""
