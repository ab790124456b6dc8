"""Event queue inputs without a database: names, JSON values, delays, handler settings and registries."""

from datetime import timedelta

import pytest

from cmb_dagster.eventqueue import EventQueueOptions, HandlerConfig, HandlerRegistry, InvalidInput
from cmb_dagster.eventqueue.models import check_name, delay_seconds, to_json


def test_backoff_doubles_up_to_the_maximum():
    config = HandlerConfig(retry_delay=1.0, max_retry_delay=5.0)
    assert [config.backoff(r) for r in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert HandlerConfig(retry_delay=1.0).backoff(10_000) == 300.0


@pytest.mark.parametrize("value", ["", None, 3, "x" * 201, "a\x00b", "half \udc80 a character"])
def test_bad_names_are_refused_naming_the_field(value):
    with pytest.raises(InvalidInput, match="^namespace: "):
        check_name("namespace", value)


@pytest.mark.parametrize("value", [object(), float("nan"), float("inf"), {1j: 2}, "nul\x00", {"k": "\ud800"},
                                   pytest.param(10 ** 5000, id="int of 5000 digits"),
                                   pytest.param("x" * (4 * 1024 * 1024), id="over the payload limit")])
def test_values_that_are_not_json_are_refused(value):
    with pytest.raises(InvalidInput, match="^value: "):
        to_json(value)


def test_the_payload_limit_is_a_setting(monkeypatch):
    monkeypatch.setenv("CMB_MAX_PAYLOAD_BYTES", "2048")
    with pytest.raises(InvalidInput, match=r"^value: 3002 bytes as JSON, at most 2048 allowed \(CMB_MAX_PAYLOAD_BYTES\)"):
        to_json("x" * 3000)


def test_json_values_pass():
    assert to_json({"a": [1, 2.5, None, True, "é", "a\\u0000"]}) == '{"a":[1,2.5,null,true,"é","a\\\\u0000"]}'


@pytest.mark.parametrize("delay", [-1, -0.001, timedelta(seconds=-1), float("nan"), "5", True, 1e300, 1.7e12,
                                   timedelta(days=40_000)])
def test_bad_delays_are_refused(delay):
    with pytest.raises(InvalidInput, match="^delay: "):
        delay_seconds(delay)


def test_delays():
    assert delay_seconds(None) == 0.0
    assert delay_seconds(timedelta(minutes=1)) == 60.0
    assert delay_seconds(2) == 2.0


def test_registry_decorator_dagster_jobs_crons_and_duplicates():
    registry = HandlerRegistry()

    @registry.handler(max_retries=7)
    def send(event):
        return None

    registry.dagster_job("report", job_name="nightly")
    registry.cron("every_minute", "* * * * *", handler="send")
    assert registry.names == ["report", "send"]
    assert registry["send"].config.max_retries == 7 and registry["send"].kind == "python"
    assert registry["report"].kind == "dagster_job" and registry["report"].job_name == "nightly"
    with pytest.raises(InvalidInput, match="two handlers are named 'send'"):
        registry.add("send", print)
    with pytest.raises(InvalidInput, match="schedule: 'every minute' is not a valid cron"):
        registry.cron("bad", "every minute")
    with pytest.raises(InvalidInput, match="handler config: max_retries"):
        registry.add("other", print, max_retries=-1)
    assert HandlerRegistry.of([registry]).names == registry.names
    assert EventQueueOptions(handlers=registry).registry() is registry


def test_registry_from_a_reference():
    registry = HandlerRegistry.of("cmb_dagster.examples.eventqueue:handlers")
    assert "send_receipt" in registry and "heartbeat_every_5_minutes" in registry.crons
    with pytest.raises(InvalidInput, match="handlers: cannot load"):
        HandlerRegistry.of("no_such_module:handlers")
    with pytest.raises(InvalidInput, match="handlers: expected 'module:attribute'"):
        HandlerRegistry.of("no_colon")
