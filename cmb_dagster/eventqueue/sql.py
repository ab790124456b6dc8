"""Every query of the event queue engine.

The hot path is two statements: EMIT (one insert for any number of events, plus one NOTIFY) and CLAIM_DUE (a batch
claimed in one statement, which first deletes the events the worker finished since its last claim: one statement and
one commit per batch). DELETE_DONE deletes finished events alone, while handlers run (before their locks can lapse)
and before a worker sleeps. Arrays of ids and times are sent in binary (the text form of 100 timestamps costs the
client more than the statement costs the server). An event is *ready* (``turn`` set) or *waiting* (delayed, retried
later, claimed, held). EMIT makes an event due now ready at once; each claim first stages the waiting events that
came due (index eventqueue_events_waiting), then walks the ready ones in (priority, turn) order on index
eventqueue_events_ready, each priority from its turn floor up (eventqueue_turn_floors), and stops after ``limit``
rows, so neither needs planner statistics. A turn is the event's
place in a round-robin over its handler's keys: after the events of its key already ready, no earlier than the head
of its priority. Keys whose rate or concurrency limit is reached are passed over, and of the rows read, each limited
key gets as many as its tokens and free slots allow (flow control's take, inlined: cmb_dagster/flow/sql.py). The
handler filter is written ``array_position(...) IS NOT NULL`` on purpose: without statistics the planner takes
``handler = ANY(...)`` to keep 0.5% of the rows and prefers reading every ready row and sorting them; an IS NOT NULL
test is estimated to keep nearly all rows, so the ordered index scan with LIMIT wins. A write of events a CTE chose
finds them by the array of their ids (``e.id = ANY(ARRAY(...))``) and reads their handler's settings by name for
each (_HANDLER), with no join to the CTE or to eventqueue_handlers: offered one, a planner that takes the table for
nearly empty (the statistics of a vacuum that a held snapshot kept from removing rows) walks a whole index.
"""

from cmb_dagster.flow import sql as flow_sql

# The flow-control scope of handler %(handler)s's events.
SCOPE_PREFIX = "eventqueue/"


def _flow_key(value: str) -> str:
    """The key of an event (columns of ``e``, its value ``value``) under its handler's key path (``h``), cut to the
    flow module's bound."""
    return f"""left(coalesce(CASE h.key_path[1] WHEN 'value' THEN ({value}) #>> h.key_path[2:]
                                       WHEN 'namespace' THEN e.namespace WHEN 'module' THEN e.module
                                       WHEN 'modifier' THEN e.modifier END, ''), 500)"""


_FLOW_KEY = _flow_key("e.value")
# A dead-lettered batch's key is its first member's (the events of a batch share their key).
_DEAD_FLOW_KEY = _flow_key("CASE WHEN e.batch_count IS NULL THEN e.value ELSE e.value -> 0 -> 'value' END")


# An event's place in claim order, priority descending (eventqueue_events_ready: (rank, turn, id)).
_RANK = "(-{}.priority::integer)"
# The highest event id given: where a priority with no event ready starts its turns (ids only grow).
_ID_HIGH_MARK = "coalesce(pg_sequence_last_value(pg_get_serial_sequence('eventqueue_events', 'id')::regclass), 0)"


def _turns(rows: str) -> str:
    """CTEs giving each row of ``rows`` (id or n, handler, flow_key, priority, place) its turn: ``turns``. Each
    key's last turn and its priority's head are read once (``heads`` is materialized: inlined, it was read again
    for every row), both from the priority's ``next`` turn up (eventqueue_turn_floors; 0 for a priority without a
    row): a new turn is never below it, and the entries below it belong to events claimed or finished. A priority
    with no event ready starts at the event ids' high mark, so turns move on as events go and no range is read
    again. The key's read cannot use eventqueue_events_ready (its predicate, ``turn >= 0``, does not follow from the
    key's bound): with the statistics of a vacuum a held snapshot held back, that index read whole looked cheaper
    than the key's range of eventqueue_events_key_turn."""
    return f"""heads AS MATERIALIZED (
    SELECT g.handler, g.flow_key, g.priority, greatest(
        coalesce((SELECT x.turn + 1 FROM eventqueue_events x
                  WHERE x.handler = g.handler AND x.flow_key = g.flow_key AND x.priority = g.priority
                    AND x.turn IS NOT NULL AND x.turn >= g.bound
                  ORDER BY x.turn DESC LIMIT 1), 0),
        coalesce((SELECT x.turn FROM eventqueue_events x
                  WHERE {_RANK.format("x")} = -g.priority AND x.turn >= g.bound AND x.turn >= 0
                  ORDER BY {_RANK.format("x")}, x.turn LIMIT 1), greatest(g.bound, {_ID_HIGH_MARK}))) AS first
    FROM (SELECT DISTINCT r.handler, r.flow_key, r.priority, coalesce(f.next, 0) AS bound
          FROM {rows} r LEFT JOIN eventqueue_turn_floors f ON f.priority = r.priority) AS g
), turns AS (
    SELECT r.*, hd.first - 1 + row_number() OVER (PARTITION BY r.handler, r.flow_key, r.priority ORDER BY r.place)
           AS turn
    FROM {rows} r JOIN heads hd USING (handler, flow_key, priority)
)"""


def _slots_of(rows: str) -> str:
    """The flow slots the events of ``rows`` (handler, flow_key, flow_slot, and more columns) hold, as flow control's
    statements name held slots (scope, key, slot, then the columns of ``rows``)."""
    return f"""(SELECT '{SCOPE_PREFIX}' || d.handler AS scope, d.flow_key AS key, d.flow_slot AS slot, d.*
     FROM {rows} d WHERE d.flow_slot IS NOT NULL)"""


def _free_slots(rows: str, holder: str = "%(holder)s") -> str:
    """Frees the concurrency slots the events of ``rows`` (handler, flow_key, flow_slot) hold for ``holder``;
    returns the rows of those freed."""
    return flow_sql.release(_slots_of(rows), holder)


