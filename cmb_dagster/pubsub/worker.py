"""The pub/sub worker: one consumer's batches, delivered in a loop that holds the consumer's lease."""

from __future__ import annotations

import warnings
from typing import Any

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.notifications import channel_name
from cmb_dagster.pubsub.engine import Delivery
from cmb_dagster.pubsub.models import ConsumerSpec, Handler, Watermark, load_handler
from cmb_dagster.workers import EngineWorker, Worker

LEASE_KIND = "pubsub.consumer"
HINT_CHANNEL = "pubsub"  # producers NOTIFY '<schema>.pubsub' on commit (migration 0008's trigger)


class ConsumerWorker(EngineWorker):
    """Delivers the events of one branch to the handler of ``spec``, ``handler(conn, events)`` (a function or an
    ``async def`` function), in order, batch after batch, one call at a time.

    The handler runs inside the transaction that advances the watermark: what it writes through
    ``conn`` commits together with the progress, so each event is applied exactly once across crashes,
    restarts and competing consumers with the same id. Effects outside this database (HTTP, other
    databases) happen at least once: make them idempotent, e.g. keyed by ``event.id``.

    :meth:`run` holds the consumer's lease, so identical consumers elsewhere stand by; producers' commits
    wake it at once (``spec.listen``), ``spec.idle_sleep`` is the fallback poll, and a failing batch is
    retried after ``spec.backoff``. A failing batch is delivered again in halves until the failing event is
    alone; what happens to an event that keeps failing, or whose deliveries kill the worker, is
    ``spec.on_poison``'s rule (docs/pubsub.md, "Poison events"). ``db``: a :class:`Database`, a psycopg
    ``ConnectionPool`` or a URL.
    """

    def __init__(self, db: DatabaseSource, options: ConsumerSpec, *, owner: str | None = None) -> None:
        super().__init__(db, owner=owner)
        self.spec = spec = options
        handler = load_handler(spec.handler) if isinstance(spec.handler, str) else spec.handler
        self.delivery = Delivery(self.db, spec, handler, keep_alive=self._keep_alive)
        self._loop: Worker | None = None

    def loops(self) -> list[Worker]:
        self.check()  # refuses at once after a restore
        self._loop = Worker(
            self.db,
            LEASE_KIND,
            [self.delivery.partition],
            self.delivery.batch,
            owner=self.owner,
            ttl=self.spec.lease_ttl,
            idle_sleep=self.spec.idle_sleep,
            backoff=self.spec.backoff,
            channels=[channel_name(self.db, HINT_CHANNEL)] if self.spec.listen else [],
            drain=self._drain,
        )
        return [self._loop]

    def finish(self) -> None:
        self._loop = None
        self.close()

    def run_once(self) -> int:
        """Deliver one batch, without the lease; return how many events it settled (0: nothing new)."""
        return self.delivery.batch(None)

    def check(self) -> Watermark:
        """Register the consumer (its watermark where ``start`` says, its handler path) and return its
        watermark; raises :class:`StreamRestored` after a restore."""
        return self.delivery.register()

    def close(self) -> None:
        """Close the connection kept between batches (the next batch opens another)."""
        self.delivery.close()

    def _drain(self) -> bool:
        """When the loop ends, before its lease is released: False while a call of the handler still runs (a
        stuck worker's): the lease is then left to lapse, so no standby delivers beside it."""
        return not self.delivery.executor.running

    def _keep_alive(self) -> None:
        if self._loop is not None:
            self._loop.keep_alive()


class Consumer(ConsumerWorker):
    """Deprecated (one release): ``ConsumerWorker(db, ConsumerSpec(consumer_id=..., branch_id=..., handler=...))``.

    ``options`` are :class:`ConsumerSpec` fields; ``schema`` is the cmb schema of a pool or a URL."""

    def __init__(
        self,
        database: DatabaseSource,
        consumer_id: str,
        branch_id: int,
        handler: Handler | str,
        *,
        schema: str | None = None,
        **options: Any,
    ) -> None:
        warnings.warn(
            "Consumer(database, consumer_id, branch_id, handler, ...) is deprecated; use "
            "ConsumerWorker(db, ConsumerSpec(consumer_id=..., branch_id=..., handler=..., ...))",
            DeprecationWarning,
            stacklevel=2,
        )
        spec = ConsumerSpec(consumer_id=consumer_id, branch_id=branch_id, handler=handler, **options)
        super().__init__(Database.of(database, schema=schema), spec)

    @classmethod
    def from_spec(cls, database: DatabaseSource, spec: ConsumerSpec) -> ConsumerWorker:
        """Deprecated (one release): ``ConsumerWorker(database, spec)``."""
        warnings.warn(
            "Consumer.from_spec(db, spec) is deprecated; use ConsumerWorker(db, spec)", DeprecationWarning, stacklevel=2
        )
        return ConsumerWorker(database, spec)
