"""Every query of the reactive scheduler (tables ``reactive_schedulers``, ``reactive_tasks``, ``reactive_marks``,
``reactive_mark_batches``, ``reactive_launches``).

A task to evaluate (an input changed since its last evaluation) is a row of ``reactive_marks``: marking and
unmarking write that narrow table, not the wide task row. The tasks a CTL change batch or the runs that succeeded mark
are one row of ``reactive_mark_batches`` instead (an array of names), deleted at the end of the tick that evaluated
them, which marks one by one those it did not get to. The tick knows the marks it writes; those written by hand
(``by_hand``, index reactive_marks_by_hand) are read each tick, all marks only when the tick does not know them.

An explanation is stored as facts (``facts``: what the evaluation read) and the text before them (``explanation``),
and rendered when read (cmb_dagster/reactive/explanations.py).

Bulk writes pass their rows as one JSON array (``jsonb_to_recordset``): psycopg dumps a JSON string much
faster than several text arrays whose every element it escapes.

A statement on given tasks joins them on both key columns from a materialized CTE of (scheduler, name) rows, so it
probes the primary key once per task whatever the statistics: given ``scheduler = %(scheduler)s`` instead, a planner
without statistics (autovacuum off) takes that for 0.5% of the table and reads every task of the scheduler into a
hash join. Their marks are found the same way, one probe each (:func:`_unmark`).
"""


def _unmark(tasks: str, where: str = "true") -> str:
    """A DELETE of the marks of the (scheduler, name) rows of CTE ``tasks`` (those matching ``where``), each found by
    its primary key: joined to them, the narrow marks table, all dead rows included, would be read whole."""
    return f"""DELETE FROM reactive_marks WHERE ctid = ANY(ARRAY(
        SELECT m.ctid FROM {tasks} t
        CROSS JOIN LATERAL (
            SELECT ctid FROM reactive_marks m WHERE m.scheduler = t.scheduler AND m.name = t.name OFFSET 0
        ) m
        WHERE {where}
    ))"""


# -- reactive scheduler: definitions ----------------------------------------------------------

# A tick starts: the scheduler's row as it was, with the token of the tick before, which this tick's replaces (a
# tick knows what the tables hold only if the one before was its process's) unless the row is another code
# location's with other tasks. Committed without waiting for the disk: the writes of the tick that need it flush this
# one too.
START_TICK = """
WITH previous AS (
    SELECT definitions_hash, location, ticked_at, tick_token FROM reactive_schedulers WHERE name = %(scheduler)s
    FOR UPDATE
), async AS (
    SELECT set_config('synchronous_commit', 'off', true) AS v
), started AS (
    UPDATE reactive_schedulers SET tick_token = %(token)s
    WHERE name = %(scheduler)s AND (SELECT v FROM async) = 'off'
      AND (definitions_hash = %(hash)s OR location IS NULL OR %(location)s::text IS NULL OR location = %(location)s)
)
SELECT definitions_hash, location, ticked_at, tick_token FROM previous
"""

# The row locked: definitions are stored by one tick at a time.
LOCK_SCHEDULER_ROW = """
SELECT definitions_hash, location, ticked_at FROM reactive_schedulers WHERE name = %(scheduler)s FOR UPDATE
"""

SAVE_DEFINITIONS_HASH = """
INSERT INTO reactive_schedulers (name, definitions_hash, location, ticked_at, tick_token)
VALUES (%(scheduler)s, %(hash)s, %(location)s, %(now)s, %(token)s)
ON CONFLICT (name) DO UPDATE
SET definitions_hash = EXCLUDED.definitions_hash, synced_at = now(),
    location = coalesce(EXCLUDED.location, reactive_schedulers.location), ticked_at = EXCLUDED.ticked_at,
    tick_token = EXCLUDED.tick_token
"""

# The code location that syncs the scheduler's tasks.
MOVE_SCHEDULER = """
UPDATE reactive_schedulers SET location = %(location)s WHERE name = %(scheduler)s
"""

# Every tick of the owner: when it started and how long it took (another location may take the name over when it
# stops; the reactive tasks asset's check says when it stopped). Committed without waiting for the disk: a crash of
# the server may lose a tick's figures, which the next tick writes again.
SAVE_TICK = """
WITH async AS (SELECT set_config('synchronous_commit', 'off', true) AS v)
UPDATE reactive_schedulers SET ticked_at = %(now)s, tick_seconds = %(seconds)s
WHERE name = %(scheduler)s AND (SELECT v FROM async) = 'off'
"""

