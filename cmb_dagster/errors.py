"""Errors raised by cmb_dagster; every one carries a message fit to print as a single line."""


class CmbError(Exception):
    """Base class of every cmb_dagster error."""


class InvalidInput(CmbError, ValueError):
    """Bad input; the message names the field and what is wrong. Nothing was written."""


class DatabaseUnavailable(CmbError):
    """Postgres could not be reached (the message names host and port, never the password)."""


class EmbeddedServerError(CmbError):
    """The embedded Postgres server could not be started (the message names its log file)."""


class SchemaTooNew(CmbError):
    """The database schema was migrated by a newer cmb_dagster than this one."""


class ConfigError(CmbError):
    """A setting is invalid."""


class InvalidDatabaseUrl(ConfigError, InvalidInput):
    """A database URL or conninfo string libpq cannot read (the message never shows its secrets)."""


class PooledDatabaseUrl(ConfigError):
    """A connection pooler's URL used where cmb needs the server itself (the message names the setting)."""
