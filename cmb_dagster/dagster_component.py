"""cmb_dagster as Dagster Components: a code location's engines configured in ``defs.yaml`` files.

``CmbComponent`` turns on any of the engines; ``ReactiveComponent``, ``PubSubComponent``, ``CallbacksComponent``,
``StagesComponent`` and ``EventQueueComponent`` each turn on one, so a team can keep each engine in a folder of its
own. ``dg scaffold defs cmb_dagster.<Component> NAME`` writes one; ``dg list components`` lists them (the package's
``dagster_dg_cli.registry_modules`` entry point names this module). ``dg check defs`` reports a mistake in a
``defs.yaml`` with its file and line.
"""

import functools
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from dagster import AssetKey, Definitions
from dagster.components import (
    Component,
    ComponentLoadContext,
    Model,
    ResolutionContext,
    Resolvable,
    Resolver,
    Scaffolder,
    ScaffoldRequest,
    scaffold_with,
)
from pydantic import BaseModel, Field, ValidationError

from cmb_dagster.alerts import AlertOptions
from cmb_dagster.callbacks.models import CallbackOptions
from cmb_dagster.dagster_translator import CmbTranslator
from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.errors import InvalidInput
from cmb_dagster.eventqueue.models import EventQueueOptions
from cmb_dagster.inputs import load_reference
from cmb_dagster.models import describe, field_path
from cmb_dagster.pubsub.models import PubSubOptions
from cmb_dagster.reactive.dagster_defs import ReactiveTriggerWarning, YamlTask, reactive_definitions
from cmb_dagster.reactive.models import ReactiveOptions
from cmb_dagster.resources import CmbResource
from cmb_dagster.stages.models import StageOptions
from cmb_dagster.triggers.models import trigger_data_problems
from cmb_dagster.vacuum import DatabaseOptions

T = TypeVar("T", bound=BaseModel)
_ENGINE_HELP = (
    "'module:attribute' naming the engine's options object, or the options' fields; unset: the engine is off."
)


class Translation(Model):
    """How the engines' assets appear: their keys and group."""

    key_prefix: list[str] = Field(default_factory=list, description="Path put before every asset key.")
    group_name: str | None = Field(default=None, description="The group of every asset; unset: cmb_<engine>.")


@dataclass(frozen=True)
class _YamlTranslator(CmbTranslator):
    """The translator a ``translation:`` block describes."""

    key_prefix: tuple[str, ...] = ()
    group_name: str | None = None

    def get_asset_key(self, engine: str, name: Sequence[str]) -> AssetKey:
        return AssetKey([*self.key_prefix, *super().get_asset_key(engine, name).path])

    def get_group_name(self, engine: str) -> str:
        return self.group_name or super().get_group_name(engine)


@dataclass(frozen=True)
class YamlReactive:
    """Reactive options whose tasks a ``defs.yaml`` wrote (:class:`YamlTask`), and the defs folders holding the
    assets those tasks target and read."""

    options: ReactiveOptions
    assets_from: tuple[str, ...]

    def resolved(self, context: ComponentLoadContext) -> tuple[ReactiveOptions, list[Any]]:
        """The options with their tasks made, and the assets of ``assets_from`` (what the tasks' targets resolve
        against: partitions, upstream assets, misspelt entities)."""
        assets = [a for folder in self.assets_from for a in context.build_defs(folder).assets or []]
        tasks = []
        for task in self.options.tasks:
            try:
                tasks.append(task.task() if isinstance(task, YamlTask) else task)
            except InvalidInput as exc:  # the job or the assets are not what the task's target names
                filename, line = _task_line(context.path / "defs.yaml", f"reactive task {task.name!r}")
                raise type(exc)(f"{filename}:{line}: {exc}") from None
        return self.options.model_copy(update={"tasks": tasks}), assets


def _error_at(context: ResolutionContext, path: Sequence[str | int], message: str, kind: type) -> Exception:
    """The error Dagster shows for a value of the ``defs.yaml``: its file, line and ``message``."""
    for part in path:
        context = context.at_path(part)
    field = ".".join(map(str, context.path))
    return context.build_resolve_fn_exc([f"{message}\n"], field_name=field, model=kind.model_construct())


