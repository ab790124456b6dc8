"""The user code of a reactive launch (its partition, run config and tags callables), run between transactions, in
a child process forked for it, under ``callable_timeout`` (killed at it): one that raises, exits, runs past it or
returns what cannot be launched backs that task off alone, with its error sanitised; a tick leaves no thread or
process of user code running behind it."""

from __future__ import annotations

import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import check_values
from cmb_dagster.database import Database
from cmb_dagster.errors import InvalidInput
from cmb_dagster.executor import Executor, Task
from cmb_dagster.inputs import check_text, to_json
from cmb_dagster.isolation import describe_error, sanitize
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.errors import PartitionNotReady
from cmb_dagster.reactive.evaluation import Evaluation
from cmb_dagster.reactive.explanations import Explanation
from cmb_dagster.reactive.models import FixedLaunchOptions, LaunchOptions, Partitioner
from cmb_dagster.reactive.tick import Tick

PARTITION_KEY_LIMIT = 1000
"""Longest partition key a partition callable may return (it is stored with the task and its launch)."""
WAIT_STEP = 1.0
"""Seconds between two renewals of the tick's lease (when due) while user code runs."""
CHOOSING = "choosing the partition"
SHAPING = "its run config or tags"


class LaunchError(Exception):
    """A ready task's launch cannot be shaped (its partition, run config or tags raised, timed out or returned
    what cannot be launched)."""


@dataclass(eq=False)
class UserCall:
    """The user code of one launch (its partition, unless already chosen, run config and tags); ``code`` names
    what of it runs, for an error that no step of it reported (a timeout, the death of its process)."""

    evaluation: Evaluation
    choose_partition: bool
    code: str = ""

    @property
    def label(self) -> str:
        return f"reactive task {self.evaluation.name}"


@dataclass(frozen=True)
class Answer:
    """What a launch's user code gave, sent back from its process: the pickled (partition key, values, run config,
    tags), the partition it waits for (key, detail), or the error of the step that failed."""

    result: tuple[bytes, bytes] | None = None
    waits_for: tuple[str, str] | None = None
    error: str | None = None


@dataclass(frozen=True)
class Wait:
    """A ready task whose partition does not exist yet: it waits (no attempt counted), evaluated again next tick."""

    evaluation: Evaluation
    explanation: Explanation


@dataclass(frozen=True)
class Shaped:
    """A launch ready to record: its evaluation (with the values its partition commits), partition, run config, tags."""

    evaluation: Evaluation
    partition_key: str | None = None
    run_config: Mapping[str, Any] | None = None
    tags: dict[str, str] = field(default_factory=dict)


