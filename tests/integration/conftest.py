"""Fixtures the integration tests share (the database ones are in tests/conftest.py)."""

from collections.abc import Iterator

import pytest
from dagster import DagsterInstance, instance_for_test

from cmb_dagster.callbacks.sink import CallbackSink
from cmb_dagster.database import Database
from cmb_dagster.resources import CmbResource


@pytest.fixture
def sink() -> Iterator[CallbackSink]:
    """A local HTTP endpoint recording every callback it receives."""
    with CallbackSink() as s:
        yield s


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as dagster_instance:
        yield dagster_instance


@pytest.fixture
def resource(db: Database) -> Iterator[CmbResource]:
    """The ``cmb`` resource on the test's database; its shared pool is closed afterwards."""
    yield CmbResource(database_url=db.url)
    Database.shared(db.url).close()
