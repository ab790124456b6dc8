"""Writing CTL from Dagster: the ``ctl`` resource for ops and assets, and the ``cmb/ctl`` metadata entry."""

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import psycopg
from dagster import ConfigurableResource, InitResourceContext, MetadataValue
from pydantic import AwareDatetime, PrivateAttr, TypeAdapter, ValidationError

from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.ctl.models import CtlChange, ParameterKey
from cmb_dagster.ctl.store import CtlStore
from cmb_dagster.inputs import shorten
from cmb_dagster.models import describe
from cmb_dagster.resources import CmbResource

CTL_METADATA_KEY = "cmb/ctl"
"""Materialization metadata entry ``{parameter: aware ISO datetime}``: CTL values of the asset's entity."""
CTL_MODE_METADATA_KEY = "cmb/ctl_mode"
"""``"forward"`` (default: a value never moves backwards) or ``"set"`` (backwards moves are written and flagged)."""
CTL_MODES = ("forward", "set")

_METADATA_VALUES = TypeAdapter(dict[str, AwareDatetime])


class CtlResource(ConfigurableResource):
    """CTL values for ops and assets: ``ctl.set("shop/orders", "loaded_until", moment)``.

    Pass ``conn=`` (e.g. from ``cmb.connection()``) to commit the CTL change in the same transaction
    as the data it describes. Changes are recorded as made by ``dagster run <run_id>``.
    """

    cmb: CmbResource
    _actor: str | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        run = context.run
        self._actor = f"dagster run {run.run_id} ({run.job_name})" if run else None

    @property
    def store(self) -> CtlStore:
        """The underlying :class:`CtlStore`."""
        return CtlStore(self.cmb.database, actor=self._actor)

    def set(
        self,
        entity: str,
        parameter: str,
        value: datetime,
        *,
        conn: psycopg.Connection | None = None,
        only_forward: bool = False,
    ) -> CtlChange | None:
        """Set one CTL value; return the recorded change (None when it already had that value).

        ``only_forward=True``: a value at or after ``value`` is kept (a backfill never moves CTL backwards).
        """
        return self.store.set(entity, parameter, value, conn=conn, only_forward=only_forward)

    def set_many(
        self,
        values: Mapping[ParameterKey, datetime],
        *,
        conn: psycopg.Connection | None = None,
        only_forward: bool = False,
    ) -> list[CtlChange]:
        """Set several CTL values atomically (``only_forward`` as in :meth:`set`)."""
        return self.store.set_many(values, conn=conn, only_forward=only_forward)

    def get(self, entity: str, parameter: str) -> datetime | None:
        """The current value, or None."""
        return self.store.get(entity, parameter)

    def get_many(self, pairs: Iterable[ParameterKey]) -> dict[ParameterKey, datetime]:
        """Current values of several parameters (missing ones left out)."""
        return self.store.get_many(pairs)


def ctl_metadata(
    parameters: Mapping[str, datetime] | None = None, /, *, mode: str = "forward", **values: datetime
) -> dict[str, MetadataValue]:
    """Materialization metadata that sets CTL values of the asset's entity (its key, e.g. ``'shop/orders'``).

    ``mode="forward"`` (the default) never moves a value backwards: a backfill of an older partition
    materialized after a newer one leaves CTL where it is. ``mode="set"`` writes the value as given (a
    backwards move is recorded and flagged). A parameter named ``mode`` goes in the positional mapping.

    >>> MaterializeResult(metadata={**ctl_metadata(loaded_until=moment), "rows": 42})  # doctest: +SKIP
    """
    if mode not in CTL_MODES:
        raise InvalidCtlInput(f"mode: expected one of {', '.join(CTL_MODES)}, got {mode!r}")
    try:
        given = {**(parameters or {}), **values}
        checked = _METADATA_VALUES.validate_python(given)
    except ValidationError as exc:
        raise InvalidCtlInput(metadata_error(exc, given)) from None
    metadata = {CTL_METADATA_KEY: MetadataValue.json({p: v.isoformat() for p, v in checked.items()})}
    if mode != "forward":
        metadata[CTL_MODE_METADATA_KEY] = MetadataValue.text(mode)
    return metadata


def ctl_mode_from_metadata(metadata: Mapping[str, Any]) -> str:
    """The write mode of a materialization's ``cmb/ctl`` entry: ``forward`` unless ``cmb/ctl_mode`` says ``set``."""
    value = metadata.get(CTL_MODE_METADATA_KEY)
    text = getattr(value, "value", getattr(value, "text", value))
    return "set" if text == "set" else "forward"


def ctl_values_from_metadata(entity: str, value: Any) -> dict[ParameterKey, datetime]:
    """The CTL values a ``cmb/ctl`` metadata entry sets; InvalidCtlInput naming the bad field otherwise."""
    data = getattr(value, "data", value)
    try:
        checked = _METADATA_VALUES.validate_python(data)
    except ValidationError as exc:
        raise InvalidCtlInput(metadata_error(exc, data)) from None
    return {(entity, parameter): moment for parameter, moment in checked.items()}


def metadata_error(exc: ValidationError, value: object) -> str:
    """One line: why ``value`` is no ``cmb/ctl`` metadata entry."""
    expected = "{parameter: aware ISO datetime}"
    return f"invalid {CTL_METADATA_KEY} metadata, expected {expected}: {describe(exc)} (got {shorten(value)})"
