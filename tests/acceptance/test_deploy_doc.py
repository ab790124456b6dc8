"""docs/deploy.md is true: every command in its ``sh`` blocks runs here as written (only the health port is a free
one), a worker command serves 200 on /healthz, uses no more connections than the doc says and exits 0 on SIGTERM;
every container in its ``yaml`` blocks runs one of those commands (pod 0's, for a StatefulSet's pod index), and
its liveness probe asks that command's health endpoint."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_worker_liveness import free_port, probe
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.examples import pubsub as pubsub_example

DOC = Path(__file__).parents[2] / "docs" / "deploy.md"
CMB = str(Path(sys.executable).with_name("cmb-dagster"))
MAX_CONNECTIONS = 6  # what the doc says a worker command used in this test


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def commands() -> list[list[str]]:
    return [shlex.split(line) for block in blocks("sh") for line in block.splitlines() if line.strip()]


def containers() -> list[dict]:
    found = []
    for block in blocks("yaml"):
        doc = yaml.safe_load(block)
        if "spec" in doc:
            found += doc["spec"]["template"]["spec"]["containers"]
        found += doc.get("services", {}).values()
    return found


def test_the_doc_has_commands_and_containers():
    assert len(commands()) >= 6
    assert {tuple(c[:2]) for c in commands() if "--health-port" in c} >= {
        ("cmb-dagster", "callbacks"),
        ("cmb-dagster", "pubsub"),
        ("cmb-dagster", "stages"),
        ("cmb-dagster", "events"),
    }
    assert len(containers()) >= 2


def test_every_container_runs_a_command_of_the_doc_and_probes_its_health_port():
    for container in containers():
        command = [arg.replace("$(POD_INDEX)", "0") for arg in container["command"] + container.get("args", [])]
        assert command in commands(), command
        probe_spec = container.get("livenessProbe")
        if probe_spec is not None:
            port = command[command.index("--health-port") + 1]
            assert probe_spec["httpGet"] == {"path": "/healthz", "port": int(port)}
            assert command[command.index("--health-host") + 1] == "0.0.0.0"


def connections(db: Database, application: str) -> int:
    with db.connection() as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (application,)
        ).fetchone()[0]


@pytest.mark.parametrize("index", range(len(commands())))
def test_each_command_runs_as_written(index: int, database_url: str, db: Database):
    command = commands()[index]
    assert command[0] == "cmb-dagster"
    application = f"cmb-deploy-doc-{os.getpid()}-{index}"
    env = {**os.environ, "CMB_DATABASE_URL": database_url, "PGAPPNAME": application}
    if command[1:3] == ["pubsub", "consume"]:
        with db.connection() as conn:  # what the demo's job creates before its consumer runs
            conn.execute(
                "CREATE TABLE IF NOT EXISTS public.pubsub_demo_totals (customer text PRIMARY KEY, orders bigint, "
                "amount numeric)"
            )
        assert pubsub_example.consumer.consumer_id in command
    if "--health-port" not in command:
        done = subprocess.run([CMB, *command[1:]], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return
    port = free_port()
    command = [CMB, *command[1:]]
    command[command.index("--health-port") + 1] = str(port)
    worker = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: probe(port) == (200, "ok\n") or worker.poll() is not None, 120, "the worker's loops run")
        assert worker.poll() is None, worker.communicate()[1]
        wait_until(lambda: connections(db, application) > 0, 30, "the worker connected")
        assert connections(db, application) <= MAX_CONNECTIONS
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
