"""A worker run hands its partitions to its successor at once: the ending run releases and announces its
leases, and the successor, already running, takes them on the announcement (not at its next renewal)."""

import itertools
import threading
import time
from datetime import UTC, datetime, timedelta

from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, CallbackWorker
from cmb_dagster.callbacks.sink import CallbackSink
from cmb_dagster.models import Backoff

# A long lease: without the announcement the successor would take the buckets only at its next renewal
# (every ttl / 3 = 4 s), well after the ending run let them go.
SETTINGS = CallbackSettings(
    poll_interval=0.2, lease_ttl=12, timeout=1, backoff=Backoff(first=0.01), lookahead=1, allowed_hosts=["127.0.0.1"]
)
EVENTS = 500  # one due every 10 ms for 5 s


def test_the_successor_calls_on_within_a_second_of_the_handover(db):
    with CallbackSink() as sink, CallbackClient(db, SETTINGS) as client:
        start = datetime.now(UTC) + timedelta(seconds=1)
        client.create_many(
            {
                "owner_client_id": "a",
                "group_key": "g",
                "event_key": f"e{i}",
                "run_at": start + timedelta(milliseconds=10 * i),
                "cb_url": f"{sink.url}/cb",
            }
            for i in range(EVENTS)
        )
        ending = CallbackWorker(db, SETTINGS)
        first = threading.Thread(target=ending.run, args=(3.0,))  # works until 2 s into the events
        first.start()
        wait_until(lambda: len(sink.received) > 20, timeout=30, what="the first run calling")
        time.sleep(0.5)  # the successor starts while the first run still holds every bucket
        with Running(CallbackWorker(db, SETTINGS)):
            first.join(30)
            assert not first.is_alive()
            wait_until(lambda: len(sink.received) >= EVENTS, timeout=60, what="every event called")
    moments = sorted(call.started for call in sink.received)
    longest = max(b - a for a, b in itertools.pairwise(moments))
    assert longest < 1.0, f"{longest:.2f} s without a call across the handover"
