"""The Dagster resource that hands ops, assets and sensors the cmb database."""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from dagster import BetaWarning, ConfigurableResource
from pydantic import Field

from cmb_dagster.database import Database

# Dagster warns about beta APIs each time a definition using them is built, i.e. every time a code location
# loads: hundreds of identical lines in `dg dev`'s terminal. Our sensors set no owners; the queue and
# lag assets are observable source assets on purpose (Observe works, there is no Materialize to fail); Dagster
# itself passes `execution_type` when it turns a multi-asset check into its checks definition.
warnings.filterwarnings("ignore", message="Parameter `owners`", category=BetaWarning)
warnings.filterwarnings("ignore", message="Function `multi_observable_source_asset`", category=BetaWarning)
warnings.filterwarnings("ignore", message="Parameter `execution_type` of function", category=BetaWarning)


class CmbResource(ConfigurableResource):
    """The cmb database for ops, assets and sensors: a pooled connection in the cmb schema.

    Leave ``database_url`` unset to use ``CMB_DATABASE_URL`` (or, when that is unset too, the embedded
    server, which a Dagster process never starts: ``cmb-dagster dev`` or ``cmb-dagster db start`` does); pass
    ``EnvVar("MY_URL")`` to read another variable.
    """

    database_url: str | None = Field(
        default=None, description="Postgres URL; unset means CMB_DATABASE_URL, or the embedded server."
    )
    schema_name: str | None = Field(default=None, description="Schema of cmb tables; unset means CMB_SCHEMA or 'cmb'.")

    @property
    def database(self) -> Database:
        """The process-wide :class:`Database` for this URL and schema."""
        return Database.shared(self.database_url, self.schema_name, start_embedded=False)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection; its transaction commits when the block succeeds."""
        with self.database.connection() as conn:
            yield conn