# The events of ``ids`` whose lock is still the one the worker took (``locked``, in the same order), found by id
# whatever the table's statistics say (a plan that joins a list of ids to a table it takes for empty reads all of it).
def _held(ids: str, locked: str) -> str:
    position = f"array_position({ids}::bigint[], e.id)"
    return f"e.id = ANY({ids}::bigint[]) AND e.locked_at = ({locked}::timestamptz[])[{position}]"


# The finished events go, each only while the lock the worker took is still its own (a worker that was stopped
# or cut off past the lock's expiry leaves an event another worker claimed since to that worker), and the slots
# they held are free (_FREED tells the workers waiting for one). A claim begins with them (an empty list when the
# worker's handlers have limits: the slots it frees must be free for the claim that follows).
_DONE = f"""done AS (
    DELETE FROM eventqueue_events e
    WHERE {_held("%(done)b", "%(done_locked)b")}
    RETURNING e.id, e.handler, e.flow_key, e.flow_slot
), freed AS (
    {_free_slots("done")}
)"""
_FREED = "SELECT pg_notify(current_schema() || '.eventqueue', handler) FROM (SELECT DISTINCT handler FROM freed) AS f"


# -- emit -------------------------------------------------------------------------------------------

# Nothing is inserted when any handler is unknown (the first unknown one is returned instead). Each event gets
# its id first (in the order given); events of a debounced handler join their key's newest batch or begin one. A
# batch is capped on its count (max_batch) and on its size as its handler receives it (batch_bytes: the length of
# its JSON text, each member's text and the ', ' or bracket beside it). The events of one key in this emit are cut
# into pieces by both: by size, each event goes with the others whose offset (the size of the key's events before
# it) falls in the same span of max_batch_bytes less the largest member, so no piece passes the cap. The first
# piece joins the key's newest unclaimed batch when that one is open (never failed, not held) and both fit; the
# others begin batches. Only the newest: an older batch with room left would receive events after a newer one's.
# Each member is built once (members is materialized); the windows that cut the pieces read only narrow rows.
EMIT = f"""
WITH v AS (
    SELECT v.*, nextval(pg_get_serial_sequence('eventqueue_events', 'id')) AS id
    FROM unnest(%(namespaces)s::text[], %(modules)s::text[], %(handlers)s::text[], %(modifiers)s::text[],
                %(values)s::jsonb[], %(delays)s::float8[], %(priorities)s::int[])
         WITH ORDINALITY AS v(namespace, module, handler, modifier, value, delay, priority, n)
    WHERE NOT EXISTS (SELECT 1 FROM unnest(%(handlers)s::text[]) AS u(handler)
                      WHERE NOT EXISTS (SELECT 1 FROM eventqueue_handlers h WHERE h.name = u.handler))
), unknown AS (
    SELECT u.handler FROM unnest(%(handlers)s::text[]) AS u(handler)
    WHERE NOT EXISTS (SELECT 1 FROM eventqueue_handlers h WHERE h.name = u.handler) LIMIT 1
), keyed AS (
    SELECT e.*, {_FLOW_KEY} AS flow_key, e.n AS place, h.debounce_seconds, h.max_wait_seconds, h.max_batch
    FROM v e JOIN eventqueue_handlers h ON h.name = e.handler
), ready AS (
    SELECT * FROM keyed WHERE delay = 0 AND debounce_seconds IS NULL
), {_turns("ready")}, inserted AS (
    INSERT INTO eventqueue_events (id, namespace, module, handler, modifier, value, delay_until, visible_at, flow_key,
                                   priority, turn)
    SELECT k.id, k.namespace, k.module, k.handler, k.modifier, k.value,
           now() + make_interval(secs => k.delay), now() + make_interval(secs => k.delay), k.flow_key, k.priority,
           t.turn
    FROM keyed k LEFT JOIN turns t ON t.n = k.n
    WHERE k.debounce_seconds IS NULL
    ORDER BY k.n
), members AS MATERIALIZED (
    SELECT k.n, k.handler, k.flow_key, k.debounce_seconds, k.max_wait_seconds, k.max_batch, m.member,
           octet_length(m.member::text) + 2 AS bytes
    FROM keyed k CROSS JOIN LATERAL (
        SELECT jsonb_build_object('id', k.id, 'namespace', k.namespace, 'module', k.module, 'modifier', k.modifier,
                                  'value', k.value, 'enqueued_at', now()) AS member
        OFFSET 0  -- not pulled up: built once, not once for each use
    ) AS m
    WHERE k.debounce_seconds IS NOT NULL
), spans AS (
    SELECT m.n, m.handler, m.flow_key, m.max_batch,
           (sum(m.bytes) OVER (PARTITION BY m.handler, m.flow_key ORDER BY m.n) - m.bytes)
           / greatest(%(max_batch_bytes)s - max(m.bytes) OVER (PARTITION BY m.handler, m.flow_key), 1) AS span
    FROM members m
), pieces AS (
    SELECT s.n, s.span, (row_number() OVER (PARTITION BY s.handler, s.flow_key, s.span ORDER BY s.n) - 1) / s.max_batch
                        AS piece
    FROM spans s
), groups AS (
    SELECT m.handler, m.flow_key, p.span = 0 AND p.piece = 0 AS leading, min(m.debounce_seconds) AS debounce,
           min(m.max_wait_seconds) AS max_wait, min(m.max_batch) AS max_batch, count(*) AS n, sum(m.bytes) AS bytes,
           min(m.n) AS first, jsonb_agg(m.member ORDER BY m.n) AS batch
    FROM pieces p JOIN members m USING (n)
    GROUP BY m.handler, m.flow_key, p.span, p.piece
), open AS (
    SELECT g.handler, g.flow_key, o.id, g.batch, g.n, g.bytes,
           CASE WHEN g.max_wait IS NULL THEN now() + make_interval(secs => g.debounce)
                ELSE least(now() + make_interval(secs => g.debounce),
                           o.enqueued_at + make_interval(secs => g.max_wait)) END AS due
    FROM groups g CROSS JOIN LATERAL (
        SELECT e.id, e.enqueued_at, e.retries, e.crashes, e.visible_at, e.batch_count, e.batch_bytes
        FROM eventqueue_events e
        WHERE e.handler = g.handler AND e.flow_key = g.flow_key AND e.batch_count IS NOT NULL AND e.locked_at IS NULL
        ORDER BY e.id DESC LIMIT 1
        FOR UPDATE OF e
    ) AS o
    WHERE g.leading AND o.retries = 0 AND o.crashes = 0 AND o.visible_at < 'infinity'
      AND o.batch_count + g.n <= g.max_batch AND o.batch_bytes + g.bytes <= %(max_batch_bytes)s
), appended AS (
    UPDATE eventqueue_events e
    SET value = e.value || o.batch, batch_count = e.batch_count + o.n, batch_bytes = e.batch_bytes + o.bytes,
        visible_at = o.due, delay_until = o.due, turn = CASE WHEN o.due > now() THEN NULL ELSE e.turn END
    FROM open o
    WHERE e.id = ANY(ARRAY(SELECT id FROM open)) AND e.id = o.id
    RETURNING e.handler, e.flow_key
), begun AS (
    INSERT INTO eventqueue_events (id, namespace, module, handler, modifier, value, delay_until, visible_at, flow_key,
                                   priority, batch_count, batch_bytes)
    SELECT k.id, k.namespace, k.module, k.handler, k.modifier, g.batch, d.due, d.due, k.flow_key, k.priority, g.n,
           g.bytes
    FROM groups g JOIN keyed k ON k.n = g.first,
         LATERAL (SELECT now() + make_interval(secs => least(g.debounce, coalesce(g.max_wait, g.debounce))) AS due) d
    WHERE NOT g.leading
       OR NOT EXISTS (SELECT 1 FROM appended a WHERE a.handler = g.handler AND a.flow_key = g.flow_key)
)
SELECT (SELECT handler FROM unknown),
       (SELECT array_agg(id ORDER BY n) FROM v),
       CASE WHEN EXISTS (SELECT 1 FROM v) THEN pg_notify(current_schema() || '.eventqueue', %(payload)s) END
"""

