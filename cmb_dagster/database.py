"""The cmb database: one URL (or the embedded server), one schema, a connection pool, migrations.

A deployment behind a transaction-pooling PgBouncer gives two URLs: the pooled one for work (each
transaction may run on another server connection, so work carries no session state and prepares no
statement) and a direct one to the server for what lives in a session: LISTEN, leases, migrations.
"""

from __future__ import annotations

import atexit
import math
import os
import select
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Generic, TypeAlias, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from cmb_dagster import migrations, sql
from cmb_dagster.embedded import embedded_url, running_embedded_url
from cmb_dagster.errors import (
    ConfigError,
    DatabaseUnavailable,
    EmbeddedServerError,
    InvalidDatabaseUrl,
    PooledDatabaseUrl,
)
from cmb_dagster.secrets import mask, scrub
from cmb_dagster.settings import Settings, check_schema_name

CONNECT_TIMEOUT_S = 5

POOL_WAIT_S = 30.0
"""Seconds a borrow waits for a pooled connection (psycopg_pool's default) unless the Database has a ``timeout``."""

NETWORK_TIMEOUT_S = 2
"""A connection whose peer stopped answering for this many seconds is closed, by both ends.

The client (libpq ``tcp_user_timeout`` and ``keepalives_*``) and the server (the same settings, given for the
session) drop a connection when data they sent stays unacknowledged, or an idle connection's keepalive probes go
unanswered, for about this long. So a worker cut off from Postgres gets an error instead of waiting for TCP's
own timeouts (a quarter of an hour), and the server ends the cut-off worker's open transaction, releasing the
locks that would make a takeover of its leases wait. Keep lease TTLs at 1.5 x this or more. A URL's own
``keepalives*`` or ``tcp_user_timeout`` parameters win over these. Unix-socket connections are not affected.
"""

