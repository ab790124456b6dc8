"""The scheduler evaluates a task when one of its inputs changes, and because time passed only at the wake time its
last evaluation gave (a Settle's quiet time ending, a deadline).

That is sound only if, with CTL values fixed, the passing of time never turns a trigger without a wake time from
false to true (Delay-type conditions only decay). Checked here over many random triggers and values.
"""

import dataclasses
import random
from datetime import UTC, datetime, timedelta

import pytest

from cmb_dagster.triggers import All, Any, ChunkDelay, ChunkDelta, ChunkRefDelay, Delay, Delta, RefDelay, evaluate

KEYS = [("sales", "loaded_until"), ("prices", "loaded_until"), ("stock", "checked_at")]
SCALES = ["15min", "30min", "hour", "6h", "day", "week", "month", "quarter", "year"]
ZONES = ["UTC", "Europe/Moscow", "America/New_York", "Australia/Lord_Howe"]
START = datetime(2024, 1, 1, tzinfo=UTC)


def random_moment(rng: random.Random) -> datetime:
    return START + timedelta(seconds=rng.randrange(0, 3 * 365 * 86400))


def random_ctl_trigger(rng: random.Random):
    (e, p), (re_, rp) = rng.sample(KEYS, 2)
    duration = timedelta(minutes=rng.randrange(1, 60 * 24 * 40))
    zone = rng.choice([None, *ZONES])
    scale = rng.choice(SCALES)
    return rng.choice(
        [
            lambda: Delta(e, p, duration),
            lambda: Delay(e, p, duration),
            lambda: RefDelay(e, p, re_, rp, duration),
            lambda: ChunkDelta(e, p, scale, rng.choice([None, 1, 2, 5]), timezone=zone),
            lambda: ChunkDelay(e, p, scale, rng.choice([None, 0, 1, 3]), timezone=zone),
            lambda: ChunkRefDelay(e, p, re_, rp, scale, rng.choice([None, 0, 1, 3]), timezone=zone),
        ]
    )()


def random_trigger(rng: random.Random):
    shape = rng.random()
    if shape < 0.5:
        return random_ctl_trigger(rng)
    children = [random_ctl_trigger(rng) for _ in range(rng.randrange(1, 4))]
    return All(*children) if shape < 0.75 else Any(*children)


def random_values(rng: random.Random, around: datetime) -> dict:
    """Values near ``around`` (thresholds of minutes to weeks matter), some parameters missing."""
    spread = timedelta(seconds=rng.choice([600, 86400, 20 * 86400]))
    return {key: around - spread * rng.random() for key in KEYS if rng.random() < 0.85}


def false_to_true(evaluate_trigger, seed: int, cases: int = 1500) -> tuple[str | None, int]:
    """The first trigger that time alone turned from false to true (or None), and how many were checked."""
    rng = random.Random(seed)
    checked = 0
    for _ in range(cases):
        trigger = random_trigger(rng)
        base = random_moment(rng)
        current, last = random_values(rng, base), random_values(rng, base)
        timezone = rng.choice(ZONES)
        now = base + timedelta(seconds=rng.choice([60, 3600, 86400, 30 * 86400]) * rng.random())
        later = now + timedelta(seconds=rng.choice([1, 59, 3600, 86400, 40 * 86400, 400 * 86400]) * rng.random())
        if evaluate_trigger(trigger, now=now, current=current, last=last, timezone=timezone).fired:
            continue
        checked += 1
        after = evaluate_trigger(trigger, now=later, current=current, last=last, timezone=timezone)
        if after.fired:
            return f"{trigger!r} turned true from {now} to {later}: {after.explanation}", checked
    return None, checked


@pytest.mark.parametrize("seed", range(8))
def test_time_alone_never_turns_a_trigger_from_false_to_true(seed):
    counterexample, checked = false_to_true(evaluate, seed)
    assert counterexample is None, counterexample
    assert checked > 300  # the property was exercised, not vacuously true


def test_the_property_check_catches_a_trigger_that_grows_true_with_time():
    """Were Delay "at least this stale" instead of "at most", the scheduler would need periodic scans."""

    def inverted_delay(trigger, **inputs):
        result = evaluate(trigger, **inputs)
        if isinstance(trigger, Delay) and (trigger.key in inputs["current"]):
            return dataclasses.replace(result, fired=not result.fired)
        return result

    counterexample, _ = false_to_true(inverted_delay, seed=0)
    assert counterexample is not None and "Delay" in counterexample