# -- dequeue ----------------------------------------------------------------------------------------

_RULE = """
(SELECT r.rule_type FROM eventqueue_rules r
 WHERE r.namespace = e.namespace AND r.handler = e.handler AND r.event_space = e.module
 ORDER BY r.rule_type LIMIT 1 FOR KEY SHARE)  -- 'block' before 'pause'
"""


# The columns of a claim's rows, read by name: what a row says is its ``decision``; a 'claim' row carries the event
# claimed, the others the columns they name ('flow_missing': scope and flow_key; 'flow_wait': the wait in value).
CLAIM_COLUMNS = (
    "decision", "id", "namespace", "module", "handler", "modifier", "value", "retries", "enqueued_at", "locked_at",
    "seen_locked_at", "priority", "flow_key", "batch_count", "place", "crashes", "scope",
)  # fmt: skip
_CLAIMED = CLAIM_COLUMNS[1:-1]  # the columns of a claimed event


def _row(decision: str, **columns: str) -> str:
    """The select list of a claim's row saying ``decision`` (an SQL expression) with ``columns`` (name: SQL
    expression) given and the others NULL."""
    return ", ".join([f"{decision} AS decision"] + [f"{columns.get(c, 'NULL')} AS {c}" for c in CLAIM_COLUMNS[1:]])


# The flow limits of the claim's candidates (``offered``: id, scope, flow_key, priority, turn, decision, take):
# of each limited key's candidates in order, as many as its tokens and free slots allow are granted (taking
# them), the others are 'throttled'. ``candidates`` adds the slot granted; 'flow_missing' names the limited keys
# whose bucket (as locked) or slots do not exist, yet or any more, or whose free slots a sweep holds (the worker
# makes them, waiting for the sweep, and claims again). A key with a concurrency limit keeps its events starting
# in order: an event is taken only when no event of the key ahead of it was skipped (another claim holds it), and
# when several may run at once, only by the worker already running some of them.
def _admit(read: str) -> str:
    """The flow-limit CTEs; ``read`` names the CTE of every row the claim read (and locked)."""
    return f"""
limits AS MATERIALIZED (
    SELECT l.scope, l.rate, l.burst, l.concurrency FROM flow_limits l
    WHERE l.scope = ANY(ARRAY(SELECT '{SCOPE_PREFIX}' || h FROM unnest(%(handlers)s::text[]) AS h))
      AND (l.rate IS NOT NULL OR l.concurrency IS NOT NULL)
), ranked AS (
    SELECT o.id, o.scope, o.flow_key, o.handler,
           row_number() OVER (PARTITION BY o.scope, o.flow_key ORDER BY o.priority DESC, o.turn, o.id) AS r
    FROM offered o JOIN limits l USING (scope)
    WHERE o.decision = 'claim' AND o.take
      AND NOT (l.concurrency IS NOT NULL AND (  -- a key's events start in order
          (l.concurrency > 1 AND EXISTS (  -- a key another worker runs events of stays with it
              SELECT 1 FROM eventqueue_events x
              WHERE x.handler = o.handler AND x.flow_key = o.flow_key AND x.locked_by IS NOT NULL
                AND x.locked_by IS DISTINCT FROM %(owner)s AND x.visible_at > now()))
          OR EXISTS (  -- an event of the key ahead of it that this claim skipped is being claimed by another
              SELECT 1 FROM eventqueue_events x
              WHERE x.handler = o.handler AND x.flow_key = o.flow_key AND x.turn IS NOT NULL
                AND (x.priority > o.priority OR (x.priority = o.priority AND x.turn < o.turn))
                AND x.id NOT IN (SELECT id FROM {read}))))
), wanted AS (  -- a worker starts every event it claims at once: as many slots of a key as it can run now
    SELECT r.scope, r.flow_key AS key, n.want, n.want AS slots, h.lock_expiry_seconds AS ttl
    FROM (SELECT scope, flow_key, handler, count(*) AS n FROM ranked GROUP BY scope, flow_key, handler) AS r
    JOIN limits l USING (scope) JOIN eventqueue_handlers h ON h.name = r.handler
    CROSS JOIN LATERAL (SELECT CASE WHEN l.concurrency IS NULL THEN r.n ELSE least(r.n, l.concurrency) END AS want) n
), {flow_sql.take("wanted", "%(holder)s")}, admitted AS (
    SELECT r.id, t.slot
    FROM ranked r JOIN flow_granted g ON g.scope = r.scope AND g.key = r.flow_key AND r.r <= g.n
    LEFT JOIN flow_taken t ON t.scope = r.scope AND t.key = r.flow_key AND t.r = r.r
), candidates AS (
    SELECT o.id, o.seen_locked_at, o.crashes, o.take, o.place, a.slot AS flow_slot,
           CASE WHEN o.decision = 'claim' AND o.take AND o.scope IN (SELECT scope FROM limits) AND a.id IS NULL
                THEN 'throttled' ELSE o.decision END AS decision
    FROM offered o LEFT JOIN admitted a ON a.id = o.id
)"""


