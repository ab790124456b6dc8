"""Consumers reading a subset of a branch (issue 34): topics and a predicate on the event, evaluated in the read
query; the watermark moves past the events filtered out."""

import pytest

from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, InvalidPubSubInput, publish, status


def consumer(db, consumer_id="f", **filters):
    seen = []
    spec = ConsumerSpec(
        consumer_id=consumer_id, handler=lambda conn, events: seen.append(list(events)), batch_size=10, **filters
    )
    return ConsumerWorker(db, spec), seen


def drain(worker):
    passed = []
    while n := worker.run_once():
        passed.append(n)
    return passed


def test_a_consumer_gets_only_its_topics_and_matching_payloads_and_status_shows_its_filter(db):
    with db.connection() as conn:
        for n in range(30):
            publish(conn, 0, {"kind": "x" if n % 3 == 0 else "y", "n": n}, topic="a" if n % 2 == 0 else "b")
    worker, seen = consumer(db, topics=["a"], where="payload->>'kind' = 'x'")
    assert drain(worker) == [10, 10, 10]  # every event read past, in bounded batches
    delivered = [e.payload["n"] for batch in seen for e in batch]
    assert delivered == [n for n in range(30) if n % 6 == 0]
    [lag] = status(db, "f", 0).consumers
    assert (lag.events, lag.delivered, lag.topics, lag.where) == (0, 5, ["a"], "payload->>'kind' = 'x'")
    everything, all_seen = consumer(db, "all")
    drain(everything)
    assert sum(len(batch) for batch in all_seen) == 30


def test_a_branch_whose_events_are_all_filtered_out_is_read_past_without_a_handler_call(db):
    with db.connection() as conn:
        conn.execute(
            "INSERT INTO pubsub_events (branch_id, topic, op, payload) SELECT 0, 'noise', 'publish', '{}'"
            " FROM generate_series(1, 205)"
        )
    worker, seen = consumer(db, topics=["signal"])
    assert sum(drain(worker)) == 205 and seen == []
    with db.connection() as conn:
        publish(conn, 0, {"n": 1}, topic="signal")
    assert drain(worker) == [1] and [e.topic for e in seen[0]] == ["signal"]
    assert status(db, "f", 0).consumers[0].events == 0


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ({"where": "payload->>'kind'"}, "where: \"payload->>'kind'\" is not a valid filter here"),
        ({"where": "nope = 1"}, "where: 'nope = 1' is not a valid filter here"),
        ({"where": "true; SELECT 1"}, "where: must be one SQL expression, without a ';'"),
        ({"where": "x" * 2001}, "where: 2001 characters, at most 2000 allowed"),
        ({"topics": ["t"] * 101}, "topics: Tuple should have at most 100 items"),
    ],
)
def test_a_bad_filter_is_refused_naming_the_field_and_registers_nothing(db, filters, message):
    with pytest.raises(InvalidPubSubInput, match=message.replace("(", r"\(").replace("*", r"\*")):
        worker, _ = consumer(db, **filters)
        worker.check()
    assert status(db).consumers == []


def test_a_new_filter_replaces_the_registered_one(db):
    worker, _ = consumer(db, topics=["a"])
    worker.check()
    again, _ = consumer(db, where="op = 'publish'")
    again.check()
    [lag] = status(db).consumers
    assert (lag.topics, lag.where) == (None, "op = 'publish'")
