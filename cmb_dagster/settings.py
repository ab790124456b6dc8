"""Settings read from the environment: where the database is and which schema holds cmb tables."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote, urlsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cmb_dagster.errors import ConfigError

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
RESERVED_SCHEMAS = frozenset({"public", "information_schema"})
"""Schema names cmb refuses besides ``pg_*``: Postgres's own, and ``public`` where users' tables live."""


def check_schema_name(value: object) -> str:
    """``value`` if it can hold cmb tables: a lowercase identifier, not reserved; ``ValueError`` otherwise."""
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ValueError(
            f"schema name {value!r} must be a lowercase SQL identifier (a-z, 0-9, _; at most 63 characters)"
        )
    if value.startswith("pg_") or value in RESERVED_SCHEMAS:
        raise ValueError(
            f"schema name {value!r} is reserved (public, information_schema and pg_* belong to Postgres "
            "and your own tables); choose a schema of cmb's own such as 'cmb'"
        )
    return value


WRITABLE_SESSION_ATTRS = frozenset({"read-write", "primary"})
"""``target_session_attrs`` values that keep every connection of a multi-host URL on the primary."""


def check_hosts(url: str) -> str:
    """``url`` if it names one server, or several with ``target_session_attrs=read-write`` (or ``primary``);
    ``ValueError`` otherwise: cmb writes and LISTENs on every connection, which a standby refuses."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.Error:
        return url  # unreadable: check_url says why
    hosts = (info.get("host") or info.get("hostaddr") or "").split(",")
    attrs = info.get("target_session_attrs") or os.environ.get("PGTARGETSESSIONATTRS") or "any"
    if len(hosts) > 1 and attrs not in WRITABLE_SESSION_ATTRS:
        raise ValueError(
            f"names {len(hosts)} hosts with target_session_attrs={attrs}: add target_session_attrs=read-write, so "
            "that every connection goes to the primary (a standby refuses writes and LISTEN)"
        )
    return url


def dagster_storage_url(url: str) -> str:
    """``url`` as the SQLAlchemy URL on psycopg2 that dagster-postgres needs (for NOTIFY).

    SQLAlchemy reads one host in the URL's authority: several (``h1:p1,h2:p2``) become ``host=h:p`` parameters,
    its form for libpq's multi-host URLs; the other parameters (``target_session_attrs``) follow.
    """
    _, rest = url.split("://", 1)
    parts = urlsplit(f"postgresql://{rest}")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if "," not in hostlist:
        return f"postgresql+psycopg2://{rest}"
    hosts = "&".join(f"host={quote(host, safe=':[]')}" for host in hostlist.split(","))
    query = f"{hosts}&{parts.query}" if parts.query else hosts
    return f"postgresql+psycopg2://{userinfo}{at}{parts.path or '/'}?{query}"


class Settings(BaseModel):
    """Database URL (``None`` = the embedded server), schema name and the home of local state."""

    model_config = ConfigDict(frozen=True, hide_input_in_errors=True)  # the URL's password stays out of errors

    database_url: str | None = Field(default=None, description="CMB_DATABASE_URL; unset = embedded Postgres.")
    direct_database_url: str | None = Field(
        default=None,
        description="CMB_DIRECT_DATABASE_URL: the server itself, when CMB_DATABASE_URL is a transaction-pooling "
        "PgBouncer; LISTEN, leases and migrations go there, work goes through the pooler.",
    )
    schema_name: str = Field(default="cmb", description="CMB_SCHEMA: the Postgres schema of cmb tables.")
    home: Path = Field(default=Path(".cmb"), description="CMB_HOME: embedded server data and Dagster artifacts.")
    worker_run_seconds: float = Field(
        default=3600.0,
        ge=10,
        le=7 * 86400,
        description="CMB_WORKER_RUN_SECONDS: how long each run of a Dagster worker job works.",
    )

    @field_validator("schema_name")
    @classmethod
    def _schema_is_identifier(cls, value: str) -> str:
        return check_schema_name(value)

    @field_validator("database_url", "direct_database_url")
    @classmethod
    def _url_is_postgres(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must start with postgresql:// (a libpq URL)")
        if value:
            from cmb_dagster.database import check_url

            check_url(value)  # InvalidDatabaseUrl is a ValueError whose message hides the secrets
            check_hosts(value)
        return value or None

    @model_validator(mode="after")
    def _direct_url_has_pooled_url(self) -> Settings:
        if self.direct_database_url and not self.database_url:
            raise ValueError(
                "direct_database_url: CMB_DIRECT_DATABASE_URL is set without CMB_DATABASE_URL (the pooler's URL, "
                "for work); set both, or neither for the embedded server"
            )
        return self

    @field_validator("home")
    @classmethod
    def _home_is_absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Settings from CMB_DATABASE_URL, CMB_DIRECT_DATABASE_URL, CMB_SCHEMA, CMB_HOME and
        CMB_WORKER_RUN_SECONDS; keyword overrides win."""
        values: dict[str, object] = {
            "database_url": os.environ.get("CMB_DATABASE_URL") or None,
            "direct_database_url": os.environ.get("CMB_DIRECT_DATABASE_URL") or None,
            "schema_name": os.environ.get("CMB_SCHEMA") or "cmb",
            "home": os.environ.get("CMB_HOME") or ".cmb",
            "worker_run_seconds": os.environ.get("CMB_WORKER_RUN_SECONDS") or 3600.0,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(_one_line(exc)) from None


def _one_line(exc: ValidationError) -> str:
    def line(error: dict) -> str:  # an error of the whole model (no field) names its field itself
        message = error["msg"].removeprefix("Value error, ")
        return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message

    return "; ".join(line(e) for e in exc.errors())