# What a claim does with its candidates: held ones are parked (visible_at = 'infinity'); one that has already begun
# max_crashes runs that never ended goes to the dead letters; the others are claimed (compare-and-set on locked_at)
# under the worker's lease. A claimed event's crashes are counted when its call starts: in the claim for the first
# start_now in claim order (place), which start at once, in START for the others. An event whose earlier run never
# ended (crashes > 0) runs alone in its worker: it starts at once only in a worker with no call running (idle).
# Each claim also returns the newest rule it read ('rules' row): a worker acknowledges that rule once no event
# claimed before it is still to start (it releases those it has not started).
_HANDLER = "(SELECT h.{} FROM eventqueue_handlers h WHERE h.name = e.handler)"
_UNLIMITED = """
candidates AS (
    SELECT o.id, o.seen_locked_at, o.crashes, o.take, o.place, NULL::int AS flow_slot, o.decision FROM offered o
)"""


def _apply(limited: bool, read: str = "offered") -> str:
    """The end of a claim: its candidates (admitted by the flow limits when ``limited``), applied."""
    missing = f"""
UNION ALL
SELECT {_row("'flow_missing'", scope="g.scope", flow_key="g.key")}
FROM flow_granted g WHERE g.missing"""
    return f"""
{_admit(read) if limited else _UNLIMITED}, rules AS MATERIALIZED (
    SELECT coalesce(max(id), 0) AS newest FROM eventqueue_rules
), held AS (
    UPDATE eventqueue_events e SET visible_at = 'infinity', turn = NULL
    FROM candidates c
    WHERE e.id = ANY(ARRAY(SELECT id FROM candidates WHERE decision IN ('pause', 'block')))
      AND e.id = c.id AND c.decision IN ('pause', 'block')
    RETURNING e.id, c.decision
), crashed AS (
    DELETE FROM eventqueue_events e
    USING candidates c
    WHERE e.id = ANY(ARRAY(SELECT id FROM candidates WHERE decision = 'claim' AND crashes > 0))
      AND e.id = c.id AND c.decision = 'claim' AND c.crashes > 0 AND e.crashes >= {_HANDLER.format("max_crashes")}
    RETURNING e.id, e.namespace, e.module, e.handler, e.modifier, e.value, e.retries, e.enqueued_at, e.crashes,
              e.priority, e.batch_count
), dead AS (
    INSERT INTO eventqueue_dead
        (id, namespace, module, handler, modifier, value, retries, enqueued_at, priority, batch_count, error, traceback)
    SELECT id, namespace, module, handler, modifier, value, retries, enqueued_at, priority, batch_count,
           format('%%s runs in a row ended with the death of their worker (a crash, kill -9 or OOM)', crashes), ''
    FROM crashed
    RETURNING id
), claimed AS (
    UPDATE eventqueue_events e
    SET locked_at = now(), visible_at = now() + make_interval(secs => {_HANDLER.format("lock_expiry_seconds")}),
        turn = NULL,
        crashes = e.crashes + CASE WHEN c.place <= %(start_now)s AND (c.crashes = 0 OR %(idle)s) THEN 1 ELSE 0 END,
        flow_slot = c.flow_slot,
        locked_by = %(owner)s, lock_fence = %(fence)s
    FROM candidates c
    WHERE e.id = ANY(ARRAY(SELECT id FROM candidates WHERE decision = 'claim' AND take))
      AND e.id = c.id AND c.decision = 'claim' AND c.take AND e.crashes < {_HANDLER.format("max_crashes")}
      AND e.locked_at IS NOT DISTINCT FROM c.seen_locked_at        -- compare-and-set on locked_at
    RETURNING e.id, e.namespace, e.module, e.handler, e.modifier, e.value, e.retries, e.enqueued_at,
              e.locked_at, c.seen_locked_at, e.priority, e.flow_key, e.batch_count, c.place, c.crashes
)
SELECT {_row("'claim'", **{c: c for c in _CLAIMED})}
FROM claimed
UNION ALL
SELECT {_row("decision", id="id")} FROM held
UNION ALL
SELECT {_row("'crashed'", id="id")} FROM dead
UNION ALL
SELECT {_row("decision", id="id")} FROM candidates
WHERE decision NOT IN ('claim', 'pause', 'block')
UNION ALL
SELECT {_row("'lock_claim_failed'", id="c.id")}
FROM candidates c
WHERE c.decision = 'claim' AND c.take AND c.id NOT IN (SELECT id FROM claimed)  -- hashed: one pass over each
  AND c.id NOT IN (SELECT id FROM crashed)
UNION ALL
SELECT {_row("'rules'", id="newest")}
FROM rules
UNION ALL
SELECT {_row("'freed'")}
FROM ({_FREED}) AS n{missing if limited else ""}
"""