def _present(value: Any, loc: Sequence[str | int]) -> list[str | int]:
    """The part of a pydantic error location that exists in ``value`` (union tags and validator names left out)."""
    path: list[str | int] = []
    for part in loc:
        if (isinstance(value, Mapping) and part in value) or (
            isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        ):
            value = value[part]
        else:
            continue
        path.append(part)
    return path


def _validated(context: ResolutionContext, kind: type[T], value: Any) -> T:
    """``value`` validated as ``kind``; an error points at the first field it names."""
    try:
        return kind.model_validate(value)
    except (ValidationError, InvalidInput) as exc:
        inner = exc.errors()[0].get("ctx", {}).get("error") if isinstance(exc, ValidationError) else exc
        message = str(inner) if isinstance(inner, InvalidInput) else describe(exc)  # type: ignore[arg-type]
        raise _error_at(context, _present(value, field_path(exc)), message, kind) from None


def _referenced(context: ResolutionContext, kind: type[T], value: str, field: str) -> T:
    try:
        options = load_reference(value, field)
    except InvalidInput as exc:
        raise _error_at(context, [], str(exc), kind) from None
    if not isinstance(options, kind):
        raise _error_at(context, [], f"{value} is a {type(options).__name__}, not {kind.__name__}", kind)
    return options


def _engine(kind: type[T], field: str) -> Any:
    """The type of an engine's attribute: a ``'module:attribute'`` reference to its options, or their fields."""

    def resolve(context: ResolutionContext, value: Any) -> T | None:
        if value is None:
            return None
        if isinstance(value, str):
            return _referenced(context, kind, value, field)
        return _validated(context, kind, context.resolve_value(value))

    resolver = Resolver(resolve, model_field_type=str | dict[str, Any] | None, description=_ENGINE_HELP)
    return Annotated[Any, resolver]  # Any: Dagster derives the YAML schema from model_field_type


def _resolve_reactive(context: ResolutionContext, value: Any) -> ReactiveOptions | YamlReactive | None:
    """Reactive options from a reference, or from fields whose ``tasks`` are written in the ``defs.yaml``."""
    if value is None:
        return None
    if isinstance(value, str):
        return _referenced(context, ReactiveOptions, value, "reactive")
    value = context.resolve_value(value)
    if not isinstance(value, Mapping):
        raise _error_at(context, [], "expected a 'module:attribute' reference or the options' fields", ReactiveOptions)
    fields = dict(value)
    assets_from = fields.pop("assets_from", [])
    if not isinstance(assets_from, list) or not all(isinstance(f, str) for f in assets_from):
        raise _error_at(context, ["assets_from"], "expected a list of defs folders", ReactiveOptions)
    tasks = fields.get("tasks")
    if isinstance(tasks, list):
        for i, task in enumerate(tasks):
            if isinstance(task, Mapping) and isinstance(task.get("trigger"), Mapping):
                for path, text in trigger_data_problems(task["trigger"], ("tasks", i, "trigger")):
                    raise _error_at(context, path, f"{'.'.join(map(str, path))}: {text}", YamlTask)
        fields["tasks"] = [_validated(context.at_path("tasks").at_path(i), YamlTask, t) for i, t in enumerate(tasks)]
    return YamlReactive(_validated(context, ReactiveOptions, fields), tuple(assets_from))


ReactiveField = Annotated[
    Any,  # ReactiveOptions | YamlReactive | None; Dagster derives the YAML schema from model_field_type
    Resolver(
        _resolve_reactive,
        model_field_type=str | dict[str, Any] | None,
        description="Reactive CTL tasks: 'module:attribute' naming a ReactiveOptions, or its fields with the tasks "
        "written here (name, job or assets, trigger, ...) and assets_from: the defs folders holding the assets "
        "they target and read.",
    ),
]


@functools.cache
def _shared_resource(database_url: str | None, schema_name: str | None) -> CmbResource:
    """One ``cmb`` resource per database and schema, so the components of a project merge (Dagster merges a
    resource key only when it is the same object)."""
    return CmbResource(database_url=database_url, schema_name=schema_name)


