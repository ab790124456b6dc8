"""Pub/sub change stream: any table's changes as an ordered stream that consumers never skip.

Producers write events in their own transaction: :func:`install_capture` puts statement-level
triggers on a table, :func:`publish` writes one event (transactional outbox). Each event records its
producing transaction's txid (``pg_current_xact_id()``). A :class:`Consumer` reads one branch and
hands batches to ``handler(conn, events)`` inside the transaction that moves its watermark, so
results written through ``conn`` and progress commit together: exactly once.

Why not "id > last id": ids are taken at insert time, transactions commit in another order, so a
reader can pass id 11 while the transaction holding id 10 is still open, and never come back.

Design choice: snapshot differences (PgQ's ``batch_event_sql``), not the original design's out-of-order table.
The original design reads only events below the reading snapshot's xmin, so a single transaction left open
anywhere (a long report, an idle session) stalls every consumer; its fix, delivering newer events
and remembering them in an ``out_of_order`` table, writes a row per early event, needs those rows
joined into every read and cleaned up later, and splits the delivery order in two. Instead each
watermark stores the snapshot up to which it has delivered (``pg_snapshot``). The next batch is
exactly the events whose txid the new snapshot shows committed and the stored one does not: a txid
the stored snapshot listed as running, or one at or above its xmax: an index scan per listed txid
and one range scan on ``(branch_id, txid, id)``, none revisiting delivered events. An open
transaction only stays in the snapshot's running list until it ends, and delays nobody else. Each
committed event belongs to exactly one such difference, so none is skipped or repeated. A
difference larger than the batch size goes out in several batches: the watermark keeps the new
snapshot as ``target`` plus the position (txid, id) reached within it.

Order: differences follow snapshot order; within one, events go by (txid, id), and a transaction's
events stay together in id order. A transaction that committed before another took its txid is
always delivered first. (Two transactions that commit between the same two snapshots go by txid,
which is not always commit order: a writer that took its txid, then waited on a row lock, comes
first.) Branches are independent streams.

pg_dump/pg_restore: txids belong to a cluster. Restored into another one, stored txids and snapshots
compare against unrelated txids, and new events could look delivered already. Each batch checks the
cluster's system identifier (recorded by the migration) and that the stored snapshot is not ahead of
the current one, and refuses with :class:`StreamRestored`, naming ``cmb-dagster pubsub reset``.
Refusing only when a stored txid is at or above ``pg_snapshot_xmax(pg_current_snapshot())``
misses restores into a cluster whose txids have already passed the stored ones yet whose running
transactions still fall inside a stored snapshot's range (their events would be skipped), and it
misfires on an idle server when compared with a stored snapshot's xmax, which may equal the
current one. The reset does not rewrite events: the stream's txid clock is ``pg_current_xact_id() +
shift``, and the reset raises the shift so new txids sort after every stored one; old events and
watermarks keep their meaning and every consumer resumes exactly where it stopped.

Retention: :func:`trim` deletes the events every registered consumer's snapshot shows committed and
that are older than ``retain`` (default 7 days), so a consumer registered later still finds a week of
history; it chooses where to begin with ``start="beginning" | "now" | "earliest_kept"``.

Poison events: after ``max_attempts`` failures on one event a consumer parks it in its dead letters
(:func:`dead_letters`, :func:`replay`) and goes on, or, with ``on_poison="stop"``, keeps retrying and
says so in its lag. Strict order: ``order="txid"`` delivers only events of transactions below the
oldest one still running, in txid order (the original design's mode without out-of-order events).

Hints: a statement writing events NOTIFYs ``<schema>.pubsub`` (once per transaction, on commit); a
running consumer LISTENs and wakes at once, polling every ``idle_sleep`` only as a fallback. The same
statement trigger refuses events while the stream's txids come from another cluster (after a
restore, until ``reset``), so no event can be written below what consumers have passed.
"""

from cmb_dagster.pubsub.admin import consumer_lag, dead_letters, drop_consumer, replay, reset, trim
from cmb_dagster._lazy import lazy_names
from cmb_dagster.pubsub.capture import install_capture, publish, remove_capture
from cmb_dagster.pubsub.consumer import Consumer, lock_watermark
from cmb_dagster.pubsub.errors import ConsumerBusy, HandlerFailed, InvalidInput, PubSubError, StreamRestored
from cmb_dagster.pubsub.models import (
    CaptureSpec,
    ConsumerSpec,
    DeadLetter,
    Event,
    Handler,
    Lag,
    PubSubOptions,
    Watermark,
)

__all__ = [
    "CaptureSpec",
    "Consumer",
    "ConsumerBusy",
    "ConsumerSpec",
    "DeadLetter",
    "Event",
    "Handler",
    "HandlerFailed",
    "InvalidInput",
    "Lag",
    "PubSubError",
    "PubSubOptions",
    "StreamRestored",
    "Watermark",
    "consumer_lag",
    "dead_letters",
    "drop_consumer",
    "install_capture",
    "lock_watermark",
    "publish",
    "pubsub_sensor",
    "remove_capture",
    "replay",
    "reset",
    "trim",
]

__getattr__ = lazy_names(__name__, {"pubsub_sensor": "cmb_dagster.pubsub.dagster_defs"})
