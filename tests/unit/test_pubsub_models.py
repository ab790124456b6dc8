import pytest

from cmb_dagster.errors import InvalidInput
from cmb_dagster.pubsub import (
    CaptureSpec,
    Consumer,
    ConsumerSpec,
    ConsumerWorker,
    InvalidPubSubInput,
    PubSubError,
    PubSubOptions,
)
from cmb_dagster.pubsub.models import handler_path, load_handler

URL = "postgresql://nobody@127.0.0.1:1/none"  # never connected to


def module_level_handler(conn, events):
    pass


def test_consumer_spec_names_the_bad_field():
    assert ConsumerSpec(consumer_id="orders.v2-a", handler="pkg.mod:fn").branch_id == 0
    for values, field in [
        ({"consumer_id": "x" * 64, "handler": "m:f"}, "consumer_id"),
        ({"consumer_id": "has space", "handler": "m:f"}, "consumer_id"),
        ({"consumer_id": "ok", "handler": "no_colon"}, "handler: must be 'module:function'"),
        ({"consumer_id": "ok", "handler": 5}, "handler"),
        ({"consumer_id": "ok", "handler": "m:f", "batch_size": 0}, "batch_size"),
        ({"consumer_id": "ok", "handler": "m:f", "branch_id": "trunk"}, "branch_id"),
        ({"consumer_id": "ok", "handler": "m:f", "lease_ttl": 0}, "lease_ttl"),
        ({"consumer_id": "ok", "handler": "m:f", "backoff": {"first": -1}}, "backoff"),
        ({"consumer_id": "ok", "handler": "m:f", "unknown": 1}, "unknown"),
    ]:
        with pytest.raises(InvalidPubSubInput, match=field):
            ConsumerSpec(**values)
    assert ConsumerSpec(consumer_id="x" * 63, handler="m:f")


def test_a_consumer_spec_takes_a_handler_path_or_the_function_itself():
    spec = ConsumerSpec(consumer_id="c", handler=module_level_handler)
    assert spec.handler is module_level_handler and spec.handler_path == f"{__name__}:module_level_handler"
    assert ConsumerSpec(consumer_id="c", handler=lambda conn, events: None).handler_path is None
    assert ConsumerSpec(consumer_id="c", handler="pkg.mod:fn").handler_path == "pkg.mod:fn"
    assert ConsumerSpec(consumer_id="c", handler="m:f").backoff.delay(0) == 0.5  # the defaults: 0.5 s doubling
    assert ConsumerSpec(consumer_id="c", handler="m:f").backoff.delay(10) == 30  # up to 30 s


def test_bad_pubsub_input_is_the_engines_error_and_an_invalid_input():
    assert issubclass(InvalidPubSubInput, PubSubError) and issubclass(InvalidPubSubInput, InvalidInput)
    with pytest.raises(InvalidPubSubInput, match="trim_cron"):
        PubSubOptions(trim_cron="often")
    with pytest.raises(InvalidPubSubInput, match="handler: cannot load"):
        ConsumerWorker(URL, ConsumerSpec(consumer_id="c", handler="nowhere.at_all:handler"))


def test_capture_spec_defaults_and_bad_ops():
    spec = CaptureSpec(table="t")
    assert (spec.branch, spec.ops, spec.key, spec.columns) == ("0", ("insert", "update"), None, None)
    with pytest.raises(InvalidPubSubInput, match=r"ops\.1"):
        CaptureSpec(table="t", ops=("insert", "upsert"))
    with pytest.raises(InvalidPubSubInput, match="table"):
        CaptureSpec(table="")


def test_handlers_round_trip_through_their_dotted_path():
    path = handler_path(module_level_handler)
    assert path == f"{module_level_handler.__module__}:module_level_handler"
    assert handler_path(lambda conn, events: None) is None
    assert load_handler(path) is module_level_handler
    with pytest.raises(InvalidPubSubInput, match="handler: cannot load 'cmb_dagster.examples.pubsub:nope'"):
        load_handler("cmb_dagster.examples.pubsub:nope")
    with pytest.raises(InvalidPubSubInput, match="not callable"):
        load_handler("cmb_dagster.examples.pubsub:DEMO_BRANCH")


def test_the_old_consumer_forms_still_build_a_worker_and_warn():
    with pytest.warns(DeprecationWarning, match="ConsumerWorker"):
        consumer = Consumer(URL, "c", 7, module_level_handler, batch_size=5, lease_ttl=2, wait=False, schema="other")
    assert isinstance(consumer, ConsumerWorker) and consumer.db.schema == "other"
    assert (consumer.spec.consumer_id, consumer.spec.branch_id, consumer.spec.batch_size) == ("c", 7, 5)
    assert (consumer.spec.lease_ttl, consumer.spec.wait) == (2, False)
    with pytest.warns(DeprecationWarning, match="ConsumerWorker"):
        worker = Consumer.from_spec(URL, ConsumerSpec(consumer_id="c", handler=module_level_handler))
    assert type(worker) is ConsumerWorker
    with pytest.raises(InvalidPubSubInput, match="batch_size"), pytest.warns(DeprecationWarning):
        Consumer(URL, "c", 0, module_level_handler, batch_size=0)