_EXAMPLES = {
    "CmbComponent": """\
  # Each engine: 'module:attribute' of its options, or their fields. An engine left out is off.
  callbacks:
    workers: 1
  # pubsub: {consumers: [{consumer_id: stats, handler: "my_project.handlers:count"}]}
  # translation: {key_prefix: [ops], group_name: monitoring}
""",
    "ReactiveComponent": """\
  options:
    assets_from: []               # defs folders holding the assets the tasks target and read, e.g. [shop]
    tasks: []
    # - name: sales_report
    #   job: my_project.jobs:sales_report_job       # or assets: [shop/sales_mart]
    #   trigger:
    #     kind: All
    #     triggers:
    #       - {kind: ChunkDelta, entity: shop/orders, parameter: loaded_until, scale: day}
    #       - {kind: Delay, entity: shop/prices, parameter: loaded_until, max_delay: 2h}
    #   priority: 10
    #   deadline: "0 7 * * *"                       # by 07:00 UTC, else its check fails
""",
    "PubSubComponent": """\
  options:
    consumers: []
    # - {consumer_id: stats, branch_id: 0, handler: "my_project.handlers:count", where: '$.kind == "refund"'}
""",
    "CallbacksComponent": """\
  options:
    workers: 1
    jobs: []                      # jobs dagster://<job> callbacks may launch
""",
    "StagesComponent": """\
  options:
    stages: []                    # or: my_project.stages:options
""",
    "EventQueueComponent": """\
  options:
    handlers: {module}:handlers   # the HandlerRegistry in handlers.py, next to this file
    workers: 1
""",
}

_HANDLERS_PY = '''\
"""The event queue's handlers: emit to them with ``emit(namespace, handler, value)``."""

from cmb_dagster.eventqueue import HandlerRegistry

handlers = HandlerRegistry()


@handlers.handler("send_receipt", max_retries=5)
def send_receipt(event) -> None:
    print(f"receipt for {event.value}")
'''


class _Scaffolder(Scaffolder):
    """Writes a ``defs.yaml`` that loads as it is, with commented examples (and, for the event queue, a
    ``handlers.py`` beside it)."""

    def scaffold(self, request: ScaffoldRequest) -> None:
        name = request.type_name.rsplit(".", 1)[-1]
        request.target_path.mkdir(parents=True, exist_ok=True)
        module = _module_of(request.target_path, request.project_root)
        if name == "EventQueueComponent":
            (request.target_path / "handlers.py").write_text(_HANDLERS_PY, encoding="utf-8")
        attributes = _EXAMPLES[name].replace("{module}", f"{module}.handlers")
        text = f"type: {request.type_name}\n\nattributes:\n{attributes}"
        (request.target_path / "defs.yaml").write_text(text, encoding="utf-8")


def _module_of(folder: Path, project_root: Path | None) -> str:
    """The Python module of a folder of a project (under its ``src/`` when it has one)."""
    root = project_root or folder
    base = root / "src" if (root / "src").is_dir() else root
    try:
        return ".".join(folder.resolve().relative_to(base.resolve()).parts)
    except ValueError:
        return folder.name


class _Shell(Component, Model, Resolvable):
    """What every cmb_dagster component takes besides its engines."""

    prefix: str = Field(default="cmb_", description="Start of the name of every job, sensor and schedule added.")
    database_url: str | None = Field(
        default=None, description="Postgres URL (e.g. '{{ env.MY_URL }}'); unset: CMB_DATABASE_URL, or the embedded."
    )
    schema_name: str | None = Field(default=None, description="Schema of the cmb tables; unset: CMB_SCHEMA or 'cmb'.")
    translation: Translation | None = Field(default=None, description="Keys and group of the engines' assets.")

    def _definitions(self, context: ComponentLoadContext, **engines: Any) -> Definitions:
        """``cmb_definitions`` of ``engines`` with this component's prefix, database and translation."""
        translation = self.translation or Translation()
        shell = {
            "prefix": self.prefix,
            "resource": _shared_resource(self.database_url, self.schema_name),
            "translator": _YamlTranslator(tuple(translation.key_prefix), translation.group_name),
        }
        reactive = engines.pop("reactive", None)
        if not isinstance(reactive, YamlReactive):
            return cmb_definitions(reactive=reactive, **engines, **shell)
        options, assets = reactive.resolved(context)
        if engines.get("database") is True:  # the reactive tasks are an engine of this location too
            engines["database"] = DatabaseOptions()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ReactiveTriggerWarning)
            try:
                tasks = reactive_definitions(options, **shell, assets=assets)  # the assets stay in their own folder
            except InvalidInput as exc:  # a finding on a task: shown at the task's line
                filename, line = _task_line(context.path / "defs.yaml", str(exc))
                raise type(exc)(f"{filename}:{line}: {exc}") from None
        for warning in caught:  # a finding on a task points at its line of the defs.yaml
            filename, line = warning.filename, warning.lineno
            if issubclass(warning.category, ReactiveTriggerWarning):
                filename, line = _task_line(context.path / "defs.yaml", str(warning.message))
            warnings.warn_explicit(warning.message, warning.category, filename, line)
        return Definitions.merge(tasks, cmb_definitions(**engines, **shell))


