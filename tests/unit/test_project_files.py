"""What `cmb-dagster init` writes, and what `cmb-dagster dev` passes on of Dagster's output."""

from importlib.resources import files
from pathlib import Path

from cmb_dagster.cli import QuietFilter, package_name, project_files

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = files("cmb_dagster") / "templates"


def test_the_repository_dagster_yaml_is_the_template():
    assert (ROOT / "dagster.yaml").read_text() == (TEMPLATES / "dagster.yaml").read_text()


def test_every_project_file_ships_with_the_package():
    assert all((TEMPLATES / name).is_file() for name in project_files("shop").values() if name)


def test_a_folder_name_becomes_a_python_package_name():
    names = ["My Pipelines", "2026-shop", "data.team", "import", "¿?"]
    assert [package_name(Path(n)) for n in names] == [
        "my_pipelines",
        "p_2026_shop",
        "data_team",
        "p_import",
        "pipelines",
    ]


def passed_on(text: str) -> str:
    keep = QuietFilter()
    return "".join(line for raw in text.splitlines(keepends=True) for line in keep(raw)) + "".join(keep.flush())


SENSOR = """2026-11-26 12:59:44 +0000 - dagster - INFO - __repository__ - cmb_reactive_scheduler - sales_report: waiting
  - ChunkDelta(shop/orders/loaded_until, 5min in UTC, 1) waits: no current value yet
  - Delay(shop/prices/loaded_until, 10min) waits: no current value yet
"""
RUN = "2026-11-26 12:59:46 +0000 - dagster - DEBUG - load_orders - 65e7 - 31121 - RUN_START - Started execution\n"
WARNING = "2026-11-26 12:59:47 +0000 - dagster.daemon - WARNING - a warning\n  its second line\n"
PLAIN = "callback received: /hook {}\n"
BETA = (
    "\x1b[32m2026-11-29 19:30:32 +0000\x1b[0m - dagster - \x1b[34mWARNING\x1b[0m - /site-packages/dagster/x.py:537: "
    "BetaWarning: Parameter `execution_type` of function `AssetsDefinition.__init__` is currently in beta\n"
    "  else AssetChecksDefinition(**ad.get_attributes_dict())\n"
)
RAW_BETA = (  # Python's own warning format, written by a process whose warning filters Dagster reset
    "/site-packages/dagster/_core/definitions/sensor_definition.py:809: BetaWarning: Parameter `owners` of "
    "initializer `SensorDefinition.__init__` is currently in beta\n  return SensorDefinition(\n"
)
RAW_DEPRECATION = "/work/shop/assets.py:3: DeprecationWarning: old\n  old()\n"
DEPRECATION = "2026-11-29 19:30:32 +0000 - dagster - WARNING - /x.py:1: DeprecationWarning: old\n  old()\n"


def interrupted(script: str) -> str:
    return (
        "Traceback (most recent call last):\n"
        f'  File "/site-packages/{script}", line 42, in <module>\n'
        "    time.sleep(1)\n"
        "KeyboardInterrupt\n"
    )


def test_info_and_debug_records_are_dropped_with_their_continuation_lines():
    assert passed_on(SENSOR + RUN + WARNING + PLAIN + SENSOR) == WARNING + PLAIN


def test_dagster_beta_notices_are_dropped_and_deprecations_kept():
    assert passed_on(BETA + DEPRECATION + BETA + PLAIN) == DEPRECATION + PLAIN
    assert passed_on(RAW_BETA + RAW_DEPRECATION + PLAIN + RAW_BETA) == RAW_DEPRECATION + PLAIN


def test_tracebacks_of_an_interrupt_are_dropped_even_interleaved_others_are_kept_whole():
    first, second = interrupted("dagster/watch_orphans.py").splitlines(True), interrupted("cmb_dagster/x.py")
    interleaved = "".join(first[:2]) + second + "".join(first[2:])
    failure = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad\n'
    assert passed_on(interleaved + RUN + interrupted("cmb_dagster/jobs.py")) == ""
    assert passed_on(PLAIN + failure + interrupted("y.py") + PLAIN) == PLAIN + failure + PLAIN
    assert passed_on(first[0] + RUN + "".join(first[1:])) == ""  # a record of another process in between
    halves = "".join(first[:3]) + "".join(second.splitlines(True)[:2]) + "KeyboardInterrupt    time.sleep(1)\n"
    assert passed_on(halves + "KeyboardInterrupt\n" + PLAIN) == PLAIN  # two processes' writes within one line
    assert passed_on("".join(first[:2])) == "".join(first[:2])  # held back until the output ends, then passed on
