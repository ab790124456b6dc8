"""Deprecated module: the engine is :mod:`cmb_dagster.reactive.engine`."""

import warnings

from cmb_dagster.reactive.engine import LEASE_KIND, TaskScheduler, values_hash

__all__ = ["LEASE_KIND", "TaskScheduler", "values_hash"]

warnings.warn(
    "cmb_dagster.reactive.scheduler is deprecated: import from cmb_dagster.reactive.engine",
    DeprecationWarning,
    stacklevel=2,
)