def _task_line(defs_yaml: Path, message: str) -> tuple[str, int]:
    """The ``defs.yaml`` and the line of the task a finding names (``reactive task 'NAME': ...``)."""
    found = re.match(r"reactive task '([^']+)'", message)
    lines = defs_yaml.read_text(encoding="utf-8").splitlines() if defs_yaml.is_file() else []
    for number, line in enumerate(lines, 1):
        if found and re.fullmatch(rf"\s*-?\s*name:\s*['\"]?{re.escape(found.group(1))}['\"]?\s*", line):
            return str(defs_yaml), number
    return str(defs_yaml), 1


@scaffold_with(_Scaffolder)
class CmbComponent(_Shell):
    """The cmb_dagster engines of a code location: their jobs, sensors, status assets and checks, and the ``cmb``
    resource, as :func:`cmb_definitions` builds them. Each engine is on when its options are given."""

    reactive: ReactiveField = None
    pubsub: _engine(PubSubOptions, "pubsub") = None  # type: ignore[valid-type]
    callbacks: _engine(CallbackOptions, "callbacks") = None  # type: ignore[valid-type]
    stages: _engine(StageOptions, "stages") = None  # type: ignore[valid-type]
    eventqueue: _engine(EventQueueOptions, "eventqueue") = None  # type: ignore[valid-type]
    alerts: _engine(AlertOptions, "alerts") = None  # type: ignore[valid-type]
    database: _engine(DatabaseOptions, "database") = None  # type: ignore[valid-type]

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        return self._definitions(
            context,
            reactive=self.reactive,
            pubsub=self.pubsub,
            callbacks=self.callbacks,
            stages=self.stages,
            events=self.eventqueue,
            alerts=self.alerts,
            database=self.database or True,
        )


class _OneEngine(_Shell):
    """A component for one engine: its options in ``options``. The database checks come with a CmbComponent or
    ``cmb_definitions`` (several one-engine components may share a code location)."""

    engine: ClassVar[str]

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        return self._definitions(context, **{self.engine: self.options}, database=False)


@scaffold_with(_Scaffolder)
class ReactiveComponent(_OneEngine):
    """Reactive CTL tasks: the scheduler sensor, the tasks' jobs and the ``ctl`` resource; the tasks written in the
    ``defs.yaml`` (their triggers are data, never code) or a ``'module:attribute'`` ReactiveOptions."""

    engine = "reactive"
    options: ReactiveField = None


@scaffold_with(_Scaffolder)
class PubSubComponent(_OneEngine):
    """Pub/sub consumers: a worker job per consumer and branch, with its keeper, status asset and checks."""

    engine = "pubsub"
    options: _engine(PubSubOptions, "options") = None  # type: ignore[valid-type]


@scaffold_with(_Scaffolder)
class CallbacksComponent(_OneEngine):
    """Delayed callbacks: worker jobs, cleanup, the schedules materializer, the jobs ``dagster://`` may launch."""

    engine = "callbacks"
    options: _engine(CallbackOptions, "options") = None  # type: ignore[valid-type]


@scaffold_with(_Scaffolder)
class StagesComponent(_OneEngine):
    """The stage scheduler: its worker jobs and the queue depth of each stage."""

    engine = "stages"
    options: _engine(StageOptions, "options") = None  # type: ignore[valid-type]


@scaffold_with(_Scaffolder)
class EventQueueComponent(_OneEngine):
    """The handler event queue: worker jobs, the ``events`` resource, a launch sensor per Dagster-job handler."""

    engine = "events"
    options: _engine(EventQueueOptions, "options") = None  # type: ignore[valid-type]
