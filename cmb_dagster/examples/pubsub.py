"""Pub/sub demo: orders captured as a change stream; a consumer keeps per-customer totals exactly once.

Launch ``pubsub_demo_place_orders`` in the UI; the ``cmb_pubsub_consumer_demo_order_totals_branch_100``
job (kept running by its sensor) folds the new orders into ``public.pubsub_demo_totals``, and the
``pubsub/demo_order_totals/branch_100`` asset plots the consumer's lag.
"""

import random

import psycopg
from dagster import OpExecutionContext, job, op

from cmb_dagster.pubsub import ConsumerSpec, Event, install_capture
from cmb_dagster.resources import CmbResource

DEMO_BRANCH = 100

consumer = ConsumerSpec(
    consumer_id="demo_order_totals", branch_id=DEMO_BRANCH, handler="cmb_dagster.examples.pubsub:add_to_totals"
)


def add_to_totals(conn: psycopg.Connection, events: list[Event]) -> None:
    """Add each new order to its customer's total, in the consumer's transaction."""
    orders = [e.payload for e in events if e.op == "insert"]
    conn.execute(
        "INSERT INTO public.pubsub_demo_totals AS t (customer, orders, amount)"
        " SELECT customer, count(*), sum(amount) FROM jsonb_to_recordset(%s::jsonb) AS o(customer text, amount numeric)"
        " GROUP BY customer"
        " ON CONFLICT (customer) DO UPDATE"
        " SET orders = t.orders + EXCLUDED.orders, amount = t.amount + EXCLUDED.amount",
        (psycopg.types.json.Jsonb(orders),),
    )


@op(description="Creates the demo tables and capture (once), then places 100 random orders.")
def place_orders(context: OpExecutionContext, cmb: CmbResource) -> None:
    with cmb.connection() as conn:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('public.pubsub_demo_orders'))")  # guards public tables
        conn.execute(
            "CREATE TABLE IF NOT EXISTS public.pubsub_demo_orders"
            " (id bigserial PRIMARY KEY, customer text NOT NULL, amount numeric NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS public.pubsub_demo_totals"
            " (customer text PRIMARY KEY, orders bigint NOT NULL, amount numeric NOT NULL)"
        )
        install_capture(conn, "public.pubsub_demo_orders", branch=str(DEMO_BRANCH), ops=["insert"])
    with cmb.connection() as conn:
        rows = [(random.choice(["ana", "bo", "chen", "dara"]), random.randint(1, 100)) for _ in range(100)]
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO public.pubsub_demo_orders (customer, amount) VALUES (%s, %s)", rows)
    context.log.info("placed 100 orders; the demo consumer adds them to public.pubsub_demo_totals")


@job(description="Places 100 demo orders, captured onto pub/sub branch 100.")
def pubsub_demo_place_orders() -> None:
    place_orders()
