"""The shape every engine follows: the same files, and Dagster imported only by its ``dagster_*`` modules."""

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "cmb_dagster"
ENGINES = ["callbacks", "eventqueue", "pubsub", "reactive", "stages"]
SHAPE = {"__init__.py", "models.py", "sql.py", "admin.py", "cli.py", "errors.py"}
IMPORTS_DAGSTER = re.compile(r"^\s*(import dagster|from dagster[\s.])", re.MULTILINE)
DAGSTER_SHELL = {"jobs.py", "resources.py", "definitions.py"}  # the foundation's Dagster shell


def modules_importing_dagster() -> set[str]:
    return {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if IMPORTS_DAGSTER.search(path.read_text())
    }


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_has_the_same_files(engine):
    files = {p.name for p in (PACKAGE / engine).glob("*.py")}
    assert SHAPE <= files, f"{engine} lacks {sorted(SHAPE - files)}"
    assert any(name.startswith("dagster_") for name in files)


def test_only_the_dagster_shell_imports_dagster():
    allowed = {
        name for name in modules_importing_dagster()
        if Path(name).name.startswith("dagster_") or name in DAGSTER_SHELL or name.startswith("examples/")
    }
    assert modules_importing_dagster() == allowed, sorted(modules_importing_dagster() - allowed)