# (libpq parameter, the server's session setting, value): see NETWORK_TIMEOUT_S
_NETWORK_SETTINGS = [
    ("keepalives_idle", "tcp_keepalives_idle", NETWORK_TIMEOUT_S // 2),
    ("keepalives_interval", "tcp_keepalives_interval", 1),
    ("keepalives_count", "tcp_keepalives_count", NETWORK_TIMEOUT_S // 2),
    ("tcp_user_timeout", "tcp_user_timeout", NETWORK_TIMEOUT_S * 1000),
]

DIRECT_POOL_SIZE = 2
"""Connections of the direct pool (lease renewals and releases: one short statement each)."""

DatabaseSource: TypeAlias = "Database | ConnectionPool | str"


class Database:
    """Where cmb tables live: a Postgres URL plus a schema, with a lazily opened connection pool.

    Build it with :meth:`from_settings` (``CMB_DATABASE_URL`` or the embedded server) or from a URL.
    The first connection checks the server is reachable and applies pending migrations.

    With a ``direct_url`` other than ``url``, ``url`` is :attr:`pooled` (a PgBouncer in transaction mode):
    work goes there (:meth:`connection`, :meth:`connect`); sessions go to ``direct_url``
    (:meth:`direct_connection`, :meth:`connect_direct`).

    With a ``timeout`` (seconds, for readers that must answer in time: see :meth:`bounded`), connecting, waiting
    for a pooled connection and each statement give up after it; without, connecting gives up after
    :data:`CONNECT_TIMEOUT_S`, a borrow after :data:`POOL_WAIT_S`, and statements run as long as they take.
    """

    def __init__(
        self,
        url: str,
        *,
        direct_url: str | None = None,
        schema: str = "cmb",
        max_pool_size: int = 10,
        migrate: bool = True,
        timeout: float | None = None,
    ) -> None:
        check_url(url)
        self.url = url
        self.direct_url = check_url(direct_url) if direct_url else url
        try:
            self.schema = check_schema_name(schema)
        except ValueError as exc:
            raise ConfigError(f"schema: {exc}") from None
        self.max_pool_size = max_pool_size
        self.timeout = timeout
        self._migrate = migrate
        self._ready = False
        self._pool: ConnectionPool | None = None
        self._direct_pool: ConnectionPool | None = None
        self._external_pool = False
        self._lock = threading.Lock()

    @classmethod
    def of(cls, source: DatabaseSource, *, schema: str | None = None) -> Database:
        """The Database behind ``source``: a Database as is, a libpq URL, or a psycopg pool of yours.

        A URL gives the one Database of this process for that URL and schema: every call shares its pool, which
        is closed at exit. A pool stays yours (``close`` leaves it open); each borrowed connection gets the cmb
        schema first on its search_path. ``schema`` defaults to ``CMB_SCHEMA``.
        """
        if isinstance(source, Database):
            return source
        schema = schema or Settings.from_env().schema_name
        if isinstance(source, str):
            return _one_per_process(("url", source, schema), lambda: cls(source, schema=schema))
        if isinstance(source, ConnectionPool):
            database = cls(source.conninfo, schema=schema)
            database._pool = source
            database._external_pool = True
            return database
        raise TypeError(f"expected a Database, a psycopg ConnectionPool or a URL, not {type(source).__name__}")

    @classmethod
    def from_settings(
        cls, settings: Settings | None = None, *, start_embedded: bool = True, **kwargs: object
    ) -> Database:
        """The database the settings name: their URL, or the embedded server under their home (started unless
        ``start_embedded`` is False: then a server that does not run is an :class:`EmbeddedServerError`)."""
        settings = settings or Settings.from_env()
        url = settings.database_url or (embedded_url if start_embedded else _running_embedded)(settings.home)
        direct = settings.direct_database_url
        return cls(url, direct_url=direct, schema=settings.schema_name, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def shared(cls, url: str | None = None, schema: str | None = None, *, start_embedded: bool = True) -> Database:
        """One Database per (url, schema) in this process, so ops and sensors reuse one pool."""
        settings = Settings.from_env(database_url=url, schema_name=schema)
        key = ("settings", settings.database_url, settings.direct_database_url, settings.schema_name)
        build = lambda: cls.from_settings(settings, start_embedded=start_embedded)  # noqa: E731
        return _one_per_process((*key, str(settings.home)), build)

    def bounded(self, timeout: float) -> Database:
        """This database for a reader that must answer in time (the metrics): a pool of its own of one
        connection, where connecting, waiting for the connection and each statement give up after ``timeout``
        seconds (connecting after 2 s at least, libpq's floor). It never migrates (a migration must not be cut
        short). Through a pooler, the pooler's ``query_timeout`` bounds statements (a session setting would stay
        on its server connection). A Database over a pool of yours is returned as is: the pool keeps your
        settings."""
        if self._external_pool:
            return self
        return Database(
            self.url, direct_url=self.direct_url, schema=self.schema, max_pool_size=1, migrate=False, timeout=timeout
        )

    # -- connections -------------------------------------------------------------------------

    @property
    def uses_your_pool(self) -> bool:
        """Whether connections come from a pool the caller passed to :meth:`of` (and owns)."""
        return self._external_pool

    def backend_pid(self, conn: psycopg.Connection) -> int:
        """The server process serving ``conn``'s transaction (through a pooler, the connection's own pid is the
        pooler's cancel key: then asked of the server)."""
        if self.pooled:
            return conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        return conn.info.backend_pid

    @property
    def pooled(self) -> bool:
        """Whether :attr:`url` goes through a transaction-pooling PgBouncer (a ``direct_url`` of its own was given).

        Its connections then send no ``options`` (PgBouncer refuses the startup parameter; the cmb schema must
        be first on the role's or database's default search_path), get no session settings, and prepare no
        statement (``prepare_threshold=None``): the next transaction may run on another server connection.
        """
        return self.direct_url != self.url

    @property
    def connect_kwargs(self) -> dict[str, object]:
        """Keyword arguments for psycopg.connect to :attr:`url`: see :meth:`_connect_kwargs`."""
        return self._connect_kwargs(pooled=self.pooled)

    def _connect_kwargs(self, *, pooled: bool) -> dict[str, object]:
        """Bounded connect and network timeouts (:data:`NETWORK_TIMEOUT_S`) unless the URL sets its own; for a
        server, the cmb schema first on the search_path, the server's side of the network timeouts and the
        :attr:`timeout` of statements; for a pooler, no statement prepared."""
        given = conninfo_to_dict(self.url if pooled else self.direct_url)
        network = [(client, server, value) for client, server, value in _NETWORK_SETTINGS if client not in given]
        connect_timeout = CONNECT_TIMEOUT_S if self.timeout is None else max(2, math.ceil(self.timeout))
        kwargs: dict[str, object] = {"connect_timeout": connect_timeout, "keepalives": 1}
        kwargs.update({c: v for c, _, v in network})
        if pooled:
            kwargs["prepare_threshold"] = None
        else:
            settings = [f"-c {s}={v}" for _, s, v in network]
            if self.timeout is not None:
                settings.append(f"-c statement_timeout={math.ceil(self.timeout * 1000)}")
            kwargs["options"] = " ".join([f"-c search_path={self.schema},public", *settings])
        return kwargs

    def connect(self, *, autocommit: bool = False) -> psycopg.Connection:
        """A new work connection of its own (not from the pool; through the pooler if :attr:`pooled`); the
        caller closes it."""
        self.ensure_ready()
        return self._raw_connect(autocommit=autocommit, direct=False)

    def connect_direct(self, *, autocommit: bool = False) -> psycopg.Connection:
        """A new connection of its own to the server itself, for session state (LISTEN); the caller closes it."""
        self.ensure_ready()
        return self._raw_connect(autocommit=autocommit, direct=True)

    @property
    def pool(self) -> ConnectionPool:
        """The process-wide connection pool, opened on first use."""
        self.ensure_ready()
        with self._lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.url,
                    kwargs=self.connect_kwargs,
                    min_size=1,
                    max_size=self.max_pool_size,
                    timeout=POOL_WAIT_S if self.timeout is None else self.timeout,
                    open=True,
                    check=check_connection,  # survive a server restart
                    name=f"cmb:{self.schema}",
                )
                _OPEN.add(self)
            return self._pool

    @property
    def direct_pool(self) -> ConnectionPool:
        """The pool of connections to the server itself (:data:`DIRECT_POOL_SIZE`); :attr:`pool` unless
        :attr:`pooled`."""
        if not self.pooled:
            return self.pool
        self.ensure_ready()
        with self._lock:
            if self._direct_pool is None:
                self._direct_pool = ConnectionPool(
                    self.direct_url,
                    kwargs=self._connect_kwargs(pooled=False),
                    min_size=1,
                    max_size=DIRECT_POOL_SIZE,
                    timeout=POOL_WAIT_S if self.timeout is None else self.timeout,
                    open=True,
                    check=check_connection,
                    name=f"cmb:{self.schema}:direct",
                )
                _OPEN.add(self)
            return self._direct_pool

    @contextmanager
    def connection(self, timeout: float | None = None, *, autocommit: bool = False) -> Iterator[psycopg.Connection]:
        """Borrow a pooled work connection (waiting ``timeout`` seconds at most, else the Database's :attr:`timeout`
        or :data:`POOL_WAIT_S`; then psycopg_pool.PoolTimeout); the block's work commits on success and rolls back
        on error.

        With ``autocommit``, each statement outside ``conn.transaction()`` commits alone, in the round trip that
        sends it (for work that is one statement); a pool given to :meth:`of` keeps its transaction, in which the
        search path is set."""
        with self.pool.connection(timeout=timeout) as conn:
            if self._external_pool:
                conn.execute("SELECT set_config('search_path', %s, true)", (f"{self.schema},public",))
            elif autocommit:
                conn.autocommit = True
                try:
                    yield conn
                finally:
                    if not conn.closed:
                        conn.autocommit = False
                return
            yield conn

    @contextmanager
    def direct_connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection]:
        """:meth:`connection` from :attr:`direct_pool`: for leases, whose renewals must not queue behind work
        waiting for the pooler's server connections."""
        if not self.pooled:
            with self.connection(timeout) as conn:
                yield conn
            return
        with self.direct_pool.connection(timeout=timeout) as conn:
            yield conn

    def close(self) -> None:
        """Close the pools (connections in use are closed when returned); a pool given to :meth:`of` stays open."""
        with self._lock:
            if self._pool is not None and not self._external_pool:
                self._pool.close()
                self._pool = None
            if self._direct_pool is not None:
                self._direct_pool.close()
                self._direct_pool = None
            _OPEN.discard(self)

    # -- readiness and migrations -------------------------------------------------------------

    def ensure_ready(self) -> None:
        """Check the server answers, refuse a schema newer than this package, and migrate if behind."""
        if self._ready:
            return
        with self._raw_connect(autocommit=True, direct=True) as conn:
            versions = migrations.applied_versions(conn, self.schema)
            migrations.check_not_newer(max(versions or {0}), self.schema)
            if self._migrate and not migrations.is_up_to_date(versions):
                conn.autocommit = False
                migrations.upgrade(conn, self.schema)
        if self.pooled:
            self._check_pooled_search_path()
        self._ready = True

    def _check_pooled_search_path(self) -> None:
        """Refuse a pooled URL whose sessions do not find cmb tables: the pooler cannot pass cmb's search_path."""
        with self._raw_connect(autocommit=True, direct=False) as conn:
            schema = conn.execute("SELECT current_schema()").fetchone()[0]
        if schema != self.schema:
            raise PooledDatabaseUrl(
                f"CMB_DATABASE_URL goes through a pooler (CMB_DIRECT_DATABASE_URL is set), where cmb cannot set the "
                f"search_path, and its sessions' schema is {schema!r}, not {self.schema!r}: make it the default, "
                f"e.g. ALTER ROLE <user> IN DATABASE <db> SET search_path = {self.schema}, public"
            )

    def upgrade(self) -> list[migrations.Migration]:
        """Apply pending migrations now; return those applied."""
        with self._raw_connect(direct=True) as conn:
            applied = migrations.upgrade(conn, self.schema)
        self._ready = True
        return applied

    def status(self) -> dict[str, object]:
        """Server version, schema, applied and expected schema versions."""
        with self._raw_connect(autocommit=True, direct=True) as conn:
            server = conn.execute("SHOW server_version").fetchone()[0]
            version = migrations.current_version(conn, self.schema)
        return {
            "server": self.display_url,
            "server_version": server,
            "schema": self.schema,
            "version": version,
            "latest": migrations.latest_version(),
        }

    @property
    def display_url(self) -> str:
        """The URL with its secrets (password, ``password=``, ``sslpassword=``) masked."""
        return mask(self.url)

    def __repr__(self) -> str:
        return f"Database({self.display_url!r}, schema={self.schema!r})"

    async def connect_async(self, *, autocommit: bool = False) -> psycopg.AsyncConnection:
        """A new async work connection of its own (as :meth:`connect`); the caller closes it."""
        self.ensure_ready()
        with self._connect_errors(self.url):
            return await psycopg.AsyncConnection.connect(self.url, autocommit=autocommit, **self.connect_kwargs)

    def _raw_connect(self, *, autocommit: bool = False, direct: bool) -> psycopg.Connection:
        url = self.direct_url if direct else self.url
        kwargs = self._connect_kwargs(pooled=False) if direct else self.connect_kwargs
        with self._connect_errors(url):
            return psycopg.connect(url, autocommit=autocommit, **kwargs)

    @contextmanager
    def _connect_errors(self, url: str) -> Iterator[None]:
        try:
            yield
        except psycopg.OperationalError as exc:
            if _POOLER_REFUSAL in str(exc):
                raise PooledDatabaseUrl(_pooler_message(url)) from None
            setting = "CMB_DIRECT_DATABASE_URL" if url != self.url else "CMB_DATABASE_URL"
            raise DatabaseUnavailable(_unreachable_message(url, exc, setting)) from None
        except psycopg.ProgrammingError as exc:  # a conninfo libpq refuses; its message may quote the password
            raise InvalidDatabaseUrl(_unreadable_message(url, exc)) from None


@contextmanager
def joined(conn: psycopg.Connection, schema: str) -> Iterator[psycopg.Connection]:
    """``conn``, an application's connection, for a write that joins its transaction: in a savepoint (a refused
    write leaves the transaction usable; on an autocommit connection, a transaction of its own), with ``schema``
    first on the search path and rows as tuples for the write alone. The search path, the lock and statement
    timeouts and the row factory are the caller's again after it."""
    row_factory, conn.row_factory = conn.row_factory, tuple_row
    try:
        if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
            with conn.transaction():
                conn.execute(sql.ENTER_SCHEMA, {"schema": schema})
                yield conn
            return
        before = conn.execute(sql.ENTER_SCHEMA, {"schema": schema}).fetchone()
        try:
            with conn.transaction():
                yield conn
        finally:
            if conn.info.transaction_status == TransactionStatus.INTRANS:
                conn.execute(sql.LEAVE_SCHEMA, before[:3])
    finally:
        conn.row_factory = row_factory


@contextmanager
def connection_for(
    conn: psycopg.Connection | None, db: DatabaseSource | None, *, autocommit: bool = False
) -> Iterator[psycopg.Connection]:
    """The connection of a call given ``conn=`` or ``db=``: ``conn`` :func:`joined` (``db``, if given too, names
    the schema; else ``CMB_SCHEMA``), or else a connection of ``db`` (default: the environment's database) whose
    work commits at the end (with ``autocommit``: each statement on its own)."""
    database = Database.of(db) if db is not None else None
    if conn is not None:
        schema = database.schema if database is not None else Settings.from_env().schema_name
        with joined(conn, schema):
            yield conn
        return
    with (database or Database.shared()).connection(autocommit=autocommit) as own:
        yield own


def check_connection(conn: psycopg.Connection) -> None:
    """The pools' check of a connection before it is lent: an idle connection whose socket has something to read
    was closed by the server (a restart, a failover, a terminated backend) or by its keepalives, and only that one
    is asked with a query. psycopg_pool's own check asks every time, a round trip on each borrow that costs work of
    one statement as much as the statement itself."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    if poller.poll(0):
        ConnectionPool.check_connection(conn)


_Connection = TypeVar("_Connection", psycopg.Connection, psycopg.AsyncConnection)
_SET_SESSION_SETTING = "SELECT set_config(%s, %s, false)"


class _OwnConnectionBase(Generic[_Connection]):
    """What a connection of one's own keeps, sync or async: its database, its session settings, the connection."""

    def __init__(self, db: Database, *, custom_plans: bool = False, settings: Mapping[str, str] | None = None) -> None:
        self.db = db
        self.settings = dict(settings or {})
        if custom_plans:
            self.settings["plan_cache_mode"] = "force_custom_plan"
        self._conn: _Connection | None = None

    @property
    def lost(self) -> bool:
        """Whether the connection broke or closed (the next ``get`` opens a new one)."""
        return self._conn is None or self._conn.closed or self._conn.broken


class OwnConnection(_OwnConnectionBase[psycopg.Connection]):
    """One thread's connection of its own, outside the pool (no check on each use), in autocommit.

    Opened on first use, and again on the use after it broke or closed. ``settings`` are session settings
    it gets on each connect (outside any pipeline, so they take effect). With ``custom_plans``, every
    statement is planned for the tables as they are when it runs: a plan cached while a table was small
    (a sequential scan) would otherwise be kept as the table grows, until its statistics change.

    Through a pooler (:attr:`Database.pooled`) it gets no session settings: they would stay on the server
    connection the pooler lent for one statement, for other clients, and miss the next one. The pooler's
    own settings stand in for them (``idle_transaction_timeout``; docs/operations.md), and nothing is
    prepared there, so every statement is planned when it runs anyway.
    """

    def get(self) -> psycopg.Connection:
        """The connection, opened anew if it was lost."""
        if self.lost:
            self.close()
            self._conn = self.db.connect(autocommit=True)
            for name, value in session_settings(self.db, self.settings).items():
                self._conn.execute(_SET_SESSION_SETTING, (name, value))
        return self._conn  # type: ignore[return-value]

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def session_settings(db: Database, settings: Mapping[str, str]) -> Mapping[str, str]:
    """The ``settings`` a work connection of ``db`` gets for its session: none through a pooler."""
    return {} if db.pooled else settings


class OwnAsyncConnection(_OwnConnectionBase[psycopg.AsyncConnection]):
    """:class:`OwnConnection` for an event loop: an async connection of its own, in autocommit."""

    async def get(self) -> psycopg.AsyncConnection:
        """The connection, opened anew if it was lost."""
        if self.lost:
            await self.close()
            self._conn = await self.db.connect_async(autocommit=True)
            for name, value in session_settings(self.db, self.settings).items():
                await self._conn.execute(_SET_SESSION_SETTING, (name, value))
        return self._conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()


_SHARED: dict[tuple[str | None, ...], Database] = {}  # Database.of's, by URL, and Database.shared's, by settings
_SHARED_LOCK = threading.Lock()
_OPEN: weakref.WeakSet[Database] = weakref.WeakSet()  # the Databases whose pool this process opened


def _one_per_process(key: tuple[str | None, ...], build: Callable[[], Database]) -> Database:
    """The Database kept under ``key``, built the first time it is asked for."""
    with _SHARED_LOCK:
        database = _SHARED.get(key)
        if database is None:
            database = _SHARED[key] = build()
        return database


def _forget_in_child() -> None:
    # a forked child (user code under isolation="process") must not use or close the parent's connections (their
    # sockets are shared with the parent) nor wait on its pools' threads (not copied): it opens pools of its own
    for database in list(_OPEN):
        _OPEN.discard(database)
        if not database._external_pool:
            database._pool = database._direct_pool = None
            database._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _close_open_pools() -> None:
    # before the interpreter tears down: a pool still filling in the background at exit (a short command that
    # failed at once) would otherwise end in "Exception ignored in: ..." on stderr
    for database in list(_OPEN):
        database.close()


def _running_embedded(home: Path) -> str:
    """The URL of the embedded server under ``home``, which a Dagster process never starts itself."""
    url = running_embedded_url(home)
    if url is None:
        raise EmbeddedServerError(
            f"the embedded Postgres under {home.resolve()} is not running: start it with `cmb-dagster db start` "
            "in the project's folder (`cmb-dagster dev` does), or set CMB_DATABASE_URL"
        )
    return url


def check_url(url: str) -> str:
    """``url`` if libpq can read it (a URL or key=value conninfo); :class:`InvalidDatabaseUrl` otherwise.

    The error never quotes the URL's secrets (libpq's own message may: "invalid percent-encoded token").
    """
    if not isinstance(url, str):
        raise InvalidDatabaseUrl(f"database URL: expected a string, got {type(url).__name__}")
    try:
        conninfo_to_dict(url)
    except psycopg.Error as exc:
        raise InvalidDatabaseUrl(_unreadable_message(url, exc)) from None
    return url


def server_address(url: str) -> str:
    """``host:port`` (or the socket directory) of each server ``url`` points at, comma-separated."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.Error:
        return "an unreadable address"
    hosts = str(info.get("host") or info.get("hostaddr") or "localhost").split(",")
    ports = str(info.get("port") or "5432").split(",")
    if len(ports) == 1:  # libpq: one port serves every host
        ports *= len(hosts)
    return ", ".join(
        f"socket {host}/.s.PGSQL.{port or 5432}" if host.startswith("/") else f"{host or 'localhost'}:{port or 5432}"
        for host, port in zip(hosts, ports, strict=False)
    )


_POOLER_REFUSAL = "unsupported startup parameter"
"""What PgBouncer answers to the startup parameters (``options``) cmb sends to a server."""


def _pooler_message(url: str) -> str:
    return scrub(
        f"{server_address(url)} is a connection pooler (it refuses the session settings cmb gives a server): "
        "set CMB_DIRECT_DATABASE_URL to the Postgres server itself, and CMB_DATABASE_URL (the pooler) is used "
        "for work only",
        url,
    )


def _unreachable_message(url: str, exc: psycopg.OperationalError, setting: str) -> str:
    reason = (str(exc).strip().splitlines() or ["no answer"])[-1].strip()
    return scrub(
        f"cannot connect to Postgres at {server_address(url)} ({reason}); "
        f"check that the server runs and that {setting} is right",
        url,
    )


def _unreadable_message(url: str, exc: psycopg.Error) -> str:
    reason = (str(exc).strip().splitlines() or ["unreadable"])[0].strip()
    return scrub(
        f"database URL {mask(url)} cannot be read ({reason}); check CMB_DATABASE_URL "
        "(in its user-info and parameters, write special characters of a password as %XX escapes, e.g. %40 for @)",
        url,
    )
