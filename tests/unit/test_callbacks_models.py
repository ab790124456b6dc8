import re
import sys
from datetime import UTC, datetime, timedelta

import pytest

from cmb_dagster.callbacks import CallbackSettings, InvalidCallbackInput, NewCallback, RetryPolicy
from cmb_dagster.callbacks.launches import DAGSTER_USER_TAGS, check_dagster_context
from cmb_dagster.callbacks.models import NewSchedule, check_many, validated
from cmb_dagster.callbacks.schedules import fire_times
from cmb_dagster.errors import InvalidInput
from cmb_dagster.flow import FlowLimits
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
        ({"cb_url": "dagster://my_job/op"}, "cb_url"),
        ({"cb_url": "dagster://my_job?day=1"}, "cb_url"),
        ({"cb_url": "dagster://my_job#op"}, "cb_url"),
        ({"cb_url": "dagster://1job"}, "cb_url"),
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


DAGSTER_URL = "dagster://nightly_report"


@pytest.mark.parametrize(
    "context",
    [
        None,
        {},
        {"run_config": {"ops": {"build": {"config": {"day": "2030-01-01"}}}}},
        {"tags": {"team": "data", "cmb/demo": "k-1", "a.b-c_d/e.f-g_h": "", "dagster/priority": "5"}},
        {"run_config": {}, "tags": {"t": "x" * 1024, "note": "free text: spaces, 'quotes', ünïcode"}},
        {"tags": {"k" * 63: "v", f"{'n' * 63}/{'k' * 63}": "v"}},
    ],
)
def test_dagster_targets_take_a_context_of_run_config_and_tags(context):
    assert new(cb_url=DAGSTER_URL, context=context).context == context
    assert check_many([unchecked(cb_url=DAGSTER_URL, context=context)], CallbackSettings())[0].context == context


@pytest.mark.parametrize(
    ("context", "field", "says"),
    [
        ([{"run_config": {}}], "context", "must be an object with only run_config"),
        ("run_config", "context", "must be an object with only run_config"),
        ({"runconfig": {}}, "context.runconfig", "unknown key"),
        ({"run_config": {}, "tags": {}, "priority": 5}, "context.priority", "unknown key"),
        ({"a b": 1}, "context['a b']", "unknown key"),
        ({"run_config": []}, "context.run_config", "must be an object"),
        ({"run_config": None}, "context.run_config", "must be an object"),
        ({"tags": ["team"]}, "context.tags", "must be an object of strings"),
        ({"tags": None}, "context.tags", "must be an object of strings"),
        ({"tags": {"retries": 3}}, "context.tags.retries", "must be a string, not a number"),
        ({"tags": {"ok": True}}, "context.tags.ok", "must be a string, not a boolean"),
        ({"tags": {"team": None}}, "context.tags.team", "must be a string, not null"),
        ({"tags": {"team": {"name": "data"}}}, "context.tags.team", "must be a string, not an object"),
        ({"tags": {"team": "x" * 1025}}, "context.tags.team", "1025 bytes, at most 1024 allowed"),
        ({"tags": {"team": "é" * 513}}, "context.tags.team", "1026 bytes, at most 1024 allowed"),
        ({"tags": {"my team": "data"}}, "context.tags['my team']", "not a Dagster tag key"),
        ({"tags": {"": "data"}}, "context.tags['']", "not a Dagster tag key"),
        ({"tags": {"k" * 64: "v"}}, f"context.tags.{'k' * 64}", "not a Dagster tag key"),
        ({"tags": {"a/b/c": "v"}}, "context.tags.a/b/c", "not a Dagster tag key"),
        ({"tags": {"dagster/step_selection": "x"}}, "context.tags.dagster/step_selection", "reserved by Dagster"),
        ({"tags": {".dagster/hidden": "x"}}, "context.tags..dagster/hidden", "reserved by Dagster"),
        ({"tags": {"cmb/callback": "x"}}, "context.tags.cmb/callback", "set by the callbacks engine"),
        ({"tags": {"cmb/callback_run_key": "x"}}, "context.tags.cmb/callback_run_key", "set by the callbacks engine"),
    ],
)
def test_a_context_a_dagster_run_cannot_take_is_refused_naming_the_field(context, field, says):
    message = rf"^{re.escape(field)}: .*{re.escape(says)}"
    with pytest.raises(InvalidCallbackInput, match=message):
        new(cb_url=DAGSTER_URL, context=context)
    good = unchecked(event_key="good", cb_url=DAGSTER_URL, context={"tags": {"team": "data"}})
    with pytest.raises(InvalidCallbackInput, match=message):  # in a batch, and with a good event before it
        check_many([good, unchecked(cb_url=DAGSTER_URL, context=context)], CallbackSettings())
    schedule = {"owner_client_id": "o", "group_key": "g", "schedule_key": "s", "cron": "0 * * * *"}
    with pytest.raises(InvalidCallbackInput, match=message):
        validated(NewSchedule, {**schedule, "cb_url": DAGSTER_URL, "context": context}).check(CallbackSettings())
    # the shape is a dagster:// target's only: an HTTP target's context is any JSON
    assert new(context=context).context == context


