"""Issue 29 item 14: a database outage is one warning line and a growing retry delay, not a traceback a
second; the reconnect is one line; a failing callback is logged once per distinct error."""

import logging
import threading
import time
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.notifications import Listener, channel_name

LOGGER = "cmb_dagster.notifications"
OUTAGE_S = 3.0


@pytest.fixture
def log_records(caplog):
    """The listener's log records so far (a function of no argument)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    return lambda: [r for r in caplog.records if r.name == LOGGER]


def messages(records, text):
    return [r.getMessage() for r in records if text in r.getMessage()]


def count_connects(db):
    """The times ``db.connect_direct`` (the listener's connection) is called from now on."""
    attempts = []
    connect = db.connect_direct

    def counted(**kwargs):
        attempts.append(time.monotonic())
        return connect(**kwargs)

    db.connect_direct = counted
    return attempts


def test_an_unreachable_server_is_one_warning_and_ever_rarer_attempts(log_records):
    db = Database("postgresql://postgres@127.0.0.1:1/x")  # nothing listens on port 1
    attempts = count_connects(db)
    with Listener(db, ["cmb.test"], lambda channel, payload: None, retry_delay=0.1):
        time.sleep(OUTAGE_S)  # the outage: what happens during it is the point, not a condition to wait for
    records = log_records()
    assert len(messages(records, "cannot connect")) == 1, [r.getMessage() for r in records]
    assert [r for r in records if r.exc_info] == []
    assert 3 <= len(attempts) <= 6  # 0.1, 0.2, 0.4, 0.8, 1.6 s apart; a fixed 0.1 s would be 30 attempts


def test_an_outage_is_one_warning_then_one_line_when_it_reconnects(db, database_url, server_url, log_records):
    name = urlsplit(database_url).path.lstrip("/")
    got = []
    channel = channel_name(db, "test")
    listener = Listener(db, [channel], lambda channel, payload: got.append(payload), heartbeat=0.2, retry_delay=0.1)
    with listener:
        wait_until(listener.connected.is_set, timeout=10, what="listener connected")
        attempts = count_connects(db)
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(sql.Identifier(name)))
            try:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (name,),
                )
                wait_until(lambda: messages(log_records(), "lost its connection"), timeout=10, what="loss logged")
                time.sleep(OUTAGE_S)  # the outage itself
                during_outage = len(attempts)
            finally:
                admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(sql.Identifier(name)))
        wait_until(lambda: messages(log_records(), "reconnected after"), timeout=15, what="reconnect logged")
        with db.connection() as conn:
            conn.execute("SELECT pg_notify(%s, 'after')", (channel,))
        wait_until(lambda: "after" in got, timeout=10, what="delivered after the outage")
    records = log_records()
    assert len(messages(records, "lost its connection")) == 1, [r.getMessage() for r in records]
    assert len(messages(records, "reconnected after")) == 1
    assert [r for r in records if r.exc_info] == []
    assert during_outage <= 6  # a growing delay, not an attempt every 0.1 s


def test_a_killed_connection_reconnects_and_says_so_once(db, log_records):
    listener = Listener(db, [channel_name(db, "test")], lambda channel, payload: None, heartbeat=0.2, retry_delay=0.1)
    with listener:
        wait_until(listener.connected.is_set, timeout=10, what="listener connected")
        with db.connection() as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN%%' AND pid <> pg_backend_pid() AND datname = current_database()"
            )
        wait_until(lambda: listener.connections == 2 and listener.connected.is_set(), timeout=10, what="reconnected")
    records = log_records()
    assert len(messages(records, "lost its connection")) == 1, [r.getMessage() for r in records]
    assert len(messages(records, "reconnected after")) == 1
    assert [r for r in records if r.exc_info] == []


def test_a_failing_callback_is_logged_with_its_traceback_once_per_error(db, log_records):
    got = []
    lock = threading.Lock()

    def on_notify(channel, payload):
        with lock:
            got.append(payload)
        if payload is not None:
            raise RuntimeError(f"cannot handle {payload}")

    channel = channel_name(db, "test")
    with Listener(db, [channel], on_notify, heartbeat=0.2, retry_delay=0.1) as listener:
        wait_until(listener.connected.is_set, timeout=10, what="listener connected")
        with db.connect(autocommit=True) as conn:  # one transaction, so one notification, each
            for payload in ["a", "b"] * 10:
                conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))
        wait_until(lambda: len(got) == 21, timeout=10, what="every notification delivered")
        assert listener.connections == 1  # the failures did not cost the connection
    failures = [r for r in log_records() if "callback failed" in r.getMessage()]
    assert [str(r.exc_info[1]) for r in failures] == ["cannot handle a", "cannot handle b"]
