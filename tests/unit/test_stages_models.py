"""Stage scheduler models without a database: merge patch (RFC 7386), stable hash, stage checks."""

import hashlib

import pytest
from pydantic import BaseModel

from cmb_dagster.errors import InvalidInput
from cmb_dagster.stages import InvalidStageInput, Stage, StageOptions, merge_patch, shard_of
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

        class state_model(BaseModel):  # noqa: N801
            n: int = 0

    assert StageOptions(stages=[Good()]).stages[0].load_state(None).n == 0
