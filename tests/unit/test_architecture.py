"""The shape every engine follows: the same files, and Dagster imported only by its ``dagster_*`` modules."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

from cmb_dagster import FlowLimits, RateLimit
from cmb_dagster.callbacks import CallbackClient
from cmb_dagster.ctl import CtlStore
from cmb_dagster.eventqueue import emit, emit_many
from cmb_dagster.pubsub import publish
from cmb_dagster.stages import StageStore

PACKAGE = Path(__file__).parents[2] / "cmb_dagster"
ENGINES = ["callbacks", "eventqueue", "pubsub", "reactive", "stages"]
SHAPE = {"__init__.py", "models.py", "sql.py", "admin.py", "cli.py", "errors.py", "worker.py"}
IMPORTS_DAGSTER = re.compile(r"^\s*(import dagster|from dagster[\s.])", re.MULTILINE)
DAGSTER_SHELL = {"jobs.py", "resources.py", "definitions.py"}  # the foundation's Dagster shell


def modules_importing_dagster() -> set[str]:
    return {
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if IMPORTS_DAGSTER.search(path.read_text())
    }


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_has_the_same_files(engine):
    files = {p.name for p in (PACKAGE / engine).glob("*.py")}
    assert files >= SHAPE, f"{engine} lacks {sorted(SHAPE - files)}"
    assert any(name.startswith("dagster_") for name in files)


def test_only_the_dagster_shell_imports_dagster():
    allowed = {
        name
        for name in modules_importing_dagster()
        if Path(name).name.startswith("dagster_")
        or name in DAGSTER_SHELL
        or name.startswith(("examples/", "templates/"))  # templates: files `cmb-dagster init` writes, not modules
    }
    assert modules_importing_dagster() == allowed, sorted(modules_importing_dagster() - allowed)


def test_the_callbacks_host_policy_lives_in_its_module():
    """Which hosts and addresses callbacks may call is judged in ``callbacks/hosts.py`` alone."""
    judging_addresses = re.compile(r"^\s*(import ipaddress|from ipaddress )|\.is_global\b", re.MULTILINE)
    judges = {p.name for p in (PACKAGE / "callbacks").glob("*.py") if judging_addresses.search(p.read_text())}
    assert judges == {"hosts.py"}


def _with_calls(node) -> list[str]:
    """The names called by a ``with`` statement's items (``conn.pipeline()`` -> ``pipeline``)."""
    import ast

    names = []
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.IfExp):  # `x.pipeline() if wanted else nullcontext()`
            call = call.body
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            names.append(call.func.attr)
    return names


def commits_inside_pipelines() -> list[str]:
    """``commit()`` calls, and transactions that end, inside a psycopg pipeline block."""
    import ast

    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.With | ast.AsyncWith):
                continue
            names = _with_calls(node)
            if "pipeline" not in names:
                continue
            where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
            if "transaction" in names[names.index("pipeline") + 1 :]:
                found.append(f"{where} a transaction inside the pipeline")
            for inner in ast.walk(node):
                if inner is node:
                    continue
                if (
                    isinstance(inner, ast.Call)
                    and isinstance(inner.func, ast.Attribute)
                    and inner.func.attr == "commit"
                ):
                    found.append(f"{where} commit() at line {inner.lineno}")
                if isinstance(inner, ast.With | ast.AsyncWith) and "transaction" in _with_calls(inner):
                    found.append(f"{where} a transaction at line {inner.lineno}")
    return sorted(found)


def test_nothing_commits_inside_a_pipeline_block():
    """A commit sent inside a pipeline block can wait forever on large data (psycopg issue #685): every
    transaction that uses a pipeline opens outside it and commits after the pipeline has synced."""
    assert commits_inside_pipelines() == []


