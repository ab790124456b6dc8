"""Sessions of a test's database seen from the outside: cut as a network cut or a server restart would, or
watched through the connections a worker opens for itself."""

from contextlib import asynccontextmanager, contextmanager

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool
from waiting import wait_until

from cmb_dagster.database import Database


def cut_other_sessions(db: Database) -> int:
    """End every session of ``db``'s database but the one asking (the pool's and a worker's own connections among
    them), and wait until the server has ended them; return how many."""
    with db.connect(autocommit=True) as conn:  # of its own: a pooled one may be among those ended
        pids = [
            pid
            for pid, ended in conn.execute(
                "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            if ended
        ]
        wait_until(lambda: not _alive(conn, pids), 30, "the sessions ended")
    return len(pids)


def session_ended(db: Database, pid: int) -> bool:
    """Whether the server has ended the session of backend ``pid``."""
    with db.connection() as conn:
        return not _alive(conn, [pid])


def _alive(conn: psycopg.Connection, pids: list[int]) -> bool:
    return conn.execute("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s))", (pids,)).fetchone()[0]


class WatchedDatabase(Database):
    """A database whose connections of their own (a worker's or an engine's, not the pool's) are kept in
    ``connections``, record the statements they send in ``statements`` and, when closed outside a transaction,
    the session settings they had (those set in the session, by name) in ``session_settings``."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.connections: list[psycopg.Connection] = []
        self.statements: list[str] = []
        self.session_settings: list[dict[str, str]] = []

    def connect(self, *, autocommit: bool = False) -> psycopg.Connection:
        statements, session_settings = self.statements, self.session_settings

        class Recording(psycopg.Connection):
            def execute(self, query, params=None, **kwargs):
                statements.append(query)
                return super().execute(query, params, **kwargs)

            def close(self) -> None:
                if not self.closed and self.info.transaction_status == TransactionStatus.IDLE:
                    rows = super().execute("SELECT name, setting FROM pg_settings WHERE source = 'session'")
                    session_settings.append(dict(rows.fetchall()))
                super().close()

        conn = Recording.connect(self.url, autocommit=autocommit, **self.connect_kwargs)
        self.connections.append(conn)
        return conn


class CommitWatchingDatabase(Database):
    """A database whose connections (pooled, of their own, async) record in ``commits_in_pipeline``, per commit
    they send (a ``commit()`` or the end of an outermost ``transaction()`` block), whether a pipeline was open."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.commits_in_pipeline: list[bool] = []
        commits = self.commits_in_pipeline

        class Watching(psycopg.Connection):
            open_pipelines = 0

            @contextmanager
            def pipeline(self):
                with super().pipeline() as pipeline:
                    self.open_pipelines += 1
                    try:
                        yield pipeline
                    finally:
                        self.open_pipelines -= 1

            @contextmanager
            def transaction(self, *args, **kwargs):
                commits_at_exit = self.info.transaction_status == TransactionStatus.IDLE
                with super().transaction(*args, **kwargs) as transaction:
                    yield transaction
                    if commits_at_exit:
                        commits.append(self.open_pipelines > 0)

            def commit(self) -> None:
                commits.append(self.open_pipelines > 0)
                super().commit()

        class AsyncWatching(psycopg.AsyncConnection):
            open_pipelines = 0

            @asynccontextmanager
            async def pipeline(self):
                async with super().pipeline() as pipeline:
                    self.open_pipelines += 1
                    try:
                        yield pipeline
                    finally:
                        self.open_pipelines -= 1

            @asynccontextmanager
            async def transaction(self, *args, **kwargs):
                commits_at_exit = self.info.transaction_status == TransactionStatus.IDLE
                async with super().transaction(*args, **kwargs) as transaction:
                    yield transaction
                    if commits_at_exit:
                        commits.append(self.open_pipelines > 0)

            async def commit(self) -> None:
                commits.append(self.open_pipelines > 0)
                await super().commit()

        self._watching, self._async_watching = Watching, AsyncWatching
        self._watched_pool: ConnectionPool | None = None

    @property
    def pool(self) -> ConnectionPool:
        self.ensure_ready()
        if self._watched_pool is None:
            self._watched_pool = ConnectionPool(
                self.url, kwargs=self.connect_kwargs, connection_class=self._watching, min_size=1, open=True
            )
        return self._watched_pool

    def connect(self, *, autocommit: bool = False) -> psycopg.Connection:
        self.ensure_ready()
        return self._watching.connect(self.url, autocommit=autocommit, **self.connect_kwargs)

    async def connect_async(self, *, autocommit: bool = False) -> psycopg.AsyncConnection:
        self.ensure_ready()
        return await self._async_watching.connect(self.url, autocommit=autocommit, **self.connect_kwargs)

    def close(self) -> None:
        if self._watched_pool is not None:
            self._watched_pool.close()
        super().close()
