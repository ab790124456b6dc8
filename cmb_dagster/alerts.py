"""Alerts: a message to a webhook each time a health check changes severity, delivered by the callbacks engine.

A transition recorded in ``check_transitions`` becomes one callback (its key names the transition, so sending it
again creates nothing new) whose body is a JSON object with a Slack-compatible ``text``; the callbacks engine
retries it and keeps it across crashes like any callback.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from cmb_dagster import sql
from cmb_dagster.callbacks.client import CallbackClient
from cmb_dagster.callbacks.errors import CallbackConflict
from cmb_dagster.callbacks.hosts import check_url
from cmb_dagster.callbacks.models import CONTEXT, CallbackSettings, NewCallback, RetryPolicy
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.health import Severity, Transition, check_label
from cmb_dagster.models import Options

ALERT_OWNER, ALERT_GROUP = "cmb", "alerts"
"""The owner and group of the alerts' callbacks (``cmb-dagster callbacks list --owner cmb`` shows them)."""

_RANK = {"ok": 0, "warn": 1, "error": 2}
_SHOWN = {"ok": "OK", "warn": "WARN", "error": "ERROR"}


class AlertOptions(Options):
    """What ``cmb_definitions(alerts=...)`` adds: a sensor sending a message to ``webhook`` when a check turns red
    (or yellow, with ``severity="warn"``) and when it turns green again. The callbacks engine delivers them (its
    workers are added when ``callbacks`` is not given; its settings decide which hosts may be called)."""

    webhook: str = Field(min_length=1, max_length=2048, description="The URL each alert is POSTed to.")
    severity: Literal["warn", "error"] = Field(
        default="warn", description="The lowest severity alerted: a check entering or leaving it sends a message."
    )
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="How a failing alert is retried.")
    interval_seconds: int = Field(default=30, ge=5, le=3600, description="How often new transitions are sent.")
    max_age_seconds: int = Field(
        default=3600, ge=60, le=7 * 86400, description="Transitions older than this are not sent (e.g. at first use)."
    )

    @field_validator("webhook")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s) URL, not {value!r}")
        return value

    def check_webhook(self, settings: CallbackSettings) -> None:
        """Refuse a webhook the callbacks engine's settings would not call (InvalidCallbackInput naming it)."""
        check_url(self.webhook, settings, field="alerts.webhook")


def message(transition: Transition) -> dict[str, str]:
    """The JSON an alert sends: a one-line ``text`` (what Slack shows) and the transition's fields."""
    asset = "/".join(transition.asset)
    check = check_label(transition.check, transition.scope)
    if transition.severity == "ok":
        text = f"[OK] {asset} {check} is green again (was {_SHOWN[transition.previous]}): {transition.text}"
    else:
        text = f"[{_SHOWN[transition.severity]}] {asset} {check}: {transition.text}"
    return {
        "text": text,
        "asset": asset,
        "check": transition.check,
        "scope": transition.scope,
        "severity": transition.severity,
        "previous": transition.previous,
        "at": transition.at.isoformat(),
    }


def alerted(transition: Transition, lowest: Severity) -> bool:
    """Whether ``transition`` enters or leaves a severity at or above ``lowest``."""
    return max(_RANK[transition.previous], _RANK[transition.severity]) >= _RANK[lowest]


def send_alerts(
    database: DatabaseSource, options: AlertOptions, settings: CallbackSettings, *, limit: int = 100
) -> int:
    """Turn the transitions not alerted yet into callbacks to the webhook (at most ``limit``); return how many.

    Each transition's callback is keyed by its id and created before the transition is marked, so a crash in
    between creates nothing twice."""
    db = Database.of(database)
    with db.connection() as conn:
        rows = conn.execute(sql.UNALERTED_TRANSITIONS, {"limit": limit, "max_age": options.max_age_seconds})
        pending = [(Transition.of(row), row[8]) for row in rows]
    sent = [t for t, fresh in pending if fresh and alerted(t, options.severity)]
    events = [
        NewCallback(
            owner_client_id=ALERT_OWNER,
            group_key=ALERT_GROUP,
            event_key=f"check-transition-{t.id}",
            run_at=t.at,
            cb_url=options.webhook,
            context=message(t),
            body=CONTEXT,
            retry=options.retry,
        )
        for t in sent
    ]
    with CallbackClient(db, settings, buffered=False) as client:
        try:
            client.create_many(events)
        except CallbackConflict:  # the webhook changed since one was created: the others are created one by one
            for event in events:
                try:
                    client.create_many([event])
                except CallbackConflict:
                    continue
    with db.connection() as conn:
        conn.execute(sql.MARK_ALERTED, {"ids": [t.id for t, _ in pending]})
    return len(sent)