def test_every_advisory_lock_key_names_the_schema():
    """Two deployments (schemas) in one database never share a lock: each key is built from the schema of
    what it guards (the cmb schema, or ``public.`` for the examples' tables there)."""
    keys = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"pg_(?:try_)?advisory_(?:xact_)?lock(?:_shared)?\(", text):
            call = text[match.end() : match.end() + 150]
            keys.append((f"{path.relative_to(PACKAGE)}:{text[: match.start()].count(chr(10)) + 1}", call))
    assert keys
    unnamed = [
        (where, call)
        for where, call in keys
        if "schema" not in call and "public." not in call and "%(key)s" not in call
    ]
    assert unnamed == []


CONTRACT_FILES = {"__init__.py", "models.py", "sql.py", "admin.py", "cli.py", "errors.py", "worker.py"}
WORKERS = {
    "callbacks": "CallbackWorker",
    "eventqueue": "EventWorker",
    "pubsub": "ConsumerWorker",
    "reactive": "ReactiveWorker",
    "stages": "StageWorker",
}
ERRORS = {
    "callbacks": "Callback",
    "eventqueue": "EventQueue",
    "pubsub": "PubSub",
    "reactive": "Reactive",
    "stages": "Stage",
}
STATUS = {
    "callbacks": "CallbacksStatus",
    "eventqueue": "EventQueueStatus",
    "pubsub": "PubSubStatus",
    "reactive": "ReactiveStatus",
    "stages": "StagesStatus",
}


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_has_the_contracts_files(engine):
    files = {p.name for p in (PACKAGE / engine).glob("*.py")}
    assert files >= CONTRACT_FILES, f"{engine} lacks {sorted(CONTRACT_FILES - files)}"


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_exports_one_worker_of_the_shared_shape(engine):
    import importlib
    import inspect

    from cmb_dagster.workers import EngineWorker

    package = importlib.import_module(f"cmb_dagster.{engine}")
    workers = {name for name in package.__all__ if name.endswith("Worker")}
    assert workers == {WORKERS[engine]}
    worker = getattr(package, WORKERS[engine])
    assert issubclass(worker, EngineWorker) and worker.__module__ == f"cmb_dagster.{engine}.worker"
    parameters = list(inspect.signature(worker).parameters.values())
    assert [p.name for p in parameters[:2]] == ["db", "options"] and "owner" in {p.name for p in parameters}
    assert worker.run is EngineWorker.run and worker.stop is EngineWorker.stop


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_has_one_error_base_and_one_bad_input_error(engine):
    import importlib

    from cmb_dagster.errors import CmbError, InvalidInput

    errors = importlib.import_module(f"cmb_dagster.{engine}.errors")
    base = getattr(errors, f"{ERRORS[engine]}Error")
    invalid = getattr(errors, f"Invalid{ERRORS[engine]}Input")
    assert issubclass(base, CmbError) and issubclass(invalid, base) and issubclass(invalid, InvalidInput)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engines_options_extend_the_options_base_and_raise_its_bad_input_error(engine):
    import importlib

    from pydantic import BaseModel

    from cmb_dagster.models import Options

    models = importlib.import_module(f"cmb_dagster.{engine}.models")
    invalid = getattr(importlib.import_module(f"cmb_dagster.{engine}.errors"), f"Invalid{ERRORS[engine]}Input")
    found = [
        value
        for name, value in vars(models).items()
        if isinstance(value, type)
        and issubclass(value, BaseModel)
        and value.__module__ == models.__name__
        and name.endswith(("Options", "Settings"))
    ]
    assert found
    for model in found:
        assert issubclass(model, Options) and issubclass(model.error, invalid), model


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engines_status_is_one_model(engine):
    import importlib
    import inspect

    from pydantic import BaseModel

    admin = importlib.import_module(f"cmb_dagster.{engine}.admin")
    models = importlib.import_module(f"cmb_dagster.{engine}.models")
    status_model = getattr(models, STATUS[engine])
    assert issubclass(status_model, BaseModel)
    assert inspect.signature(admin.status).return_annotation in (status_model, STATUS[engine])


