"""A team's `dg` project: `dg` lists the cmb_dagster component, scaffolds its defs.yaml, and `dg check defs`
loads the engines it names, or refuses bad options naming the field."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DG = shutil.which("dg", path=str(Path(sys.executable).parent))
pytestmark = pytest.mark.skipif(DG is None, reason="dg (dagster-dg-cli, a dev dependency) is not installed")

PYPROJECT = """\
[project]
name = "shop"
version = "0.1.0"
requires-python = ">=3.11"
dependencies = ["cmb-dagster"]

[tool.dg]
directory_type = "project"

[tool.dg.project]
root_module = "shop"
"""
DEFINITIONS = """\
from pathlib import Path

from dagster import definitions, load_from_defs_folder


@definitions
def defs():
    return load_from_defs_folder(path_within_project=Path(__file__).parent.parent.parent)
"""
ENGINES = """\
type: cmb_dagster.CmbComponent

attributes:
  eventqueue: cmb_dagster.examples.eventqueue:options
  pubsub:
    consumers:
      - consumer_id: {consumer_id}
        handler: cmb_dagster.examples.pubsub:add_to_totals
"""


REPORTS = """\
from cmb_dagster.examples.eventqueue import eventqueue_demo_report  # the job the example's handler launches
"""
SHOP = """\
from dagster import DailyPartitionsDefinition, asset

@asset(key=["shop", "orders"])
def orders() -> None: ...

@asset(key=["shop", "sales_mart"], deps=[orders], partitions_def=DailyPartitionsDefinition(start_date="2026-01-01"))
def sales_mart() -> None: ...
"""
REACTIVE = """\
type: cmb_dagster.ReactiveComponent

attributes:
  options:
    assets_from: [shop]
    tasks:
      - name: sales_mart
        assets: [shop/sales_mart]
        partition: [{entity}, loaded_until]
        trigger: {{kind: ChunkDelta, entity: {entity}, parameter: loaded_until, scale: day}}
"""


@pytest.fixture
def project(tmp_path, database_url):
    """A dg project (as `create-dagster project` lays it out) and the environment `dg` runs in."""
    (tmp_path / "src" / "shop" / "defs").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "src" / "shop" / "__init__.py").write_text("")
    (tmp_path / "src" / "shop" / "defs" / "__init__.py").write_text("")
    (tmp_path / "src" / "shop" / "definitions.py").write_text(DEFINITIONS)
    (tmp_path / "src" / "shop" / "defs" / "reports.py").write_text(REPORTS)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(tmp_path / "src"),  # the project, as its own install would make it importable
        "DAGSTER_HOME": str(tmp_path / "home"),
        "CMB_DATABASE_URL": database_url,
    }
    return tmp_path, env


def dg(project, *args: str) -> subprocess.CompletedProcess[str]:
    folder, env = project
    return subprocess.run([DG, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_dg_lists_scaffolds_and_checks_the_component(project):
    listed = dg(project, "list", "components")
    assert listed.returncode == 0 and "cmb_dagster.CmbComponent" in listed.stdout, listed.stderr
    scaffolded = dg(project, "scaffold", "defs", "cmb_dagster.CmbComponent", "cmb")
    defs_yaml = project[0] / "src" / "shop" / "defs" / "cmb" / "defs.yaml"
    assert scaffolded.returncode == 0 and "type: cmb_dagster.CmbComponent" in defs_yaml.read_text(), scaffolded
    defs_yaml.write_text(ENGINES.format(consumer_id="orders"))
    checked = dg(project, "check", "defs")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    listed = dg(project, "list", "defs")
    assert "cmb_pubsub_consumer_orders_branch_0" in listed.stdout and "cmb_events_worker" in listed.stdout, listed
    defs_yaml.write_text(ENGINES.format(consumer_id="'bad id'"))
    refused = dg(project, "check", "defs")
    assert refused.returncode != 0 and "consumer_id" in refused.stdout + refused.stderr, refused


def test_reactive_tasks_in_yaml_load_and_a_misspelt_entity_fails_at_its_line(project):
    folder = project[0] / "src" / "shop" / "defs"
    (folder / "shop").mkdir()
    (folder / "shop" / "assets.py").write_text(SHOP)
    scaffolded = dg(project, "scaffold", "defs", "cmb_dagster.ReactiveComponent", "reactive")
    assert scaffolded.returncode == 0, scaffolded.stdout + scaffolded.stderr
    assert dg(project, "check", "defs").returncode == 0  # the scaffolded defs.yaml loads as it is
    (folder / "reactive" / "defs.yaml").write_text(REACTIVE.format(entity="shop/orders"))
    checked = dg(project, "check", "defs")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "cmb_reactive_sales_mart" in dg(project, "list", "defs").stdout
    (folder / "reactive" / "defs.yaml").write_text(REACTIVE.format(entity="shop/ordres"))
    refused = dg(project, "check", "defs")
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "reactive/defs.yaml:7: reactive task 'sales_mart'" in said, said
    assert "did you mean shop/orders?" in said
    (folder / "reactive" / "defs.yaml").write_text(REACTIVE.format(entity="shop/orders").replace("scale", "scael"))
    refused = dg(project, "check", "defs")
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "reactive/defs.yaml:10 - " in said and "scael: unknown field" in said, said
