"""Endpoints: events a disabled endpoint keeps can still be cancelled, updated and kept through a cleanup; the
endpoint commands refuse bad input naming the field and write nothing; an owner's policy is validated."""

import json
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from callback_settings import FAST
from receiver import Receiver, Request
from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackWorker, EndpointPolicy, InvalidCallbackInput, RetryPolicy
from cmb_dagster.callbacks.admin import status
from cmb_dagster.models import Backoff

DOWN = "http://127.0.0.1:9/down"


def statuses(db) -> dict[str, int]:
    with db.connection() as conn:
        return dict(conn.execute("SELECT status, count(*) FROM callback_events GROUP BY status").fetchall())


def endpoint_rows(db) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM callback_endpoints").fetchone()[0]


def test_events_a_disabled_endpoint_keeps_can_be_cancelled_updated_and_outlive_a_cleanup(db):
    with CallbackClient(db, FAST) as client:
        client.disable_endpoint("shop", f"{DOWN}?tenant=7")  # the endpoint is the URL without its query
        now = datetime.now(UTC)
        for key in ("a", "b", "c"):
            client.create("shop", "orders", key, now - timedelta(days=3), f"{DOWN}?order={key}")
        with Running(CallbackWorker(db, FAST)):
            wait_until(lambda: statuses(db) == {"disabled": 3}, what="the gate keeps them, calling nothing")
        [endpoint] = client.endpoints("shop")
        assert (endpoint.endpoint, endpoint.state, endpoint.disabled_by, endpoint.disabled) == (
            DOWN,
            "disabled",
            "operator",
            3,
        )
        report = status(db, bucket_sets=1)
        assert (report.endpoints.open, report.endpoints.disabled) == (0, 1)
        assert [h.endpoint for h in report.unhealthy] == [DOWN] and report.totals.disabled == 3
        assert (report.bucket_sets[0].disabled_endpoints, report.bucket_sets[0].disabled) == (1, 3)
        assert client.cancel("shop", "orders", "a").status == "cancelled"
        assert client.update("shop", "orders", "b", context={"new": True}).status == "pending"
        client.clean(ttl_days=0)  # finished events older than now go; those waiting for their endpoint stay
        assert {e.event_key: e.status for e in client.list(owner_client_id="shop")} == {"b": "pending", "c": "disabled"}
        assert client.enable_endpoint("shop", DOWN) == 1  # c: held again, released by the workers
        assert client.endpoints("shop")[0].state == "closed"


@pytest.mark.parametrize(
    ("owner", "endpoint", "field"),
    [
        ("shop\x00", DOWN, "owner_client_id"),
        ("x" * 129, DOWN, "owner_client_id"),
        ("shop", "javascript:alert(1)", "endpoint"),
        ("shop", "dagster://nightly", "endpoint"),
        ("shop", "http://" + "h" * 3000 + "/x", "endpoint"),
        ("shop", None, "endpoint"),
    ],
)
def test_endpoint_commands_refuse_bad_input_naming_the_field_and_write_nothing(db, owner, endpoint, field):
    with CallbackClient(db, FAST) as client:
        for command in (client.disable_endpoint, client.enable_endpoint):
            with pytest.raises(InvalidCallbackInput, match=field):
                command(owner, endpoint)
    assert endpoint_rows(db) == 0


def test_an_unknown_endpoint_cannot_be_enabled_and_text_is_only_ever_a_value(db):
    hostile = "shop'); DELETE FROM callback_events; --"
    with CallbackClient(db, FAST) as client:
        client.create("shop", "g", "k", datetime.now(UTC) + timedelta(hours=1), DOWN)
        with pytest.raises(InvalidCallbackInput, match="endpoint: .* is not known"):
            client.enable_endpoint(hostile, DOWN)
        assert client.disable_endpoint(hostile, DOWN + "'; DROP TABLE callback_endpoints; --") == 0
        assert [e.owner_client_id for e in client.endpoints(state="disabled")] == [hostile]
        assert statuses(db) == {"pending": 1}


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"failure_rate": 1.5}, "failure_rate"),
        ({"disable_after": float("inf")}, "disable_after"),
        ({"window": 0}, "window"),
        ({"probe_interval": Backoff(first=0, max=10)}, "probe_interval"),
        ({"probes": 3}, "probes"),
    ],
)
def test_an_owner_policy_out_of_bounds_is_refused_naming_the_field(db, policy, field):
    with pytest.raises(InvalidCallbackInput, match=field):
        EndpointPolicy(**policy)
    with CallbackClient(db, FAST) as client, pytest.raises(InvalidCallbackInput, match=field):
        client.set_endpoint_policy("shop", policy)
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM callback_owner_settings").fetchone()[0] == 0


