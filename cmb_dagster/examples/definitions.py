"""The example code location: what ``cmb-dagster dev`` shows a new user."""

from dagster import Definitions

from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.examples import callbacks as callbacks_example

defs = cmb_definitions(
    callbacks=True,
)
defs = Definitions.merge(defs, callbacks_example.definitions)
