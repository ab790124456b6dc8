"""`cmb-dagster dev` brings up the UI with the examples; a restart keeps runs and cmb rows."""

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import psycopg
import pytest
from waiting import wait_until

from cmb_dagster.embedded import embedded_url

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(port: int, query: str, variables: dict | None = None) -> dict:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


LOCATIONS = "{ workspaceOrError { ... on Workspace { locationEntries { name locationOrLoadError { __typename } } } } }"
LAUNCH = """mutation($job: String!) { launchRun(executionParams: {selector: {repositoryLocationName: "cmb_examples",
  repositoryName: "__repository__", jobName: $job}, runConfigData: {}}) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""
RUN = "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }"
RUNS_OF = """query($job: String!) { runsOrError(filter: {pipelineName: $job}) {
  ... on Runs { results { runId status tags { key value } } } } }"""


def finished_runs(port: int, job: str) -> list[dict]:
    runs = graphql(port, RUNS_OF, {"job": job})["runsOrError"]["results"]
    return [r for r in runs if r["status"] in ("SUCCESS", "FAILURE")]


class DevServer:
    def __init__(self, env: dict[str, str], port: int, log: Path):
        self.port = port
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [*CLI, "dev", "--port", str(port), "--sink-port", str(free_port())],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/server_info"), 120, "the UI", interval=0.5)
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        self.session = int(children.stdout.split()[0])  # `dagster dev` leads a session of its own

    def stop(self):
        """SIGTERM, as a process manager would; every process dev started must be gone after it."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()
        left = subprocess.run(
            ["ps", "-o", "pid=,args=", "--sid", str(self.session)], capture_output=True, text=True
        ).stdout.strip()
        assert not left, f"processes left behind by cmb-dagster dev:\n{left}"


@pytest.fixture
def dev_env(tmp_path, empty_database_url):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CMB_", "DAGSTER_"))}
    env["CMB_HOME"] = str(tmp_path / "home")
    if os.environ.get("CMB_TEST_DATABASE_URL"):
        env["CMB_DATABASE_URL"] = empty_database_url  # the real server: a database of our own
    yield env
    if "CMB_DATABASE_URL" not in env:
        subprocess.run([*CLI, "db", "stop"], env=env, timeout=60)


def test_dev_serves_examples_and_restart_keeps_runs_and_rows(dev_env, tmp_path):
    port = free_port()
    server = DevServer(dev_env, port, tmp_path / "dev.log")
    try:
        entries = graphql(port, LOCATIONS)["workspaceOrError"]["locationEntries"]
        assert [(e["name"], e["locationOrLoadError"]["__typename"]) for e in entries] == [
            ("cmb_examples", "RepositoryLocation")
        ]
        launched = graphql(port, LAUNCH, {"job": "health_check"})["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]
        status = wait_until(
            lambda: (
                graphql(port, RUN, {"id": run_id})["runOrError"]["status"] in ("SUCCESS", "FAILURE")
                and graphql(port, RUN, {"id": run_id})["runOrError"]["status"]
            ),
            120,
            "the run to finish",
        )
        assert status == "SUCCESS", (tmp_path / "dev.log").read_text()[-3000:]
        # a Dagster-job handler's run: the worker stores the request, the job's launch sensor launches it
        assert graphql(port, LAUNCH, {"job": "eventqueue_demo_place_order"})["launchRun"]["__typename"] == (
            "LaunchRunSuccess"
        )
        [report] = wait_until(lambda: finished_runs(port, "eventqueue_demo_report"), 240, "the handler's run")
        tags = {t["key"]: t["value"] for t in report["tags"]}
        assert report["status"] == "SUCCESS" and tags["dagster/run_key"].startswith("eventqueue:"), tags
        assert tags["dagster/sensor_name"] == "cmb_events_launch_eventqueue_demo_report"
    finally:
        server.stop()
    if "CMB_DATABASE_URL" not in dev_env:  # embedded: restart the server itself too
        subprocess.run([*CLI, "db", "stop"], env=dev_env, timeout=60, check=True)
    server = DevServer(dev_env, port, tmp_path / "dev.log")
    try:
        assert graphql(port, RUN, {"id": run_id})["runOrError"]["status"] == "SUCCESS"
        cmb_url = dev_env.get("CMB_DATABASE_URL") or embedded_url(Path(dev_env["CMB_HOME"]))
        with psycopg.connect(cmb_url) as conn:
            assert conn.execute(
                "SELECT count(*) FROM cmb.health_checks WHERE source = %s", (f"dagster run {run_id}",)
            ).fetchone() == (1,)
    finally:
        server.stop()


def test_definitions_validate_on_the_workspace(database_url):
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"} | {"CMB_DATABASE_URL": database_url}
    exports = subprocess.run([*CLI, "env"], env=env, capture_output=True, text=True, check=True).stdout
    for line in exports.splitlines():  # what `eval "$(cmb-dagster env)"` does
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value.strip("'")
    dagster = Path(sys.executable).parent / "dagster"
    result = subprocess.run(
        [str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "All code locations passed validation" in result.stdout + result.stderr
