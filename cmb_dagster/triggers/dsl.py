"""Readable constructors for triggers: ``param("sales", "loaded_until").advanced_by(1, "day")``.

The trigger classes are the low-level form; these helpers say what event a task waits for.
Triggers also combine with ``&`` (all of) and ``|`` (any of).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from cmb_dagster.triggers.models import (
    All,
    Any,
    ChunkDelay,
    ChunkDelta,
    ChunkRefDelay,
    CtlTriggerBase,
    Delay,
    Delta,
    RefDelay,
    Settle,
    combine,
)


@dataclass(frozen=True, slots=True)
class Param:
    """A CTL parameter ``(entity, parameter)`` that triggers are built on; create it with ``param``."""

    entity: str
    parameter: str

    def advanced_by(
        self, amount: timedelta | str | int, scale: str | None = None, *, timezone: str | None = None
    ) -> Delta | ChunkDelta:
        """Fires once the parameter moved ``amount`` past the last run's value.

        Without ``scale`` it is a duration; with ``scale`` it is a number of chunks.

        >>> param("sales", "loaded_until").advanced_by("1d")
        Delta('sales', 'loaded_until', '1d')
        >>> param("sales", "loaded_until").advanced_by(2, "day")
        ChunkDelta('sales', 'loaded_until', 'day', 2)
        """
        if scale is None:
            return Delta(self.entity, self.parameter, amount)
        return ChunkDelta(self.entity, self.parameter, scale, amount, timezone=timezone)

    def new_chunk(self, scale: str, *, timezone: str | None = None) -> ChunkDelta:
        """Fires once the parameter reached a newer chunk than the last run's value.

        >>> param("sales", "loaded_until").new_chunk("month")
        ChunkDelta('sales', 'loaded_until', 'month')
        """
        return ChunkDelta(self.entity, self.parameter, scale, timezone=timezone)

    def fresh_within(
        self, max_delay: timedelta | str | int, scale: str | None = None, *, timezone: str | None = None
    ) -> Delay | ChunkDelay:
        """Fires while the parameter lags the current time by at most ``max_delay``.

        Without ``scale`` it is a duration; with ``scale`` it is a number of chunks.

        >>> param("sales", "loaded_until").fresh_within("2h")
        Delay('sales', 'loaded_until', '2h')
        >>> param("sales", "loaded_until").fresh_within(1, "day")
        ChunkDelay('sales', 'loaded_until', 'day', 1)
        """
        if scale is None:
            return Delay(self.entity, self.parameter, max_delay)
        return ChunkDelay(self.entity, self.parameter, scale, max_delay, timezone=timezone)

    def same_chunk_as_now(self, scale: str, *, timezone: str | None = None) -> ChunkDelay:
        """Fires while the parameter is in the current time's chunk (or later).

        >>> param("sales", "loaded_until").same_chunk_as_now("day", timezone="Europe/Moscow")
        ChunkDelay('sales', 'loaded_until', 'day', timezone='Europe/Moscow')
        """
        return ChunkDelay(self.entity, self.parameter, scale, timezone=timezone)

    def settled_for(self, quiet: timedelta | str) -> Settle:
        """Fires once the parameter has not changed for ``quiet`` and holds a value the last run did not see.

        >>> param("shop/prices", "loaded_until").settled_for("15min")
        Settle('shop/prices', 'loaded_until', '15min')
        """
        return Settle(self.entity, self.parameter, quiet)

    def behind(
        self,
        reference: Param,
        by_at_most: timedelta | str | int,
        scale: str | None = None,
        *,
        timezone: str | None = None,
    ) -> RefDelay | ChunkRefDelay:
        """Fires while the parameter lags ``reference`` by at most ``by_at_most``.

        Without ``scale`` it is a duration; with ``scale`` it is a number of chunks.

        >>> param("mart", "loaded_until").behind(param("sales", "loaded_until"), by_at_most="1h")
        RefDelay('mart', 'loaded_until', 'sales', 'loaded_until', '1h')
        """
        if scale is None:
            return RefDelay(self.entity, self.parameter, reference.entity, reference.parameter, by_at_most)
        return ChunkRefDelay(
            self.entity, self.parameter, reference.entity, reference.parameter, scale, by_at_most, timezone=timezone
        )

    def caught_up_with(self, reference: Param, scale: str, *, timezone: str | None = None) -> ChunkRefDelay:
        """Fires while the parameter is in the same chunk as ``reference`` (or later).

        >>> param("mart", "loaded_until").caught_up_with(param("sales", "loaded_until"), "day")
        ChunkRefDelay('mart', 'loaded_until', 'sales', 'loaded_until', 'day')
        """
        return ChunkRefDelay(
            self.entity, self.parameter, reference.entity, reference.parameter, scale, timezone=timezone
        )


ASSET_PARAMETER = "loaded_until"
"""The parameter a trigger reads when it names an asset key without one (what ``ctl_metadata(loaded_until=...)``
sets)."""


def param(entity: object, parameter: str = ASSET_PARAMETER) -> Param:
    """The CTL parameter ``parameter`` of ``entity``, to build triggers on.

    ``entity`` is a string or a Dagster asset key (its ``to_user_string()``, e.g. ``'shop/orders'``: the
    entity asset materializations write with ``ctl_metadata``); ``parameter`` defaults to ``loaded_until``.

    >>> param("shop/orders", "loaded_until").new_chunk("day")
    ChunkDelta('shop/orders', 'loaded_until', 'day')
    """
    to_user_string = getattr(entity, "to_user_string", None)
    return Param(to_user_string() if callable(to_user_string) else str(entity), parameter)


def all_of(*triggers: CtlTriggerBase | All) -> All:
    """Fires when every trigger fires; nested ``All`` are flattened, ``Any`` inside is an error.

    >>> sales = param("sales", "loaded_until")
    >>> all_of(sales.new_chunk("day"), sales.fresh_within("2h"))
    All(ChunkDelta('sales', 'loaded_until', 'day'), Delay('sales', 'loaded_until', '2h'))
    """
    return combine(All, *triggers)  # type: ignore[return-value]


def any_of(*triggers: CtlTriggerBase | Any) -> Any:
    """Fires when at least one trigger fires; nested ``Any`` are flattened, ``All`` inside is an error.

    >>> any_of(param("sales", "loaded_until").new_chunk("day"), param("prices", "loaded_until").new_chunk("day"))
    Any(ChunkDelta('sales', 'loaded_until', 'day'), ChunkDelta('prices', 'loaded_until', 'day'))
    """
    return combine(Any, *triggers)  # type: ignore[return-value]