def test_one_owners_open_endpoint_holds_only_its_own_events(db):
    """Two tenants call one URL; it fails only for one of them: that one's breaker opens, the other's calls go on."""

    def answer(request: Request) -> tuple[int, bytes]:
        return (503, b"no") if json.loads(request.body)["owner_client_id"] == "broke" else (200, b"ok")

    policy = EndpointPolicy(failure_threshold=3, failure_rate=None, probe_interval=Backoff(first=60, max=60))
    with Receiver(answer) as receiver, CallbackClient(db, FAST) as client:
        client.set_endpoint_policy("broke", policy)
        client.set_endpoint_policy("fine", policy)
        now = datetime.now(UTC)
        for owner in ("broke", "fine"):
            client.create_many(
                {
                    "owner_client_id": owner,
                    "group_key": "g",
                    "event_key": f"k{i}",
                    "run_at": now,
                    "cb_url": receiver.url,
                    "retry": RetryPolicy.constant(0.2, fast_retries=0),
                }
                for i in range(50)
            )
        with Running(CallbackWorker(db, FAST)):
            wait_until(lambda: len(client.list(owner_client_id="fine", status="notified", limit=100)) == 50)
            wait_until(lambda: len(client.list(owner_client_id="broke", status="held", limit=100)) == 50)
        assert [(e.owner_client_id, e.state) for e in client.endpoints()] == [("broke", "open"), ("fine", "closed")]
        calls = Counter(json.loads(r.body)["owner_client_id"] for r in receiver.received())
        assert calls["broke"] <= 50  # each called once at most: their retries found the endpoint open


def test_an_endpoint_that_hangs_opens_on_its_timeouts_and_stops_holding_call_slots(db):
    """Calls that time out count as failures: the endpoint opens, and its events no longer take call slots."""
    hanging = threading.Event()

    def answer(request: Request) -> tuple[int, bytes]:
        if request.path == "/hang":
            hanging.wait(5)  # past the worker's 1 s timeout
        return 200, b"ok"

    settings = FAST.model_copy(update={"worker_concurrency": 4})
    policy = EndpointPolicy(failure_threshold=4, failure_rate=None, probe_interval=Backoff(first=60, max=60))
    with Receiver(answer) as receiver, CallbackClient(db, settings) as client:
        client.set_endpoint_policy("shop", policy)
        now = datetime.now(UTC)
        client.create_many(
            {
                "owner_client_id": "shop",
                "group_key": "hang",
                "event_key": f"h{i}",
                "run_at": now,
                "cb_url": f"{receiver.url}/hang",
                "retry": RetryPolicy(fast_retries=0),
            }
            for i in range(40)
        )
        with Running(CallbackWorker(db, settings)):
            wait_until(lambda: client.endpoints("shop", state="open"), timeout=20, what="the breaker opens")
            client.create_many(
                {
                    "owner_client_id": "shop",
                    "group_key": "ok",
                    "event_key": f"o{i}",
                    "run_at": datetime.now(UTC),
                    "cb_url": f"{receiver.url}/ok",
                }
                for i in range(40)
            )
            wait_until(
                lambda: len(client.list(group_key="ok", owner_client_id="shop", status="notified", limit=100)) == 40,
                timeout=20,
            )
        hanging.set()
        assert len(receiver.received("/hang")) < 40
        assert client.endpoints("shop", state="open")[0].last_error == "timed out"


def test_events_of_several_urls_named_as_one_endpoint_share_its_breaker(db):
    """An owner names the endpoint its events count for: failures of one URL open it for the other URL too."""

    def answer(request: Request) -> tuple[int, bytes]:
        return (503, b"down") if request.path == "/a" else (200, b"ok")

    policy = EndpointPolicy(failure_threshold=3, failure_rate=None, probe_interval=Backoff(first=60, max=60))
    retry = RetryPolicy.constant(0.2, fast_retries=0)
    with Receiver(answer) as receiver, CallbackClient(db, FAST) as client:
        client.set_endpoint_policy("shop", policy)
        for i in range(5):
            client.create("shop", "g", f"a{i}", datetime.now(UTC), f"{receiver.url}/a", retry=retry, endpoint="billing")
        with Running(CallbackWorker(db, FAST)):
            wait_until(lambda: client.endpoints("shop", state="open"), what="billing opens")
            client.create("shop", "g", "b", datetime.now(UTC), f"{receiver.url}/b", endpoint="billing")
            wait_until(lambda: client.get("shop", "g", "b").status == "held", what="/b held with it")
            wait_until(lambda: len(client.list(owner_client_id="shop", status="held")) == 6, what="all held")
        [billing] = client.endpoints("shop")
        assert billing.endpoint == "billing" and not receiver.received("/b")
        assert client.get("shop", "g", "b").endpoint_name == "billing"
        assert client.enable_endpoint("shop", "billing") == 6  # one command for every URL of the name
    with pytest.raises(InvalidCallbackInput, match="endpoint"):
        client.create("shop", "g", "c", datetime.now(UTC), "dagster://nightly", endpoint="billing")
    with pytest.raises(InvalidCallbackInput, match="endpoint"):
        client.create("shop", "g", "c", datetime.now(UTC), f"{receiver.url}/c", endpoint="not:a name")
