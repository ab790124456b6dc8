"""The listener wakes on NOTIFY, and reconnects by itself after its connection is killed."""

import threading

from waiting import wait_until

from cmb_dagster.notifications import Listener, channel_name


def test_listener_delivers_and_reconnects(db):
    got: list[tuple[str, str | None]] = []
    lock = threading.Lock()

    def on_notify(channel, payload):
        with lock:
            got.append((channel, payload))

    channel = channel_name(db, "test")
    with Listener(db, [channel], on_notify, heartbeat=0.2, retry_delay=0.1) as listener:
        wait_until(listener.connected.is_set, timeout=10, what="listener connected")
        assert (channel, None) in got  # told to look everywhere on connect
        with db.connection() as conn:
            conn.execute("SELECT pg_notify(%s, 'one')", (channel,))
        wait_until(lambda: (channel, "one") in got, timeout=10, what="notification delivered")

        with db.connection() as conn:  # kill the listening connection behind its back
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE (query LIKE 'LISTEN%%' OR query = 'SELECT 1') AND pid <> pg_backend_pid() "
                "AND datname = current_database()"
            )
        wait_until(lambda: got.count((channel, None)) >= 2, timeout=10, what="reconnected")
        with db.connection() as conn:
            conn.execute("SELECT pg_notify(%s, 'two')", (channel,))
        wait_until(lambda: (channel, "two") in got, timeout=10, what="delivered after reconnect")
