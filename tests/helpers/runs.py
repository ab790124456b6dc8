"""A stand-in run storage for the reactive worker's tests."""

from collections.abc import Sequence

from cmb_dagster.reactive.models import Launch, RunInfo, RunState


class RunStorage:
    """A stand-in run storage: every run requested through it exists at once and has succeeded."""

    def __init__(self) -> None:
        self.requested: list[Launch] = []

    def launch(self, launches: Sequence[Launch]) -> None:
        self.requested.extend(launches)

    def lookup(self, scheduler: str, run_keys: Sequence[str]) -> dict[str, RunInfo]:
        known = {launch.run_key for launch in self.requested}
        return {key: RunInfo(f"run-{key}", RunState.SUCCESS) for key in run_keys if key in known}
