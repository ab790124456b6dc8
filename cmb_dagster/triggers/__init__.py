"""Trigger algebra: when should a reactive task run, given CTL parameter values.

CTL triggers compare a parameter's current value with the last run's value (``Delta``,
``ChunkDelta``), with the current time (``Delay``, ``ChunkDelay``) or with another parameter
(``RefDelay``, ``ChunkRefDelay``), or wait until a parameter stopped changing (``Settle``); ``All`` and
``Any`` combine them. ``evaluate`` decides and explains; ``param(...)`` builds triggers readably. Pure Python:
no Dagster, no database.
"""

from cmb_dagster.triggers.checks import check, parameters, uses_last
from cmb_dagster.triggers.dsl import Param, all_of, any_of, param
from cmb_dagster.triggers.evaluation import TriggerResult, evaluate
from cmb_dagster.triggers.models import (
    All,
    Any,
    ChunkDelay,
    ChunkDelta,
    ChunkRefDelay,
    CtlTrigger,
    Delay,
    Delta,
    ParameterKey,
    RefDelay,
    Settle,
    Trigger,
    trigger_from_dict,
    trigger_from_json,
)

__all__ = [
    "All",
    "Any",
    "ChunkDelay",
    "ChunkDelta",
    "ChunkRefDelay",
    "CtlTrigger",
    "Delay",
    "Delta",
    "Param",
    "ParameterKey",
    "RefDelay",
    "Settle",
    "Trigger",
    "TriggerResult",
    "all_of",
    "any_of",
    "check",
    "evaluate",
    "param",
    "parameters",
    "trigger_from_dict",
    "trigger_from_json",
    "uses_last",
]
