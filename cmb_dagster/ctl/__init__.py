"""CTL: (entity, parameter) -> timestamp values saying how far each object's data has arrived.

:class:`CtlStore` reads and writes values, keeps the history of every change and publishes each
change to the pub/sub stream in the same transaction. :mod:`cmb_dagster.ctl.scheduler` is the
reactive scheduler's engine. No Dagster here.
"""

from cmb_dagster.ctl.errors import CtlError, InvalidCtlInput, InvalidReactiveTask
from cmb_dagster.ctl.store import CTL_BRANCH_ID, CtlChange, CtlStore

__all__ = ["CTL_BRANCH_ID", "CtlChange", "CtlError", "CtlStore", "InvalidCtlInput", "InvalidReactiveTask"]