class UserCode:
    """The tasks' partition callables and launch options, run by ``executor`` (one call at a time, each in a child
    process forked for it); ``database`` counts the runs of each task's user code that ended with the death of their
    process."""

    def __init__(
        self,
        database: Database,
        scheduler: str,
        executor: Executor,
        partitioners: Mapping[str, Partitioner],
        launch_options: Mapping[str, LaunchOptions],
    ) -> None:
        self.database = database
        self.scheduler = scheduler
        self.executor = executor
        self.partitioners = partitioners
        self.launch_options = launch_options

    def shape(self, tick: Tick, calls: Sequence[UserCall]) -> list[Shaped | Wait | str | None]:
        """Each launch as its user code shapes it, run outside any transaction: a :class:`Shaped`, a :class:`Wait`
        (its partition does not exist yet), the error of its user code (raised, timed out, or an unusable result),
        or None when the tick's time for user code was spent before it started."""
        needed = [c for c in calls if self._has_user_code(c)]
        crashed = self._count_user_code(tick, [c.evaluation.name for c in needed])
        runnable = [c for c in needed if c.evaluation.name not in crashed]
        ran = {id(task.item): task for task in self._call_user_code(tick, runnable)}
        self._end_user_code(
            [c.evaluation.name for c in runnable if id(c) in ran],
            [c.evaluation.name for c in runnable if id(c) not in ran],
        )
        shapes: list[Shaped | Wait | str | None] = []
        for c in calls:
            name = c.evaluation.name
            try:
                if not self._has_user_code(c):
                    options = self.launch_options.get(name)
                    run_config, tags = options(c.evaluation.values) if options is not None else (None, {})
                    shapes.append(self._checked(c, None, c.evaluation.values, run_config, tags))
                elif name in crashed:
                    shapes.append(
                        f"its user code ended with the death of its process {crashed[name]} times in a row; "
                        f"not run again until `cmb-dagster reactive retry {self.scheduler} {name}`"
                    )
                elif id(c) not in ran:
                    shapes.append(None)
                else:
                    shapes.append(self._shaped(ran[id(c)]))
            except LaunchError as exc:
                shapes.append(str(exc))
        return shapes

    def _count_user_code(self, tick: Tick, names: Sequence[str]) -> dict[str, int]:
        """Count a run of these tasks' user code before it starts (committed); return the tasks whose earlier
        runs ended with the death of their process ``max_crashes`` times, with that count (they do not run)."""
        if not names:
            return {}
        with self.database.connection() as conn:
            return dict(
                conn.execute(
                    sql.COUNT_USER_CODE,
                    {"scheduler": self.scheduler, "names": list(names), "max_crashes": tick.settings.max_crashes},
                ).fetchall()
            )

    def _end_user_code(self, ended: Sequence[str], unstarted: Sequence[str]) -> None:
        if ended or unstarted:
            with self.database.connection() as conn:
                conn.execute(
                    sql.END_USER_CODE,
                    {"scheduler": self.scheduler, "ended": list(ended), "unstarted": list(unstarted)},
                )

    def _chooses_partition(self, call: UserCall) -> bool:
        return call.choose_partition and call.evaluation.name in self.partitioners

    def _user_code_of(self, call: UserCall) -> str:
        """What user code a launch runs, as its errors name it ("": none)."""
        options = self.launch_options.get(call.evaluation.name)
        shapes = options is not None and not isinstance(options, FixedLaunchOptions)
        return " or ".join(([CHOOSING] if self._chooses_partition(call) else []) + ([SHAPING] if shapes else []))

    def _has_user_code(self, call: UserCall) -> bool:
        return bool(self._user_code_of(call))

    def _call_user_code(self, tick: Tick, calls: Sequence[UserCall]) -> list[Task[UserCall]]:
        """Run the user code of ``calls``, one after another, each in a child process under ``callable_timeout``,
        keeping the tick's lease; return the calls that ran (each has ended: its process is gone). A tick starts
        calls within its time box, or within ``callable_timeout`` of its first call if that ends later."""
        if not calls:
            return []
        timeout = tick.settings.callable_timeout
        if tick.user_code_until is None:
            tick.user_code_until = max(tick.deadline, time.monotonic() + timeout)
        ran = []
        for call in calls:
            if time.monotonic() >= tick.user_code_until:
                break
            call.code = self._user_code_of(call)
            task = self.executor.start(call, self._run_user_code, timeout)
            try:
                while not task.ended:
                    self.executor.wait(WAIT_STEP)
                    self.executor.ended()
                    tick.keep_lease()
                    self.executor.check()
            finally:  # a renewal that raised: the call still ends (killed at its deadline) before the tick does
                self.executor.wait_all(timeout)
                self.executor.ended()
            ran.append(task)
        return ran

    def _run_user_code(self, call: UserCall) -> Answer:
        """The (partition key, values, run config, tags) of a launch from its user code, pickled to cross back to
        the scheduler's process; or the partition it waits for, or the error of the step that failed. Runs in
        the child process of the call."""
        e = call.evaluation
        key: Any = None
        values: Any = e.values
        run_config: Any = None
        tags: dict[str, str] = {}
        step = CHOOSING
        try:
            partitioner = self.partitioners.get(e.name) if call.choose_partition else None
            if partitioner is not None:
                key, values = partitioner(e.values, e.last)
            step = SHAPING
            options = self.launch_options.get(e.name)
            if options is not None:
                run_config, raw_tags = options(values)
                tags = {str(k): str(v) for k, v in (raw_tags or {}).items()}
        except PartitionNotReady as exc:
            return Answer(waits_for=(str(exc.partition_key), str(exc.detail)))
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt of user code too
            return Answer(error=f"{step} raised {describe_error(exc)}")
        pickled = []
        for step, part in ((CHOOSING, (key, values)), (SHAPING, (run_config, tags))):
            try:
                pickled.append(pickle.dumps(part))
            except BaseException as exc:  # noqa: BLE001 - pickling runs the objects' own code
                why = f"it cannot be pickled to reach the scheduler's process ({describe_error(exc)})"
                return Answer(error=f"{step} returned an unusable result: {why}")
        return Answer(result=(pickled[0], pickled[1]))

    def _shaped(self, task: Task[UserCall]) -> Shaped | Wait:
        """The launch a call of user code shaped, or a :class:`Wait` when its partition does not exist yet;
        :class:`LaunchError` if it raised, exited, timed out or returned what cannot be launched."""
        item = task.item
        try:
            answer: Answer = task.outcome
        except Exception as exc:  # noqa: BLE001 - its process was killed at the deadline, or died
            raise LaunchError(f"{item.code} raised {describe_error(exc)}") from None
        if answer.error is not None:
            raise LaunchError(answer.error)
        if answer.waits_for is not None:
            partition_key, detail = answer.waits_for
            detail = f" ({sanitize(detail)})" if detail else ""
            why = (
                f"waiting for partition {sanitize(partition_key)}: it does not exist yet{detail}; "
                "evaluated again on the next ticks (no failed attempt counted)"
            )
            return Wait(item.evaluation, item.evaluation.explanation.prefixed(why + "\n"))
        chosen, shaped = answer.result or (b"", b"")
        key, values = _unpickled(CHOOSING, chosen)
        run_config, tags = _unpickled(SHAPING, shaped)
        return self._checked(item, key, values, run_config, tags)

    def _checked(self, item: UserCall, key: Any, values: Any, run_config: Any, tags: Any) -> Shaped:
        """The launch of ``item`` on what its user code returned; :class:`LaunchError` if that cannot be launched
        (a partition key or values CTL cannot store, a run config or tags that are not JSON within the payload
        limit)."""
        e = item.evaluation
        if self._chooses_partition(item):
            try:
                key = check_text(key, "partition key", max_length=PARTITION_KEY_LIMIT)
                values = check_values(values)
            except InvalidInput as exc:
                why = describe_error(exc)
                raise LaunchError(f"{CHOOSING} returned an unusable result: {why}") from None
            explanation = e.explanation.prefixed(f"partition {key} (commits {_values_text(values)} on success)\n")
            e = Evaluation(e.name, e.status, explanation, values, e.last)
        try:
            to_json({"run_config": run_config, "tags": tags}, "run config and tags")
        except InvalidInput as exc:
            raise LaunchError(f"{SHAPING} returned an unusable result: {describe_error(exc)}") from None
        return Shaped(e, key, run_config, dict(tags))


def _unpickled(step: str, pickled: bytes) -> Any:
    """A part of a launch that its user code's process pickled; :class:`LaunchError` if it cannot be read back."""
    try:
        return pickle.loads(pickled)
    except Exception as exc:  # noqa: BLE001 - unpickling runs the objects' own code
        raise LaunchError(f"{step} returned an unusable result: {describe_error(exc)}") from None


def _values_text(values: Mapping[ParameterKey, datetime]) -> str:
    return ", ".join(f"{e}/{p}={v.isoformat()}" for (e, p), v in sorted(values.items()))
