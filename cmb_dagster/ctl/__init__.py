"""CTL: (entity, parameter) -> timestamp values saying how far each object's data has arrived.

:class:`CtlStore` reads and writes values, keeps the history of every change and publishes each
change to the pub/sub stream in the same transaction. In Dagster, ops write through
:class:`CtlResource` (resource key ``ctl``) and assets through :func:`ctl_metadata`.
"""

from cmb_dagster._lazy import lazy_names
from cmb_dagster.ctl.errors import CtlError, InvalidCtlInput
from cmb_dagster.ctl.models import CtlChange, ParameterKey
from cmb_dagster.ctl.store import CTL_BRANCH_ID, CtlStore

__all__ = [
    "CTL_BRANCH_ID",
    "CtlChange",
    "CtlError",
    "CtlResource",
    "CtlStore",
    "InvalidCtlInput",
    "ParameterKey",
    "ctl_metadata",
]

__getattr__ = lazy_names(__name__, dict.fromkeys(["CtlResource", "ctl_metadata"], "cmb_dagster.ctl.dagster_resources"))
