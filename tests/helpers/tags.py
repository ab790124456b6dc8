"""The run tags Dagster does not accept as keys, by its own rule: the strict tag check of a definition (Dagster
exports no public function for it)."""

from collections.abc import Mapping

from dagster import AssetSpec, DagsterInvalidDefinitionError

SYSTEM_PREFIXES = ("dagster/", ".dagster/")


def invalid_tag_keys(tags: Mapping[str, str]) -> list[str]:
    return [key for key in tags if not _accepted(key)]


def _accepted(key: str) -> bool:
    # a definition may not carry Dagster's system tags: those are checked with a prefix of the same shape
    probe = "x" + key.removeprefix(".") if key.startswith(SYSTEM_PREFIXES) else key
    try:
        AssetSpec("probe", tags={probe: ""})
    except DagsterInvalidDefinitionError:
        return False
    return True
