"""How what cmb_dagster adds appears in Dagster: a translator a team subclasses to choose asset keys and groups
and the tags of the worker jobs' runs."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dagster import AssetKey


@dataclass(frozen=True)
class CmbTranslator:
    """Names the observable assets of every engine (consumer lag, queues, stages, callback events) and tags the
    runs of its worker jobs.

    ``name`` is what the engine knows the asset by (e.g. ``("orders", "branch_0")`` for a pub/sub consumer,
    ``("send_receipt",)`` for an event queue handler). Subclass and override to fit your asset tree::

        class Translator(CmbTranslator):
            def get_asset_key(self, engine, name):
                return AssetKey(["ops", "cmb", engine, *name])

        cmb_definitions(pubsub=..., translator=Translator())
    """

    def get_asset_key(self, engine: str, name: Sequence[str]) -> AssetKey:
        """The key of an engine's asset; by default ``<engine>/<name...>``."""
        return AssetKey([engine, *name])

    def get_group_name(self, engine: str) -> str:
        """The group of an engine's assets; by default ``cmb_<engine>``."""
        return f"cmb_{engine}"

    def get_worker_tags(self, engine: str, job_name: str) -> Mapping[str, str]:
        """Tags of every run of an engine's worker job (e.g. ``dagster-k8s/config`` for its pod's resources under
        dagster-k8s); by default none."""
        return {}


DEFAULT_TRANSLATOR = CmbTranslator()
