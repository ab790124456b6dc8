"""Test databases: one migrated template per server, copied into a fresh database for each test.

``CMB_TEST_DATABASE_URL`` points the tests at a real server; unset, they use the embedded one
(under ``CMB_HOME``, default ``./.cmb``), started once and shared with everything else.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from cmb_dagster import migrations
from cmb_dagster.database import Database
from cmb_dagster.embedded import embedded_url
from cmb_dagster.settings import Settings


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C interrupts the tests also when they run as a shell's background job (which starts them with SIGINT
    ignored): Dagster, run in this process, gives SIGTERM SIGINT's handler, and an ignored SIGTERM would be inherited
    by every worker process a test starts and then stops with it."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The modules whose tests take minutes (`dagster dev`, hundreds of CLI processes, the soak): moved ahead of the tests
# collected with them, so that `make test`'s parallel workers (pytest-xdist, ``--dist load``) start them first and run
# the rest around them. Paths given in another order (the server suite of ``.ci/run``) keep theirs.
STARTED_FIRST = (
    "tests/acceptance/test_dev_command.py",
    "tests/acceptance/test_cli_safety.py",
    "tests/acceptance/test_soak.py",
    "tests/acceptance/test_init.py",
    "tests/acceptance/test_dg.py",
    "tests/acceptance/test_dev_stop.py",
    "tests/acceptance/test_pubsub_cli.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of :data:`STARTED_FIRST`, in its order, ahead of the other tests of their folder."""
    rank = {path: n for n, path in enumerate(STARTED_FIRST)}
    first = sorted(
        (item for item in items if item.nodeid.partition("::")[0] in rank),
        key=lambda item: rank[item.nodeid.partition("::")[0]],
    )
    if not first:
        return
    rest = [item for item in items if item.nodeid.partition("::")[0] not in rank]
    folder = STARTED_FIRST[0].rpartition("/")[0] + "/"
    at = next((n for n, item in enumerate(rest) if item.nodeid.startswith(folder)), len(rest))
    items[:] = rest[:at] + first + rest[at:]


def with_dbname(url: str, dbname: str) -> str:
    """``url`` pointing at another database on the same server."""
    return urlsplit(url)._replace(path=f"/{dbname}").geturl()


@pytest.fixture(scope="session")
def server_url() -> str:
    """URL of the server the tests use (its maintenance database)."""
    return os.environ.get("CMB_TEST_DATABASE_URL") or embedded_url(Settings.from_env().home)


@pytest.fixture(scope="session")
def template_db(server_url: str) -> str:
    """Name of a database migrated to the latest version, to copy from."""
    digest = hashlib.sha1("".join(f"{m.version}:{m.sql}" for m in migrations.available()).encode()).hexdigest()[:10]
    name = f"cmb_test_template_{digest}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(hashtext('cmb_dagster.test_template'))")
        try:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                Database(with_dbname(server_url, name)).upgrade()
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtext('cmb_dagster.test_template'))")
    return name


def _create_database(server_url: str, template: str | None) -> tuple[str, str]:
    name = f"cmb_test_{uuid.uuid4().hex[:12]}"
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(query)
    return name, with_dbname(server_url, name)


def _drop_database(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class SpareDatabases:
    """Copies of the template made one test ahead, in a thread of their own: a copy takes a fifth of a second, spent
    while the test before runs. A copy that failed is made again when it is taken."""

    def __init__(self, server_url: str, template: str) -> None:
        self.server_url, self.template = server_url, template
        self._maker = ThreadPoolExecutor(1, thread_name_prefix="spare-database")
        self._next: Future[tuple[str, str]] | None = None

    def take(self) -> tuple[str, str]:
        """A fresh migrated database (name, URL); the next one is begun."""
        ready, self._next = self._next, self._maker.submit(_create_database, self.server_url, self.template)
        if ready is not None:
            try:
                return ready.result()
            except psycopg.Error:
                pass
        return _create_database(self.server_url, self.template)

    def close(self) -> None:
        """Drop the copy not taken."""
        if self._next is not None:
            with contextlib.suppress(psycopg.Error):
                _drop_database(self.server_url, self._next.result()[0])
        self._maker.shutdown()


@pytest.fixture(scope="session")
def spare_databases(server_url: str, template_db: str) -> Iterator[SpareDatabases]:
    spares = SpareDatabases(server_url, template_db)
    yield spares
    spares.close()


@pytest.fixture
def database_url(server_url: str, spare_databases: SpareDatabases) -> Iterator[str]:
    """URL of a fresh database, already migrated, dropped after the test."""
    name, url = spare_databases.take()
    yield url
    _drop_database(server_url, name)


@pytest.fixture
def empty_database_url(server_url: str) -> Iterator[str]:
    """URL of a fresh database with nothing in it, dropped after the test."""
    name, url = _create_database(server_url, None)
    yield url
    _drop_database(server_url, name)


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    """A migrated :class:`Database` of its own for this test."""
    database = Database(database_url)
    yield database
    database.close()


@pytest.fixture(scope="module")
def latin1_db(server_url: str) -> Iterator[Database]:
    """A migrated database in LATIN1, an encoding that holds little of Unicode (the server refuses the rest),
    shared by the tests of a module."""
    name = f"cmb_test_latin1_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(create.format(sql.Identifier(name)))
    database = Database(with_dbname(server_url, name))
    try:
        database.upgrade()
        yield database
    finally:
        database.close()
        _drop_database(server_url, name)


@pytest.fixture
def server_home() -> Iterator[Path]:
    """A folder for a server of the test's own (``embedded_url(server_home / "pg")``), outside pytest's temporary
    folders: a pytest session starting meanwhile (the other suite of ``.ci/run``) makes those private to root,
    and the embedded server runs as a user of its own when the tests run as root."""
    home = Path(tempfile.mkdtemp(prefix="cmb-test-server-"))
    home.chmod(0o755)
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)
