"""Consumers reading a subset of a branch: topics, and an SQL/JSON path predicate evaluated by Postgres as a
parameter of a fixed statement (it can read the event and nothing else); the watermark moves past the events
filtered out, and an event the filter raises on is parked by name instead of stalling the consumer."""

import pytest

from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, InvalidPubSubInput, dead_letters, publish, status


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


def delivered(seen, field="n"):
    return [e.payload[field] for batch in seen for e in batch]


def test_a_consumer_gets_only_its_topics_and_matching_payloads_and_status_shows_its_filter(db):
    with db.connection() as conn:
        for n in range(30):
            publish(0, {"kind": "x" if n % 3 == 0 else "y", "n": n}, topic="a" if n % 2 == 0 else "b", conn=conn)
    worker, seen = consumer(db, topics=["a"], where='$.kind == "x"')
    assert drain(worker) == [10, 10, 10]  # every event read past, in bounded batches
    assert delivered(seen) == [n for n in range(30) if n % 6 == 0]
    [lag] = status(db, "f", 0).consumers
    assert (lag.events, lag.delivered, lag.topics, lag.where) == (0, 5, ["a"], '$.kind == "x"')
    everything, all_seen = consumer(db, "all")
    drain(everything)
    assert sum(len(batch) for batch in all_seen) == 30


def test_a_filter_reads_the_events_topic_op_and_key_as_variables(db):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.accounts (id int PRIMARY KEY, plan text)")
        from cmb_dagster.pubsub import install_capture

        install_capture(conn, "public.accounts", ops=("insert", "update", "delete"))
        conn.execute("INSERT INTO public.accounts VALUES (1, 'free'), (2, 'pro'), (3, 'pro')")
        conn.execute("UPDATE public.accounts SET plan = 'free' WHERE id = 3")
        publish(0, {"id": 9, "plan": "pro"}, topic="manual", conn=conn)
    worker, seen = consumer(db, where='$op == "insert" && $topic == "public.accounts" && $key.id >= 2')
    drain(worker)
    assert [(e.op, e.key) for batch in seen for e in batch] == [("insert", {"id": 2}), ("insert", {"id": 3})]


def test_a_branch_whose_events_are_all_filtered_out_is_read_past_without_a_handler_call(db):
    with db.connection() as conn:
        conn.execute(
            "INSERT INTO pubsub_events (branch_id, topic, op, payload) SELECT 0, 'noise', 'publish', '{}'"
            " FROM generate_series(1, 205)"
        )
    worker, seen = consumer(db, topics=["signal"])
    assert sum(drain(worker)) == 205 and seen == []
    with db.connection() as conn:
        publish(0, {"n": 1}, topic="signal", conn=conn)
    assert drain(worker) == [1] and [e.topic for e in seen[0]] == ["signal"]
    assert status(db, "f", 0).consumers[0].events == 0


def test_percent_signs_and_quotes_are_text_of_the_filter_never_of_a_statement(db):
    with db.connection() as conn:
        for n, s in enumerate(["a%b", "abc", "100%", "it's", "%(x)s", "%s"]):
            publish(0, {"n": n, "s": s}, conn=conn)
    worker, seen = consumer(db, where='$.s like_regex "%" || $.s == "it\'s" || $.s starts with "ab"')
    drain(worker)
    assert delivered(seen) == [0, 1, 2, 3, 4, 5]
    exact, exact_seen = consumer(db, "exact", where='$.s == "%(x)s"')
    drain(exact)
    assert delivered(exact_seen) == [4]


def test_a_filter_that_fails_on_one_event_treats_it_as_not_matching_and_the_rest_go_on(db):
    """The issue's `1/((payload->>'n')::int) > 0` with n=0 on one event stalled the consumer: in a path, the
    division by zero is an error the silent evaluation suppresses, so that event does not match."""
    with db.connection() as conn:
        for n in [3, 1, 0, 2, 5, 4]:
            publish(0, {"n": n}, conn=conn)
    worker, seen = consumer(db, where="1 / $.n > 0")
    assert sum(drain(worker)) == 6
    assert delivered(seen) == [3, 1, 2, 5, 4]
    [lag] = status(db, "f", 0).consumers
    assert (lag.events, lag.parked, lag.failing_event) == (0, 0, None)