# SAVE_TICK at the end of a tick that evaluated batches of marked tasks: the batches go, and the tasks it did not
# evaluate (or evaluates again next tick) are marked one by one (committed before the tick ends: the next tick reads
# them only if this one says so).
END_TICK = """
WITH marked AS (
    INSERT INTO reactive_marks (scheduler, name)
    SELECT %(scheduler)s, n.name FROM unnest(%(left)b::text[]) AS n(name)
    ON CONFLICT DO NOTHING
), done AS (
    DELETE FROM reactive_mark_batches WHERE scheduler = %(scheduler)s AND id = ANY(%(batches)s::bigint[])
)
UPDATE reactive_schedulers SET ticked_at = %(now)s, tick_seconds = %(seconds)s WHERE name = %(scheduler)s
"""

# The schedulers' last ticks, for their health check and metrics.
SCHEDULER_TICKS = """
SELECT name, location, ticked_at, tick_seconds FROM reactive_schedulers
WHERE %(scheduler)s::text IS NULL OR name = %(scheduler)s
ORDER BY name
"""

# The current values of CTL parameters and when each was set (constant time per parameter: the primary key, probed
# for each, OFFSET 0 keeping the lookup per parameter whatever the statistics).
CURRENT_VALUES = """
SELECT k.entity, k.parameter, v.value, v.updated_at
FROM unnest(%(entities)s::text[], %(parameters)s::text[]) AS k(entity, parameter)
CROSS JOIN LATERAL (
    SELECT value, updated_at FROM ctl_values v WHERE v.entity = k.entity AND v.parameter = k.parameter OFFSET 0
) v
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
INSERT INTO reactive_mark_batches (scheduler, names) VALUES (%(scheduler)s, %(names)b::text[]) RETURNING id
"""

NOTE_BACKWARDS = """
WITH n AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, * FROM unnest(%(names)s::text[], %(notes)s::text[]) AS n(name, note)
)
UPDATE reactive_tasks t SET backwards_note = n.note
FROM n
WHERE t.scheduler = n.scheduler AND t.name = n.name
"""

# -- reactive scheduler: runs in flight --------------------------------------------------------

LAUNCHED_TASKS = """
SELECT name, run_key, run_id, launched_at, attempts, ready_values, explanation, produces, partition_key, facts
FROM reactive_tasks WHERE scheduler = %(scheduler)s AND status = 'launched'
"""

NOTE_RUN_IDS = """
WITH r AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, * FROM unnest(%(names)s::text[], %(run_ids)s::text[]) AS r(name, run_id)
)
UPDATE reactive_tasks t SET run_id = r.run_id
FROM r
WHERE t.scheduler = r.scheduler AND t.name = r.name AND t.run_id IS DISTINCT FROM r.run_id
"""

# Success: the values the run was launched on become the task's last-seen state; its trigger is
# evaluated again (the tasks are marked in one batch, whose id is returned). Failure: the trigger stays armed
# (ready_values kept) and the task waits a backoff. Either is shown in the tick log.
FINISH_RUNS = f"""
WITH finished AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, * FROM jsonb_to_recordset(%(rows)s::jsonb)
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
        updated_at = %(now)s, shown_at = %(now)s
    FROM finished f
    WHERE t.scheduler = f.scheduler AND t.name = f.name AND t.status = 'launched' AND t.run_key = f.run_key
    RETURNING t.scheduler, f.name, f.run_key, f.run_id, f.success
), marked AS (
    INSERT INTO reactive_mark_batches (scheduler, names)
    SELECT %(scheduler)s, array_agg(name) FROM tasks WHERE success HAVING count(*) > 0
    RETURNING id
), unmarked AS (
    {_unmark("tasks", "NOT t.success")}
), outcomes AS (
    UPDATE reactive_launches l
    SET outcome = CASE WHEN f.success THEN 'success' ELSE 'failure' END, run_id = f.run_id, finished_at = %(now)s
    FROM tasks f
    WHERE l.scheduler = f.scheduler AND l.run_key = f.run_key AND l.outcome IS NULL
)
SELECT id FROM marked
"""

