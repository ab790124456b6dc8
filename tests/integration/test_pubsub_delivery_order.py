"""The two order modes: order="txid" delivers in txid order, waiting only for older transactions of this
database; the default mode is not held back by them."""

import random
import threading
import time

import psycopg
from waiting import wait_until

from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, publish


def worker(db, consumer_id, handler, **options):
    return ConsumerWorker(db, ConsumerSpec(consumer_id=consumer_id, handler=handler, **options))


def test_order_txid_delivers_in_txid_order_under_interleaved_long_and_short_transactions(db):
    committed: list[int] = []
    lock = threading.Lock()

    def produce(seed):
        r = random.Random(seed)
        with db.connect() as conn:
            for _ in range(15):
                ids = [publish(0, {"p": seed}, conn=conn)]
                time.sleep(r.choice([0, 0, 0.002, 0.01, 0.04]))  # long and short transactions interleave
                ids.append(publish(0, {"p": seed}, conn=conn))
                conn.commit()
                with lock:
                    committed.extend(ids)

    delivered: list[tuple[int, int]] = []
    consumer = worker(
        db,
        "strict-order",
        lambda conn, events: delivered.extend((e.txid, e.id) for e in events),
        batch_size=7,
        order="txid",
    )
    producers = [threading.Thread(target=produce, args=(seed,)) for seed in range(4)]
    for p in producers:
        p.start()
    while any(p.is_alive() for p in producers):
        consumer.run_once()
    for p in producers:
        p.join()
    # Any transaction of the cluster still running (another database's too) holds strict order back.
    wait_until(lambda: consumer.run_once() == 0 and len(delivered) >= len(committed), what="everything delivered")
    assert delivered == sorted(delivered)  # txid order, a transaction's events in id order
    assert sorted(i for _, i in delivered) == sorted(committed)  # nothing skipped, nothing twice


def test_order_txid_waits_for_an_older_open_transaction_of_this_database_only(db, server_url):
    delivered = []
    strict = worker(db, "strict", lambda conn, events: delivered.extend(e.id for e in events), order="txid")
    loose = worker(db, "loose", lambda conn, events: None)
    elsewhere = psycopg.connect(server_url)  # a writer in another database of the cluster: no events here
    elsewhere.execute("SELECT pg_current_xact_id()")
    with db.connection() as conn:
        before = publish(0, {"n": "while another database writes"}, conn=conn)
    wait_until(lambda: strict.run_once() == 0 and delivered == [before], what="not held back by another database")
    elsewhere.rollback()
    elsewhere.close()
    delivered.clear()
    older = db.connect()
    first = publish(0, {"n": "older, still open"}, conn=older)
    with db.connection() as conn:
        second = publish(0, {"n": "younger, committed"}, conn=conn)
    assert strict.run_once() == 0  # the younger one waits for the older transaction
    assert loose.run_once() == 2  # the default mode delivers it at once
    older.commit()
    older.close()
    wait_until(lambda: strict.run_once() == 0 and len(delivered) == 2, what="both delivered")
    assert delivered == [first, second]
