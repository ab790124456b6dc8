"""Handlers by name: Python callables (a decorator), Dagster jobs, and cron handlers that emit on a schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from croniter import croniter

from cmb_dagster import flow
from cmb_dagster.eventqueue import sql
from cmb_dagster.eventqueue.errors import InvalidEventQueueInput
from cmb_dagster.eventqueue.models import (
    CRON_MODULE,
    DEFAULT_MODIFIER,
    DEFAULT_NAMESPACE,
    Event,
    HandlerConfig,
    check_name,
    to_json,
)
from cmb_dagster.inputs import load_reference

HandlerFn = Callable[[Event], Any] | Callable[[list[Event]], Any]  # a debounced handler takes a list


def scope(handler: str) -> str:
    """The flow-control scope of a handler's keys."""
    return sql.SCOPE_PREFIX + handler


@dataclass(frozen=True)
class Handler:
    """A named handler: a Python callable, or (``job_name`` set) a Dagster job launched with the value as run config."""

    name: str
    fn: HandlerFn | None = None
    config: HandlerConfig = field(default_factory=HandlerConfig)
    job_name: str | None = None

    @property
    def kind(self) -> str:
        return "dagster_job" if self.job_name else "python"


@dataclass(frozen=True)
class CronHandler:
    """Emits ``value`` to ``handler`` once per fire time of ``schedule`` (a cron expression), across all workers."""

    name: str
    schedule: str
    handler: str
    namespace: str = DEFAULT_NAMESPACE
    value: Any = None
    timezone: str = "UTC"
    modifier: str = DEFAULT_MODIFIER
    module: str = CRON_MODULE

    def __post_init__(self) -> None:
        check_name("name", self.name)
        check_name("handler", self.handler)
        check_name("namespace", self.namespace)
        if not croniter.is_valid(self.schedule):
            raise InvalidEventQueueInput(f"schedule: {self.schedule!r} is not a valid cron expression")
        to_json(self.value)


class HandlerRegistry:
    """Handlers and cron handlers by name.

    >>> handlers = HandlerRegistry()
    >>> @handlers.handler("send_email", max_retries=5, backoff=Backoff(first=2))
    ... def send_email(event): ...
    >>> handlers.cron("hourly_digest", "0 * * * *", handler="send_email", value={"digest": True})
    """

    def __init__(self, handlers: Iterable[Handler | CronHandler] = ()) -> None:
        self.handlers: dict[str, Handler] = {}
        self.crons: dict[str, CronHandler] = {}
        for item in handlers:
            self.include(item)

    @classmethod
    def of(cls, source: Any) -> HandlerRegistry:
        """A registry from a registry, a ``"module:attribute"`` string, or a list of any of those and handlers."""
        if isinstance(source, HandlerRegistry):
            return source
        if isinstance(source, str):
            return cls.of(load_reference(source, "handlers", error=InvalidEventQueueInput))
        if isinstance(source, Handler | CronHandler):
            return cls([source])
        if isinstance(source, Iterable):
            registry = cls()
            for item in source:
                registry.include(item)
            return registry
        raise InvalidEventQueueInput(
            f"handlers: expected a HandlerRegistry or a list of handlers, got {type(source).__name__}"
        )

    def include(self, item: HandlerRegistry | Handler | CronHandler | str) -> None:
        """Add a handler, a cron handler, or everything of another registry."""
        if isinstance(item, Handler):
            if item.name in self.handlers and self.handlers[item.name] is not item:
                raise InvalidEventQueueInput(f"handlers: two handlers are named {item.name!r}")
            self.handlers[item.name] = item
        elif isinstance(item, CronHandler):
            if item.name in self.crons and self.crons[item.name] != item:
                raise InvalidEventQueueInput(f"handlers: two cron handlers are named {item.name!r}")
            self.crons[item.name] = item
        else:
            other = HandlerRegistry.of(item)
            for handler in other.handlers.values():
                self.include(handler)
            for cron in other.crons.values():
                self.include(cron)

    def handler(self, name: str | None = None, **config: Any) -> Callable[[HandlerFn], HandlerFn]:
        """Decorator: register the function as handler ``name`` (default: its name) with
        :class:`HandlerConfig` fields."""

        def register(fn: HandlerFn) -> HandlerFn:
            self.add(name or fn.__name__, fn, **config)
            return fn

        return register

    def add(self, name: str, fn: HandlerFn, **config: Any) -> Handler:
        """Register ``fn`` as handler ``name``."""
        handler = Handler(check_name("handler", name), fn, HandlerConfig(**config))
        self.include(handler)
        return handler

    def dagster_job(self, name: str, job_name: str | None = None, **config: Any) -> Handler:
        """Register a handler that launches Dagster job ``job_name`` (default ``name``), the value as run config."""
        handler = Handler(check_name("handler", name), None, HandlerConfig(**config), job_name=job_name or name)
        self.include(handler)
        return handler

    def cron(self, name: str, schedule: str, *, handler: str | None = None, **fields: Any) -> CronHandler:
        """Emit to ``handler`` (default ``name``) on ``schedule``; ``namespace``, ``value``, ``timezone`` optional."""
        cron = CronHandler(name, schedule, handler or name, **fields)
        self.include(cron)
        return cron

    @property
    def names(self) -> list[str]:
        return sorted(self.handlers)

    def __getitem__(self, name: str) -> Handler:
        return self.handlers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.handlers

    def __len__(self) -> int:
        return len(self.handlers)

    def register(self, conn: psycopg.Connection) -> None:
        """Record the handlers and their settings in the database (emit refuses unknown handlers)."""
        for cron in self.crons.values():
            if cron.handler not in self.handlers:
                raise InvalidEventQueueInput(
                    f"handler: cron {cron.name!r} emits to {cron.handler!r}, which is not registered"
                )
        items = list(self.handlers.values())
        if not items:
            return
        conn.execute(
            sql.REGISTER_HANDLERS,
            {
                "names": [h.name for h in items],
                "kinds": [h.kind for h in items],
                "lock_expiry": [h.config.lock_expiry for h in items],
                "max_retries": [h.config.max_retries for h in items],
                "backoff_first": [h.config.backoff.first for h in items],
                "backoff_max": [h.config.backoff.max for h in items],
                "max_crashes": [h.config.max_crashes for h in items],
                "key_paths": [h.config.key or "" for h in items],
                "debounce": [h.config.debounce for h in items],
                "max_wait": [h.config.max_wait for h in items],
                "max_batch": [h.config.max_batch for h in items],
            },
        )
        flow.register(conn, {scope(h.name): h.config.limits for h in items})