def test_the_dagster_tag_rules_are_dagsters_own():
    from dagster import AssetSpec, DagsterInvalidDefinitionError
    from dagster._core.storage.tags import USER_EDITABLE_SYSTEM_TAGS  # Dagster has no public name for them

    assert set(DAGSTER_USER_TAGS) == set(USER_EDITABLE_SYSTEM_TAGS)

    def valid_for_dagster(key: str) -> bool:  # definition tags are checked strictly, with Dagster's rule for keys
        try:
            AssetSpec("a", tags={key: "v"})
        except DagsterInvalidDefinitionError:
            return False
        return True

    def taken(key: str) -> bool:
        try:
            check_dagster_context({"tags": {key: "v"}})
        except InvalidCallbackInput:
            return False
        return True

    keys = ["team", "a/b", "a.b-c_d", "k" * 63, "k" * 64, f"{'n' * 63}/k", f"{'n' * 64}/k", "a b", "", "a/b/c", "ü"]
    keys += ["/k", "k/", "dagster/priority", "dagster/solid_selection", ".dagster/x", "dagster/kind/python"]
    for key in keys:
        reserved = key.startswith(("dagster/", ".dagster/")) and key not in USER_EDITABLE_SYSTEM_TAGS
        assert taken(key) == (valid_for_dagster(key) and not reserved), key


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

    with pytest.warns(DeprecationWarning, match="worker_job_names"):
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


# -- limits per destination and priorities ---------------------------------------------------------


def test_each_callback_is_under_its_most_specific_limit():
    settings = CallbackSettings(
        per_owner={"acme": FlowLimits(concurrency=4), "acme/reports": FlowLimits(concurrency=1), "free": FlowLimits()}
    )
    assert settings.flow_key("shop", "g", "api.example.com") == ("callbacks/host", "api.example.com")
    assert settings.flow_key("shop", "g", None) is None  # dagster:// has no host
    assert settings.flow_key("acme", "g", "api.example.com") == ("callbacks/owner/acme", "")
    assert settings.flow_key("acme", "reports", "api.example.com") == ("callbacks/owner/acme/reports", "")
    assert settings.flow_key("free", "g", "api.example.com") is None
    assert CallbackSettings(per_host=None).flow_key("shop", "g", "api.example.com") is None
    assert settings.flow_scopes()["callbacks/host"].concurrency == 64


@pytest.mark.parametrize(
    ("per_owner", "field"),
    [
        ({"": {"concurrency": 1}}, "per_owner"),
        ({"acme/": {"concurrency": 1}}, "per_owner"),
        ({"acme": {"concurrency": 0}}, "concurrency"),
        ({"acme": {"rate_limit": "fast"}}, "rate_limit"),
        ({f"o{i}": {"concurrency": 1} for i in range(1001)}, "per_owner"),
    ],
)
def test_per_owner_limits_are_typed_and_bounded(per_owner, field):
    with pytest.raises(InvalidCallbackInput, match=field):
        CallbackSettings(per_owner=per_owner)


@pytest.mark.parametrize("priority", [1001, -1001, "5", 2.5, True])
def test_a_priority_is_an_integer_within_bounds(priority):
    with pytest.raises(InvalidCallbackInput, match="priority"):
        validated(NewCallback, {**new().model_dump(), "priority": priority})
    assert validated(NewCallback, {**new().model_dump(), "priority": -1000}).priority == -1000
