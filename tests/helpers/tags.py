"""The run tags Dagster does not accept as keys (its own check: Dagster exports no public one)."""

from collections.abc import Mapping

from dagster._utils.tags import is_valid_tag_key


def invalid_tag_keys(tags: Mapping[str, str]) -> list[str]:
    return [key for key in tags if not is_valid_tag_key(key)]