# The ranges of eventqueue_events_ready a claim reads, highest priority first: each priority with a row in
# eventqueue_turn_floors from its floor up, and the priorities between them (none claimed yet: a new priority) whole.
_SEGMENTS = """segments AS MATERIALIZED (
    SELECT f.priority AS high, f.priority AS low, f.floor FROM eventqueue_turn_floors f
    UNION ALL
    SELECT coalesce(lag(f.priority::integer) OVER (ORDER BY f.priority DESC) - 1, 32767), f.priority + 1, 0
    FROM eventqueue_turn_floors f
    UNION ALL
    SELECT coalesce(min(f.priority::integer) - 1, 32767), -32768, 0 FROM eventqueue_turn_floors f
)"""


# The worker's batch: the ready events of its handlers whose key is not at a limit, in (priority, turn) order:
# held rows are skipped, not waited for. Events under a rule are parked (visible_at = 'infinity'), the rule row
# share-locked so an unpause waits for this transaction and then finds them parked. An event whose earlier run
# never ended (crashes > 0) is claimed alone: the batch is then that one event. A 'came_due' row says waiting
# events came due (the worker stages them, STAGE); 'flow_wait' returns the seconds until a key at its rate limit
# has a token again. A worker whose handlers have no rate or concurrency limit runs the claim without the
# flow-control parts (``limited`` False). Each priority is read from its floor up, a ``full`` claim from its first
# turn: a worker makes one now and then for the events whose transaction committed long after their emit (their
# turns can be below the floor).
def claim_due(limited: bool) -> str:
    """The claim of a batch, with the flow limits applied when ``limited``."""
    return f"""
WITH {_DONE}, {_AT_LIMIT + ", " if limited else ""}{_SEGMENTS}, due AS (
    SELECT d.* FROM (SELECT * FROM segments ORDER BY high DESC) AS s CROSS JOIN LATERAL (
        SELECT e.id, e.locked_at AS seen_locked_at, e.crashes, e.priority, e.turn, e.handler, e.flow_key,
               '{SCOPE_PREFIX}' || e.handler AS scope, coalesce({_RULE}, 'claim') AS decision
        FROM eventqueue_events e
        WHERE ({_RANK.format("e")}, e.turn) >= (-s.high, CASE WHEN %(full)s THEN 0 ELSE s.floor END)
          AND {_RANK.format("e")} <= -s.low AND e.turn >= 0
          AND e.visible_at <= now() AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL
          AND coalesce(e.locked_by <> %(owner)s, true)  -- its lock lapsed while its call runs here: not again here
          {_NOT_AT_LIMIT if limited else ""}
        ORDER BY {_RANK.format("e")}, e.turn, e.id
        LIMIT %(limit)s
        FOR UPDATE OF e SKIP LOCKED
    ) AS d
    LIMIT %(limit)s
), suspect AS (
    SELECT id FROM due WHERE decision = 'claim' AND crashes > 0 ORDER BY priority DESC, turn, id LIMIT 1
), offered AS (
    SELECT due.*, NOT EXISTS (SELECT 1 FROM suspect) OR id = (SELECT id FROM suspect) AS take,
           row_number() OVER (ORDER BY priority DESC, turn, id) AS place
    FROM due
    WHERE decision <> 'claim' OR NOT EXISTS (SELECT 1 FROM suspect) OR id = (SELECT id FROM suspect)
), {_apply(limited, "due")}
UNION ALL
SELECT {_row("'came_due'")}
WHERE EXISTS (SELECT 1 FROM eventqueue_events e WHERE e.turn IS NULL AND e.locked_by IS NULL AND e.visible_at <= now()
              AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL){_FLOW_WAIT if limited else ""}
"""


def stage(locked: bool) -> str:
    """The waiting events of the worker's handlers that came due become ready, taking their turns; returns how many.
    Those no worker holds (delayed, retried, released by a rule, given back by a worker or taken from a lapsed one:
    eventqueue_events_waiting), or with ``locked`` those whose claim's lock expired (eventqueue_events_locks)."""
    return f"""
WITH came_due AS (
    SELECT e.id, e.handler, e.flow_key, e.priority, e.visible_at AS place
    FROM eventqueue_events e
    WHERE e.turn IS NULL AND e.locked_by IS {"NOT NULL" if locked else "NULL"} AND e.visible_at <= now()
      AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL
    ORDER BY e.visible_at
    LIMIT %(stage_limit)s
    FOR UPDATE OF e SKIP LOCKED
), {_turns("came_due")}, staged AS (
    UPDATE eventqueue_events e SET turn = t.turn FROM turns t WHERE e.id = t.id
    RETURNING e.id
)
SELECT count(*) FROM staged
"""


STAGE = {locked: stage(locked) for locked in (False, True)}


# The turn floors of the priorities a worker claimed events of: ``next`` becomes the floor and the lowest turn ready
# from it up (or, none being ready, the event ids' high mark, above every turn given) the next, at most once a
# second for each priority whatever the workers, and only when one of them moves.
REFRESH_TURN_FLOORS = f"""
INSERT INTO eventqueue_turn_floors AS f (priority, floor, next, shifted_at)
SELECT p.priority, p.next, coalesce(
    (SELECT e.turn FROM eventqueue_events e
     WHERE {_RANK.format("e")} = -p.priority AND e.turn >= p.next AND e.turn >= 0
     ORDER BY {_RANK.format("e")}, e.turn LIMIT 1),
    greatest(p.next, {_ID_HIGH_MARK})), now()
FROM (SELECT u.priority, coalesce(o.next, 0) AS next
      FROM unnest(%(priorities)s::smallint[]) AS u(priority)
      LEFT JOIN eventqueue_turn_floors o ON o.priority = u.priority) AS p
ON CONFLICT (priority) DO UPDATE SET floor = EXCLUDED.floor, next = EXCLUDED.next, shifted_at = EXCLUDED.shifted_at
WHERE f.shifted_at <= now() - interval '1 second' AND (EXCLUDED.next > f.next OR f.floor < f.next)
"""

