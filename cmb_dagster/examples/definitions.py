"""The example code location: what ``cmb-dagster dev`` shows a new user."""

from cmb_dagster.definitions import cmb_definitions

defs = cmb_definitions()
