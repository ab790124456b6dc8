"""A field renamed in this release still reads its old name, with a DeprecationWarning pointing at the code that
gave it (directly or nested in other options); both names at once are refused."""

import pytest
from click.testing import CliRunner

from cmb_dagster.callbacks import CallbackSettings
from cmb_dagster.cli import main
from cmb_dagster.errors import InvalidInput
from cmb_dagster.eventqueue import EventQueueOptions, HandlerRegistry, WorkerSettings
from cmb_dagster.stages import StageOptions

BUILDERS = {
    "WorkerSettings": lambda **values: WorkerSettings(**values),
    "StageOptions": lambda **values: StageOptions(stages=[], **values),
    "CallbackSettings": lambda **values: CallbackSettings(**values),
}


@pytest.mark.parametrize("model", sorted(BUILDERS))
def test_concurrency_of_a_worker_is_read_as_worker_concurrency_and_warns_its_caller(model):
    with pytest.warns(DeprecationWarning, match=rf"{model}\(concurrency=\.\.\.\) is deprecated: worker_concurrency"):
        settings = BUILDERS[model](concurrency=3)
    assert settings.worker_concurrency == 3


def test_the_warning_points_at_the_callers_line_also_for_nested_options():
    with pytest.warns(DeprecationWarning) as caught:
        options = EventQueueOptions(handlers=HandlerRegistry(), worker={"concurrency": 4})
    assert options.worker.worker_concurrency == 4
    assert [w.filename for w in caught] == [__file__]


@pytest.mark.parametrize("model", sorted(BUILDERS))
def test_both_names_at_once_are_refused_naming_the_old_one(model):
    with pytest.raises(InvalidInput, match="concurrency: Extra inputs are not permitted"):
        BUILDERS[model](concurrency=3, worker_concurrency=4)


@pytest.mark.parametrize("group", ["events", "callbacks"])
def test_the_workers_concurrency_option_is_still_read_and_says_it_is_deprecated(group):
    result = CliRunner().invoke(main, [group, "worker", "--concurrency", "0"])
    assert "The option 'concurrency' is deprecated. use --worker-concurrency instead" in result.output
    assert "Invalid value for '--concurrency'" in result.output
