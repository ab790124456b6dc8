"""The reactive scheduler's tick pauses Python's cyclic garbage collector and always gives it back."""

import gc

import pytest

from cmb_dagster.database import Database
from cmb_dagster.reactive.engine import TaskScheduler
from cmb_dagster.reactive.models import TaskSpec
from cmb_dagster.triggers import Delta


def scheduler(db: Database) -> TaskScheduler:
    return TaskScheduler(db, "gc", [TaskSpec(name="t", trigger=Delta("e", "p", "1h"))])


def test_the_collector_is_paused_during_a_tick_and_enabled_after_it_even_when_the_tick_raises(db):
    seen = []

    def manual(after):
        seen.append(gc.isenabled())
        return []

    def broken(after):
        raise RuntimeError("run storage is down")

    assert gc.isenabled()
    scheduler(db).tick(lambda scheduler, keys: {}, manual=manual)
    assert seen == [False]
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="run storage is down"):
        scheduler(db).tick(lambda scheduler, keys: {}, manual=broken)
    assert gc.isenabled()


def test_a_collector_disabled_by_the_application_stays_disabled_after_a_tick(db):
    gc.disable()
    try:
        scheduler(db).tick(lambda scheduler, keys: {}, manual=lambda after: [])
        assert not gc.isenabled()
    finally:
        gc.enable()