# Keys at their rate limit (an empty bucket) or concurrency limit (every slot taken), through the indexes on
# the few buckets empty now and on the slots taken.
_AT_LIMIT = f"""at_limit AS MATERIALIZED (
    {flow_sql.at_limit(f"ARRAY(SELECT '{SCOPE_PREFIX}' || h FROM unnest(%(handlers)s::text[]) AS h)")}
)"""
_NOT_AT_LIMIT = f"""AND NOT EXISTS (SELECT 1 FROM at_limit a
                      WHERE a.scope = '{SCOPE_PREFIX}' || e.handler AND a.key = e.flow_key)"""
_FLOW_WAIT = f"""
UNION ALL
SELECT {_row("'flow_wait'", value="to_jsonb(min(wait))")}
FROM at_limit HAVING count(*) > 0"""


# The flowchart for named events (a notification that names them): each row says which edge it took.
def claim_ids(limited: bool) -> str:
    """The claim of named events, with the flow limits applied when ``limited``."""
    return f"""
WITH {_DONE}, offered AS (
    SELECT e.id, e.locked_at AS seen_locked_at, e.crashes, true AS take, NULL::bigint AS place, e.priority, e.turn,
           e.handler, e.flow_key, '{SCOPE_PREFIX}' || e.handler AS scope,
           coalesce({_RULE},
                    CASE WHEN e.delay_until > now() THEN 'delay_not_yet'
                         WHEN e.locked_at IS NOT NULL AND e.visible_at > now() THEN 'is_locked'
                         ELSE 'claim' END) AS decision
    FROM eventqueue_events e
    WHERE e.id = ANY(%(ids)s::bigint[]) AND e.handler = ANY(%(handlers)s::text[])
    FOR UPDATE OF e SKIP LOCKED
), {_apply(limited)}
"""


CLAIM_DUE = {limited: claim_due(limited) for limited in (False, True)}
CLAIM_IDS = {limited: claim_ids(limited) for limited in (False, True)}

EXISTING_IDS = "SELECT id FROM eventqueue_events WHERE id = ANY(%(ids)s::bigint[])"

# Seconds until the next waiting event of these handlers that no worker holds comes due (for the worker's sleep;
# 0: one is due). A lock's expiry is found by RECLAIM_LAPSED's check.
NEXT_VISIBLE = """
SELECT greatest(extract(epoch FROM visible_at - now())::float8, 0) FROM eventqueue_events
WHERE turn IS NULL AND locked_by IS NULL AND array_position(%(handlers)s::text[], handler) IS NOT NULL
  AND visible_at < 'infinity'
ORDER BY visible_at LIMIT 1
"""

DELETE_DONE = f"""
WITH {_DONE}
{_FREED}
"""

# The events held by workers whose liveness lease lapsed (a kill -9, a lost host): visible again at once (they
# take their turns when staged; the crashes of those whose calls had started are counted), the slots their worker
# held for them free (its name read in the statement's snapshot, which this update is not part of). Read through
# eventqueue_events_claimed, which holds the events being run and nothing else. Returns how many, and whether a
# claim's lock expired meanwhile (through eventqueue_events_locks: the worker then stages them).
RECLAIM_LAPSED = f"""
WITH lapsed AS (
    UPDATE eventqueue_events e SET visible_at = now(), locked_by = NULL, lock_fence = NULL
    WHERE e.locked_by IS NOT NULL AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL
      AND e.visible_at > now() AND e.visible_at < 'infinity'
      AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.kind = %(kind)s AND l.partition = e.locked_by
                      AND l.fence = e.lock_fence AND l.expires_at > now())
    RETURNING e.id, e.handler, e.flow_key, e.flow_slot,
              (SELECT x.locked_by FROM eventqueue_events x WHERE x.id = e.id) AS holder  -- before this update
), freed AS (
    {_free_slots("lapsed", "h.holder")}
)
SELECT count(*),
       EXISTS (SELECT 1 FROM eventqueue_events e WHERE e.turn IS NULL AND e.locked_by IS NOT NULL
               AND e.visible_at <= now() AND array_position(%(handlers)s::text[], e.handler) IS NOT NULL)
FROM lapsed
"""

# Claimed events about to start: their crashes counted up (a run that never ends is then charged to them alone), each
# only while its claim is still this worker's (lock and holder unchanged). Returns the ids that may start. Committed
# without waiting for the WAL flush: only a crash of the server itself loses a count, never a worker's death.
START = f"""
UPDATE eventqueue_events e SET crashes = e.crashes + 1
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS commit_without_flush
WHERE {_held("%(ids)s", "%(locked)s")} AND e.locked_by IS NOT DISTINCT FROM %(owner)s
RETURNING e.id
"""

# Claimed events that will not start here (a new rule, the worker stops): visible again at once (they take their turns
# when staged), their slots free. Returns how many.
RELEASE = f"""
WITH released AS (
    UPDATE eventqueue_events e SET visible_at = now(), locked_by = NULL, lock_fence = NULL
    WHERE {_held("%(ids)s", "%(locked)s")} AND e.locked_by IS NOT DISTINCT FROM %(owner)s
    RETURNING e.id, e.handler, e.flow_key, e.flow_slot
), freed AS (
    {_free_slots("released")}
)
SELECT count(*) FROM released
"""

# The worker still runs these events (or has them to start, or to delete): their locks last another expiry. Returns
# the events renewed; the others are no longer this worker's (their claim was taken over, or they are gone).
EXTEND_LOCKS = f"""
WITH extended AS (
    UPDATE eventqueue_events e SET visible_at = now() + make_interval(secs => {_HANDLER.format("lock_expiry_seconds")})
    WHERE {_held("%(ids)s", "%(locked)s")}
    RETURNING e.id, e.handler, e.flow_key, e.flow_slot, {_HANDLER.format("lock_expiry_seconds")} AS ttl
), slots AS (
    {flow_sql.renew(_slots_of("extended"), "%(holder)s")}
)
SELECT id FROM extended
"""

