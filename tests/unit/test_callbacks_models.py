import sys
from datetime import UTC, datetime, timedelta

import pytest

from cmb_dagster.callbacks import CallbackSettings, InvalidCallbackInput, NewCallback, RetryPolicy
from cmb_dagster.callbacks.models import NewSchedule, check_many, validated
from cmb_dagster.callbacks.schedules import fire_times
from cmb_dagster.errors import InvalidInput
from cmb_dagster.inputs import DEFAULT_MAX_PAYLOAD_BYTES
from cmb_dagster.models import Backoff

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def new(**overrides):
    data = {
        "owner_client_id": "o",
        "group_key": "g",
        "event_key": "k",
        "run_at": NOW,
        "cb_url": "https://api.example.com/cb",
    }
    return validated(NewCallback, {**data, **overrides}).check(CallbackSettings())


def test_constant_and_exponential_main_retries():
    assert [RetryPolicy().main_retry_delay(n) for n in range(3)] == [60.0, 60.0, 60.0]
    policy = RetryPolicy.exponential(first_delay=timedelta(minutes=1), factor=2, max_delay=300)
    assert [policy.main_retry_delay(n) for n in range(5)] == [60, 120, 240, 300, 300]
    assert RetryPolicy.constant(10, fast_retries=0).fast_retries == 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"run_at": datetime(2030, 1, 1)}, "run_at"),  # naive
        ({"cb_url": "ftp://example.com/x"}, "cb_url"),
        ({"cb_url": "http:///nohost"}, "cb_url"),
        ({"cb_url": "dagster://not a job"}, "cb_url"),
        ({"event_key": "k" * 257}, "event_key"),
        ({"owner_client_id": ""}, "owner_client_id"),
        ({"group_key": "g" * 129}, "group_key"),
        ({"context": {"blob": "x" * DEFAULT_MAX_PAYLOAD_BYTES}}, "context"),  # over the shared payload limit
        ({"cb_url": "dagster://my_job", "context": {"unknown": 1}}, "context"),
        ({"retry": {"fast_retries": -1}}, "retry.fast_retries"),
        ({"retry": {"backoff": "fibonacci"}}, "retry.backoff"),
    ],
)
def test_bad_input_names_the_field(overrides, field):
    with pytest.raises(InvalidCallbackInput, match=rf"^{field}(\.|:)"):
        new(**overrides)


def test_context_limit_is_configurable():
    small = CallbackSettings(max_context_bytes=10)
    event = validated(
        NewCallback,
        {
            "owner_client_id": "o",
            "group_key": "g",
            "event_key": "k",
            "run_at": NOW,
            "cb_url": "http://x.example",
            "context": {"a": "0123456789"},
        },
    )
    with pytest.raises(InvalidCallbackInput, match="^context: 18 bytes as JSON, at most 10 allowed"):
        event.check(small)


def unchecked(**overrides):
    data = {
        "owner_client_id": "o",
        "group_key": "g",
        "event_key": "k",
        "run_at": NOW,
        "cb_url": "https://api.example.com/cb",
    }
    return validated(NewCallback, {**data, **overrides})


def test_a_batch_checks_each_context_against_the_limit_not_their_sum():
    settings = CallbackSettings(max_context_bytes=20)
    batch = [unchecked(event_key=f"k{i}", context={"a": "0123456789"}) for i in range(5)]  # 16 bytes each, 80 together
    assert check_many(batch, settings) == batch
    with pytest.raises(InvalidCallbackInput, match="^context: 24 bytes as JSON, at most 20 allowed"):
        check_many([*batch, unchecked(event_key="big", context={"a": "0123456789012345"})], settings)


@pytest.mark.parametrize("context", [{"x": float("nan")}, {"x": "a\u0000b"}, {"x": "\ud800"}])
def test_a_batch_with_one_context_postgres_cannot_store_names_the_context(context):
    batch = [unchecked(event_key="k1", context={"i": 1}), unchecked(event_key="k2", context=context)]
    with pytest.raises(InvalidCallbackInput, match="^context: "):
        check_many(batch, CallbackSettings())


def test_a_batch_checks_the_shape_of_contexts_sent_to_dagster_jobs():
    batch = [
        unchecked(event_key="k1", context={"i": 1}),
        unchecked(event_key="k2", cb_url="dagster://nightly", context={"run_config": {}, "extra": 1}),
    ]
    with pytest.raises(InvalidCallbackInput, match="dagster:// targets"):
        check_many(batch, CallbackSettings())


def test_allowlist_of_hosts_blocks_internal_addresses():
    settings = CallbackSettings(allowed_hosts=["api.example.com", "*.hooks.example.org", "10.1.0.0/16"])
    assert settings.host_allowed("api.example.com")
    assert settings.host_allowed("a.hooks.example.org")
    assert settings.host_allowed("10.1.2.3")
    assert not settings.host_allowed("hooks.example.org.evil.com")
    assert not settings.host_allowed("169.254.169.254")
    assert not settings.host_allowed("localhost")
    event = validated(
        NewCallback,
        {
            "owner_client_id": "o",
            "group_key": "g",
            "event_key": "k",
            "run_at": NOW,
            "cb_url": "http://169.254.169.254/latest/meta-data",
        },
    )
    with pytest.raises(InvalidCallbackInput, match="is not allowed"):
        event.check(settings)


