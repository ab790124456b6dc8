"""Passing time alone never makes a trigger fire: with current and last fixed, "waits" stays "waits".

Later code relies on this (a waiting trigger only needs re-checking when a CTL value changes),
so it is checked by random sampling with a fixed seed over every trigger type.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from cmb_dagster.triggers import (
    All,
    Any,
    ChunkDelay,
    ChunkDelta,
    ChunkRefDelay,
    Delay,
    Delta,
    RefDelay,
    Trigger,
    evaluate,
)

KEYS = [("sales", "loaded_until"), ("prices", "loaded_until"), ("stock", "updated_at")]
SCALES = ["1min", "15min", "30min", "hour", "6h", "day", "week", "month", "quarter", "year"]
ZONES = [None, "UTC", "Europe/Moscow", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "America/Sao_Paulo"]
# UTC offset changes in the zones above.
OFFSET_CHANGES = [
    ("America/New_York", datetime(2021, 11, 7, 6, 0, tzinfo=UTC)),  # falls back an hour
    ("America/New_York", datetime(2021, 3, 14, 7, 0, tzinfo=UTC)),  # springs forward an hour
    ("Australia/Lord_Howe", datetime(2021, 4, 3, 15, 0, tzinfo=UTC)),  # falls back 30 minutes
    ("America/Sao_Paulo", datetime(2018, 2, 18, 2, 0, tzinfo=UTC)),  # fell back across midnight
    ("Europe/Moscow", datetime(2014, 10, 25, 22, 0, tzinfo=UTC)),  # moved from UTC+4 to UTC+3 for good
]
# Random moments cluster around these, so offset changes and calendar boundaries get exercised.
HOTSPOTS = [change for _, change in OFFSET_CHANGES] + [datetime(2021, 12, 31, 23, 0, tzinfo=UTC)]
CASES = 20_000


def random_moment(rng: random.Random, around: datetime) -> datetime:
    spread = rng.choice([timedelta(minutes=90), timedelta(hours=30), timedelta(days=40), timedelta(days=400)])
    return around + spread * rng.uniform(-1, 1)


def random_duration(rng: random.Random) -> timedelta:
    return rng.choice([timedelta(minutes=1), timedelta(hours=1), timedelta(days=1)]) * rng.randint(1, 48)


def random_ctl_trigger(rng: random.Random) -> Trigger:
    key, ref = rng.sample(KEYS, 2)
    scale, zone = rng.choice(SCALES), rng.choice(ZONES)
    chunks = rng.choice([None, 0, 1, 2, 5])
    kind = rng.choice([Delta, Delay, RefDelay, ChunkDelta, ChunkDelay, ChunkRefDelay])
    if kind is Delta or kind is Delay:
        return kind(*key, random_duration(rng))
    if kind is RefDelay:
        return RefDelay(*key, *ref, random_duration(rng))
    if kind is ChunkDelta:
        return ChunkDelta(*key, scale, chunks or None, timezone=zone)
    if kind is ChunkDelay:
        return ChunkDelay(*key, scale, chunks, timezone=zone)
    return ChunkRefDelay(*key, *ref, scale, chunks, timezone=zone)


def random_trigger(rng: random.Random) -> Trigger:
    shape = rng.random()
    if shape < 0.6:
        return random_ctl_trigger(rng)
    children = [random_ctl_trigger(rng) for _ in range(rng.randint(1, 3))]
    return All(*children) if shape < 0.8 else Any(*children)


def random_values(rng: random.Random, around: datetime, missing: float) -> dict:
    return {key: random_moment(rng, around) for key in KEYS if rng.random() >= missing}


def test_time_passing_never_turns_waiting_into_firing():
    rng = random.Random(20210425)
    outcomes = {"waits then waits": 0, "fires then waits": 0, "fires then fires": 0}
    for _ in range(CASES):
        trigger = random_trigger(rng)
        around = rng.choice(HOTSPOTS)
        current = random_values(rng, around, missing=0.1)
        last = random_values(rng, around - timedelta(days=1), missing=0.2)
        task_timezone = rng.choice(ZONES)
        now = random_moment(rng, around)
        step = rng.choice([timedelta(seconds=1), timedelta(minutes=17), timedelta(hours=5), timedelta(days=33)])
        later = now + step * rng.random() + timedelta(microseconds=1)
        before = evaluate(trigger, now=now, current=current, last=last, timezone=task_timezone)
        after = evaluate(trigger, now=later, current=current, last=last, timezone=task_timezone)
        assert before.fired or not after.fired, (
            f"{trigger!r} waited at {now} but fired at {later} (timezone={task_timezone})\n"
            f"current={current}\nlast={last}\nbefore: {before.explanation}\nafter: {after.explanation}"
        )
        if after.fired:
            outcomes["fires then fires"] += 1
        else:
            outcomes["fires then waits" if before.fired else "waits then waits"] += 1
    # The sample must exercise all possible outcomes, or the property above would be vacuous.
    assert min(outcomes.values()) > CASES // 200, outcomes


def test_now_crossing_offset_changes_never_turns_waiting_into_firing():
    """Dense sweep: ``now`` walks minute by minute through each offset change, from just after ``current``."""
    key = KEYS[0]
    for zone, change in OFFSET_CHANGES:
        for scale, allowed in [("1min", 0), ("15min", 0), ("20min", 1), ("30min", 0), ("hour", 0), ("day", 0)]:
            trigger = ChunkDelay(*key, scale, allowed, timezone=zone)
            for minutes_before in range(5, 95, 10):
                current = {key: change - timedelta(minutes=minutes_before)}
                fired_before = True
                for minute in range(150):
                    now = current[key] + timedelta(minutes=minute)
                    fired = evaluate(trigger, now=now, current=current, last={}).fired
                    assert fired_before or not fired, f"{trigger!r} fired again at {now}, current={current}"
                    fired_before = fired