END_BACKOFFS = """
WITH ended AS (
    UPDATE reactive_tasks SET status = 'waiting', updated_at = %(now)s
    WHERE scheduler = %(scheduler)s AND status = 'backoff' AND backoff_until <= %(now)s
    RETURNING name
), marked AS (
    INSERT INTO reactive_marks (scheduler, name) SELECT %(scheduler)s, name FROM ended ON CONFLICT DO NOTHING
)
SELECT name FROM ended
"""

# Tasks whose wake time came (time alone can make them launch now) are marked for evaluation (index
# reactive_tasks_wake: the cost follows the tasks woken, not the tasks defined). Returned with them: the tasks marked
# by hand (index reactive_marks_by_hand), which the tick evaluates too.
WAKE_TASKS = """
WITH woken AS (
    UPDATE reactive_tasks SET wake_at = NULL
    WHERE scheduler = %(scheduler)s AND wake_at IS NOT NULL AND wake_at <= %(now)s
    RETURNING name
), marked AS (
    INSERT INTO reactive_marks (scheduler, name) SELECT %(scheduler)s, name FROM woken ON CONFLICT DO NOTHING
)
SELECT name FROM woken
UNION ALL
SELECT name FROM reactive_marks WHERE scheduler = %(scheduler)s AND by_hand
"""

# -- reactive scheduler: evaluation and launch -------------------------------------------------

# The marked tasks to evaluate, highest priority first (read when the tick does not know its marks, then evaluated in
# batches).
MARKED_TASKS = """
WITH m AS MATERIALIZED (SELECT scheduler, name FROM reactive_marks WHERE scheduler = %(scheduler)s)
SELECT t.name
FROM m JOIN reactive_tasks t ON t.scheduler = m.scheduler AND t.name = m.name
WHERE t.defined AND t.status NOT IN ('launched', 'backoff')
ORDER BY t.priority DESC, t.name
"""

# The batches of marked tasks (read with MARKED_TASKS).
MARK_BATCHES = """
SELECT id, names FROM reactive_mark_batches WHERE scheduler = %(scheduler)s
"""

# One batch of marked tasks, in the order given; a ready task stays marked until the launch step.
TASKS_TO_EVALUATE = """
WITH n AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, * FROM unnest(%(names)b::text[]) WITH ORDINALITY AS n(name, position)
)
SELECT t.name, t.last_values, t.backwards_note, t.priority, t.attempts, t.last_success_at, t.deadline_since
FROM n JOIN reactive_tasks t ON t.scheduler = n.scheduler AND t.name = n.name
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

# The highest-priority task among ``names`` whose trigger waits (the one a hold is for): each read by its primary key
# (OFFSET 0 keeps the status test out of the lookup, where it would match index reactive_tasks_shown instead).
TOP_WAITING_TASK = """
SELECT t.name, t.priority
FROM unnest(%(names)s::text[]) AS n(name)
CROSS JOIN LATERAL (
    SELECT name, priority, status, defined FROM reactive_tasks
    WHERE scheduler = %(scheduler)s AND name = n.name OFFSET 0
) t
WHERE t.status = 'waiting' AND t.defined
ORDER BY t.priority DESC, t.name
LIMIT 1
"""

# A row's ``unmark``: the task may have a mark of its own (not only in a batch).
SAVE_EVALUATIONS = f"""
WITH e AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, * FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS e(name text, status text, ready_values jsonb, explanation text, facts jsonb, wake_at timestamptz,
              unmark boolean)
), saved AS (
    UPDATE reactive_tasks t
    SET status = e.status, ready_values = e.ready_values, explanation = e.explanation, facts = e.facts,
        wake_at = e.wake_at, evaluated_at = %(now)s, updated_at = %(now)s, shown_at = %(now)s
    FROM e
    WHERE t.scheduler = e.scheduler AND t.name = e.name AND t.status NOT IN ('launched', 'backoff')
    RETURNING t.scheduler, t.name, e.unmark
)
{_unmark("saved", "t.unmark")}
"""

# A ready task whose partition does not exist yet waits for it, still marked (each tick evaluates it again), with no
# attempt counted; ``shown`` says whether its state changed (the tick log shows it then, and hourly otherwise): its
# explanation, other than the time it was evaluated.
WAIT_FOR_PARTITION = """
WITH e AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, * FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS e(name text, explanation text, facts jsonb)
)
UPDATE reactive_tasks t
SET status = 'waiting', ready_values = NULL, explanation = e.explanation, facts = e.facts, evaluated_at = %(now)s,
    updated_at = %(now)s,
    shown_at = CASE WHEN t.status <> 'waiting' OR t.explanation IS DISTINCT FROM e.explanation
                      OR t.facts - 'at' IS DISTINCT FROM e.facts - 'at' THEN %(now)s
                    ELSE t.shown_at END
