"""Every numeric field of every options and settings model has a lower and an upper bound."""

from datetime import timedelta

import annotated_types
import pytest

from cmb_dagster.callbacks.dagster_defs import CleanupConfig
from cmb_dagster.callbacks.models import CallbackOptions, CallbackSettings, RetryPolicy
from cmb_dagster.errors import InvalidInput
from cmb_dagster.eventqueue.models import EventQueueOptions, HandlerConfig, WorkerSettings
from cmb_dagster.pubsub.models import ConsumerSpec, PubSubOptions
from cmb_dagster.reactive.models import ReactiveOptions, SchedulerSettings, TaskSpec
from cmb_dagster.stages.models import StageOptions

MODELS = [
    CallbackOptions,
    CleanupConfig,
    CallbackSettings,
    RetryPolicy,
    EventQueueOptions,
    HandlerConfig,
    WorkerSettings,
    ConsumerSpec,
    PubSubOptions,
    ReactiveOptions,
    SchedulerSettings,
    TaskSpec,
    StageOptions,
]
NUMBERS = (int, float, timedelta)


def bounds(field) -> tuple[bool, bool]:
    kinds = {type(m) for m in field.metadata}
    return bool(kinds & {annotated_types.Ge, annotated_types.Gt}), bool(
        kinds & {annotated_types.Le, annotated_types.Lt}
    )


def numeric(annotation) -> bool:
    return annotation in NUMBERS or any(a in NUMBERS for a in getattr(annotation, "__args__", ()))


def test_every_numeric_option_is_bounded_both_ways():
    fields = [
        (model.__name__, name, field)
        for model in MODELS
        for name, field in model.model_fields.items()
        if numeric(field.annotation)
    ]
    assert len(fields) >= 40
    assert [(m, n) for m, n, f in fields if bounds(f) != (True, True)] == []


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: CallbackSettings(lease_ttl=float("inf")), "lease_ttl"),
        (lambda: CallbackSettings(max_in_flight=10**9), "max_in_flight"),
        (lambda: WorkerSettings(sweep_interval=float("nan")), "sweep_interval"),
        (lambda: HandlerConfig(max_retries=10**6), "max_retries"),
        (lambda: ConsumerSpec(consumer_id="c", handler="m:f", branch_id=2**63), "branch_id"),
        (lambda: SchedulerSettings(backoff={"first": 365 * 86400}), "backoff"),
        (lambda: CallbackOptions(ttl_days=10**6), "ttl_days"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_options_raise_the_package_error():
    with pytest.raises(InvalidInput, match="materialize_interval_seconds"):
        CallbackOptions(materialize_interval_seconds=10**9)
