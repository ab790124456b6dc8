import pytest

from cmb_dagster.pubsub import CaptureSpec, ConsumerSpec, InvalidInput
from cmb_dagster.pubsub.models import handler_path, load_handler, validated


def module_level_handler(conn, events):
    pass


def test_consumer_spec_names_the_bad_field():
    assert validated(ConsumerSpec, consumer_id="orders.v2-a", handler="pkg.mod:fn").branch_id == 0
    for values, field in [
        ({"consumer_id": "x" * 64, "handler": "m:f"}, "consumer_id"),
        ({"consumer_id": "has space", "handler": "m:f"}, "consumer_id"),
        ({"consumer_id": "ok", "handler": "no_colon"}, "handler: Value error, must be 'module:function'"),
        ({"consumer_id": "ok", "handler": "m:f", "batch_size": 0}, "batch_size"),
        ({"consumer_id": "ok", "handler": "m:f", "branch_id": "trunk"}, "branch_id"),
    ]:
        with pytest.raises(InvalidInput, match=field):
            validated(ConsumerSpec, **values)
    assert validated(ConsumerSpec, consumer_id="x" * 63, handler="m:f")


def test_capture_spec_defaults_and_bad_ops():
    spec = validated(CaptureSpec, table="t")
    assert (spec.branch, spec.ops, spec.key, spec.columns) == ("0", ("insert", "update"), None, None)
    with pytest.raises(InvalidInput, match=r"ops\.1"):
        validated(CaptureSpec, table="t", ops=("insert", "upsert"))
    with pytest.raises(InvalidInput, match="table"):
        validated(CaptureSpec, table="")


def test_handlers_round_trip_through_their_dotted_path():
    path = handler_path(module_level_handler)
    assert path == f"{module_level_handler.__module__}:module_level_handler"
    assert handler_path(lambda conn, events: None) is None
    assert load_handler(path) is module_level_handler
    with pytest.raises(InvalidInput, match="handler: cannot import 'cmb_dagster.examples.pubsub:nope'"):
        load_handler("cmb_dagster.examples.pubsub:nope")
    with pytest.raises(InvalidInput, match="not callable"):
        load_handler("cmb_dagster.examples.pubsub:DEMO_BRANCH")
