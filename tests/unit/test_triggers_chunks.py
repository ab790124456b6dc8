"""Durations, chunk scales and chunk indices, including DST transitions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from cmb_dagster.triggers import ChunkDelay, ChunkDelta, evaluate
from cmb_dagster.triggers.chunks import chunk_of, get_zone, parse_scale
from cmb_dagster.triggers.durations import compact_duration, human_duration, parse_duration

KEY = ("sales.orders", "loaded_until")


def chunk(moment: datetime, scale: str, zone: str = "UTC") -> tuple[int, str]:
    parsed = parse_scale(scale)
    index, local = chunk_of(moment, parsed, get_zone(zone))
    return index, parsed.label_of(local)


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# --- durations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        timedelta(seconds=45),
        timedelta(minutes=30),
        timedelta(days=2),
        timedelta(days=1, hours=23, minutes=36, seconds=17),
        timedelta(weeks=3),
        timedelta(seconds=1, microseconds=500_000),
        timedelta(microseconds=1),
        timedelta(hours=-2),
        timedelta(0),
    ],
)
def test_compact_duration_round_trips(value):
    assert parse_duration(compact_duration(value)) == value


def test_compact_duration_examples():
    assert compact_duration(timedelta(days=2)) == "2d"
    assert compact_duration(timedelta(days=1, minutes=90)) == "1d1h30min"
    assert compact_duration(timedelta(0)) == "0s"


def test_human_duration_examples():
    assert human_duration(timedelta(days=2)) == "2 days"
    assert human_duration(timedelta(days=1, hours=23, minutes=36, seconds=17)) == "1 day, 23:36:17"
    assert human_duration(timedelta(minutes=23, seconds=43)) == "0:23:43"
    assert human_duration(timedelta(hours=-1)) == "-1:00:00"


@pytest.mark.parametrize("text", ["", "2", "d", "2 x", "1.2.3h", "2d-1h", "1m", None, 5])
def test_unreadable_durations(text):
    with pytest.raises(ValueError, match=repr(text) if text is not None else "None"):
        parse_duration(text)


# --- scales --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("1min", "1min"),
        ("minute", "1min"),
        ("15min", "15min"),
        ("30min", "30min"),
        ("90min", "90min"),
        ("hour", "hour"),
        ("1h", "hour"),
        ("60min", "hour"),
        ("6h", "6h"),
        ("12h", "12h"),
        ("24h", "day"),
        ("day", "day"),
        ("1d", "day"),
        ("Day", "day"),
        ("week", "week"),
        ("1w", "week"),
        ("7d", "week"),
        ("month", "month"),
        ("quarter", "quarter"),
        ("year", "year"),
    ],
)
def test_scales_are_canonical(text, canonical):
    assert parse_scale(text).name == canonical


@pytest.mark.parametrize("text", ["7min", "5h", "25h", "2d", "45s", "90s", "0min", "decade", "m", ""])
def test_bad_scales(text):
    with pytest.raises(ValueError, match=repr(text)):
        parse_scale(text)


@pytest.mark.parametrize("name", ["Europe/Atlantis", "Europe", "utc", "", "../etc/passwd"])
def test_unknown_zone(name):
    with pytest.raises(ValueError, match=f"unknown time zone {name!r}"):
        get_zone(name)


# --- chunk indices and labels -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale", "label"),
    [
        ("15min", "2021-04-25 03:15"),
        ("hour", "2021-04-25 03:00"),
        ("6h", "2021-04-25 00:00"),
        ("day", "2021-04-25"),
        ("week", "2021-W16"),
        ("month", "2021-04"),
        ("quarter", "2021-Q2"),
        ("year", "2021"),
    ],
)
def test_chunk_labels(scale, label):
    assert chunk(utc("2021-04-25 03:27:33"), scale)[1] == label


def test_seed_example_is_two_days_apart():
    assert chunk(utc("2021-04-25 03:27:33"), "day")[0] - chunk(utc("2021-04-23 03:51:16"), "day")[0] == 2


def test_chunks_are_consecutive_across_calendar_boundaries():
    assert chunk(utc("2021-01-01 00:00"), "month")[0] - chunk(utc("2020-12-31 23:59"), "month")[0] == 1
    assert chunk(utc("2021-01-01 00:00"), "quarter")[0] - chunk(utc("2020-12-31 23:59"), "quarter")[0] == 1
    assert chunk(utc("2021-01-01 00:00"), "year")[0] - chunk(utc("2020-12-31 23:59"), "year")[0] == 1
    assert chunk(utc("2021-01-04 00:00"), "week")[0] - chunk(utc("2021-01-03 23:59"), "week")[0] == 1  # Mon/Sun
    assert chunk(utc("2021-01-03 23:59"), "week")[0] == chunk(utc("2020-12-28 00:00"), "week")[0]
    assert chunk(utc("2021-04-26 00:00"), "6h")[0] - chunk(utc("2021-04-25 18:00"), "6h")[0] == 1
    assert chunk(utc("2021-04-25 23:59"), "6h")[0] - chunk(utc("2021-04-25 00:00"), "6h")[0] == 3


def test_weeks_start_on_monday():
    monday = utc("2021-04-19 00:00")
    assert chunk(monday + timedelta(days=6, hours=23), "week") == chunk(monday, "week")
    assert chunk(monday - timedelta(seconds=1), "week")[0] == chunk(monday, "week")[0] - 1


def test_rounding_happens_in_local_wall_time():
    # 21:30 UTC is 00:30 next day in Moscow and 03:00 next day in Kolkata (UTC+5:30).
    moment = utc("2021-04-24 21:30")
    assert chunk(moment, "day", "Europe/Moscow")[1] == "2021-04-25"
    assert chunk(moment, "hour", "Asia/Kolkata")[1] == "2021-04-25 03:00"
    assert chunk(moment, "hour", "UTC")[1] == "2021-04-24 21:00"


def test_dst_days_are_one_chunk_however_long():
    # New York: 2021-03-14 has 23 hours, 2021-11-07 has 25.
    zone = "America/New_York"
    short_day_start = datetime(2021, 3, 14, tzinfo=ZoneInfo(zone))
    long_day_start = datetime(2021, 11, 7, tzinfo=ZoneInfo(zone))
    assert chunk(short_day_start + timedelta(hours=22, minutes=59), "day", zone)[1] == "2021-03-14"
    assert chunk(long_day_start.astimezone(UTC) + timedelta(hours=24, minutes=59), "day", zone)[1] == "2021-11-07"
    next_day = datetime(2021, 11, 8, tzinfo=ZoneInfo(zone))
    assert chunk(next_day, "day", zone)[0] - chunk(short_day_start, "day", zone)[0] == 239


def test_spring_forward_skips_the_missing_hour():
    zone = "America/New_York"  # 2021-03-14 02:00 EST -> 03:00 EDT
    before = utc("2021-03-14 06:59")  # 01:59 EST
    after = utc("2021-03-14 07:00")  # 03:00 EDT
    assert chunk(before, "hour", zone)[1] == "2021-03-14 01:00"
    assert chunk(after, "hour", zone)[1] == "2021-03-14 03:00"
    # Chunk indices follow the wall clock, so the missing 02:00 chunk still counts.
    assert chunk(after, "hour", zone)[0] - chunk(before, "hour", zone)[0] == 2


def test_fall_back_keeps_chunks_from_going_backwards():
    zone = "America/New_York"  # 2021-11-07 02:00 EDT -> 01:00 EST; 01:00-02:00 happens twice
    first_pass = utc("2021-11-07 05:50")  # 01:50 EDT
    second_pass = utc("2021-11-07 06:05")  # 01:05 EST
    assert chunk(first_pass, "15min", zone)[1] == "2021-11-07 01:45"
    assert chunk(second_pass, "15min", zone) == chunk(first_pass, "15min", zone)
    assert chunk(utc("2021-11-07 07:00"), "15min", zone)[1] == "2021-11-07 02:00"
    # Hour chunks: both passes of 01:xx are the 01:00 chunk.
    assert chunk(second_pass, "hour", zone) == chunk(first_pass, "hour", zone)


@pytest.mark.parametrize(
    ("zone", "start"),
    [
        ("America/New_York", "2021-11-07 04:00"),
        ("Europe/Berlin", "2021-10-31 00:00"),
        ("Australia/Lord_Howe", "2021-04-03 14:00"),  # clocks go back 30 minutes
        ("America/Sao_Paulo", "2018-02-18 01:00"),  # clocks went back across midnight
        ("Europe/Moscow", "2014-10-25 21:00"),  # permanent change from UTC+4 to UTC+3
    ],
)
@pytest.mark.parametrize("scale", ["1min", "15min", "20min", "30min", "hour", "2h", "day", "week", "month"])
def test_chunk_index_never_decreases_through_offset_changes(zone, start, scale):
    moment = utc(start)
    previous = chunk(moment, scale, zone)[0]
    for _ in range(6 * 60):
        moment += timedelta(seconds=61)
        index = chunk(moment, scale, zone)[0]
        assert index >= previous, (moment, moment.astimezone(ZoneInfo(zone)))
        previous = index


def test_chunk_delta_counts_calendar_days_across_dst():
    trigger = ChunkDelta(*KEY, "day", 1, timezone="Europe/Berlin")
    last = {KEY: datetime(2021, 3, 27, 23, 30, tzinfo=ZoneInfo("Europe/Berlin"))}
    current = {KEY: datetime(2021, 3, 28, 0, 10, tzinfo=ZoneInfo("Europe/Berlin"))}
    assert evaluate(trigger, now=utc("2021-03-28 12:00"), current=current, last=last).fired


def test_chunk_delay_uses_now_in_the_trigger_zone():
    trigger = ChunkDelay(*KEY, "day", timezone="Asia/Tokyo")
    current = {KEY: utc("2021-04-24 15:00")}  # 00:00 on the 25th in Tokyo
    assert evaluate(trigger, now=utc("2021-04-25 14:59"), current=current, last={}).fired
    result = evaluate(trigger, now=utc("2021-04-25 15:00"), current=current, last={})
    assert not result.fired
    assert "now 2021-04-25 15:00:00+00:00 in chunk 2021-04-26" in result.explanation
