"""Pub/sub change stream: any table's changes (:func:`install_capture`) and published events (:func:`publish`)
as an ordered stream per branch that a :class:`ConsumerWorker` delivers, batch after batch, to a handler
running in the transaction that moves its watermark: nothing skipped, exactly once when the results live in
the same database. A consumer can be rewound (:func:`reset_consumer`), read a subset of its branch
(``ConsumerSpec.topics``, ``where``), and a table's existing rows can be published (:func:`backfill`).
docs/pubsub.md describes the guarantees and how they are kept.
"""

from cmb_dagster._lazy import lazy_names
from cmb_dagster.pubsub.admin import (
    backfills,
    consumer_lag,
    dead_letters,
    drop_consumer,
    replay,
    reset,
    reset_consumer,
    status,
    trim,
)
from cmb_dagster.pubsub.backfill import backfill
from cmb_dagster.pubsub.capture import install_capture, publish, remove_capture
from cmb_dagster.pubsub.engine import lock_watermark
from cmb_dagster.pubsub.errors import (
    BackfillFailed,
    ConsumerBusy,
    HandlerFailed,
    InvalidInput,
    InvalidPubSubInput,
    PubSubError,
    StreamRestored,
)
from cmb_dagster.pubsub.models import (
    BackfillProgress,
    BackfillSpec,
    CaptureSpec,
    ConsumerSpec,
    DeadLetter,
    Event,
    Handler,
    Lag,
    PubSubOptions,
    PubSubStatus,
    Watermark,
)
from cmb_dagster.pubsub.worker import Consumer, ConsumerWorker

__all__ = [
    "BackfillFailed",
    "BackfillProgress",
    "BackfillSpec",
    "CaptureSpec",
    "Consumer",
    "ConsumerBusy",
    "ConsumerSpec",
    "ConsumerWorker",
    "DeadLetter",
    "Event",
    "Handler",
    "HandlerFailed",
    "InvalidInput",
    "InvalidPubSubInput",
    "Lag",
    "PubSubError",
    "PubSubOptions",
    "PubSubStatus",
    "StreamRestored",
    "Watermark",
    "backfill",
    "backfills",
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
    "reset_consumer",
    "status",
    "trim",
]

__getattr__ = lazy_names(__name__, {"pubsub_sensor": "cmb_dagster.pubsub.dagster_defs"})
