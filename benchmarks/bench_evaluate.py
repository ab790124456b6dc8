"""Throughput of ``cmb_dagster.triggers.evaluate``: evaluations per second for typical triggers.

Run: ``python benchmarks/bench_evaluate.py [--seconds 1.0]``. Prints a table, then a JSON object
as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cmb_dagster.triggers import All, ChunkDelta, Delay, Delta, Trigger, evaluate

ORDERS = ("sales.orders", "loaded_until")
PRICES = ("sales.prices", "loaded_until")
NOW = datetime(2021, 4, 25, 6, 0, tzinfo=UTC)
CURRENT = {ORDERS: datetime(2021, 4, 25, 3, 27, 33, tzinfo=UTC), PRICES: datetime(2021, 4, 25, 5, 0, tzinfo=UTC)}
LAST = {ORDERS: datetime(2021, 4, 23, 3, 51, 16, tzinfo=UTC), PRICES: datetime(2021, 4, 24, 5, 0, tzinfo=UTC)}

CASES: dict[str, Trigger] = {
    "Delta": Delta(*ORDERS, "2d"),
    "ChunkDelta(day, Europe/Moscow)": ChunkDelta(*ORDERS, "day", 2, timezone="Europe/Moscow"),
    "All(Delta, ChunkDelta, Delay)": All(
        Delta(*ORDERS, "1d"),
        ChunkDelta(*PRICES, "day", timezone="Europe/Moscow"),
        Delay(*PRICES, "2h"),
    ),
}


def evaluations_per_second(trigger: Trigger, seconds: float) -> float:
    """Best rate over a few timed batches of ``evaluate(trigger, ...)`` calls."""
    batch = 1_000
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(batch):
            evaluate(trigger, now=NOW, current=CURRENT, last=LAST)
        best = max(best, batch / (time.perf_counter() - started))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent per case")
    seconds = parser.parse_args().seconds
    rates = {name: evaluations_per_second(trigger, seconds) for name, trigger in CASES.items()}
    width = max(map(len, rates))
    print(f"{'trigger':<{width}}  {'evaluations/s':>14}  {'µs/evaluation':>14}")
    for name, rate in rates.items():
        print(f"{name:<{width}}  {rate:>14,.0f}  {1e6 / rate:>14.2f}")
    print(json.dumps({"evaluations_per_second": {name: round(rate) for name, rate in rates.items()}}))


if __name__ == "__main__":
    main()
