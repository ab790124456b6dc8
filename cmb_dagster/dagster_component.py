"""cmb_dagster as a Dagster Component: a code location's engines configured in a ``defs.yaml``.

``dg scaffold defs cmb_dagster.CmbComponent cmb`` writes one; ``dg list components`` lists it (the package's
``dagster_dg_cli.registry_modules`` entry point names this module).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from dagster import AssetKey, Definitions
from dagster.components import Component, ComponentLoadContext, Model, Resolvable
from pydantic import Field

from cmb_dagster.alerts import AlertOptions
from cmb_dagster.callbacks.models import CallbackOptions
from cmb_dagster.dagster_translator import CmbTranslator
from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.errors import InvalidInput
from cmb_dagster.eventqueue.models import EventQueueOptions
from cmb_dagster.inputs import load_reference
from cmb_dagster.models import Options
from cmb_dagster.pubsub.models import PubSubOptions
from cmb_dagster.reactive.models import ReactiveOptions
from cmb_dagster.resources import CmbResource
from cmb_dagster.stages.models import StageOptions

EngineOptions = str | dict[str, Any] | None
T = TypeVar("T", bound=Options)
_ENGINE_HELP = (
    "'module:attribute' naming the engine's options object, or the options' fields; unset: the engine is off."
)


class Translation(Model):
    """How the engines' assets appear: their keys and group."""

    key_prefix: list[str] = Field(default_factory=list, description="Path put before every asset key.")
    group_name: str | None = Field(default=None, description="The group of every asset; unset: cmb_<engine>.")


@dataclass(frozen=True)
class _YamlTranslator(CmbTranslator):
    """The translator a ``translation:`` block describes."""

    key_prefix: tuple[str, ...] = ()
    group_name: str | None = None

    def get_asset_key(self, engine: str, name: Sequence[str]) -> AssetKey:
        return AssetKey([*self.key_prefix, *super().get_asset_key(engine, name).path])

    def get_group_name(self, engine: str) -> str:
        return self.group_name or super().get_group_name(engine)


class CmbComponent(Component, Model, Resolvable):
    """The cmb_dagster engines of a code location: their jobs, sensors, status assets and checks, and the ``cmb``
    resource, as :func:`cmb_definitions` builds them. Each engine is on when its options are given."""

    reactive: EngineOptions = Field(default=None, description=f"Reactive CTL tasks: {_ENGINE_HELP}")
    pubsub: EngineOptions = Field(default=None, description=f"Pub/sub consumers: {_ENGINE_HELP}")
    callbacks: EngineOptions = Field(default=None, description=f"Delayed callbacks: {_ENGINE_HELP}")
    stages: EngineOptions = Field(default=None, description=f"Stage scheduler: {_ENGINE_HELP}")
    eventqueue: EngineOptions = Field(default=None, description=f"Handler event queue: {_ENGINE_HELP}")
    alerts: EngineOptions = Field(default=None, description=f"Alerts to a webhook: {_ENGINE_HELP}")
    prefix: str = Field(default="cmb_", description="Start of the name of every job, sensor and schedule added.")
    database_url: str | None = Field(
        default=None, description="Postgres URL (e.g. '{{ env.MY_URL }}'); unset: CMB_DATABASE_URL, or the embedded."
    )
    schema_name: str | None = Field(default=None, description="Schema of the cmb tables; unset: CMB_SCHEMA or 'cmb'.")
    translation: Translation | None = Field(default=None, description="Keys and group of the engines' assets.")

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        translation = self.translation or Translation()
        return cmb_definitions(
            reactive=_options(self.reactive, ReactiveOptions, "reactive"),
            pubsub=_options(self.pubsub, PubSubOptions, "pubsub"),
            callbacks=_options(self.callbacks, CallbackOptions, "callbacks"),
            stages=_options(self.stages, StageOptions, "stages"),
            events=_options(self.eventqueue, EventQueueOptions, "eventqueue"),
            alerts=_options(self.alerts, AlertOptions, "alerts"),
            prefix=self.prefix,
            resource=CmbResource(database_url=self.database_url, schema_name=self.schema_name),
            translator=_YamlTranslator(tuple(translation.key_prefix), translation.group_name),
        )


def _options(value: EngineOptions, kind: type[T], field: str) -> T | None:
    """An engine's options from a ``defs.yaml`` value: a reference to them, or their fields."""
    if value is None:
        return None
    if isinstance(value, dict):
        return kind(**value)
    options = load_reference(value, field)
    if not isinstance(options, kind):
        raise InvalidInput(f"{field}: {value} is a {type(options).__name__}, not {kind.__name__}")
    return options
