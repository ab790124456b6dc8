"""The database the engines share, seen in Dagster: an observable asset whose checks say whether vacuum can clean the
engines' tables (the oldest snapshot held and by whom, the dead-row share)."""

from __future__ import annotations

from dagster import AssetKey, AssetObservation, Definitions

from cmb_dagster.dagster_translator import DEFAULT_TRANSLATOR, CmbTranslator
from cmb_dagster.database import Database
from cmb_dagster.health import Verdict
from cmb_dagster.jobs import status_definitions
from cmb_dagster.vacuum import DatabaseOptions, status


def vacuum_asset_key(translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetKey:
    """The observable asset of the engines' tables as vacuum sees them."""
    return translator.get_asset_key("database", ["vacuum"])


def database_definitions(
    options: DatabaseOptions, *, prefix: str = "cmb_", translator: CmbTranslator = DEFAULT_TRANSLATOR
) -> Definitions:
    """The status sensor, asset and checks of the database the engines share."""
    key = vacuum_asset_key(translator)

    def observe(database: Database) -> list[AssetObservation | Verdict]:
        found = status(database)
        holder = found.holder
        metadata = {
            "horizon_seconds": found.horizon_seconds,
            "held_by": str(holder) if holder else "",
            "dead_rows": sum(t.dead for t in found.tables),
            "live_rows": sum(t.live for t in found.tables),
        }
        return [AssetObservation(asset_key=key, metadata=metadata), *options.checks.verdicts(key.path, found)]

    return status_definitions(
        f"{prefix}database_status",
        observe,
        minimum_interval_seconds=options.observe_interval_seconds,
        description="Observes what keeps vacuum from cleaning the engines' tables: the oldest snapshot held in the "
        "database (and who holds it) and the dead rows of each table.",
        group_name=translator.get_group_name("database"),
        assets={key: "The engines' tables as vacuum sees them: the oldest snapshot held, dead and live rows."},
        checks={key: options.checks.descriptions()},
    )
