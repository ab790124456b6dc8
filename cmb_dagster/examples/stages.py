"""Stage scheduler example: offers, with a timer stage, an enrichment stage and a notification.

- ``withdraw``: an active offer is withdrawn ``EXPOSURE`` after it was first seen (2 minutes, so that it
  visibly fires; a marketplace would wait months); a timer stage with its own state.
- ``price``: enriches an offer with a computed ``predicted_price`` (asked only when ``base_price`` or
  ``category`` change).
- after ``withdraw`` commits, its after-commit handler POSTs a notification to the local callback sink
  (``cmb-dagster callbacks sink`` at http://127.0.0.1:8765), with the event id as ``Idempotency-Key``;
  when no sink runs it just logs the notification.

Run the ``stages_demo_offers`` job to create offers, then watch ``cmb-dagster stages status``.
"""

import json
import logging
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

from dagster import Config, OpExecutionContext, job, op
from pydantic import BaseModel

from cmb_dagster.resources import CmbResource
from cmb_dagster.stages import Entity, MergePatch, SavedEntity, Stage, StageOptions, StageResult, StageStore

EXPOSURE = timedelta(minutes=2)
SINK = "http://127.0.0.1:8765/stages/withdrawn"
MARGINS = {"cars": 0.05, "flats": 0.02}

log = logging.getLogger("cmb_dagster.examples.stages")


class Exposure(BaseModel):
    """When the withdraw stage first saw the offer active, and when it withdraws it."""

    seen_at: datetime | None = None
    withdraw_at: datetime | None = None


def notify_withdrawn(saved: SavedEntity) -> None:
    """Side effect after the commit (at least once): tell the owner the offer was withdrawn."""
    if not saved.changed or saved.payload.get("status") != "withdrawn":
        return
    body = json.dumps({"offer": saved.entity_id, "version": saved.version, "title": saved.payload.get("title")})
    headers = {"Content-Type": "application/json", "Idempotency-Key": str(saved.event_id)}
    request = urllib.request.Request(SINK, body.encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=2):
            pass
    except (urllib.error.URLError, OSError) as exc:
        log.info("offer %s withdrawn (event %d); no sink at %s (%s)", saved.entity_id, saved.event_id, SINK, exc)


class Withdraw(Stage):
    name = "withdraw"
    state_model = Exposure
    fields = ("status",)
    after_commit = staticmethod(notify_withdrawn)

    def should_process(self, entity: Entity, state: Exposure) -> bool:
        return entity.payload.get("status") == "active"

    def process(self, entity: Entity, state: Exposure) -> StageResult:
        now = datetime.now(UTC)
        if entity.payload.get("status") != "active":
            return StageResult()  # asked anyway (e.g. should_process failed): nothing to do
        if state.withdraw_at is None:
            withdraw_at = now + EXPOSURE
            return StageResult(new_state=Exposure(seen_at=now, withdraw_at=withdraw_at), timer=withdraw_at)
        if now < state.withdraw_at:
            return StageResult(timer=state.withdraw_at)
        return StageResult(update=MergePatch({"status": "withdrawn", "withdrawn_at": now.isoformat()}))


class Price(Stage):
    name = "price"
    fields = ("base_price", "category")

    def should_process(self, entity: Entity, state: BaseModel) -> bool:
        return "base_price" in entity.payload

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        base = entity.payload.get("base_price")
        if not isinstance(base, (int, float)):
            return StageResult(update=MergePatch({"predicted_price": None}))
        margin = MARGINS.get(entity.payload.get("category", ""), 0.1)
        return StageResult(update=MergePatch({"predicted_price": round(base * (1 + margin), 2)}))


options = StageOptions(stages=[Withdraw(), Price()], shard_count=4, rescan_cron="0 3 * * *")


class OffersConfig(Config):
    count: int = 5


@op(description="Creates active offers; the price stage enriches them, the withdraw stage withdraws them later.")
def put_demo_offers(context: OpExecutionContext, config: OffersConfig, cmb: CmbResource) -> None:
    store = StageStore(cmb.database, options.stages)
    key = context.run_id[:8]
    offers = {
        f"offer-{key}-{i}": {
            "title": f"demo offer {i}",
            "status": "active",
            "category": ["cars", "flats"][i % 2],
            "base_price": 1000 * (i + 1),
        }
        for i in range(config.count)
    }
    versions = store.put_many(offers)
    context.log.info(f"put {len(versions)} offers; withdrawn in {EXPOSURE}: {sorted(versions)}")


@job(description="Creates demo offers for the stage scheduler example.")
def stages_demo_offers() -> None:
    put_demo_offers()
