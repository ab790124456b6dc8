"""Pausing Python's cyclic garbage collector for a burst of short-lived objects."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_collection_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (reference counting still frees the block's objects).

    A block that keeps thousands of objects alive at once (a reactive tick, a batch of creates) would
    otherwise have them promoted and the whole process heap scanned (a Dagster code server's is large),
    for objects freed when the block ends. If the application turned the collector off, it stays off.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
