"""What a status sensor's tick recorded: asset observations and asset check evaluations, apart."""

from dagster import AssetCheckEvaluation, AssetObservation, SensorResult


def observations(result: SensorResult) -> list[AssetObservation]:
    """The observations among the tick's asset events."""
    return [e for e in result.asset_events if isinstance(e, AssetObservation)]


def evaluations(result: SensorResult) -> dict[str, AssetCheckEvaluation]:
    """The check evaluations among the tick's asset events, by ``asset/key:check``."""
    return {
        f"{e.asset_key.to_user_string()}:{e.check_name}": e
        for e in result.asset_events
        if isinstance(e, AssetCheckEvaluation)
    }