def test_dagster_targets_take_run_config_and_tags():
    event = new(cb_url="dagster://nightly_report", context={"run_config": {"ops": {}}, "tags": {"team": "data"}})
    assert event.cb_url == "dagster://nightly_report"


def test_settings_keep_a_call_shorter_than_the_lease():
    with pytest.raises(ValueError, match="lease_ttl"):
        CallbackSettings(timeout=20, lease_ttl=15)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"timeout": 100}, "timeout"),
        ({"unknown": 1}, "unknown"),
        ({"backoff": Backoff(first=11)}, "backoff"),
        ({"backoff": Backoff(first=1, max=7200)}, "backoff"),
        ({"backoff": {"first": -1}}, "backoff: Backoff: first"),
    ],
)
def test_bad_settings_are_one_line_of_the_engine_error_naming_the_field(values, field):
    with pytest.raises(InvalidCallbackInput, match=rf"^CallbackSettings: ({field})") as raised:
        CallbackSettings(**values)
    assert "\n" not in str(raised.value) and isinstance(raised.value, InvalidInput)


def test_fast_retries_pause_by_the_settings_backoff():
    assert CallbackSettings().backoff == Backoff(first=0.1, factor=2, max=60)
    pauses = [CallbackSettings().backoff.delay(tries) for tries in range(RetryPolicy().fast_retries + 8)]
    assert pauses[:4] == [0.1, 0.2, 0.4, 0.8] and max(pauses) <= 60


def test_the_old_fast_retry_pause_is_a_deprecated_spelling_of_the_backoff():
    with pytest.deprecated_call(match="fast_retry_pause"):
        settings = CallbackSettings(fast_retry_pause=0.01)
    assert settings.backoff == Backoff(first=0.01, factor=2, max=60)
    with pytest.raises(InvalidCallbackInput, match="fast_retry_pause"), pytest.deprecated_call():
        CallbackSettings(fast_retry_pause=0.01, backoff=Backoff())


def test_the_old_error_name_is_a_deprecated_alias():
    import cmb_dagster.callbacks
    import cmb_dagster.callbacks.errors

    for module in (cmb_dagster.callbacks, cmb_dagster.callbacks.errors):
        with pytest.deprecated_call(match="InvalidCallbackInput"):
            assert module.CallbackValidationError is InvalidCallbackInput
    with pytest.raises(AttributeError):
        cmb_dagster.callbacks.NoSuchName  # noqa: B018


def test_options_live_in_models_and_refuse_bad_values_naming_the_field():
    from cmb_dagster.callbacks import CallbackOptions

    assert CallbackOptions().worker_job_name(0) == "cmb_callbacks_worker"
    for values, field in [
        ({"workers": 0}, "workers"),
        ({"cleanup_cron": "often"}, "cleanup_cron"),
        ({"ttl_days": -1}, "ttl_days"),
        ({"settings": {"timeout": 100}}, "settings"),
    ]:
        with pytest.raises(InvalidCallbackInput, match=f"^CallbackOptions: {field}"):
            CallbackOptions(**values)


def test_a_bad_allowed_hosts_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("CMB_CALLBACK_ALLOWED_HOSTS", "a b")
    with pytest.raises(InvalidCallbackInput, match="^CMB_CALLBACK_ALLOWED_HOSTS: 'a b' is not a host name"):
        CallbackSettings()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"cron": "61 * * * *"}, "cron"), ({"timezone": "Mars/Olympus"}, "timezone"), ({"horizon": 5}, "horizon")],
)
def test_bad_schedules_name_the_field(overrides, message):
    data = {
        "owner_client_id": "o",
        "group_key": "g",
        "schedule_key": "s",
        "cron": "*/5 * * * *",
        "cb_url": "http://x.example",
    }
    with pytest.raises(InvalidCallbackInput, match=rf"^{message}:"):
        validated(NewSchedule, {**data, **overrides})


def test_fire_times_follow_the_timezone_across_dst():
    # 02:30 local does not exist on 2030-03-31 in Europe/Berlin; 09:00 local is 08:00Z in winter, 07:00Z in summer
    after = datetime(2030, 3, 29, 12, tzinfo=UTC)
    times = fire_times("0 9 * * *", "Europe/Berlin", after, after + timedelta(days=3))
    assert times == [
        datetime(2030, 3, 30, 8, tzinfo=UTC),
        datetime(2030, 3, 31, 7, tzinfo=UTC),
        datetime(2030, 4, 1, 7, tzinfo=UTC),
    ]


def test_the_engine_imports_no_dagster():
    import subprocess

    code = (
        "import sys, cmb_dagster.callbacks, cmb_dagster.callbacks.sink;"
        " print(any(m.startswith('dagster') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
