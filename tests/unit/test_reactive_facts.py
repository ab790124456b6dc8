"""An explanation stored as the facts of an evaluation renders, once read back as JSON, the text the evaluation
gives: the same verdicts, values, time zones and notes."""

import json
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from cmb_dagster.reactive.explanations import ALREADY_SEEN, Explanation, render, stored_facts
from cmb_dagster.triggers import (
    All,
    Any,
    ChunkDelay,
    ChunkDelta,
    ChunkRefDelay,
    Delay,
    Delta,
    RefDelay,
    Settle,
    evaluate,
    parameters,
)

A = ("shop/orders", "loaded_until")
B = ("shop/prices", "loaded_until")
MOSCOW = timezone(timedelta(hours=3))
NOW = datetime(2024, 5, 1, 12, 30, 15, 250_000, tzinfo=ZoneInfo("Europe/Moscow"))

TRIGGERS = [
    Delta(*A, "1h"),
    Delay(*A, "2h"),
    RefDelay(*A, *B, "1h"),
    ChunkDelta(*A, "day", timezone="Europe/Moscow"),
    ChunkDelay(*A, "hour"),
    ChunkRefDelay(*A, *B, "day"),
    Settle(*A, "15min"),
    All(Delta(*A, "1h"), Delay(*B, "30d")),
    Any(ChunkDelta(*A, "hour"), Settle(*B, "10min")),
]
INPUTS = {
    "first run": ({A: NOW - timedelta(hours=1), B: NOW}, {}),
    "moved on": ({A: NOW - timedelta(minutes=5), B: datetime(2024, 5, 1, 7, tzinfo=MOSCOW)}, {A: NOW - timedelta(1)}),
    "already seen": ({A: NOW - timedelta(hours=3), B: NOW}, {A: NOW - timedelta(hours=3), B: NOW}),
    "moved back": ({A: NOW - timedelta(days=2, microseconds=7)}, {A: NOW - timedelta(days=1)}),
    "no value yet": ({}, {A: NOW - timedelta(days=1)}),
}


def expected(trigger, current, last, note=None) -> str:
    """The text the tick composed before explanations were stored as facts."""
    changed = {key: value - timedelta(minutes=20) for key, value in current.items()}
    result = evaluate(trigger, now=NOW, current=current, last=last, timezone="Asia/Tokyo", changed=changed)
    text = result.explanation + (f"\nnote: {note}" if note else "")
    if result.fired and not any(last.get(key) != value for key, value in result.used.items()):
        text += ALREADY_SEEN
    return text


def facts_of(trigger, current, last, note=None) -> dict:
    """The facts a tick stores (as the engine writes them), read back from JSON."""
    settles = {c.key for c in getattr(trigger, "triggers", (trigger,)) if isinstance(c, Settle)}
    values = []
    for key in sorted(parameters(trigger)):
        row = [*key, current[key].isoformat() if key in current else None]
        row.append(last[key].isoformat() if key in last else None)
        if key in settles:
            row.append((current[key] - timedelta(minutes=20)).isoformat() if key in current else None)
        values.append(row)
    return json.loads(json.dumps(stored_facts("hash", NOW.isoformat(), values, note)))


@pytest.mark.parametrize("trigger", TRIGGERS, ids=repr)
@pytest.mark.parametrize("case", INPUTS)
def test_stored_facts_render_the_text_of_the_evaluation(trigger, case):
    current, last = INPUTS[case]
    note = "shop/orders/loaded_until moved backwards" if case == "moved back" else None
    rendered = render(facts_of(trigger, current, last, note), trigger, "Asia/Tokyo")
    assert rendered == expected(trigger, current, last, note)


def test_an_explanation_renders_once_after_its_text_and_keeps_text_without_facts():
    trigger = Delta(*A, "1h")
    facts = facts_of(trigger, {A: NOW}, {})
    explanation = Explanation("", facts, trigger, "UTC").prefixed("retry after 2 failed run(s); ")
    assert str(explanation) == "retry after 2 failed run(s); " + expected(trigger, {A: NOW}, {})
    assert str(explanation) is str(explanation)  # rendered once
    assert str(Explanation("evaluating the trigger raised ValueError")) == "evaluating the trigger raised ValueError"


def test_facts_of_a_replaced_trigger_say_so_instead_of_rendering_with_the_new_one():
    trigger = Delta(*A, "1h")
    stored = Explanation.stored("", facts_of(trigger, {A: NOW}, {}), Delay(*A, "1h"), "another hash", "UTC")
    text = str(stored)
    assert text.startswith(f"evaluated at {NOW.isoformat()} on shop/orders/loaded_until = ") and "replaced" in text