# The newest rule: a worker acknowledges it once every event it claimed before has started.
NEWEST_RULE = "SELECT coalesce(max(id), 0) FROM eventqueue_rules"

ACKNOWLEDGE_RULES = """
INSERT INTO eventqueue_workers AS w (owner, rules_seen) VALUES (%(owner)s, %(rule)s)
ON CONFLICT (owner) DO UPDATE SET rules_seen = greatest(w.rules_seen, EXCLUDED.rules_seen), seen_at = now()
"""

FORGET_WORKER = "DELETE FROM eventqueue_workers WHERE owner = %(owner)s"

# Live workers (their liveness lease unexpired) that have not acknowledged rule %(rule)s yet.
UNACKNOWLEDGED = """
SELECT l.partition FROM leases l LEFT JOIN eventqueue_workers w ON w.owner = l.partition
WHERE l.kind = %(kind)s AND l.expires_at > now() AND coalesce(w.rules_seen, 0) < %(rule)s
ORDER BY l.partition
"""

# RetryAllowed: increment, delay with backoff; only while the lock is still ours. Its slot is free.
RETRY = f"""
WITH retried AS (
    UPDATE eventqueue_events e
    SET retries = retries + 1, locked_at = NULL, locked_by = NULL, lock_fence = NULL, last_error = %(error)s,
        crashes = 0, flow_slot = NULL,
        delay_until = now() + make_interval(secs => %(delay)s), visible_at = now() + make_interval(secs => %(delay)s)
    FROM (SELECT id, flow_slot FROM eventqueue_events WHERE id = %(id)s AND locked_at = %(locked_at)s FOR UPDATE)
         AS old
    WHERE e.id = old.id
    RETURNING e.id, e.handler, e.flow_key, old.flow_slot
), freed AS (
    {_free_slots("retried")}
)
SELECT id FROM retried
"""

# RetryTooMany: into the dead-letter table with the last error and traceback. Its slot is free.
KILL = f"""
WITH moved AS (
    DELETE FROM eventqueue_events WHERE id = %(id)s AND locked_at = %(locked_at)s
    RETURNING id, namespace, module, handler, modifier, value, retries, enqueued_at, priority, flow_key, flow_slot,
              batch_count
), freed AS (
    {_free_slots("moved")}
)
INSERT INTO eventqueue_dead
    (id, namespace, module, handler, modifier, value, retries, enqueued_at, priority, batch_count, error, traceback)
SELECT id, namespace, module, handler, modifier, value, retries, enqueued_at, priority, batch_count, %(error)s,
       %(traceback)s
FROM moved
RETURNING id
"""

# -- handlers ---------------------------------------------------------------------------------------

REGISTER_HANDLERS = """
INSERT INTO eventqueue_handlers AS h (name, kind, lock_expiry_seconds, max_retries, retry_delay_seconds,
                                      max_retry_delay_seconds, max_crashes, key_path, debounce_seconds,
                                      max_wait_seconds, max_batch)
SELECT n, k, le, mr, bf, bm, mc, CASE WHEN kp = '' THEN NULL ELSE string_to_array(kp, '.') END, db, mw, mb
FROM unnest(%(names)s::text[], %(kinds)s::text[], %(lock_expiry)s::float8[], %(max_retries)s::int[],
            %(backoff_first)s::float8[], %(backoff_max)s::float8[], %(max_crashes)s::int[], %(key_paths)s::text[],
            %(debounce)s::float8[], %(max_wait)s::float8[], %(max_batch)s::int[])
     AS u(n, k, le, mr, bf, bm, mc, kp, db, mw, mb)
ON CONFLICT (name) DO UPDATE SET
    kind = EXCLUDED.kind, lock_expiry_seconds = EXCLUDED.lock_expiry_seconds, max_retries = EXCLUDED.max_retries,
    retry_delay_seconds = EXCLUDED.retry_delay_seconds, max_retry_delay_seconds = EXCLUDED.max_retry_delay_seconds,
    max_crashes = EXCLUDED.max_crashes, key_path = EXCLUDED.key_path, debounce_seconds = EXCLUDED.debounce_seconds,
    max_wait_seconds = EXCLUDED.max_wait_seconds, max_batch = EXCLUDED.max_batch, registered_at = now()
"""

HANDLER_EXISTS = "SELECT 1 FROM eventqueue_handlers WHERE name = %(handler)s"

# -- rules ------------------------------------------------------------------------------------------

# A new rule, and a hint to every worker to check the events it has claimed against it (on commit).
ADD_RULE = """
WITH added AS (
    INSERT INTO eventqueue_rules (rule_type, namespace, handler, event_space)
    VALUES (%(rule_type)s, %(namespace)s, %(handler)s, %(event_space)s)
    ON CONFLICT DO NOTHING
    RETURNING id
)
SELECT id, pg_notify(current_schema() || '.eventqueue', 'rules') FROM added
"""

# Deleting waits for claimers that share-locked the rule; the next statement then sees what they parked.
DELETE_RULE = """
DELETE FROM eventqueue_rules
WHERE rule_type = %(rule_type)s AND namespace = %(namespace)s AND handler = %(handler)s
  AND event_space = %(event_space)s
RETURNING id
"""

# Held events become visible again unless another rule still holds them, and workers are told.
RELEASE_HELD = """
WITH released AS (
    UPDATE eventqueue_events e
    SET visible_at = CASE WHEN e.locked_at IS NULL THEN e.delay_until
                          ELSE e.locked_at + make_interval(secs => h.lock_expiry_seconds) END
    FROM eventqueue_handlers h
    WHERE e.handler = %(handler)s AND e.namespace = %(namespace)s AND e.module = %(event_space)s
      AND e.visible_at = 'infinity' AND h.name = e.handler
      AND NOT EXISTS (SELECT 1 FROM eventqueue_rules r WHERE r.handler = e.handler AND r.namespace = e.namespace
                      AND r.event_space = e.module)
    RETURNING e.id
)
SELECT count(*), CASE WHEN count(*) > 0 THEN pg_notify(current_schema() || '.eventqueue', %(handler)s) END
FROM released
"""