FROM e
WHERE t.scheduler = e.scheduler AND t.name = e.name AND t.status NOT IN ('launched', 'backoff')
RETURNING t.name, t.shown_at = %(now)s AS shown
"""

# Waiting tasks whose explanation (what blocks them) the tick log has not shown for an hour: shown again, at most
# ``limit`` a tick, those shown longest ago first (then by priority). Read in the order of index reactive_tasks_shown,
# it stops at the first task shown since: an idle tick reads no task that is not due (REMINDERS_DUE: whether any is).
REMINDERS_DUE = """
SELECT EXISTS (
    SELECT FROM reactive_tasks
    WHERE scheduler = %(scheduler)s AND status = 'waiting' AND defined AND coalesce(shown_at, '-infinity') <= %(since)s
)
"""

REMIND_WAITING = """
WITH due AS (
    SELECT name FROM reactive_tasks
    WHERE scheduler = %(scheduler)s AND status = 'waiting' AND defined
      AND coalesce(shown_at, '-infinity') <= %(since)s
    ORDER BY coalesce(shown_at, '-infinity'), priority DESC, name
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE reactive_tasks t SET shown_at = %(now)s
FROM due
WHERE t.scheduler = %(scheduler)s AND t.name = due.name
RETURNING t.name, t.explanation, t.facts, t.evaluated_at, t.priority
"""

# A ready task whose launch could not be shaped (its partition, run config or tags raised) backs off.
LAUNCH_REFUSED = f"""
WITH e AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, * FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS e(name text, explanation text, facts jsonb, backoff_until timestamptz, unmark boolean)
), refused AS (
    UPDATE reactive_tasks t
    SET status = 'backoff', ready_values = NULL, explanation = e.explanation, facts = e.facts,
        attempts = t.attempts + 1, backoff_until = e.backoff_until, evaluated_at = %(now)s, updated_at = %(now)s
    FROM e
    WHERE t.scheduler = e.scheduler AND t.name = e.name AND t.status NOT IN ('launched', 'backoff')
    RETURNING t.scheduler, t.name, e.unmark
)
{_unmark("refused", "t.unmark")}
"""

# The user code of these tasks is about to run (committed before it does): one more run counted, unless a task
# already has max_crashes runs that never ended (those are returned, and not run).
COUNT_USER_CODE = """
WITH n AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, name FROM unnest(%(names)s::text[]) AS n(name)
), counted AS (
    UPDATE reactive_tasks t SET crashes = t.crashes + 1
    FROM n
    WHERE t.scheduler = n.scheduler AND t.name = n.name AND t.crashes < %(max_crashes)s
    RETURNING t.name
)
SELECT t.name, t.crashes
FROM n CROSS JOIN LATERAL (
    SELECT name, crashes FROM reactive_tasks WHERE scheduler = n.scheduler AND name = n.name OFFSET 0
) t
WHERE t.name NOT IN (SELECT name FROM counted)
"""

# The user code of %(ended)s ended (returned, raised or timed out); that of %(unstarted)s never started.
END_USER_CODE = """
WITH n AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, name, name = ANY(%(ended)s::text[]) AS ended
    FROM unnest(%(ended)s::text[] || %(unstarted)s::text[]) AS n(name)
)
UPDATE reactive_tasks t
SET crashes = CASE WHEN n.ended THEN 0 ELSE greatest(t.crashes - 1, 0) END
FROM n
WHERE t.scheduler = n.scheduler AND t.name = n.name
"""


def _change_task(assignments: str, returns: str = "name") -> str:
    """An UPDATE of task ``%(name)s`` of scheduler ``%(scheduler)s`` that also marks it by hand, so the next tick
    evaluates it; it returns ``returns`` of the changed row (no row: no such task)."""
    return f"""
