"""cmb_dagster: reactive, event-driven pipelines for Dagster on Postgres.

The engines are plain Python over Postgres; the Dagster names (``CmbResource``, ``cmb_definitions``)
load Dagster only when first used, so the CLI and engine workers start fast.
"""

from typing import Any

from cmb_dagster.database import Database
from cmb_dagster.errors import CmbError, DatabaseUnavailable, EmbeddedServerError, SchemaTooNew
from cmb_dagster.settings import Settings

_DAGSTER_NAMES = {"CmbResource": "cmb_dagster.resources", "cmb_definitions": "cmb_dagster.definitions"}

__all__ = [
    "CmbError",
    "CmbResource",
    "Database",
    "DatabaseUnavailable",
    "EmbeddedServerError",
    "SchemaTooNew",
    "Settings",
    "cmb_definitions",
]


def __getattr__(name: str) -> Any:
    if name in _DAGSTER_NAMES:
        import importlib

        return getattr(importlib.import_module(_DAGSTER_NAMES[name]), name)
    raise AttributeError(f"module 'cmb_dagster' has no attribute {name!r}")
