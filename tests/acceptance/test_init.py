"""A team that installed the package starts a dg project: `cmb-dagster init` in a fresh folder, then `dg` commands
(after eval "$(cmb-dagster env)" too), and a quiet `cmb-dagster dev` that Ctrl-C stops without a traceback. The walk
through a team's project: a consumer scaffolded and a partitioned reactive task added in YAML, `dg check defs` (a
typo caught at its line), the UI, a materialization launching the right partition, no deprecation warning."""

import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from test_dev_command import CLI, LOCATIONS, answers, free_port, graphql
from test_dev_command import dev_env as dev_env  # a fixture
from test_dev_stop import EMBEDDED_ONLY, cmb_url, dagster_sessions, session_processes, with_kill
from waiting import wait_until

BIN = Path(sys.executable).parent  # where pip put `cmb-dagster` and `dg`
FILES = [
    "pyproject.toml",
    "dagster_home/dagster.yaml",
    ".gitignore",
    "src/new_project/__init__.py",
    "src/new_project/definitions.py",
    "src/new_project/defs/__init__.py",
    "src/new_project/defs/shop/assets.py",
    "src/new_project/defs/reactive/defs.yaml",
]
IDLE_TICKS = 3  # reactive scheduler ticks (one each 10 s) watched after start-up: 30 s
MAX_LINES = 15  # the whole terminal output from the start to the end of those ticks; goal: < 60 lines in 10 minutes
JOBS = "{ repositoriesOrError { ... on RepositoryConnection { nodes { jobs { name } } } } }"
NOISE = ["DEBUG", " - INFO - ", "Priority sorting", "Checking for new runs", "Traceback", "Warning:"]


def cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def in_shell(command: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` in a shell of the project folder, after eval "$(cmb-dagster env)", as a user types them."""
    script = f'eval "$(cmb-dagster env)" && {command}'
    path = {"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}
    result = subprocess.run(["sh", "-c", script], cwd=cwd, env=env | path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture
def project(tmp_path, dev_env):
    folder = tmp_path / "new project"
    result = cli(["init", str(folder)], dev_env, tmp_path)
    assert result.returncode == 0, result.stderr
    written = [line.removeprefix("wrote ") for line in result.stdout.splitlines()[: len(FILES)]]
    assert written == [str(folder / f) for f in FILES]
    return folder


def test_init_refuses_to_overwrite_and_env_needs_a_project(project, dev_env, tmp_path):
    definitions = project / "src" / "new_project" / "definitions.py"
    definitions.write_text("# ours\n")
    again = cli(["init"], dev_env, project)
    assert again.returncode == 1 and definitions.read_text() == "# ours\n"
    assert len(again.stderr.splitlines()) == 1 and "--force" in again.stderr, again.stderr
    forced = cli(["init", "--force"], dev_env, project)
    assert forced.returncode == 0 and "src/new_project/definitions.py (overwritten)" in forced.stdout, forced.stderr
    assert "load_from_defs_folder" in definitions.read_text()
    elsewhere = cli(["env"], dev_env, tmp_path)
    assert elsewhere.returncode == 1 and elsewhere.stdout == ""
    assert elsewhere.stderr.count("\n") == 1 and "cmb-dagster init" in elsewhere.stderr, elsewhere.stderr


def test_dg_commands_work_in_a_project_as_it_is_and_after_eval_env(project, dev_env):
    checked = subprocess.run(
        [BIN / "dg", "check", "defs"], cwd=project, env=dev_env, capture_output=True, text=True, timeout=300
    )  # no variable needed to load the definitions
    assert checked.returncode == 0 and "All definitions loaded successfully" in checked.stdout, checked.stderr
    exports = cli(["env"], dev_env, project)
    assert exports.returncode == 0, exports.stderr
    home = project / "dagster_home"
    assert f"export DAGSTER_HOME='{home}'" in exports.stdout, exports.stdout
    embedded = "CMB_DATABASE_URL" not in dev_env
    assert ("starting the embedded Postgres" in exports.stderr) == embedded, exports.stderr  # said on stderr only
    assert all(line.startswith(("export ", ": ")) for line in exports.stdout.splitlines())

    in_shell("dg launch --assets shop/orders", dev_env, project)  # in process, on the cmb server's storage
    with psycopg.connect(cmb_url(dev_env)) as conn:
        runs = conn.execute("SELECT pipeline_name, status FROM runs ORDER BY create_timestamp").fetchall()
    assert runs == [("__ASSET_JOB", "SUCCESS")]
    if embedded:  # the shell's CMB_DATABASE_URL names the embedded server, which `db stop` stops all the same
        assert in_shell("cmb-dagster db stop", dev_env, project).stdout == "stopped\n"


MART = """\
from dagster import DailyPartitionsDefinition, asset


DAYS = DailyPartitionsDefinition("2026-01-01", end_offset=1)  # today's partition exists: it fills as orders load


@asset(key=["shop", "sales_mart"], deps=[["shop", "orders"]], partitions_def=DAYS)
def sales_mart() -> None: ...
"""
MART_TASK = """\
      - name: sales_mart
        assets: [shop/sales_mart]
        partition: [shop/orders, loaded_until]
        trigger: {kind: ChunkDelta, entity: shop/orders, parameter: loaded_until, scale: day}
"""
CONSUMERS = """\
type: cmb_dagster.PubSubComponent

attributes:
  options:
    consumers:
      - {consumer_id: order_totals, handler: "new_project.defs.consumers.handlers:count"}
"""
HANDLERS = """\
def count(conn, events) -> None:
    print(f"{len(events)} changes")
"""


def dg(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BIN / "dg", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def add_a_consumer_and_a_partitioned_task(project: Path, env: dict[str, str]) -> None:
    """What a team adds to the project in YAML, checked by `dg check defs` (a typo is refused at its line)."""
    defs = project / "src" / "new_project" / "defs"
    scaffolded = dg(["scaffold", "defs", "cmb_dagster.PubSubComponent", "consumers"], env, project)
    assert scaffolded.returncode == 0, scaffolded.stdout + scaffolded.stderr
    (defs / "consumers" / "handlers.py").write_text(HANDLERS)
    (defs / "consumers" / "defs.yaml").write_text(CONSUMERS)
    (defs / "shop" / "marts.py").write_text(MART)
    reactive = defs / "reactive" / "defs.yaml"
    text = reactive.read_text()
    last_task_ends = text.index("# More engines")
    with_mart = text[:last_task_ends] + MART_TASK + text[last_task_ends:]
    line = with_mart[: with_mart.index("- name: sales_mart")].count("\n") + 1
    reactive.write_text(with_mart.replace(MART_TASK, MART_TASK.replace("shop/orders", "shop/ordres")))
    refused = dg(["check", "defs"], env, project)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and f"reactive/defs.yaml:{line}: reactive task 'sales_mart'" in said, said
    assert "did you mean shop/orders?" in said, said
    reactive.write_text(with_mart)
    checked = dg(["check", "defs"], env, project)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def partition_runs(env: dict[str, str]) -> list[tuple[str, str]]:
    with psycopg.connect(cmb_url(env)) as conn:
        return conn.execute(
            "SELECT r.status, t.value FROM runs r JOIN run_tags t ON t.run_id = r.run_id"
            " WHERE t.key = 'dagster/partition' AND r.pipeline_name = 'cmb_reactive_sales_mart'"
            " ORDER BY r.create_timestamp"
        ).fetchall()


def reactive_runs(env: dict[str, str]) -> list[tuple[str]]:
    with psycopg.connect(cmb_url(env)) as conn:
        return conn.execute(
            "SELECT status FROM runs WHERE pipeline_name = 'cmb_reactive_orders_report' ORDER BY create_timestamp"
        ).fetchall()


def scheduler_ticks(env: dict[str, str]) -> int:
    with psycopg.connect(cmb_url(env)) as conn:
        return conn.execute(
            "SELECT count(*) FROM job_ticks WHERE type = 'SENSOR' AND tick_body LIKE %s",
            ('%"job_name": "cmb_reactive_scheduler"%',),
        ).fetchone()[0]


@EMBEDDED_ONLY
def test_dev_in_a_project_is_quiet_and_ctrl_c_stops_it_without_a_traceback(project, dev_env, tmp_path):
    add_a_consumer_and_a_partitioned_task(project, dev_env | {"PATH": f"{BIN}{os.pathsep}{dev_env.get('PATH', '')}"})
    port = free_port()
    log = tmp_path / "terminal.log"
    with log.open("wb") as terminal:  # stdout and stderr, as in a terminal
        dev = subprocess.Popen(
            [*CLI, "dev", "--port", str(port)],
            cwd=project,
            env=dev_env,
            stdout=terminal,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/server_info"), 180, "the UI", interval=0.5)
        entries = graphql(port, LOCATIONS)["workspaceOrError"]["locationEntries"]
        assert [(e["name"], e["locationOrLoadError"]["__typename"]) for e in entries] == [
            ("new_project", "RepositoryLocation")
        ]
        jobs = {job["name"] for job in graphql(port, JOBS)["repositoriesOrError"]["nodes"][0]["jobs"]}
        assert {"cmb_pubsub_consumer_order_totals_branch_0", "cmb_reactive_sales_mart"} <= jobs, jobs
        wait_until(lambda: "Dagster UI is up" in log.read_text(), 30, "dev to say the UI is up", interval=0.2)
        ticks = wait_until(lambda: scheduler_ticks(dev_env), 120, "the reactive scheduler's first tick", interval=0.5)
        wait_until(lambda: scheduler_ticks(dev_env) >= ticks + IDLE_TICKS, 90, "idle ticks", interval=0.5)
        idle = log.read_text().splitlines()
        assert len(idle) < MAX_LINES, "\n".join(idle)
        assert not [line for line in idle if any(noise in line for noise in NOISE)], "\n".join(idle)
        assert not [line for line in idle if "callback sink" in line]  # not the examples' workspace: no sink

        # the upstream materialized by hand: the reactive scheduler launches the report by itself
        in_shell("dg launch --assets shop/orders", dev_env, project)
        wait_until(lambda: reactive_runs(dev_env) == [("SUCCESS",)], 180, "the reactive report run", interval=1)
        loaded = in_shell("cmb-dagster ctl get shop/orders", dev_env, project).stdout
        value = re.search(r"loaded_until = (\S+)", loaded)
        assert value, loaded
        day = (datetime.fromisoformat(value.group(1)) - timedelta(microseconds=1)).date().isoformat()  # end excluded
        wait_until(lambda: partition_runs(dev_env) == [("SUCCESS", day)], 120, "the partition's run", interval=1)
        idle = log.read_text().splitlines()

        sessions = [dev.pid, *dagster_sessions(dev.pid)]
        os.killpg(dev.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group
        dev.wait(timeout=60)
        wait_until(lambda: not any(session_processes(s) for s in sessions), 30, "every process to stop", interval=0.2)
    finally:
        with_kill(dev.pid)
    output = log.read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-5000:]
    assert "Deprecat" not in output, output[-5000:]
    stopped = output.splitlines()[len(idle) :]
    if "CMB_DATABASE_URL" in dev_env:
        assert stopped == [], stopped
    else:
        assert stopped == [
            f"the embedded Postgres keeps running; `cmb-dagster db stop` stops it ({dev_env['CMB_HOME']})"
        ]