WITH changed AS (
    UPDATE reactive_tasks
    SET {assignments}
    WHERE scheduler = %(scheduler)s AND name = %(name)s
    RETURNING {returns}
), marked AS (
    INSERT INTO reactive_marks (scheduler, name, by_hand) SELECT %(scheduler)s, %(name)s, true FROM changed
    ON CONFLICT (scheduler, name) DO UPDATE SET by_hand = true
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
# A launch's reason is stored as the task's explanation is: the text before its facts, and the facts (one JSON array,
# in the order of the other columns: psycopg dumps it in one call).
MARK_LAUNCHED = f"""
WITH launched AS MATERIALIZED (
    SELECT %(scheduler)s::text AS scheduler, l.*, nullif(f.facts, 'null') AS facts
    FROM unnest(%(names)b::text[], %(run_keys)b::text[], %(values)b::jsonb[], %(hashes)b::text[], %(attempts)b::int[],
                %(reasons)b::text[], %(partition_keys)b::text[], %(unmarks)b::bool[]) WITH ORDINALITY
         AS l(name, run_key, ctl_values, values_hash, attempt, reason, partition_key, unmark, position)
    JOIN jsonb_array_elements(%(facts)s::jsonb) WITH ORDINALITY AS f(facts, position) USING (position)
), tasks AS (
    UPDATE reactive_tasks t
    SET status = 'launched', run_key = l.run_key, run_id = NULL, launched_at = %(now)s, ready_values = l.ctl_values,
        explanation = l.reason, facts = l.facts, evaluated_at = %(now)s, updated_at = %(now)s, wake_at = NULL,
        partition_key = l.partition_key
    FROM launched l
    WHERE t.scheduler = l.scheduler AND t.name = l.name AND t.status NOT IN ('launched', 'backoff')
    RETURNING t.scheduler, t.name, l.run_key, l.values_hash, l.attempt, l.ctl_values, l.reason, l.facts,
              l.partition_key, l.unmark
), unmarked AS (
    {_unmark("tasks", "t.unmark")}
)
INSERT INTO reactive_launches (scheduler, task, run_key, values_hash, attempt, ctl_values, reason, facts, launched_at,
                               partition_key)
SELECT %(scheduler)s, name, run_key, values_hash, attempt, ctl_values, reason, facts, %(now)s, partition_key
FROM tasks
RETURNING task
"""

# `set-last` and `forget` end a backoff too: the next tick evaluates the task (a run in flight keeps its count).
_CLEAR_BACKOFF = """status = CASE WHEN status = 'backoff' THEN 'waiting' ELSE status END, backoff_until = NULL,
        attempts = CASE WHEN status = 'launched' THEN attempts ELSE 0 END"""

# -- reactive scheduler: status ---------------------------------------------------------------

TASK_STATUS = """
SELECT scheduler, name, status, defined,
       EXISTS (SELECT FROM reactive_marks m WHERE m.scheduler = t.scheduler AND m.name = t.name)
       OR EXISTS (SELECT FROM reactive_mark_batches b WHERE b.scheduler = t.scheduler AND t.name = ANY(b.names))
       AS dirty,
       priority, timezone, trigger, trigger_hash, last_values, ready_values, run_key, run_id, launched_at, attempts,
       backoff_until, explanation AS stored_explanation, facts, evaluated_at, backwards_note,
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
    RETURNING scheduler, task, run_id, ctl_values
), tasks AS (
    UPDATE reactive_tasks t
    SET last_values = r.ctl_values, backwards_note = NULL, last_success_at = %(now)s,
        updated_at = %(now)s
    FROM (SELECT DISTINCT ON (task) scheduler, task, ctl_values FROM recorded ORDER BY task, run_id) r
    WHERE t.scheduler = r.scheduler AND t.name = r.task
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

# The launch's reason and values are written into its run's log once, by the scheduler tick that first sees the run
# and claims it (two processes may tick). The reason is rendered from its facts
# with the task's trigger.
CLAIM_LAUNCH_LOG = """
WITH claimed AS (
    UPDATE reactive_launches SET logged_at = now()
    WHERE scheduler = %(scheduler)s AND run_key = %(run_key)s AND logged_at IS NULL
    RETURNING task, ctl_values, reason, facts
)
SELECT c.task, c.ctl_values, c.reason, c.facts, t.trigger, t.trigger_hash, t.timezone
FROM claimed c LEFT JOIN reactive_tasks t ON t.scheduler = %(scheduler)s AND t.name = c.task
"""
