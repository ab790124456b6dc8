"""Stage scheduler models without a database: merge patch (RFC 7386), stable hash, stage and option checks,
the backoff, the error classes."""

import hashlib

import pytest
from pydantic import BaseModel

from cmb_dagster.errors import CmbError, InvalidInput
from cmb_dagster.models import Backoff
from cmb_dagster.stages import (
    InvalidStageInput,
    InvalidStageResult,
    Stage,
    StageError,
    StageOptions,
    merge_patch,
    shard_of,
)
from cmb_dagster.stages.models import entity_hash

# The examples of RFC 7386, appendix A.
RFC_7386 = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize(("target", "patch", "expected"), RFC_7386)
def test_merge_patch_follows_rfc_7386(target, patch, expected):
    before = repr(target)
    assert merge_patch(target, patch) == expected
    assert repr(target) == before  # the target is not modified


def test_shard_hash_is_stable_md5_prefix():
    # fixed values: the same in every process and Python version (not Python's salted hash)
    assert entity_hash("offer-1") == int(hashlib.md5(b"offer-1").hexdigest()[:8], 16)
    assert entity_hash("") == 0xD41D8CD9
    assert shard_of("", 7) == 0xD41D8CD9 % 7


class Named(Stage):
    name = "named"


def test_stage_checks_name_field():
    class Bad(Stage):
        name = "has space"

    with pytest.raises(InvalidStageInput, match=r"stages\[0\].name"):
        StageOptions(stages=[Bad()])
    with pytest.raises(InvalidStageInput, match="two stages are named"):
        StageOptions(stages=[Named(), Named()])
    with pytest.raises(InvalidStageInput, match=r"stages\[0\]: must be a Stage"):
        StageOptions(stages=["nope"])


def test_stage_settings_are_checked():
    with pytest.raises(InvalidStageInput, match="rate_limit"):
        StageOptions(stages=[Named(rate_limit=0)])
    with pytest.raises(InvalidStageInput, match="not a stage setting"):
        Named(colour="red")
    with pytest.raises(InvalidInput, match="max_parallelism"):
        StageOptions(stages=[Named(max_parallelism=0)])


def test_state_model_must_be_pydantic():
    class Weird(Stage):
        name = "weird"
        state_model = dict  # type: ignore[assignment]

    with pytest.raises(InvalidStageInput, match="state_model"):
        StageOptions(stages=[Weird()])

    class Good(Stage):
        name = "good"

        class state_model(BaseModel):
            n: int = 0

    assert StageOptions(stages=[Good()]).stages[0].load_state(None).n == 0


def test_options_refuse_unknown_keys_and_bad_values_with_one_line_naming_the_field():
    with pytest.raises(InvalidStageInput, match=r"^StageOptions: batch_sise: Extra inputs are not permitted$"):
        StageOptions(stages=[Named()], batch_sise=10)
    with pytest.raises(InvalidStageInput, match=r"^StageOptions: lease_ttl: [^\n]*$"):
        StageOptions(stages=[Named()], lease_ttl=float("inf"))
    with pytest.raises(InvalidStageInput, match="rescan_cron: 'every day' is not a valid cron expression"):
        StageOptions(stages=[Named()], rescan_cron="every day")


def test_a_stage_backs_off_one_second_doubling_up_to_five_minutes():
    assert Named().backoff == Backoff(first=1, factor=2, max=300)
    assert [Named().backoff.delay(n) for n in (0, 1, 2, 20)] == [1, 2, 4, 300]

    class Quick(Stage):
        name = "quick"
        backoff = Backoff(first=0.1, max=1)

    assert Quick(backoff=Backoff(first=2)).backoff.first == 2 and Quick().backoff.max == 1
    with pytest.raises(InvalidStageInput, match=r"stages\[0\].backoff: must be a Backoff"):
        StageOptions(stages=[Named(backoff=5)])


def test_retry_backoff_and_max_backoff_still_set_the_backoff():
    with pytest.warns(DeprecationWarning, match="retry_backoff"):

        class Old(Stage):
            name = "old"
            retry_backoff = 0.1

    assert Old().backoff == Backoff(first=0.1, factor=2, max=300)
    assert "retry_backoff" not in vars(Old)
    with pytest.warns(DeprecationWarning, match="retry_backoff and max_backoff"):
        stage = Named(retry_backoff=0.5, max_backoff=5)
    assert stage.backoff == Backoff(first=0.5, factor=2, max=5)
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidStageInput, match="max_backoff: .*max"):
        Named(max_backoff=-1)


def test_a_bad_result_is_a_bad_input_of_the_stage_scheduler():
    assert issubclass(InvalidStageResult, InvalidStageInput) and issubclass(InvalidStageInput, StageError)
    assert issubclass(StageError, CmbError) and issubclass(InvalidStageInput, InvalidInput)
