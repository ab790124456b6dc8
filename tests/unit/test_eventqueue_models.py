"""Event queue inputs without a database: names, JSON values, delays, handler settings and registries."""

from datetime import timedelta

import pytest

from cmb_dagster.errors import InvalidInput
from cmb_dagster.eventqueue import (
    Backoff,
    EventQueueOptions,
    EventQueueStatus,
    HandlerConfig,
    HandlerRegistry,
    HandlerStatus,
    InvalidEventQueueInput,
    WorkerSettings,
)
from cmb_dagster.eventqueue.models import check_name, delay_seconds, to_json


def test_backoff_doubles_up_to_the_maximum():
    config = HandlerConfig(backoff=Backoff(first=1.0, max=5.0))
    assert [config.backoff.delay(r) for r in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert HandlerConfig().backoff.delay(10_000) == 300.0
    assert HandlerConfig().backoff == Backoff(first=1.0, factor=2, max=300.0)


def test_the_old_retry_delay_fields_still_set_the_backoff_with_a_warning():
    with pytest.warns(DeprecationWarning, match="retry_delay"):
        config = HandlerConfig(retry_delay=0.2, max_retry_delay=0.5)
    assert config.backoff == Backoff(first=0.2, factor=2, max=0.5)
    with pytest.warns(DeprecationWarning, match="retry_delay"):
        assert HandlerRegistry().add("h", print, retry_delay=3.0).config.backoff.first == 3.0
    with pytest.raises(InvalidEventQueueInput, match="retry_delay: Extra inputs"):
        HandlerConfig(backoff=Backoff(), retry_delay=1.0)  # both: the old field is refused


@pytest.mark.parametrize(
    ("model", "values", "field"),
    [
        (HandlerConfig, {"max_retries": -1}, "max_retries"),
        (HandlerConfig, {"backoff": {"factor": 0}}, "backoff"),
        (HandlerConfig, {"lock_expiry": 1e9}, "lock_expiry"),
        (WorkerSettings, {"batch_size": 0}, "batch_size"),
        (WorkerSettings, {"bogus": 1}, "bogus"),
        (EventQueueOptions, {"handlers": [], "workers": 0}, "workers"),
    ],
)
def test_bad_settings_raise_the_engine_error_in_one_line_naming_the_field(model, values, field):
    with pytest.raises(InvalidEventQueueInput, match=rf"^{model.__name__}: {field}\b") as caught:
        model(**values)
    assert isinstance(caught.value, InvalidInput) and "\n" not in str(caught.value)


def test_status_holds_the_rows_and_their_totals():
    row = {
        "kind": "python",
        "queued": 1,
        "delayed": 2,
        "locked": 3,
        "held": 4,
        "dead": 5,
        "oldest_queued_seconds": 1.5,
        "rules": [],
    }
    report = EventQueueStatus(handlers=[HandlerStatus(handler="a", **row), HandlerStatus(handler="b", **row)])
    assert report.totals == {"queued": 2, "delayed": 4, "locked": 6, "held": 8, "dead": 10}
    with pytest.warns(DeprecationWarning, match="status"):  # status(db) was the list of rows
        assert [r.handler for r in report] == ["a", "b"]


def test_the_plain_invalid_input_name_of_the_package_is_deprecated():
    import cmb_dagster.eventqueue

    with pytest.warns(DeprecationWarning, match="InvalidEventQueueInput"):
        assert cmb_dagster.eventqueue.InvalidInput is InvalidInput
    assert issubclass(InvalidEventQueueInput, InvalidInput)


@pytest.mark.parametrize("value", ["", None, 3, "x" * 201, "a\x00b", "half \udc80 a character"])
def test_bad_names_are_refused_naming_the_field(value):
    with pytest.raises(InvalidEventQueueInput, match="^namespace: "):
        check_name("namespace", value)


@pytest.mark.parametrize(
    "value",
    [
        object(),
        float("nan"),
        float("inf"),
        {1j: 2},
        "nul\x00",
        {"k": "\ud800"},
        pytest.param(10**5000, id="int of 5000 digits"),
        pytest.param("x" * (4 * 1024 * 1024), id="over the payload limit"),
    ],
)
def test_values_that_are_not_json_are_refused(value):
    with pytest.raises(InvalidEventQueueInput, match="^value: "):
        to_json(value)


def test_the_payload_limit_is_a_setting(monkeypatch):
    monkeypatch.setenv("CMB_MAX_PAYLOAD_BYTES", "2048")
    expected = r"^value: 3002 bytes as JSON, at most 2048 allowed \(CMB_MAX_PAYLOAD_BYTES\)"
    with pytest.raises(InvalidEventQueueInput, match=expected):
        to_json("x" * 3000)


def test_json_values_pass():
    assert to_json({"a": [1, 2.5, None, True, "é", "a\\u0000"]}) == '{"a":[1,2.5,null,true,"é","a\\\\u0000"]}'


@pytest.mark.parametrize(
    "delay", [-1, -0.001, timedelta(seconds=-1), float("nan"), "5", True, 1e300, 1.7e12, timedelta(days=40_000)]
)
def test_bad_delays_are_refused(delay):
    with pytest.raises(InvalidEventQueueInput, match="^delay: "):
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
    with pytest.raises(InvalidEventQueueInput, match="two handlers are named 'send'"):
        registry.add("send", print)
    with pytest.raises(InvalidEventQueueInput, match="schedule: 'every minute' is not a valid cron"):
        registry.cron("bad", "every minute")
    with pytest.raises(InvalidEventQueueInput, match="HandlerConfig: max_retries"):
        registry.add("other", print, max_retries=-1)
    assert HandlerRegistry.of([registry]).names == registry.names
    assert EventQueueOptions(handlers=registry).registry() is registry
    with pytest.raises(InvalidEventQueueInput, match="handlers: an event queue needs at least one handler"):
        EventQueueOptions(handlers=[]).registry()


def test_registry_from_a_reference():
    registry = HandlerRegistry.of("cmb_dagster.examples.eventqueue:handlers")
    assert "send_receipt" in registry and "heartbeat_every_5_minutes" in registry.crons
    with pytest.raises(InvalidEventQueueInput, match="handlers: cannot load"):
        HandlerRegistry.of("no_such_module:handlers")
    with pytest.raises(InvalidEventQueueInput, match="handlers: .* is not 'module:attribute'"):
        HandlerRegistry.of("no_colon")
