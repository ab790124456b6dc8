"""Workers running in threads of the test process for the length of a ``with`` block (or until ``stop``)."""

from __future__ import annotations

import threading
from typing import Any


class Running:
    """Runs each worker's ``run()`` in a thread; ``stop()`` (or leaving the block) stops them gracefully and
    fails if one does not return. ``reports`` holds what each run returned."""

    def __init__(self, *workers: Any) -> None:
        self.workers = workers
        self.reports: list[Any] = [None] * len(workers)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(workers))]
        for thread in self.threads:
            thread.start()

    @property
    def worker(self) -> Any:
        """The first (often the only) worker."""
        return self.workers[0]

    @property
    def report(self) -> Any:
        return self.reports[0]

    def _run(self, index: int) -> None:
        self.reports[index] = self.workers[index].run()

    def stop(self, timeout: float = 30.0) -> None:
        for worker in self.workers:
            worker.stop()
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a worker did not stop"

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