LIST_RULES = """
SELECT rule_type, namespace, handler, event_space, created_at,
       (SELECT count(*) FROM eventqueue_events e WHERE e.handler = r.handler AND e.namespace = r.namespace
        AND e.module = r.event_space AND (e.visible_at = 'infinity' OR e.locked_at IS NULL)) AS held
FROM eventqueue_rules r ORDER BY handler, namespace, event_space, rule_type
"""

# -- status -----------------------------------------------------------------------------------------

# An event (``x``) a rule holds: parked by a claim, or not running and under a pause or block rule (whether or not a
# worker has claimed it since the rule was made).
_HELD_BY_RULE = """(x.visible_at = 'infinity' OR (x.locked_at IS NULL AND EXISTS (
    SELECT 1 FROM eventqueue_rules r WHERE r.handler = x.handler AND r.namespace = x.namespace
                                       AND r.event_space = x.module)))"""

# Per registered handler, from the indexes whatever the statistics: its events by eventqueue_events_handler, its
# dead letters by eventqueue_dead_handler.
STATUS = f"""
SELECT h.name AS handler, h.kind, c.queued, c.delayed, c.locked, c.held, d.dead,
       coalesce(c.oldest, 0) AS oldest_queued_seconds,
       ARRAY(SELECT r.rule_type || ' ' || r.namespace || '/' || r.event_space
             FROM eventqueue_rules r WHERE r.handler = h.name ORDER BY r.id) AS rules,
       array_to_string(h.key_path, '.') AS key, l.rate AS rate_per_second, l.burst, l.concurrency
FROM eventqueue_handlers h
LEFT JOIN flow_limits l ON l.scope = '{SCOPE_PREFIX}' || h.name
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE e.held) AS held,
           count(*) FILTER (WHERE NOT e.held AND e.locked_at IS NULL AND e.delay_until <= now()) AS queued,
           count(*) FILTER (WHERE NOT e.held AND e.locked_at IS NULL AND e.delay_until > now()) AS delayed,
           count(*) FILTER (WHERE NOT e.held AND e.locked_at IS NOT NULL) AS locked,
           extract(epoch FROM now() - min(e.enqueued_at) FILTER (
               WHERE NOT e.held AND e.locked_at IS NULL AND e.delay_until <= now()))::float8 AS oldest
    FROM (SELECT x.enqueued_at, x.locked_at, x.delay_until, {_HELD_BY_RULE} AS held
          FROM eventqueue_events x WHERE x.handler = h.name) AS e
) AS c
CROSS JOIN LATERAL (SELECT count(*) AS dead FROM eventqueue_dead x WHERE x.handler = h.name) AS d
ORDER BY h.name
"""

# -- dead letters -----------------------------------------------------------------------------------

LIST_DEAD = f"""
SELECT e.id, e.namespace, e.module, e.handler, e.modifier, e.value, e.retries, e.enqueued_at, e.priority,
       {_DEAD_FLOW_KEY}, e.died_at, e.error, e.traceback
FROM eventqueue_dead e LEFT JOIN eventqueue_handlers h ON h.name = e.handler
WHERE (%(handler)s::text IS NULL OR e.handler = %(handler)s)
ORDER BY e.id LIMIT %(limit)s
"""

LOCK_DEAD_IDS = "SELECT id FROM eventqueue_dead WHERE id = ANY(%(ids)s::bigint[]) FOR UPDATE"

REPLAY = f"""
WITH moved AS (
    DELETE FROM eventqueue_dead
    WHERE (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND (%(handler)s::text IS NULL OR handler = %(handler)s)
    RETURNING id, namespace, module, handler, modifier, value, enqueued_at, priority, batch_count
), inserted AS (
    INSERT INTO eventqueue_events (id, namespace, module, handler, modifier, value, enqueued_at, priority, flow_key,
                                   batch_count, batch_bytes)
    SELECT e.id, e.namespace, e.module, e.handler, e.modifier, e.value, e.enqueued_at, e.priority, {_DEAD_FLOW_KEY},
           e.batch_count, CASE WHEN e.batch_count IS NOT NULL THEN octet_length(e.value::text) END
    FROM moved e JOIN eventqueue_handlers h ON h.name = e.handler
    RETURNING id
)
SELECT (SELECT array_agg(id ORDER BY id) FROM inserted),
       CASE WHEN EXISTS (SELECT 1 FROM inserted) THEN pg_notify(current_schema() || '.eventqueue', '') END
"""

# -- cron -------------------------------------------------------------------------------------------

DB_NOW = "SELECT now()"

# One fire per (cron, fire_time) across all workers: the event is inserted only with its record.
CRON_FIRE = f"""
WITH record AS (
    INSERT INTO eventqueue_cron_records (cron, fire_time, event_id)
    VALUES (%(cron)s, %(fire_time)s, nextval(pg_get_serial_sequence('eventqueue_events', 'id')))
    ON CONFLICT DO NOTHING
    RETURNING event_id
), e AS (
    SELECT event_id AS id, %(namespace)s::text AS namespace, %(module)s::text AS module,
           %(handler)s::text AS handler, %(modifier)s::text AS modifier, %(value)s::jsonb AS value
    FROM record
), inserted AS (
    INSERT INTO eventqueue_events (id, namespace, module, handler, modifier, value, flow_key)
    SELECT e.id, e.namespace, e.module, e.handler, e.modifier, e.value, {_FLOW_KEY}
    FROM e JOIN eventqueue_handlers h ON h.name = e.handler
    RETURNING id
)
SELECT id, pg_notify(current_schema() || '.eventqueue', %(handler)s) FROM inserted
"""