def test_an_event_the_filter_raises_on_is_parked_by_name_and_the_consumer_goes_on(db, caplog):
    """A datetime template the server cannot apply raises even in silent evaluation, only on events whose field
    is a string: the batch is judged event by event, that event is parked with the error, the others go on."""
    with db.connection() as conn:
        ids = [publish(0, {"n": n, "d": "soon" if n == 4 else None}, conn=conn) for n in range(8)]
    worker, seen = consumer(db, where='$.d.datetime("TH") < "2020-01-01".datetime() || $.n >= 0')
    assert sum(drain(worker)) == 8
    assert delivered(seen) == [0, 1, 2, 3, 5, 6, 7]
    with db.connection() as conn:
        [parked] = dead_letters(conn, "f", 0)
    assert parked.event.id == ids[4] and "the consumer's filter raised on this event" in parked.error
    assert "invalid datetime format separator" in parked.error
    [lag] = status(db, "f", 0).consumers
    assert (lag.events, lag.parked) == (0, 1)
    assert f"parked event {ids[4]}: the filter raised on it" in caplog.text
    with db.connection() as conn:
        publish(0, {"n": 8, "d": None}, conn=conn)
    assert drain(worker) == [1] and delivered(seen)[-1] == 8  # the next batches read as fast as before


INJECTIONS = [
    # the backfill string, which passed every earlier check and emptied a table
    'TRUE) ORDER BY "id" LIMIT 1000 FOR SHARE OF r), x AS (DELETE FROM public.victim RETURNING 1), '
    "y AS (SELECT 1 FROM public.victim WHERE (TRUE",
    "pg_sleep(5) IS NOT NULL",
    "(SELECT count(*) FROM cmb.callback_signing_secrets) > 0",
    "set_config('search_path', 'public', false) IS NOT NULL",
    "length(pg_read_file('/etc/passwd')) > 0",
    "(payload->>'n')::int > (SELECT max(v) FROM public.victim)::text::int",
    "payload->>'s' LIKE 'a%'",
    "$.a == 1 && exists($ ? (@ == $victim))",
]


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ({"where": "payload->>'kind'"}, "is not an SQL/JSON path predicate"),
        ({"where": "$.kind"}, "it selects values; a filter must be true or false"),
        ({"where": '$.kind == "x" && $nope == 1'}, "$nope is not a variable here (variables: $topic, $op, $key"),
        ({"where": '$"x y" == 1'}, "$x y is not a variable here"),
        ({"where": '$.s like_regex "("'}, "invalid regular expression"),
        ({"where": "x" * 2001}, "where: 2001 characters, at most 2000 allowed"),
        ({"where": " "}, "where: must be an SQL/JSON path predicate"),
        ({"where": '$.a == "\x00"'}, "U\\+0000"),
        ({"topics": ["t"] * 101}, "topics: Tuple should have at most 100 items"),
        *[({"where": text}, "where: ") for text in INJECTIONS],
    ],
)
def test_a_bad_filter_is_refused_naming_the_field_runs_nothing_and_registers_nothing(db, filters, message):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.victim (v int)")
        conn.execute("INSERT INTO public.victim VALUES (1), (2)")
        publish(0, {"n": 1, "s": "abc"}, conn=conn)
    with pytest.raises(InvalidPubSubInput, match=message.replace("(", r"\(").replace("$", r"\$")):
        worker, _ = consumer(db, **filters)
        worker.check()
    assert status(db).consumers == []
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM public.victim").fetchone()[0] == 2
        assert conn.execute("SHOW search_path").fetchone()[0].startswith("cmb")


def test_a_new_filter_replaces_the_registered_one(db):
    worker, _ = consumer(db, topics=["a"])
    worker.check()
    again, _ = consumer(db, where='$op == "publish"')
    again.check()
    [lag] = status(db).consumers
    assert (lag.topics, lag.where) == (None, '$op == "publish"')
