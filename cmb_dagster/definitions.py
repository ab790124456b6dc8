"""The one factory that assembles a code location's cmb_dagster Definitions."""

from typing import Any

from dagster import Definitions

from cmb_dagster.alerts import AlertOptions
from cmb_dagster.callbacks.dagster_defs import callback_definitions
from cmb_dagster.callbacks.models import CallbackOptions
from cmb_dagster.dagster_database import database_definitions
from cmb_dagster.dagster_translator import DEFAULT_TRANSLATOR, CmbTranslator
from cmb_dagster.eventqueue.dagster_defs import eventqueue_definitions
from cmb_dagster.eventqueue.models import EventQueueOptions
from cmb_dagster.jobs import alerts_sensor
from cmb_dagster.pubsub.dagster_defs import pubsub_definitions
from cmb_dagster.pubsub.models import PubSubOptions
from cmb_dagster.reactive.dagster_defs import reactive_definitions
from cmb_dagster.reactive.models import ReactiveOptions
from cmb_dagster.resources import CmbResource
from cmb_dagster.stages.dagster_defs import stages_definitions
from cmb_dagster.stages.models import StageOptions
from cmb_dagster.vacuum import DatabaseOptions


def cmb_definitions(
    *,
    reactive: ReactiveOptions | None = None,
    pubsub: PubSubOptions | None = None,
    callbacks: CallbackOptions | None = None,
    stages: StageOptions | None = None,
    events: EventQueueOptions | None = None,
    alerts: AlertOptions | None = None,
    database: DatabaseOptions | bool = True,
    prefix: str = "cmb_",
    resource: CmbResource | None = None,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
    **definitions: Any,
) -> Definitions:
    """Definitions with the ``cmb`` resource, each engine whose options are given, and your own definitions.

        Each engine's options object documents what it adds and its defaults. ``prefix`` starts the name of
        every job, sensor and schedule cmb_dagster adds, so two code locations don't collide. ``resource``
        defaults to ``CmbResource()`` (``CMB_DATABASE_URL`` or the embedded server); ``translator`` names the assets
        the engines add (subclass :class:`CmbTranslator` to choose their keys and groups). ``alerts`` sends a message
        to a webhook whenever an engine's asset check changes severity (the callbacks engine delivers it; its workers
        are added with default options when ``callbacks`` is not given). ``database`` adds the checks of the database
    the engines share (whether vacuum can clean their tables): with any engine (True), with these options, or never
    (False, for a code location whose other part adds them). Your own ``jobs``,
        ``assets``, ``schedules``, ``sensors``, ``resources`` (any ``Definitions`` argument) are merged in.
    """
    resource = resource or CmbResource()
    shell = {"prefix": prefix, "resource": resource, "translator": translator}
    parts = [Definitions(resources={"cmb": resource}), Definitions(**definitions)]
    if reactive is not None:
        assets = definitions.get("assets") or ()
        parts.append(reactive_definitions(reactive, **shell, assets=assets))
    if pubsub is not None:
        parts.append(pubsub_definitions(pubsub, **shell))
    if alerts is not None:
        callbacks = callbacks or CallbackOptions()
        alerts.check_webhook(callbacks.settings)
        parts.append(Definitions(sensors=[alerts_sensor(alerts, callbacks.settings, prefix=prefix)]))
    if callbacks is not None:
        parts.append(callback_definitions(callbacks, **shell))
    if stages is not None:
        parts.append(stages_definitions(stages, **shell))
    if events is not None:
        parts.append(eventqueue_definitions(events, **shell))
    engines = (reactive, pubsub, callbacks, stages, events)
    if isinstance(database, DatabaseOptions) or (database is True and any(e is not None for e in engines)):
        options = database if isinstance(database, DatabaseOptions) else DatabaseOptions()
        parts.append(database_definitions(options, prefix=prefix, translator=translator))
    return Definitions.merge(*parts)