DEFINITIONS = {
    "callbacks": "callback_definitions",
    "eventqueue": "eventqueue_definitions",
    "pubsub": "pubsub_definitions",
    "reactive": "reactive_definitions",
    "stages": "stages_definitions",
}


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_has_the_same_dagster_shell(engine):
    import importlib
    import inspect

    shell = importlib.import_module(f"cmb_dagster.{engine}.dagster_defs")
    parameters = inspect.signature(getattr(shell, DEFINITIONS[engine])).parameters
    assert next(iter(parameters)) == "options"
    for name in ("prefix", "resource", "translator"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    source = (PACKAGE / engine / "dagster_defs.py").read_text()
    assert "status_definitions(" in source  # one way into the UI
    assert "worker_job_names(" in source or engine in ("pubsub", "reactive")  # one worker per consumer / none


REACTIVE_TICK_STEPS = ["start", "changes", "runs", "evaluation", "launch", "record"]


def test_the_reactive_tick_is_its_steps_and_keeps_no_tick_state_on_the_scheduler():
    """``TaskScheduler.tick`` calls the steps, each in a module of its own, passing them the tick; between ticks the
    scheduler keeps only what it knows of its tables (``_known``): no method but ``__init__`` sets another attribute."""
    import ast

    tree = ast.parse((PACKAGE / "reactive" / "engine.py").read_text())
    imported = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert {f"cmb_dagster.reactive.{step}" for step in REACTIVE_TICK_STEPS} <= imported
    [scheduler] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TaskScheduler"]
    set_later = set()
    for method in scheduler.body:
        if not isinstance(method, ast.FunctionDef) or method.name == "__init__":
            continue
        for node in ast.walk(method):
            targets = list(node.targets) if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            set_later |= {
                found.attr
                for target in targets
                for found in ast.walk(target)
                if isinstance(found, ast.Attribute) and isinstance(found.value, ast.Name) and found.value.id == "self"
            }
    assert set_later == {"_known"}


def test_a_private_dagster_import_says_why():
    private = re.compile(r"^from dagster\._core\S* import", re.MULTILINE)
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if private.match(line):
                above = lines[number - 1]
                assert above.startswith("#") or private.match(above), f"{path.name}:{number + 1} says not why"


def _writes() -> dict[str, object]:
    methods = {
        CallbackClient: ["create", "create_many", "update", "cancel"],
        StageStore: ["put", "put_many", "patch", "delete"],
        CtlStore: ["set", "set_many"],
    }
    writes = {f"{owner.__name__}.{name}": getattr(owner, name) for owner, names in methods.items() for name in names}
    return writes | {"emit": emit, "emit_many": emit_many, "publish": publish}


def test_every_public_write_joins_a_callers_transaction_through_the_conn_keyword():
    for name, write in _writes().items():
        parameters = inspect.signature(write).parameters
        assert parameters["conn"].kind is inspect.Parameter.KEYWORD_ONLY, name
        if "." not in name:  # a function (a method writes to its object's database)
            assert parameters["db"].kind is inspect.Parameter.KEYWORD_ONLY, name


@pytest.mark.parametrize("engine", ["callbacks", "eventqueue", "stages"])
def test_every_engine_taking_flow_limits_exports_their_types(engine):
    module = importlib.import_module(f"cmb_dagster.{engine}")
    assert module.RateLimit is RateLimit and module.FlowLimits is FlowLimits
    assert {"RateLimit", "FlowLimits"} <= set(module.__all__)


FLOW_WRITE = re.compile(r"\b(UPDATE|INSERT INTO|DELETE FROM)\s+flow_(buckets|slots|limits)\b", re.IGNORECASE)


def test_flow_control_is_written_once_in_its_module():
    """Takes, renewals, releases and the token bucket are flow control's statements: an engine's claim inlines its
    fragments (cmb_dagster/flow/sql.py) rather than writing to its tables itself."""
    writers = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if FLOW_WRITE.search(path.read_text()) or "tokens + " in path.read_text()
    }
    assert writers == {"flow/sql.py"}
