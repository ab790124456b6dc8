"""Worker slices of the buckets (``--index/--workers``, ``CallbackOptions(workers=N)``): each worker serves the
buckets with id % workers == index, including buckets added later; a slice outside the workers is refused."""

import pytest

from cmb_dagster.callbacks.admin import set_bucket_count
from cmb_dagster.callbacks.errors import InvalidCallbackInput
from cmb_dagster.callbacks.worker import bucket_slice


def test_slices_split_the_buckets_and_pick_up_added_ones(db):
    set_bucket_count(db, 8)
    slices = [bucket_slice(db, i, 3) for i in range(3)]
    served = [s() for s in slices]
    assert sorted(b for part in served for b in part) == list(range(8))
    assert all(b % 3 == i for i, part in enumerate(served) for b in part)
    set_bucket_count(db, 12)
    assert slices[2]() == [2, 5, 8, 11]


@pytest.mark.parametrize(("index", "workers"), [(3, 3), (-1, 2)])
def test_a_slice_outside_the_workers_is_refused(db, index, workers):
    with pytest.raises(InvalidCallbackInput, match="index"):
        bucket_slice(db, index, workers)
